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


def _tail_inputs(tp):
    g = torch.Generator().manual_seed(1)
    B, L, D, NB = 3, 64, 128, 2
    latent = torch.randn(B, L, generator=g).to(torch.bfloat16)  # this rank's latent partial (the same on all)
    lw = (1 + 0.1 * torch.randn(L, generator=g)).to(torch.bfloat16)
    up = (torch.randn(D, L, generator=g) / L ** 0.5).to(torch.bfloat16)
    partial = torch.randn(B, D, generator=g).to(torch.bfloat16)
    prefix = torch.randn(B, D, generator=g).to(torch.bfloat16)
    blocks = torch.randn(B, NB, D, generator=g).to(torch.bfloat16)
    nw, pw, ow = (torch.randn(D, generator=g).to(torch.bfloat16) for _ in range(3))
    return latent, lw, up, partial, prefix, blocks, nw, pw.view(1, D), ow


def _tail_worker(rank, world, out_dir):
    import torch.distributed as dist

    import k3compile.dialect  # noqa: F401  (registers the k3 ops in this rank)

    latent, lw, up, partial, prefix, blocks, nw, pw, ow = _tail_inputs(world)
    group = dist.group.WORLD.group_name
    outs = [torch.ops.k3.ffn_tail_norm(latent, lw, 1e-5, up, partial, group, world, prefix, blocks, nw, pw, 1e-5,
                                       ow, 1e-5, up_rank) for up_rank in (-1, rank)]
    outs.append(torch.ops.k3.ffn_tail(latent, lw, 1e-5, up, partial, group, world, prefix, -1))
    outs.append(torch.ops.k3.ffn_tail(latent, lw, 1e-5, up, partial, group, world, prefix, rank))
    torch.save(outs, os.path.join(out_dir, f"tail{rank}.pt"))


def test_sharded_up_projection_equals_the_replicated_one_on_every_rank(tmp_path):
    # shard_routing's FFN-tail up-projection: each rank computes its rows and all-gathers them; every output is
    # one rank's whole dot product, so the tail's results equal the replicated up-projection's bit for bit
    for world in (2, 4):
        run_gloo(_tail_worker, world, str(tmp_path))
        for r in range(world):
            (n_rep, p_rep), (n_sh, p_sh), t_rep, t_sh = torch.load(tmp_path / f"tail{r}.pt")
            assert torch.equal(n_rep, n_sh) and torch.equal(p_rep, p_sh) and torch.equal(t_rep, t_sh), (world, r)
            assert torch.equal(p_rep, t_rep)
