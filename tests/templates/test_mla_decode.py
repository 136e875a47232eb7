"""Template mla_decode on the CPU: the examples compile for sm_90a without spills, rendering is
deterministic, bad parameters are refused, the float64 reference agrees with the dialect op
``mla_decode_latent`` (the semantics the kernel must reproduce on the GPU), and the kernel's split-context
schedule (split sizes from the runtime lengths, log2-domain online softmax, combine) reproduces the
reference when emulated in float64."""

from __future__ import annotations

import math
import re

import pytest
import torch

from k3compile import dialect
from k3compile.templates import TemplateError, get
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
    assert env["THREADS"] == 32 * max(env["H"], 2) <= 1024  # one warp per head, at least two


def test_render_differs_per_point():
    a = T.point(**EXAMPLES["mini_b1"])
    b = T.point(**{**EXAMPLES["mini_b1"], "splits": 3})
    assert a.key() != b.key() and "NSPLIT = 3" in b.render()


def test_args_roles_and_shapes():
    c = T.point(**EXAMPLES["k3tp8_b8"]).c
    args = {a.name: a for a in T.args(c)}
    assert [a.name for a in T.args(c)] == ["q", "kv", "kv_norm_weight", "gate", "cache", "lengths", "kv_b_weight",
                                           "out", "latent", "ws_ol", "ws_ml"]
    assert args["q"].shape == (8, 12 * 192) and args["gate"].shape == (8, 12 * 128)
    assert args["cache"].shape == (8, 32768, 576) and args["kv_b_weight"].shape == (12 * 256, 512)
    assert args["lengths"].dtype == "i64" and args["lengths"].role == "act"
    assert args["out"].role == "out" and args["latent"].role == "out" and args["ws_ol"].role == "scratch"
    # bytes: the cache read at full context dominates; it is read, not written
    assert T.bytes(c) > 8 * 32767 * 576 * 2 and T.bytes(c) < 8 * 32768 * 576 * 2 * 1.05


@pytest.mark.parametrize("bad, what", [
    ({"bucket": 3}, "bucket"),
    ({"heads": 33}, "heads=33"),
    ({"heads": 2, "kv_lora": 1024}, "2 heads give 64 threads, fewer than the 128"),
    ({"kv_lora": 300}, "kv_lora=300"),
    ({"rope": 48}, "rope=48"),
    ({"v": 100}, "v=100"),
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
    assert set(ref) == {a.name for a in T.args(c) if a.role == "out"}
    eager = _eager(c, x)
    for k in ref:
        assert ref[k].dtype == torch.float64 and ref[k].shape == eager[k].shape, k
        assert rel(eager[k], ref[k]) < T.tolerance(c) / 2, (k, rel(eager[k], ref[k]))
    assert rel(eager["latent"], ref["latent"]) < 1e-3  # the same bf16 values up to rare rounding ties


def test_reference_detects_wrong_semantics():
    """Plausible mistakes miss the tolerance by far on these inputs."""
    c = _small("k3tp8_b8", lmax=64)
    x = T.random_inputs(c, torch.Generator().manual_seed(1))
    ref = T.reference(c, x)["out"]
    tol = T.tolerance(c)
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


def _emulate(c: dict, x: dict, ref_latent: torch.Tensor) -> torch.Tensor:
    """Float64 emulation of the two kernels' schedule: the splits from the runtime lengths (same integer
    formulas as ``Kernel.splits_of``), one online softmax per split in log2 units over its positions (the
    current token's row from the latent), the partials merged as ``combine_kernel`` does."""
    m, h, nope, r, vd, cd = c["M"], c["H"], c["NOPE"], c["R"], c["V"], c["C"]
    w = x["kv_b_weight"].double().view(h, nope + vd, cd)
    q = x["q"].double().view(m, h, nope + r)
    out = torch.empty(m, h, vd, dtype=torch.float64)
    covered = []
    for i in range(m):
        length = max(0, min(int(x["lengths"][i]), c["LMAX"] - 1))
        n = length + 1
        nact = min((n + c["CHUNK_MIN"] - 1) // c["CHUNK_MIN"], c["NSPLIT"])
        chunk = (n + nact - 1) // nact
        ql = torch.einsum("hd,hdc->hc", q[i, :, :nope], w[:, :nope]) * c["SCALE"] * LOG2E
        qpe = q[i, :, nope:] * c["SCALE"] * LOG2E
        parts, seen = [], []
        for s in range(c["NSPLIT"]):
            if s >= nact:
                continue
            start, end = s * chunk, min(s * chunk + chunk, n)
            m_run, l_run, ol = torch.full((h,), -1e30, dtype=torch.float64), torch.zeros(h), torch.zeros(h, cd)
            for p in range(start, end):
                row = ref_latent[i] if p == length else x["cache"][i, p].double()
                seen.append(p)
                score = ql @ row[:cd] + qpe @ row[cd:]
                m_new = torch.maximum(m_run, score)
                alpha, prob = torch.exp2(m_run - m_new), torch.exp2(score - m_new)
                l_run = l_run * alpha + prob
                ol = ol * alpha[:, None] + prob[:, None] * row[:cd]
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
    c = _small("mini_b8", lmax=40, bucket=8, splits=splits, chunk_min=chunk_min)
    x = T.random_inputs(c, torch.Generator().manual_seed(splits))
    x["lengths"][2:5] = torch.tensor([1, 2, 33])  # tiny rows (empty splits) and an uneven split
    ref = T.reference(c, x)
    emu = _emulate(c, x, ref["latent"])
    assert rel(emu, ref["out"]) < 1e-12


def test_default_splits():
    assert T.point(**EXAMPLES["k3tp8_b1"]).c["NSPLIT"] == 128  # 32768 / 256, under 2 x 132 CTAs
    assert T.point(**EXAMPLES["k3tp8_b64"]).c["NSPLIT"] == math.ceil(264 / 64)
    assert T.point(**{**EXAMPLES["mini_b1"], "lmax": 100}).c["NSPLIT"] == 1


def test_compiles_sm90a_without_spills(tmp_path, monkeypatch):
    """Every example compiles (fresh cache) for sm_90a with no spills; both kernels are in the PTX, the
    kernels wait on their PDL dependency and the cache is never stored to (only loads of bf16 rows)."""
    monkeypatch.setenv("K3COMPILE_CACHE", str(tmp_path / "cache"))
    for label, (point, rep, ptx) in compile_examples(T, tmp_path / "out").items():
        c = point.c
        assert rep["spill_store_bytes"] == 0 and rep["spill_load_bytes"] == 0, (label, rep)
        assert rep["stack_bytes"] == 0, (label, rep)
        assert rep["registers"] <= 65536 // (32 * c["H"]), (label, rep)
        assert ".target sm_90a" in ptx, label
        assert len(re.findall(r"^\.visible \.entry", ptx, re.M)) == 2, label
        assert ptx.count("griddepcontrol.wait") == 2 and ptx.count("griddepcontrol.launch_dependents") == 2
        assert "ld.global.v4" in ptx, label  # 16-byte cache / weight loads
