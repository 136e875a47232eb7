"""Template ``gemv`` on the CPU: every example compiles for sm_90a without spills, with 128-bit weight
loads and the PDL wait before the dependents launch; rendering is deterministic; bad parameters fail
with a message naming the fix; the reference follows the dialect ops; and the kernel's work split
(constants -> tasks -> outputs) covers every output exactly once."""

from __future__ import annotations

import math

import pytest
import torch

from k3compile import build
from k3compile.audit import audit_point
from template_checks import module_constants
from templates import TemplateError, get
from templates.gemv import (HOLD_VECS, MAX_STAGES, SMEM_BUDGET, SMEM_PER_SM, SMS, STAGE_X_BYTES, kernel_layout,
                            max_row_tiles, mma_split)

T = get("gemv")
EXAMPLES = T.examples()


def _point(label):
    return T.point(**EXAMPLES[label])


def test_tensor_cores_from_bucket_8_for_plain_gemvs_only():
    for label, params in EXAMPLES.items():
        c = _point(label).c
        assert c["MMA"] == (c["M"] >= 8 and c["PRO"] == "none" and c["K"] % 128 == 0), label
        if c["MMA"]:  # about one CTA per SM, every CTA inside the shared-memory budget
            assert c["GRID"] == -(-c["N"] // (16 * c["RT"])), label
            # more than one wave only at the most row tiles the registers hold (or shared memory: two stages)
            smem2 = c["WARPS"] * max(c["M"] * 16 * (c["RT"] + 1) * 4, 2 * (16 * (c["RT"] + 1) + c["M"]) * 64)
            assert (c["GRID"] * c["SPLIT"] <= SMS or c["RT"] == max_row_tiles(c["M"] // 8, c["WARPS"])
                    or smem2 > SMEM_BUDGET), label
            # the fp32 partial sums reuse the ring's bytes (weights and activations) after the K loop
            smem = c["WARPS"] * max(c["M"] * 16 * c["RT"] * 4, c["STAGES"] * (16 * c["RT"] + c["M"]) * 64)
            assert smem <= SMEM_BUDGET and 2 <= c["STAGES"] <= MAX_STAGES, label
    assert not T.point(**{**EXAMPLES["k3tp8_b64"], "mma": False}).c["MMA"]  # codegen --batch-invariant
    with pytest.raises(TemplateError, match="mma=True needs"):
        T.point(**{**EXAMPLES["k3tp8_b1"], "mma": True})


def test_tensor_core_split_fits_shared_memory_at_every_real_shape():
    from k3compile.models.config import get_config

    k3 = get_config("kimi_k3")
    shapes = {(6284, 7168), (2096, 7168), (7168, 3584), (7168, 1792), (7168, 768), (7168, 4224), (12288, 7168),
              (k3.vocab_size // 8, k3.hidden_size), (k3.vocab_size // 16, k3.hidden_size), (16, 256), (1024, 256),
              (896, 3584)}
    for m in (8, 16, 32, 64):
        for n, k in shapes:
            warps, rt, stages, grid, split = mma_split(m, n, k)
            smem = warps * max(m * 16 * rt * 4, stages * (16 * rt + m) * 64)
            assert smem <= SMEM_BUDGET and 2 <= stages <= MAX_STAGES and rt * m // 8 <= 32, (m, n, k, rt, stages)
            # past the spill-free row tiles only where those would cost the grid a wave
            free = max_row_tiles(m // 8, warps)
            assert rt <= free or -(-n // (16 * free)) * split > SMS * (1 if warps == 8 else 2) * -(
                -grid * split // (SMS * (1 if warps == 8 else 2))), (m, n, k, rt, grid)
            # 8 warps (two per scheduler) unless the grid takes more than one wave: then 4, two CTAs per SM
            assert warps == (8 if m <= 16 or grid * split <= SMS else 4), (m, n, k, warps, grid)
            assert grid * split <= SMS or 2 * smem <= SMEM_BUDGET or stages == 2, (m, n, k, smem)
            # a K split only where the activations (m rows for 16 rt / 2 weight rows before the split) outweigh
            # the weights per CTA, or are half of them with one row tile, and K has 16 stages or more; or, with
            # the row tiles kept, where the grid fills half the SMs or less, m > 16 rt and K has 8 stages or more
            kst8 = -(-k // 256)
            pair = (m > 8 * rt or (m >= 8 and rt == 2)) and kst8 >= 16
            wider = m > 16 * rt and 2 * grid <= SMS and kst8 >= 8
            assert split == 1 or (split == 2 and kst8 % 2 == 0 and (pair or wider)), (m, n, k, rt, split)
            assert grid * 16 * rt >= n > (grid - 1) * 16 * rt, (m, n, k)
    assert mma_split(64, 2096, 7168)[3:] == (66, 2) and mma_split(8, 2096, 7168)[3:] == (66, 2)
    assert mma_split(64, 2304, 1536)[3:] == (72, 1)  # 3 K stages per CTA of a pair: measured slower
    # the row-sharded FFN up-projection (56 row tiles): pairs from batch 32 (measured at 64), none at 8
    assert mma_split(64, 896, 3584)[1:] == (1, 5, 56, 2) and mma_split(8, 896, 3584)[3:] == (56, 1)
    assert mma_split(8, 2096, 7168, split=4)[1:] == (4, 6, 33, 4)  # the knob: 4 x the row tiles, a quarter of K
    assert mma_split(64, 2304, 1536, split=1, row_tiles=1)[1] == 1
    # as many row tiles as the registers hold without spilling (max_row_tiles) where the grid keeps its waves: the
    # TP8 lm_head at batch 32 (7, not 8: 183 CTAs at two per SM, one wave either way; measured faster) ...
    assert mma_split(32, 20480, 7168)[:2] == (4, 7) and max_row_tiles(4, 4) == 7
    # ... else as many as shared memory holds (batch 16: 9 row tiles would take 143 CTAs, a second wave; measured
    # 33 % slower than spilling 8 bytes at 10), up to 128 accumulator registers
    assert mma_split(16, 20480, 7168)[:2] == (8, 10) and max_row_tiles(2) == 9
    assert mma_split(8, 163840, 7168)[:2] == (8, 13)  # shared memory: 788 CTAs, 1024 at the spill-free 10
    assert mma_split(8, 163840, 7168, row_tiles=10)[:2] == (8, 10)  # the knob (an A/B) ...
    assert mma_split(8, 163840, 7168, row_tiles=40)[1] == 13  # ... up to what shared memory holds


def test_split_knobs_are_checked():
    base = {"bucket": 64, "n": 2304, "k": 1536}
    with pytest.raises(TemplateError, match="must divide the 6 K stages"):
        T.point(**{**base, "bucket": 8}, split=4)
    with pytest.raises(TemplateError, match="tensor-core path"):
        T.point(bucket=1, n=2304, k=1536, split=2)
    with pytest.raises(TemplateError, match="row_tiles"):
        T.point(**base, row_tiles=0)
    with pytest.raises(TemplateError, match="row_tiles=2 applies to the tensor-core path only"):
        T.point(bucket=1, n=2304, k=1536, row_tiles=2)


def test_prologue_input_is_staged_in_shared_memory_when_it_fits():
    """With a prologue, xin (M x K bf16) is formed once per CTA in shared memory when it fits STAGE_X_BYTES, and
    then the grid stays within what shared memory lets be resident at once; examples take both forms."""
    forms = set()
    for label in EXAMPLES:
        c = _point(label).c
        staged = c["PRO"] != "none" and c["M"] * c["K"] * 2 <= STAGE_X_BYTES
        assert c["STAGE_X"] == staged, label
        if staged:
            per_sm = min(8, SMEM_PER_SM // (c["M"] * c["K"] * 2 + 2048))
            assert c["GRID"] <= SMS * per_sm and -(-c["GRID"] // SMS) * (c["M"] * c["K"] * 2) <= SMEM_PER_SM, label
        if c["PRO"] != "none":
            forms.add((c["PRO"], staged))
    assert forms == {("rms_norm", True), ("rms_norm", False), ("situ", True), ("situ", False)}, forms


def test_unroll_keeps_batch_one_bytes_in_flight_on_long_k_at_batch_four():
    """UNROLL (K steps in flight per lane): 4 at batch 1-2; at batch 4 (two rows per task) 4 only where K has
    16 steps or more (the front GEMVs), 2 on short K (the SiTU GEMV's 3 steps unrolled whole spilled into 168
    registers); 2 up to batch 8, then 1; never more than K's steps."""
    def unroll(bucket, n, k, **kw):
        return T.point(bucket=bucket, n=n, k=k, **kw).c["UNROLL"]

    assert [unroll(b, 2096, 7168) for b in (1, 2, 4, 8, 16)] == [4, 4, 4, 2, 1]
    assert unroll(4, 7168, 4096) == 4 and unroll(4, 7168, 3840) == 2  # 16 steps, 15 steps
    assert unroll(4, 7168, 1536) == 2 and unroll(4, 7168, 768, pro="situ") == 2
    assert unroll(1, 7168, 512) == 2  # two steps: both unrolled
    assert _point("k3tp8_front_gather_b4").c["UNROLL"] == 4


def test_hold_loads_whole_rows_where_a_small_grid_gives_every_warp_one_task():
    """HOLD (the warp's weight rows into registers before the PDL wait) only on the FMA path without prefetch,
    where a grid of at most one CTA per SM gives every warp one task of at most HOLD_VECS vectors a lane; at
    batch 4 the FFN tail's up-projection takes one row per task for it (twice the CTAs of two rows)."""
    for label in EXAMPLES:
        c = _point(label).c
        tasks = (c["N"] // c["ROWS"]) * (c["M"] // c["MB"])
        if c["HOLD"]:
            assert not c["MMA"] and not c["PREFETCH"] and (c["GRID"] <= SMS or EXAMPLES[label].get("hold")), label
            assert tasks <= c["GRID"] * c["WARPS"] and c["ROWS"] * -(-c["K"] // 256) <= HOLD_VECS, label
    on, off = _point("k3tp8_ffnup_shard_b4").c, _point("k3tp8_ffnup_shard_nohold_b4").c
    assert (on["HOLD"], on["ROWS"], on["GRID"]) == (True, 1, 112) and (off["HOLD"], off["ROWS"], off["GRID"]) == (
        False, 2, 56)
    assert not _point("k3tp8_b1").c["HOLD"]  # 12288 rows: more than one CTA per SM
    assert not _point("k3tp8_qup_norm_b1").c["HOLD"] and _point("k3tp8_qup_norm_hold_b1").c["HOLD"]  # 288 CTAs
    with pytest.raises(TemplateError, match="hold=True needs"):
        T.point(**{**EXAMPLES["k3tp8_b1"], "hold": True})
    with pytest.raises(TemplateError, match="hold='yes' must be"):
        T.point(**{**EXAMPLES["k3tp8_b1"], "hold": "yes"})


def test_examples_cover_the_required_labels():
    for cfg in ("mini", "k3tp8"):
        for b in (1, 8, 64):
            assert f"{cfg}_b{b}" in EXAMPLES
    pros = {e.get("pro", "none") for e in EXAMPLES.values()}
    assert pros == {"none", "rms_norm", "situ"}
    splits = {(0 < e.get("n_f32", 0), e.get("n_f32", 0) < e["n"]) for e in EXAMPLES.values()}
    assert splits == {(False, True), (True, False), (True, True)}  # bf16 only, fp32 only, both


def test_examples_compile_for_sm90a_without_spills(tmp_path):
    points = {label: _point(label) for label in EXAMPLES}
    reports = build.build([build.job_for(p) for p in points.values()], tmp_path)
    for label, p in points.items():
        rep = reports[p.name]
        assert rep["stack_bytes"] == 0, (label, rep)
        ptx = (tmp_path / p.name / "kernel.ptx").read_text()
        assert ".target sm_90a" in ptx, label
        assert "ld.local" not in ptx and "st.local" not in ptx, label
        wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < launch, f"{label}: griddepcontrol.wait must come before launch_dependents"
        # no activation is read before the wait: the only global loads before it are the staged RMSNorm
        # prologue's norm-weight vectors (VPT 128-bit loads per thread) and, with HOLD, the warp's weight
        # vectors (NSTEPS per row of its task), and the audit traces every access before the wait back to a
        # weight argument
        before = ptx[:wait].count("ld.global")
        held = p.c["ROWS"] * -(-p.c["K"] // 256) if p.c["HOLD"] else 0
        assert before == sum(".v4." in ln for ln in ptx[:wait].splitlines() if "ld.global" in ln), label
        if p.c["STAGE_X"] and p.c["PRO"] == "rms_norm":
            assert 0 < before - held <= -(-p.c["K"] // (8 * 32 * p.c["WARPS"])), (label, before)
        else:
            assert before == held, f"{label}: {before} global loads precede griddepcontrol.wait, {held} held"
        assert audit_point(p, ptx).ok, (label, audit_point(p, ptx).problems())
        # with PREFETCH the weight rows go to L2 in bulk before the wait (FMA path: one per task of a warp, in
        # a loop; tensor cores: a CTA's rows, in one or two pieces around its share of K), else never in bulk
        bulk = ptx.count("cp.async.bulk.prefetch.L2.global")
        assert bulk == (0 if not p.c["PREFETCH"] else 2 if p.c["MMA"] else 1), (label, bulk)
        assert ptx[wait:].count("cp.async.bulk.prefetch") == 0, label
        if p.c["PREFETCH"] and not p.c["MMA"]:  # resident at once
            regs = -(-rep["registers"] // 8) * 8
            assert p.c["GRID"] <= 132 * (65536 // (32 * p.c["WARPS"] * regs)), (label, rep, p.c["GRID"])
        if p.c["MMA"]:  # weights and activations through the 16-byte cp.async ring; the weights' first stages
            # are issued before the wait (weights are static), the activations' only after it
            n_before = ptx[:wait].count("cp.async.cg.shared.global")
            assert n_before == (p.c["STAGES"] - 1) * 2 * p.c["RT"], (label, n_before)  # R / 8 weight rows each
            assert "ld.shared.v4" in ptx, label
            assert "cp.async.wait_group" in ptx[launch:] and "mma.sync.aligned.m16n8k16" in ptx, label
        else:
            assert "ld.global.v4" in ptx, f"{label}: weight loads are not 128-bit"


def test_render_is_deterministic_and_reads_like_a_kernel():
    p = _point("mini_rmsnorm_b2")
    a, b = p.render(), T.point(**EXAMPLES["mini_rmsnorm_b2"]).render()
    assert a == b
    assert "example values" not in a
    assert "PRO = 'rms_norm'" in a and "N_F32 = 16" in a and "M = 2" in a
    compile(a, "gemv_rendered.py", "exec")  # valid Python
    assert a.count("# constants of this instance") == 1
    # different points render differently and get different names
    q = _point("mini_b1")
    assert q.render() != a and q.name != p.name


@pytest.mark.parametrize("params, words", [
    ({"bucket": 3, "n": 64, "k": 256}, ["bucket 3", "pad the batch"]),
    ({"bucket": 1, "n": 64, "k": 204}, ["k=204", "multiple of 8", "pad K"]),
    ({"bucket": 1, "n": 64, "k": 0}, ["multiple of 8"]),
    ({"bucket": 1, "n": 0, "k": 256}, ["positive"]),
    ({"bucket": 1, "n": 64, "k": 256, "n_f32": 65}, ["n_f32=65", "fp32 ones come first"]),
    ({"bucket": 1, "n": 64, "k": 256, "pro": "silu"}, ["'silu'", "rms_norm"]),
    ({"bucket": 1, "n": 64, "k": 256, "pro": "rms_norm", "eps": 0.0}, ["eps"]),
    ({"bucket": 1, "n": 64, "k": 256, "pro": "situ", "beta": -1.0}, ["beta", "4.0"]),
    ({"bucket": 1, "n": 64, "k": 256, "prefetch": 100}, ["prefetch=100", "multiple of 16"]),
])
def test_bad_params_raise_a_useful_error(params, words):
    with pytest.raises(TemplateError) as e:
        T.point(**params)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("label", list(EXAMPLES))
def test_constants_and_args_are_consistent(label):
    c = _point(label).c
    assert c["K"] % 8 == 0 and c["N"] % c["ROWS"] == 0 and c["M"] % c["MB"] == 0
    assert c["ROWS"] * c["MB"] <= 32  # accumulators per lane stay in registers
    args = T.args(c)
    names = [a.name for a in args]
    assert names[0] == "w" and args[0].role == "weight" and args[0].shape == (c["N"], c["K"])
    assert ("y_f32" in names) == (c["N_F32"] > 0) and ("y_bf16" in names) == (c["N_F32"] < c["N"])
    for a in args:
        assert a.nbytes > 0
    assert T.bytes(c) >= args[0].nbytes and T.flops(c) == 2 * c["M"] * c["N"] * c["K"]


def _simulate(c, inputs):
    """A model of the kernel's work split in float32: GRID CTAs x WARPS warps stride over (row group,
    batch chunk) tasks; each lane sums its 8-element vectors along K, then the warp sums the lanes.
    Returns the outputs and how many times each (m, n) was written."""
    M, N, K, NF = c["M"], c["N"], c["K"], c["N_F32"]
    xin = T.xin(c, inputs).float()
    w = inputs["w"].float()
    y = torch.full((M, N), float("nan"))
    writes = torch.zeros(M, N, dtype=torch.int64)
    mchunks = M // c["MB"]
    tasks = (N // c["ROWS"]) * mchunks
    vec_lane = torch.arange(K // 8) % 32  # 8-element vector v along K belongs to lane v % 32 (last step partial)
    lanes_k = [torch.arange(K).reshape(-1, 8)[vec_lane == lane].reshape(-1) for lane in range(32)]
    for cta in range(c["GRID"]):
        for warp in range(c["WARPS"]):
            for task in range(cta * c["WARPS"] + warp, tasks, c["GRID"] * c["WARPS"]):
                n0, m0 = (task // mchunks) * c["ROWS"], (task % mchunks) * c["MB"]
                rows = torch.arange(n0, n0 + c["ROWS"])
                ms = torch.arange(m0, m0 + c["MB"])
                part = torch.stack([xin[ms][:, ks] @ w[rows][:, ks].T for ks in lanes_k], -1)  # per lane
                y[m0:m0 + c["MB"], n0:n0 + c["ROWS"]] = part.sum(-1)
                writes[m0:m0 + c["MB"], n0:n0 + c["ROWS"]] += 1
    return {"y_f32": y[:, :NF], "y_bf16": y[:, NF:].to(torch.bfloat16)}, writes


def _simulate_mma(c, inputs):
    """The tensor-core path's split: CTA = R = 16*RT rows (the last CTA clamps its loads to row N-1 and writes
    only rows < N); K goes in stages of KB = 32*WARPS elements, warp w taking the 32-element slice w of each
    stage (none past K; the CTA's starting stage only changes the order); in a slice lane (g, t) holds elements
    8t..8t+7 and MMA i takes elements 8t+4i..8t+4i+3 of every lane (logical k 2t, 2t+1 <- 8t+4i, +1; 2t+8,
    2t+9 <- 8t+4i+2, +3), rows g / g+8 of each row tile, batch row g of each column tile; the warps' partial
    sums are added in warp order. Each warp's K elements are gathered from the MMAs it runs, so every K element
    must land in exactly one MMA of one warp."""
    M, N, K, NF, W, SPLIT = c["M"], c["N"], c["K"], c["N_F32"], c["WARPS"], c["SPLIT"]
    R, kb = 16 * c["RT"], 32 * W
    ksp = -(-K // kb) // SPLIT  # K stages of one CTA of a cluster (rank q: stages q * ksp ..)
    assert ksp * SPLIT == -(-K // kb), "the ranks of a cluster share the K stages evenly"
    xin = T.xin(c, inputs).float()
    w = inputs["w"].float()
    y = torch.full((M, N), float("nan"))
    writes = torch.zeros(M, N, dtype=torch.int64)
    covered = torch.zeros(K, dtype=torch.int64)
    rank_warp_ks = []
    for q in range(SPLIT):
        warp_ks = []
        for warp in range(W):
            ks = [stage * kb + 32 * warp + 8 * t + 4 * i + e for stage in range(q * ksp, (q + 1) * ksp)
                  if stage * kb + 32 * warp < K
                  for i in range(2) for t in range(4) for e in range(4)]  # one MMA: K = 16 = 4 lanes x (2 + 2)
            warp_ks.append(torch.tensor(ks, dtype=torch.int64))
            covered[warp_ks[-1]] += 1
        rank_warp_ks.append(warp_ks)
    assert bool((covered == 1).all()), "every K element in exactly one MMA of one warp of one rank"
    for cta in range(c["GRID"]):
        rows = torch.clamp(torch.arange(cta * R, cta * R + R), max=N - 1)
        acc = torch.stack([w[rows][:, ks] @ xin[:, ks].T for warp_ks in rank_warp_ks for ks in warp_ks])
        n = torch.arange(cta * R, cta * R + R)
        keep = n < N
        y[:, n[keep]] = acc.sum(0)[keep].T  # [SPLIT * W, R, M]: the warps' partial sums, rank by rank
        writes[:, n[keep]] += 1
    return {"y_f32": y[:, :NF], "y_bf16": y[:, NF:].to(torch.bfloat16)}, writes


@pytest.mark.parametrize("label", [lbl for lbl in EXAMPLES if lbl.startswith("mini_") or "front" in lbl])
def test_work_split_covers_every_output_once(label):
    c = _point(label).c
    inputs = T.random_inputs(c, torch.Generator().manual_seed(0))
    out, writes = (_simulate_mma if c["MMA"] else _simulate)(c, inputs)
    # the kernel's output layout (compact blocks per entry with SEGMENTS, REPLICAS / F32_REPLICAS copies)
    out = kernel_layout(c, torch.cat([out[n].double() for n in ("y_f32", "y_bf16") if n in out], dim=1))
    env = module_constants(_point(label).render())
    if c["MMA"]:  # the kernel file's split is the simulated one
        assert env["KB"] == 32 * c["WARPS"] and env["R"] == 16 * c["RT"] and env["NT"] * 8 == c["M"]
    assert bool((writes == 1).all()), f"{label}: outputs written {writes.min()}..{writes.max()} times"
    ref = T.reference(c, inputs)
    assert set(ref) == {a.name for a in T.args(c) if a.role == "out"}
    for name, r in ref.items():
        err = (out[name].double() - r).norm() / r.norm()
        assert err <= T.tolerance(c)[name], (label, name, float(err))


@pytest.mark.parametrize("label", [lbl for lbl in EXAMPLES if lbl.startswith("mini_")])
def test_inputs_are_realistic_and_reference_matches_the_dialect(label):
    from k3compile import dialect

    c = _point(label).c
    gen = torch.Generator().manual_seed(1)
    inputs = T.random_inputs(c, gen)
    args = {a.name: a for a in T.args(c)}
    assert set(inputs) == {n for n, a in args.items() if a.role != "out"}
    for name, t in inputs.items():
        assert t.shape == args[name].shape and t.dtype == args[name].torch_dtype, name
        assert torch.isfinite(t).all() and t.abs().mean() > 0.01, name
    ref = T.reference(c, inputs)
    for name, r in ref.items():
        assert r.dtype == torch.float64 and r.shape == args[name].shape and r.abs().mean() > 1e-3
    # the dialect op this point implements, computed the eager way
    w = inputs["w"]
    if c["PRO"] == "none":
        eager = torch.nn.functional.linear(inputs["x"].float(), w.float())
    elif c["PRO"] == "rms_norm":
        eager = dialect.rms_norm_linear_impl(inputs["x"], inputs["norm_weight"], c["EPS"], w).float()
    else:
        eager = dialect.situ_linear_impl(inputs["gate"], inputs["up"], w, c["BETA"], c["LINEAR_BETA"]).float()
    lay = kernel_layout(c, eager)  # the kernel's layout
    eager = torch.cat([lay[n] for n in ("y_f32", "y_bf16") if n in lay], dim=1)
    full = torch.cat([ref[n] for n in ("y_f32", "y_bf16") if n in ref], dim=1)
    err = (eager.double() - full).norm() / full.norm()
    assert err <= 1e-2, (label, float(err))


def test_tolerance_is_tight_enough_to_catch_a_wrong_prologue():
    c = _point("mini_rmsnorm_b2").c
    inputs = T.random_inputs(c, torch.Generator().manual_seed(2))
    ref = T.reference(c, inputs)["y_bf16"]
    wrong = inputs["x"].double() @ inputs["w"].double().T  # the prologue forgotten
    err = (wrong[:, c["N_F32"]:] - ref).norm() / ref.norm()
    assert err > 10 * T.tolerance(c)["y_bf16"]
    assert math.isclose(T.tolerance(c)["y_bf16"], 1e-2) and T.tolerance(c)["y_f32"] <= 1e-3
