"""Template kda_decode on the CPU: every example compiles for sm_90a with no spills, rendering is deterministic,
bad parameters are refused with a TemplateError, and the float64 reference() agrees with the dialect op
``kda_decode_fb`` (models/ops.py kda_decode, bf16/fp32 on the CPU) on the template's own random inputs.
The kernel itself runs only on the GPU (the lead's GPU tests)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from k3compile import dialect
from k3compile.templates import TemplateError, get
from template_checks import rel

T = get("kda_decode")
STATES = ("conv_q", "conv_k", "conv_v", "recurrent_state")


def _point(label):
    return T.point(**T.examples()[label])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _dialect(point, inputs):
    c = point.c
    args = [inputs[a.name] for a in point.args() if a.role != "out"]
    out = dialect.kda_decode_fb_impl(*args, head_dim=c["D"], lower_bound=c["LOWER_BOUND"], eps=c["EPS"])
    return dict(zip(("y",) + STATES, out))


def test_examples_cover_both_configs():
    ex = T.examples()
    plain = {f"{cfg}_b{b}" for cfg in ("mini", "k3tp8") for b in (1, 2, 4, 8, 64)}
    assert set(ex) == plain | {"k3tp8_b1_cl1", "k3tp8_b1_cl2", "k3tp8_b1_cl4", "k3tp8_b4_cl2", "k3tp8_b4_cl4"}
    assert len({_point(label).name for label in ex}) == len(ex)  # no two labels for one kernel
    assert ex["mini_b8"]["heads"] == 8 and ex["k3tp8_b8"]["heads"] == 12  # k3-mini TP1; kimi_k3 96 heads / TP8
    assert all(p["rank"] == 128 and p["head_dim"] == 128 and p["conv_width"] == 4 for p in ex.values())
    # every cluster size is compiled (and checked on the GPU) at least once
    assert {_point(label).c["CL"] for label in ex} == {1, 2, 4, 8}


def test_default_cluster_keeps_one_wave():
    """K3 TP8 (12 heads): 8 CTAs per head at batch 1 (96 CTAs), 4 at 2, one from 4 (48 heads x tokens: a
    cluster measured no faster); up to 32 heads x tokens the most that keep one wave of SMs."""
    from k3compile.templates.kda_decode import CLUSTER_MAX_HEADS

    got = {b: T.point(**{**GOOD, "bucket": b}).c["CL"] for b in (1, 2, 4, 8, 16, 64)}
    assert got == {1: 8, 2: 4, 4: 1, 8: 1, 16: 1, 64: 1}
    for b in (1, 2, 4, 8, 16, 64):
        for heads in (1, 3, 6, 8, 12, 24, 48, 96):
            cl = T.point(**{**GOOD, "bucket": b, "heads": heads}).c["CL"]
            if b * heads > CLUSTER_MAX_HEADS:
                assert cl == 1, (b, heads, cl)
            else:
                assert b * heads * cl <= 132 and (cl == 8 or b * heads * 2 * cl > 132), (b, heads, cl)
    assert T.point(**{**GOOD, "bucket": 1, "cluster": 2}).c["CL"] == 2


def test_examples_compile_without_spills(tmp_path, monkeypatch):
    from k3compile import build

    monkeypatch.setenv("K3COMPILE_CACHE", str(tmp_path / "cache"))  # a real compile, not a cache hit
    points = {label: _point(label) for label in T.examples()}
    reports = build.build([build.job_for(p) for p in points.values()], tmp_path / "out", workers=2)
    for label, p in points.items():
        rep = reports[p.name]
        assert not rep["cached"], label
        assert rep["arch"] == "sm_90a"
        assert rep["stack_bytes"] == 0, (label, rep)
        assert rep["registers"] <= 128, (label, rep)  # two 256-thread CTAs per SM
        ptx = (tmp_path / "out" / p.name / "kernel.ptx").read_text()
        assert ".target sm_90a" in ptx
        assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
        # state rows per thread (8 warps, 32 / (D / CL / 4) rows per warp instruction): one 128-bit load and
        # one 128-bit store each
        rows = p.c["D"] // (8 * (32 // (p.c["D"] // p.c["CL"] // 4)))
        assert rows == {1: 16, 2: 8, 4: 4, 8: 2}[p.c["CL"]], label
        # a cluster exchanges the output norm's sum of squares: one DSMEM store per peer, one barrier after the
        # relaxed arrive at the start; one CTA per head has neither
        assert ptx.count("st.shared::cluster.f32") == (1 if p.c["CL"] > 1 else 0), label
        assert ptx.count("barrier.cluster.arrive.relaxed") == (1 if p.c["CL"] > 1 else 0), label
        assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == rows, label
        assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) >= rows, label
        # the state loads follow the dependency wait (state may be written by the previous kernel)
        wait = ptx.index("griddepcontrol.wait")
        first_state_store = ptx.index("st.global.v4.b32")
        assert len(re.findall(r"ld\.global\.v4\.b32", ptx[wait:first_state_store])) >= rows


def test_rendering_is_deterministic():
    a, b = _point("k3tp8_b8"), _point("k3tp8_b8")
    assert a.key() == b.key() and a.render() == b.render()
    text = a.render()
    assert "# (example values" not in text
    assert "\nM = 8  #" in text and "\nH = 12  #" in text and "\nR = 128  #" in text
    assert "LOWER_BOUND = -5.0" in text and "EPS = 1e-05" in text
    compile(text, "kda_decode_rendered.py", "exec")
    assert _point("mini_b8").render() != text and _point("k3tp8_b1").key() != a.key()


GOOD = dict(bucket=8, heads=12, head_dim=128, rank=128, conv_width=4, lower_bound=-5.0, eps=1e-5)


@pytest.mark.parametrize("bad, match", [
    (dict(head_dim=64), "head_dim 64"),
    (dict(rank=100), "rank 100"),
    (dict(rank=512), "rank 512"),
    (dict(bucket=0), "bucket 0"),
    (dict(heads=0), "heads 0"),
    (dict(conv_width=1), "conv_width 1"),
    (dict(lower_bound=5.0), "lower_bound 5.0"),
    (dict(eps=0.0), "eps 0.0"),
    (dict(cluster=3), "cluster 3"),
    (dict(cluster=16), "cluster 16"),
])
def test_bad_params_raise(bad, match):
    with pytest.raises(TemplateError, match=match):
        T.point(**{**GOOD, **bad})
    with pytest.raises(TemplateError, match="sm_100a"):
        T.point(arch="sm_100a", **GOOD)


def test_args_follow_the_dialect_signature():
    p = _point("k3tp8_b8")
    args = p.args()
    params = list(inspect.signature(dialect.kda_decode_fb_impl).parameters)
    assert [a.name for a in args if a.role != "out"] == params[:params.index("head_dim")]
    assert [a.name for a in args if a.role == "out"] == ["y"]
    assert {a.name for a in args if a.role == "state"} == set(STATES)
    assert {a.name: a.dtype for a in args}["recurrent_state"] == "f32"
    assert {a.name: a.dtype for a in args}["a_log"] == "f32"  # the model keeps A_log and dt_bias in fp32
    inputs = T.random_inputs(p.c, torch.Generator().manual_seed(1))
    for a in args:
        if a.role == "out":
            continue
        t = inputs[a.name]
        assert t.dtype == a.torch_dtype and tuple(t.shape) == a.shape, a.name
        assert bool(torch.isfinite(t.float()).all()), a.name
    assert (inputs["a_log"].exp() >= 1).all() and (inputs["a_log"].exp() <= 16).all() and (inputs["a_log"] != 0).all()
    assert 0.08 < inputs["recurrent_state"].std().item() < 0.12
    state_bytes = 2 * 8 * 12 * 128 * 128 * 4
    assert state_bytes < T.bytes(p.c) < 1.2 * state_bytes  # the fp32 state dominates the traffic
    assert T.flops(p.c) > 7 * 8 * 12 * 128 * 128


@pytest.mark.parametrize("label", ["mini_b1", "mini_b8", "k3tp8_b64"])
def test_reference_matches_dialect(label):
    p = _point(label)
    c = p.c
    inputs = T.random_inputs(c, torch.Generator().manual_seed(0))
    keep = {k: v.clone() for k, v in inputs.items()}
    ref = T.reference(c, inputs)
    got = _dialect(p, inputs)
    for k, v in keep.items():
        assert torch.equal(v, inputs[k]), f"{k} was modified"
    assert set(ref) == {"y", *STATES}
    for name, want in ref.items():
        assert want.dtype == torch.float64 and tuple(want.shape) == tuple(got[name].shape), name
        err = rel(got[name], want)
        assert err <= T.tolerance(c)[name], (label, name, err)
    for name in ("conv_q", "conv_k", "conv_v"):  # a shift of bf16 values: exact
        assert torch.equal(ref[name], got[name].double()), name
    assert rel(got["y"], ref["y"]) < 5e-3  # bf16 rounding of y only (~2e-3)
    assert T.tolerance(c)["y"] == 1e-2 and set(T.tolerance(c)) == set(ref)  # a bound for every checked output


def test_reference_comparison_has_teeth():
    """The same comparison fails when the semantics change a little (decay, beta or the rank-1 update)."""
    p = _point("mini_b8")
    c = p.c
    inputs = T.random_inputs(c, torch.Generator().manual_seed(0))
    got = _dialect(p, inputs)
    for key, change in [("a_log", lambda t: t + 0.05), ("beta_logits", lambda t: (t.float() + 0.1).to(t.dtype)),
                        ("dt_bias", lambda t: t + 0.1)]:
        bad = dict(inputs, **{key: change(inputs[key])})
        ref = T.reference(c, bad)
        assert rel(got["recurrent_state"], ref["recurrent_state"]) > T.tolerance(c)["recurrent_state"], key
    ref = T.reference({**c, "EPS": 1.0}, inputs)
    assert rel(got["y"], ref["y"]) > T.tolerance(c)["y"]
