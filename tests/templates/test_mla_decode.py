"""Template mla_decode on the CPU: the examples compile for sm_90a without spills, rendering is
deterministic, bad parameters are refused, the float64 reference agrees with the dialect op
``mla_decode_latent`` (the semantics the kernel must reproduce on the GPU) and writes the latent row into the
cache (which the GPU check compares bit for bit with the kernel's own latent), and the kernels' split-context
schedule (split sizes from the runtime lengths, the absorbed query rounded to bf16, a log2-domain online
softmax per tile of TILE positions with bf16 probabilities, combine) reproduces the reference when emulated
in float64, within what the bf16 operands cost."""

from __future__ import annotations

import re

import pytest
import torch

from k3compile import dialect
from k3compile.templates import TemplateError, get
from k3compile.templates import mla_decode as md
from k3compile.templates.mla_decode import split_plan
from template_checks import compile_examples, rel, rendered_constants

T = get("mla_decode")
EXAMPLES = T.examples()
LOG2E = 1.4426950408889634




def _small(label: str, lmax: int = 96, bucket: int | None = None, **kw) -> dict:
    """The example's point with a short cache (and optionally fewer rows) for CPU checks."""
    p = {**EXAMPLES[label], "lmax": lmax, **kw}
    if bucket is not None:
        p["bucket"] = bucket
    return T.point(**p).c


def _eager(c: dict, x: dict) -> dict:
    out, latent = dialect.mla_decode_latent_impl(x["q"], x["kv"], x["kv_norm_weight"], c["KV_EPS"], x["gate"],
                                                 x["cache"], x["lengths"], x["kv_b_weight"], c["NOPE"], c["V"],
                                                 c["SCALE"])
    return {"out": out, "latent": latent}


def test_examples_present_and_sized():
    for cfg, heads in (("mini", 8), ("k3tp8", 12)):
        for b in (1, 8, 64):
            c = T.point(**EXAMPLES[f"{cfg}_b{b}"]).c
            assert c["H"] == heads and c["M"] == b and c["C"] == 512 and c["R"] == 64
            cache = next(a for a in T.args(c) if a.name == "cache")
            assert cache.nbytes <= 2.5e9 and cache.role == "state"
    assert T.point(**EXAMPLES["mini_b1"]).c["LMAX"] == 8192  # k3-mini max_position_embeddings


@pytest.mark.parametrize("label", sorted(EXAMPLES))
def test_render_deterministic(label):
    env = rendered_constants(T, EXAMPLES[label])
    assert env["THREADS"] == 256 and env["TILE"] == 8 * env["WARPS"]  # a warp's 8 positions per tile
    # the heads in groups of at most 32 (one group up to 32), each padded to whole 16-row MMA tiles
    groups, per = md.head_groups(env["H"])
    assert (env["HGN"], env["HG"]) == (groups, per) and per <= md.HEADS_PER_CTA and groups * per >= env["H"]
    assert (groups - 1) * per < env["H"]  # no empty group
    assert env["HP"] == 16 * -(-per // 16) and env["HP"] >= per
    assert env["ATT_GRID"][1 if env["BALANCED"] else 2] == groups


def test_head_groups():
    """Up to 32 local heads one attention CTA takes them all (K3 at TP 4, 8, 16; k3-mini); above, equal groups of at
    most 32 (K3 at TP 2: 2 x 24, TP 1: 3 x 32); past MAX_HEADS a clear error that names the fix."""
    assert [md.head_groups(h) for h in (1, 12, 24, 32, 33, 48, 96)] == [
        (1, 1), (1, 12), (1, 24), (1, 32), (2, 17), (2, 24), (3, 32)]
    assert md.attention_smem(96, 576) == md.attention_smem(32, 576) <= md.SMEM_BUDGET
    assert T.point(**EXAMPLES["k3tp1_b1"]).c["H"] == 96 and T.point(**EXAMPLES["k3tp2_b8"]).c["H"] == 48
    with pytest.raises(TemplateError, match="a larger TP size"):
        T.point(**{**EXAMPLES["k3tp1_b1"], "heads": md.MAX_HEADS + 1})


def test_render_differs_per_point():
    a = T.point(**EXAMPLES["mini_b1"])
    b = T.point(**{**EXAMPLES["mini_b1"], "splits": 3})
    assert a.key() != b.key() and "NSPLIT = 3" in b.render()


def test_args_roles_and_shapes():
    c = T.point(**EXAMPLES["k3tp8_b8"]).c
    args = {a.name: a for a in T.args(c)}
    assert [a.name for a in T.args(c)] == ["q", "kv", "kv_norm_weight", "gate", "cache", "lengths", "kv_b_weight",
                                           "out", "latent", "ws_q", "ws_ol", "ws_ml"]
    assert args["ws_q"].shape == (8, 12, 512) and args["ws_q"].role == "scratch"
    assert args["q"].shape == (8, 12 * 192) and args["gate"].shape == (8, 12 * 128)
    assert args["cache"].shape == (8, 32768, 576) and args["kv_b_weight"].shape == (12 * 256, 512)
    assert args["lengths"].dtype == "i64" and args["lengths"].role == "act"
    assert args["out"].role == "out" and args["latent"].role == "out" and args["ws_ol"].role == "scratch"
    # bytes: the cache read at full context (LMAX - 1 rows per row) dominates, plus the row written per row
    rest = sum(a.nbytes for a in T.args(c) if a.role not in ("scratch", "state"))
    assert T.bytes(c) - rest == 8 * 32767 * 576 * 2 + 8 * 576 * 2


@pytest.mark.parametrize("bad, what", [
    ({"bucket": 3}, "bucket"),
    ({"heads": 129}, "heads=129 must be in 1..128"),
    ({"kv_lora": 4096}, "kv_lora=4096 must be a multiple of 256 up to 2048"),
    ({"kv_lora": 2048}, "bytes of shared memory"),
    ({"nope": 100}, "nope=100"),
    ({"nope": 48}, "nope=48 must be a positive multiple of 32"),
    ({"kv_lora": 300}, "kv_lora=300"),
    ({"rope": 48}, "rope=48"),
    ({"v": 100}, "v=100"),
    ({"v": 288}, "v=288 must be a multiple of 32 up to 256"),
    ({"combine": 3}, "combine=3"),
    ({"combine": 4, "kv_lora": 256}, "combine=4 must be 1, 2 or 4 CTAs per head, each at least 128"),
    ({"combine_rows": 2}, "combine_rows=2 must be 1, 2, 4 or 8, divide the bucket 1"),
    ({"combine_rows": 3, "bucket": 64}, "combine_rows=3 must be 1, 2, 4 or 8"),
    ({"combine_rows": 8, "bucket": 64, "combine": 1}, "256 outputs per combine CTA (rows x v / combine = 8 x 128 / 1"),
    ({"lmax": 0}, "lmax=0"),
    ({"lmax": 2 ** 22, "bucket": 8}, "2^31"),
    ({"kv_eps": 0.0}, "kv_eps"),
    ({"scale": -1.0}, "scale"),
    ({"splits": 0}, "splits=0"),
    ({"chunk_min": 0}, "chunk_min=0"),
])
def test_bad_params_raise(bad, what):
    with pytest.raises(TemplateError, match=re.escape(what)):
        T.point(**{**EXAMPLES["mini_b1"], **bad})


@pytest.mark.parametrize("label, bucket", [("mini_b8", 8), ("k3tp8_b8", 8), ("k3tp8_b1", 1), ("mini_b64", 16)])
def test_reference_matches_dialect(label, bucket):
    c = _small(label, lmax=96, bucket=bucket)
    x = T.random_inputs(c, torch.Generator().manual_seed(0))
    assert set(x) == {a.name for a in T.args(c) if a.role != "out"}
    for a in T.args(c):
        if a.role != "out":
            assert x[a.name].dtype == a.torch_dtype and tuple(x[a.name].shape) == a.shape, a.name
    for k in ("q", "kv", "kv_norm_weight", "gate", "cache", "kv_b_weight"):
        assert torch.isfinite(x[k].float()).all() and (x[k] != 0).float().mean() > 0.99, k
    lengths = x["lengths"]
    assert lengths.min() >= 0 and lengths.max() <= c["LMAX"] - 1
    if bucket >= 3:
        assert len(set(lengths.tolist())) == bucket and lengths.max() == c["LMAX"] - 1 and lengths.min() == 0
    assert (x["ws_ol"] == 0).all() and (x["ws_ml"] == 0).all()
    ref = T.reference(c, {k: v.clone() for k, v in x.items()})
    assert set(ref) == {a.name for a in T.args(c) if a.role == "out"} | {"cache"}
    eager = _eager(c, x)
    for k in eager:
        assert ref[k].dtype == torch.float64 and ref[k].shape == eager[k].shape, k
        assert rel(eager[k], ref[k]) < T.tolerance(c)[k] / 2, (k, rel(eager[k], ref[k]))
    assert rel(eager["latent"], ref["latent"]) < 1e-3  # the same bf16 values up to rare rounding ties


def test_reference_detects_wrong_semantics():
    """Plausible mistakes miss the tolerance by far on these inputs."""
    c = _small("k3tp8_b8", lmax=64)
    x = T.random_inputs(c, torch.Generator().manual_seed(1))
    ref = T.reference(c, x)["out"]
    tol = T.tolerance(c)["out"]
    latent = _eager(c, x)["latent"]
    call = lambda **kw: dialect.mla_decode_impl(**{  # noqa: E731
        "q": x["q"], "latent": latent, "gate": x["gate"], "cache": x["cache"], "lengths": x["lengths"],
        "kv_b_weight": x["kv_b_weight"], "nope_dim": c["NOPE"], "v_dim": c["V"], "scale": c["SCALE"], **kw})
    cache_cur = x["cache"].clone()  # the current token read from the (stale) cache row instead of latent
    wrong = {
        "raw_kv_as_latent": call(latent=x["kv"]),  # kv_a RMSNorm skipped
        "stale_current_row": call(cache=cache_cur, latent=cache_cur[torch.arange(c["M"]), x["lengths"]]),
        "scale_1": call(scale=1.0),
        "one_position_short": call(lengths=(x["lengths"] - 1).clamp_min(0)),
        "no_gate": call(gate=torch.full_like(x["gate"], 30.0)),
    }
    for name, y in wrong.items():
        assert rel(y, ref) > 3 * tol, (name, rel(y, ref))


def test_reference_writes_the_latent_row_into_the_cache():
    """The reference's cache is the input cache with exactly one position per row changed, lengths[m] (clamped
    into 0 .. LMAX-1 as the kernels clamp it), holding the bf16 latent row bit for bit; the cache's tolerance is
    exact (0), the outputs' 1e-2."""
    c = _small("k3tp8_b8", lmax=64, bucket=8)
    x = T.random_inputs(c, torch.Generator().manual_seed(3))
    x["lengths"][3] = c["LMAX"] + 5  # out of range: clamped to the last position
    before = x["cache"].clone()
    ref = T.reference(c, x)
    assert torch.equal(x["cache"], before), "the reference must not write its inputs"
    cache = ref["cache"]
    assert cache.dtype == torch.bfloat16 and cache.shape == before.shape
    for i in range(c["M"]):
        pos = min(int(x["lengths"][i]), c["LMAX"] - 1)
        assert torch.equal(cache[i, pos].double(), ref["latent"][i]), i  # the latent row, exactly
        changed = (cache[i] != before[i]).any(-1).nonzero().flatten().tolist()
        assert changed == [pos], (i, changed)  # every other position untouched
    assert T.tolerance(c) == {"out": 1e-2, "latent": 1e-2, "cache": 0.0}


def test_gpu_check_compares_the_cache_exactly_with_the_kernels_latent():
    """``kernel_check.compare`` on results shaped as the kernel leaves them: the cache must hold the kernel's own
    latent rows bit for bit (``copied_state``), so a latent that differs from the float64 one by a bf16 tie
    still passes when the cache holds the same values, while one wrong cache element, a row written at the next
    position or a cache left unwritten fails; the torch baseline writes the cache as the kernel must."""
    from k3compile import kernel_check

    point = T.point(**{**EXAMPLES["k3tp8_b8"], "lmax": 40, "bucket": 4})
    c = point.c
    x = T.random_inputs(c, torch.Generator().manual_seed(4))
    ref = T.reference(c, x)
    latent = ref["latent"].to(torch.bfloat16)
    latent[1, 7] = _next_bf16(latent[1, 7])  # a rounding tie gone the other way
    assert latent[1, 7] != ref["latent"][1, 7]
    rows = torch.arange(c["M"])

    def kernel_results(cache_latent=latent):
        cache = x["cache"].clone()
        cache[rows, x["lengths"]] = cache_latent
        return {"out": ref["out"].to(torch.bfloat16), "latent": latent, "cache": cache}

    dev = kernel_results()
    res = kernel_check.compare(point, x, dev)
    assert res["ok"], res["problems"]
    assert res["errors"]["cache"] == 0.0 and 0 < res["errors"]["latent"] < 1e-3
    wrong = dev["cache"].clone()
    wrong[2, int(x["lengths"][2]), 100] += 1
    assert kernel_check.compare(point, x, {**dev, "cache": wrong})["problems"] == [
        f"cache: 1 of {wrong.numel()} values differ (exact comparison)"]
    shifted = x["cache"].clone()
    shifted[rows, (x["lengths"] + 1).clamp_max(c["LMAX"] - 1)] = latent
    for bad in (shifted, x["cache"].clone(), kernel_results(ref["latent"].to(torch.bfloat16))["cache"]):
        res = kernel_check.compare(point, x, {**dev, "cache": bad})
        assert not res["ok"] and res["problems"][0].startswith("cache: "), res["problems"]

    d = {k: v.clone() for k, v in x.items()}
    d.update(out=torch.empty_like(dev["out"]), latent=torch.empty_like(latent))
    T.torch_baseline(c, d)()
    assert torch.equal(d["cache"], T.copied_state(c, x, {"latent": d["latent"]})["cache"])
    assert (d["cache"] != x["cache"]).any(-1).sum() == c["M"]  # one row per row written


def _next_bf16(v: torch.Tensor) -> torch.Tensor:
    """The bf16 value next to ``v`` (away from zero): what a rounding tie decided the other way gives."""
    bits = v.view(torch.int16)
    return (bits + 1).view(torch.bfloat16)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _emulate(c: dict, x: dict, ref_latent: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """Float64 emulation of the three kernels' schedule: the splits from the runtime lengths (``split_plan``, the
    integer formulas of ``Kernel.splits_of``), the absorbed query rounded to bf16, one online softmax per split in log2
    units over tiles of TILE positions (the current token's row from the latent; the tile's maximum first, then
    the probabilities rounded to bf16 and summed as rounded), the partials merged as ``combine_kernel`` does.
    ``exact``: no bf16 rounding of the query and the probabilities (the schedule alone)."""
    m, h, nope, r, vd, cd, tile = c["M"], c["H"], c["NOPE"], c["R"], c["V"], c["C"], c["TILE"]
    rnd = (lambda v: v) if exact else _bf16
    w = x["kv_b_weight"].double().view(h, nope + vd, cd)
    q = x["q"].double().view(m, h, nope + r)
    out = torch.empty(m, h, vd, dtype=torch.float64)
    covered = []
    plan = split_plan(c, x["lengths"])
    for i in range(m):
        length = max(0, min(int(x["lengths"][i]), c["LMAX"] - 1))
        n = length + 1
        nact, chunk = plan[i]
        ql = rnd(torch.einsum("hd,hdc->hc", q[i, :, :nope], w[:, :nope]))
        qk = torch.cat([ql, q[i, :, nope:]], dim=1)  # [h, C + R]
        parts, seen = [], []
        for s in range(c["NSPLIT"]):
            if s >= nact:
                continue
            start, end = s * chunk, min(s * chunk + chunk, n)
            m_run, l_run, ol = torch.full((h,), -1e30, dtype=torch.float64), torch.zeros(h), torch.zeros(h, cd)
            for t0 in range(start, end, tile):
                ps = list(range(t0, min(t0 + tile, end)))
                seen += ps
                rows = torch.stack([ref_latent[i] if p == length else x["cache"][i, p].double() for p in ps])
                score = (qk @ rows.T) * c["SCALE"] * LOG2E  # [h, positions]
                m_new = torch.maximum(m_run, score.max(1).values)
                prob = rnd(torch.exp2(score - m_new[:, None]))
                alpha = torch.exp2(m_run - m_new)
                l_run = l_run * alpha + prob.sum(1)
                ol = ol * alpha[:, None] + prob @ rows[:, :cd]
                m_run = m_new
            parts.append((m_run, l_run, ol))
        covered.append(sorted(seen) == list(range(n)))
        m_all = torch.stack([p[0] for p in parts]).max(0).values
        l_all = sum(p[1] * torch.exp2(p[0] - m_all) for p in parts)
        ol_all = sum(p[2] * torch.exp2(p[0] - m_all)[:, None] for p in parts) / l_all[:, None]
        o = torch.einsum("hc,hvc->hv", ol_all, w[:, nope:])
        out[i] = o * torch.sigmoid(x["gate"][i].double().view(h, vd))
    assert all(covered), covered  # every position 0..lengths[m] exactly once
    return out.reshape(m, h * vd)


@pytest.mark.parametrize("splits, chunk_min", [(1, 256), (4, 8), (5, 3), (16, 1), (7, 40)])
def test_split_schedule_emulation_matches_reference(splits, chunk_min):
    """The per-row split rule (batch-invariant code) at split sizes below a tile."""
    c = _small("mini_b8", lmax=40, bucket=8, splits=splits, chunk_min=chunk_min, balance=False)
    x = T.random_inputs(c, torch.Generator().manual_seed(splits))
    x["lengths"][2:5] = torch.tensor([1, 2, 33])  # tiny rows (empty splits) and an uneven split
    ref = T.reference(c, x)
    assert rel(_emulate(c, x, ref["latent"], exact=True), ref["out"]) < 1e-12  # the schedule is exact
    err = rel(_emulate(c, x, ref["latent"]), ref["out"])  # what the bf16 query and probabilities cost
    assert 1e-5 < err < T.tolerance(c)["out"] / 4, err


@pytest.mark.parametrize("bucket, lmax, seed", [(8, 600, 0), (8, 5000, 1), (64, 400, 2)])
def test_balanced_split_schedule_emulation_matches_reference(bucket, lmax, seed):
    """The balanced splits (the default): one tile per split while the batch's tiles fit one wave (600), several
    tiles per split beyond it (5000: tp > 1), every row at batch 64; the schedule exact, the rounding within
    tolerance."""
    c = _small("mini_b8", lmax=lmax, bucket=bucket)
    assert c["BALANCE"]
    x = T.random_inputs(c, torch.Generator().manual_seed(seed))
    plan = split_plan(c, x["lengths"])
    assert max(nact for nact, _ in plan) > 1
    if lmax == 5000:
        assert plan[0][1] > c["TILE"]  # several tiles per split
    ref = T.reference(c, x)
    assert rel(_emulate(c, x, ref["latent"], exact=True), ref["out"]) < 1e-12
    assert rel(_emulate(c, x, ref["latent"]), ref["out"]) < T.tolerance(c)["out"] / 4


def _plan_of(label: str, lengths, **kw):
    c = T.point(**{**EXAMPLES[label], **kw}).c
    return c, split_plan(c, torch.tensor(lengths))


def test_split_plan_balances_the_batch_over_one_wave():
    """Batch 64 at context 1k (1,025 positions, 17 tiles): 2 splits of 9 tiles per row, 128 CTAs in one wave, where
    the per-row rule gave 5 splits of 4 tiles (320 CTAs, three rounds); at 32k 2 splits of 251 tiles; batch 8 at 1k
    9 splits of 2 tiles; batch 1 at 1k 17 splits of at most a tile (the per-row rule); a long row among short ones
    takes the SMs they leave, at most NSPLIT splits."""
    c, plan = _plan_of("k3tp8_b64", [1024] * 64, lmax=32768)
    assert set(plan) == {(2, 9 * 64)}
    c0 = {**c, "BALANCE": False}
    assert set(split_plan(c0, [1024] * 64)) == {(5, 205)}
    assert set(_plan_of("k3tp8_b64", [32000] * 64, lmax=32768)[1]) == {(2, 251 * 64)}
    assert set(_plan_of("k3tp8_b8", [1024] * 8)[1]) == {(9, 128)}
    assert _plan_of("k3tp8_b1", [1024])[1] == [(17, 61)]  # one row: its own rule (batch-invariant code's)
    c8, plan = _plan_of("k3tp8_b8", [32000] + [100] * 7)
    assert plan[0] == (63, 8 * 64) and plan[1] == (1, 512)  # capped at NSPLIT = 66 splits: 8 tiles each
    assert c8["NSPLIT"] == 66


@pytest.mark.parametrize("bucket", [2, 8, 64])
def test_split_plan_is_the_smallest_split_that_fits_one_wave(bucket):
    """Random batches: tp (tiles per split) is the smallest at least the floor (CHUNK_MIN, NSPLIT) whose splits fit
    SMS CTAs; every row's splits cover its positions, at most NSPLIT of them."""
    gen = torch.Generator().manual_seed(bucket)
    c = T.point(**{**EXAMPLES["k3tp8_b8"], "bucket": bucket, "lmax": 32768}).c
    tile = c["TILE"]
    for _ in range(50):
        top = int(torch.randint(1, 32768, (1,), generator=gen))
        lengths = torch.randint(0, top, (bucket,), generator=gen)
        plan = split_plan(c, lengths)
        tiles = [(int(n) + tile) // tile for n in lengths]
        tp = plan[0][1] // tile
        floor = max(-(-c["CHUNK_MIN"] // tile), -(-max(tiles) // c["NSPLIT"]))
        ctas = lambda t: sum(-(-x // t) for x in tiles)  # noqa: E731
        assert tp >= floor and ctas(tp) <= c["SMS"], (tp, floor)
        assert tp == floor or ctas(tp - 1) > c["SMS"]
        for (nact, chunk), n in zip(plan, lengths):
            assert chunk == tp * tile and nact <= c["NSPLIT"] and (nact - 1) * chunk < int(n) + 1 <= nact * chunk


def test_splits_shorter_and_longer_than_a_tile():
    """Splits of a few positions (fewer than a tile: the rest of the tile is masked) and of several tiles."""
    for lmax, chunk_min in ((300, 256), (300, 5)):
        c = _small("k3tp8_b8", lmax=lmax, bucket=4, chunk_min=chunk_min)
        x = T.random_inputs(c, torch.Generator().manual_seed(lmax + chunk_min))
        ref = T.reference(c, x)
        assert rel(_emulate(c, x, ref["latent"]), ref["out"]) < T.tolerance(c)["out"] / 4


def test_default_splits():
    c1 = T.point(**EXAMPLES["k3tp8_b1"]).c
    assert c1["NSPLIT"] == 132 and c1["CHUNK_MIN"] == 64  # one row: one wave; 17 one-tile splits at context 1k
    assert T.point(**EXAMPLES["k3tp8_b8"]).c["CHUNK_MIN"] == 64
    assert T.point(**EXAMPLES["k3tp8_b64"]).c["CHUNK_MIN"] == 256
    assert T.point(**EXAMPLES["k3tp8_b8"]).c["NSPLIT"] == 66  # 528 CTAs: 4 whole waves of 132
    assert T.point(**EXAMPLES["k3tp8_b64"]).c["NSPLIT"] == 33  # 2112 CTAs: 16 whole waves
    for b in (8, 16, 32, 64):  # whole waves of at least 4 at full context
        s = T.point(**{**EXAMPLES["k3tp8_b8"], "bucket": b, "lmax": 32768}).c["NSPLIT"]
        assert (b * s) % 132 == 0 and b * s >= 4 * 132 and (b * (s - 1) < 4 * 132 or (b * (s - 1)) % 132), (b, s)
    assert T.point(**{**EXAMPLES["mini_b1"], "lmax": 100}).c["NSPLIT"] == 2  # 100 positions, 64 per split
    assert T.point(**{**EXAMPLES["mini_b1"], "lmax": 100, "chunk_min": 256}).c["NSPLIT"] == 1


def test_combine_split_is_the_most_the_shapes_allow():
    """The combine kernel's cluster of CTAs per (head, row group), each merging C / split columns of the partials: 4
    at every bucket at K3's C = 512, V = 128; at most V / 32 and C / 128 (a 4-element chunk of ol per lane), a power
    of two dividing both."""
    got = {b: T.point(**{**EXAMPLES["k3tp8_b8"], "bucket": b}).c["COMBINE_SPLIT"] for b in (1, 2, 4, 8, 16, 32, 64)}
    assert set(got.values()) == {4}
    assert T.point(**{**EXAMPLES["mini_h1_b1"], "v": 32}).c["COMBINE_SPLIT"] == 1
    assert T.point(**{**EXAMPLES["mini_h1_b1"], "v": 64}).c["COMBINE_SPLIT"] == 2
    assert T.point(**{**EXAMPLES["mini_h1_b1"], "v": 96}).c["COMBINE_SPLIT"] == 2  # 3 CTAs would not divide C
    assert T.point(**{**EXAMPLES["mini_h1_b1"], "kv_lora": 256}).c["COMBINE_SPLIT"] == 2
    c2r1 = T.point(**EXAMPLES["mini_b4_c2r1"]).c
    assert c2r1["COMBINE_SPLIT"] == 2 and c2r1["RB"] == 1 and not c2r1["BALANCE"]


def test_default_combine_rows():
    """Rows per combine CTA: 8 at K3 TP8's batch 64 (measured), 4 at 32, 2 below (at least two CTAs per SM), never
    more than 256 outputs per CTA, and what the point takes when none is given."""
    got = {b: T.point(**{**EXAMPLES["k3tp8_b8"], "bucket": b}).c["RB"] for b in (1, 2, 4, 8, 16, 32, 64)}
    assert got == {1: 1, 2: 2, 4: 2, 8: 2, 16: 2, 32: 4, 64: 8}
    assert T.point(**{**EXAMPLES["k3tp8_b8"], "bucket": 64, "combine": 2}).c["RB"] == 4  # 8 x 128 / 2 > 256
    assert T.point(**{**EXAMPLES["mini_b64"]}).c["RB"] == 4  # 8 heads: 8 rows would leave 256 CTAs < 2 x 132
    assert T.point(**EXAMPLES["k3tp8_b64_r2"]).c["RB"] == 2


def test_compiles_sm90a_without_spills(tmp_path, monkeypatch):
    """Every example compiles (fresh cache) for sm_90a with no spills; the three kernels are in the PTX and wait
    on their PDL dependency; the attention kernel copies cache rows with cp.async and runs QK^T and PV as the
    planned number of tensor-core MMAs."""
    monkeypatch.setenv("K3COMPILE_CACHE", str(tmp_path / "cache"))
    for label, (point, rep, ptx) in compile_examples(T, tmp_path / "out").items():
        c = point.c
        assert rep["stack_bytes"] == 0, (label, rep)
        assert rep["registers"] <= 255, (label, rep)
        assert ".target sm_90a" in ptx, label
        assert len(re.findall(r"^\.visible \.entry", ptx, re.M)) == 3, label
        assert ptx.count("griddepcontrol.wait") == 3 and ptx.count("griddepcontrol.launch_dependents") == 3
        # the attention kernel lets the combine launch after its last tile when BALANCED, else right after its wait
        att = next(body for body in re.split(r"^\.visible \.entry ", ptx, flags=re.M)[1:]
                   if body.startswith("kernel_cutlass_kernel_"))
        trig = att.find("griddepcontrol.launch_dependents")
        assert (trig > att.rfind("mma.sync")) == (c["BALANCE"] and c["M"] > 1) and trig > att.find("griddepcontrol.wait"), label
        assert "ld.global.v4" in ptx, label  # 16-byte loads (the latent row, the combine's partials)
        # the attention kernel: cache rows by 16-byte cp.async, QK^T and PV on the tensor cores; the absorb kernel:
        # ql^T = W_uk^T q_nope^T on the tensor cores, NOPE / 16 MMAs (two chains) per 16-column, 8-row output tile
        ht, row = -(-md.head_groups(c["H"])[1] // 16), c["C"] + c["R"]  # a head group's MMA tiles
        assert ptx.count("cp.async.cg.shared.global") >= 1, label
        attn_mma = ht * (row // 16 + c["C"] // 8 // 8 * c["TILE"] // 16)
        assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == attn_mma + c["NOPE"] // 16, label
        attn_trans = ht * (c["TILE"] // 16) * (c["C"] // 128)
        assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == attn_trans + c["NOPE"] // 16, label
