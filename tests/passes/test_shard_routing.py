"""shard_routing: routing is identical on every rank (bit for bit) and equal to the unsharded router, ties
included: the same experts, and the same weights up to the fp32 rounding of the router GEMM (a CPU BLAS may
sum an [E / TP]-row shard in another order than the whole [E]-row weight: 3e-7 apart on an AVX2 machine)."""

import os

import torch

from k3compile.models import ops

from cpu import run_gloo

E, HID, K = 16, 256, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, HID, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, HID, generator=g) / HID ** 0.5).to(torch.bfloat16)
    # Ties: experts 3 and 12 (on different ranks at TP 2 and 4) have identical rows, so identical scores;
    # expert 7 duplicates expert 5 within one shard. Bias 0 keeps the tie in the selection key too.
    w[12] = w[3]
    w[7] = w[5]
    bias = torch.zeros(E)
    bias[[3, 12]] = 0.6  # equal selection-only bias: the tied pair competes for the top-k places
    bias[0] = 0.3
    return x, w, bias


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    import k3compile.dialect  # noqa: F401  (registers the k3 ops in this rank)

    x, w, bias = _inputs()
    logits = torch.ops.k3.linear_gather(x, w, True, dist.group.WORLD.group_name, world, rank)
    weights, ids = torch.ops.k3.moe_select(logits, bias, K, True, 1.0)
    torch.save((logits, weights, ids), os.path.join(out_dir, f"rank{rank}.pt"))


def test_sharded_routing_identical_across_ranks_and_to_unsharded(tmp_path):
    x, w, bias = _inputs()
    ref_w, ref_ids = ops.moe_route(x, w, bias, K, True, 1.0)
    scores = torch.sigmoid(torch.nn.functional.linear(x.float(), w.float()))
    assert torch.equal(scores[:, 3], scores[:, 12]) and torch.equal(scores[:, 5], scores[:, 7])
    picked = (ref_ids == 3) | (ref_ids == 12)
    assert bool(picked.any()), "the test must route tokens to the tied experts"
    for world in (2, 4):
        run_gloo(_worker, world, str(tmp_path))
        results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
        for logits, weights, ids in results:
            assert torch.equal(ids, results[0][2]) and torch.equal(weights, results[0][1])
            assert torch.equal(ids, ref_ids), f"TP{world}: routing differs from the unsharded router"
            torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=0)  # GEMM rounding only (seen: 1.2e-7)
            torch.testing.assert_close(logits, torch.nn.functional.linear(x.float(), w.float()), rtol=0, atol=1e-5)
