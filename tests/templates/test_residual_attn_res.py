"""Template residual_attn_res on the CPU: every example compiles for sm_90a without spills, the kernel's
argument unpacking matches args(), rendering is deterministic, bad parameters are refused, and the float64
reference agrees with the dialect's eager ops (the semantics the kernel must reproduce on the GPU)."""

from __future__ import annotations

import re

import pytest
import torch

from k3compile import dialect
from k3compile.templates import TemplateError, get
from k3compile.templates.residual_attn_res import stacked_blocks
from template_checks import compile_examples, rel, rendered_constants

T = get("residual_attn_res")
EXAMPLES = T.examples()




def test_examples_cover_the_variants():
    pts = [T.point(**p).c for p in EXAMPLES.values()]
    kinds = {(c["ADD"], c["HAS_PREFIX"], c["OUT_NORM"], c["NB"] > 0) for c in pts}
    assert {(True, True, True, True), (False, True, False, True), (False, True, True, True),
            (True, True, True, False), (True, False, True, True)} <= kinds
    for cfg in ("mini", "k3tp8"):
        for b in (1, 8, 64):
            assert f"{cfg}_b{b}" in EXAMPLES
    # the latent-MoE FFN tail (r + partial), with and without the all-reduce, AttnRes and the output norm
    assert {(c["TP"] > 1, c["NB"] > 0, c["OUT_NORM"]) for c in pts if c["ADD_R"]} >= {
        (False, True, True), (True, True, True), (True, False, False)}
    # clusters of every size the K3 buckets take, with and without the all-reduce and the AttnRes statistics
    assert {(c["CL"], c["TP"] > 1, c["NB"] > 0) for c in pts} >= {(7, False, True), (7, True, True), (4, True, True),
                                                                  (2, False, False), (2, True, False), (1, False, True)}


def test_default_cluster_splits_wide_rows_within_one_wave():
    from k3compile.templates.residual_attn_res import default_cluster
    assert [default_cluster(b, 7168) for b in (1, 8, 16, 32, 64)] == [7, 7, 7, 4, 2]
    assert default_cluster(1, 256) == 1 and default_cluster(64, 512) == 2
    for b in (1, 2, 4, 8, 16, 32, 64):
        c = T.point(bucket=b, d=7168, nb=4).c
        assert c["CL"] * c["M"] <= 132 and 7168 % (c["CL"] * 8 * c["THREADS"]) == 0


@pytest.mark.parametrize("label", sorted(EXAMPLES))
def test_render_deterministic_and_args_match_kernel(label):
    env = rendered_constants(T, EXAMPLES[label])
    # the kernel unpacks its arguments by ARG_NAMES: it must be exactly args() in order
    p = T.point(**EXAMPLES[label])
    assert env["ARG_NAMES"] == [a.name for a in p.args()]
    assert env["D"] % (8 * env["THREADS"] * env["CL"]) == 0 and env["THREADS"] % 32 == 0 and env["THREADS"] <= 512


def test_render_differs_per_point():
    a = T.point(**EXAMPLES["mini_b1"])
    b = T.point(**{**EXAMPLES["mini_b1"], "nb": 3})
    assert a.key() != b.key() and a.render() != b.render()
    assert "NB = 3" in b.render()


@pytest.mark.parametrize("bad, what", [
    ({"bucket": 3}, "bucket"),
    ({"d": 300}, "multiple of 256"),
    ({"d": 128}, "multiple of 256"),
    ({"nb": 17}, "nb=17"),
    ({"nb": -1}, "nb=-1"),
    ({"add": False, "has_prefix": False}, "no input"),
    ({"add": False, "add_r": True}, "add_r=True"),
    ({"eps": 0.0}, "eps"),
    ({"cluster": 9}, "cluster=9"),
    ({"cluster": 3}, "cluster=3"),  # 256 columns do not split into 3 multiples of 256
    ({"out_eps": -1.0}, "eps"),
    ({"threads": 64}, "threads=64"),  # more threads than the row's 32 chunks of 8
    ({"threads": 48}, "threads=48"),  # not whole warps
])
def test_bad_params_raise(bad, what):
    params = {**EXAMPLES["mini_b1"], **bad}
    with pytest.raises(TemplateError, match=re.escape(what)):
        T.point(**params)


def test_args_per_variant():
    names = lambda **kw: [a.name for a in T.point(**{**EXAMPLES["mini_b1"], **kw}).args()]  # noqa: E731
    blocks = ["block0", "block1"]  # mini_b1: nb = 2, one [M, D] tensor per sealed block
    assert names() == ["a", "prefix", *blocks, "norm_weight", "proj_weight", "out_norm_weight", "y", "new_prefix"]
    assert names(add=False, out_norm=False) == ["prefix", *blocks, "norm_weight", "proj_weight", "y"]
    assert names(nb=0) == ["a", "prefix", "out_norm_weight", "y", "new_prefix"]
    assert names(nb=0, add_r=True) == ["a", "r", "prefix", "out_norm_weight", "y", "new_prefix"]
    assert names(has_prefix=False) == ["a", *blocks, "norm_weight", "proj_weight", "out_norm_weight", "y",
                                       "new_prefix"]
    args = {a.name: a for a in T.point(**EXAMPLES["k3tp8_b8"]).args()}
    assert [n for n in args if n.startswith("block")] == ["block0", "block1", "block2", "block3"]
    assert args["block3"].shape == (8, 7168) and args["proj_weight"].shape == (7168,)
    assert args["y"].role == "out" and args["new_prefix"].role == "out" and args["norm_weight"].role == "weight"


def _eager(c: dict, x: dict) -> dict:
    """The dialect op this variant implements, on the bf16 inputs (the semantics of record)."""
    m, d = c["M"], c["D"]
    if c["TP"] > 1:  # what the all-reduce hands the op: the ranks' rows summed, in bf16
        x = {**x, "a": sum(x[f"peer{p}"].double() for p in range(c["TP"])).to(torch.bfloat16)}
    if c["ADD_R"]:  # the FFN output the op adds to the prefix: r + all_reduce(partial), in bf16
        x = {**x, "a": x["r"] + x["a"]}
    blocks = stacked_blocks(c, x) if c["NB"] else torch.empty(m, 0, d, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)  # nb == 0: AttnRes weights are not arguments; any values do
    nw = x.get("norm_weight", (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16))
    pw = x.get("proj_weight", torch.randn(d, generator=gen).to(torch.bfloat16)).reshape(1, d)
    if not c["ADD"]:
        if c["OUT_NORM"]:
            y = dialect.attn_res_rms_norm_impl(x["prefix"], blocks, nw, pw, c["EPS"], x["out_norm_weight"],
                                               c["OUT_EPS"])
        else:
            y = dialect.attn_res_impl(x["prefix"], blocks, nw, pw, c["EPS"])
        return {"y": y}
    if c["HAS_PREFIX"]:
        if c["OUT_NORM"]:  # the FFN tail with a dense partial, TP = 1
            y, new_prefix = dialect.ffn_tail_norm_impl(None, None, 0.0, None, x["a"], "", 1, x["prefix"], blocks,
                                                       nw, pw, c["EPS"], x["out_norm_weight"], c["OUT_EPS"])
            if c["NB"] == 0:  # AttnRes of the prefix alone is the identity: this is add_rms_norm
                y2, s2 = dialect.add_rms_norm_impl(x["a"], x["prefix"], x["out_norm_weight"], c["OUT_EPS"])
                assert torch.equal(y2, y) and torch.equal(s2, new_prefix)
        else:
            new_prefix = dialect.ffn_tail_impl(None, None, 0.0, None, x["a"], "", 1, x["prefix"])
            y = dialect.attn_res_impl(new_prefix, blocks, nw, pw, c["EPS"])
        return {"y": y, "new_prefix": new_prefix}
    assert c["OUT_NORM"]  # o_proj with no prefix yet: an identity GEMM makes the op's GEMM output a
    eye = torch.eye(d, dtype=torch.bfloat16)
    y, new_prefix = dialect.oproj_residual_norm_impl(x["a"], eye, "", 1, None, blocks, nw, pw, c["EPS"],
                                                     x["out_norm_weight"], c["OUT_EPS"])
    assert torch.equal(new_prefix, x["a"])
    return {"y": y, "new_prefix": new_prefix}


@pytest.mark.parametrize("label", sorted(EXAMPLES))
def test_reference_matches_dialect(label):
    params = dict(EXAMPLES[label])
    params["bucket"] = min(params["bucket"], 8)  # same variant, fewer rows: keeps the CPU test fast
    if params["bucket"] != EXAMPLES[label]["bucket"]:
        params.pop("threads", None)  # fewer rows take a wider cluster: a fixed thread count may not divide it
    c = T.point(**params).c
    x = T.random_inputs(c, torch.Generator().manual_seed(0))
    args = T.point(**params).args()
    assert set(x) == {a.name for a in args if a.role != "out"}
    for k, v in x.items():
        if "signal" in k:
            continue
        assert v.dtype == torch.bfloat16 and torch.isfinite(v).all() and (v != 0).float().mean() > 0.99, k
    ref = T.reference(c, x)
    assert set(ref) == {a.name for a in args if a.role == "out" or a.name in ("comm", "signal")}
    if c["TP"] > 1:  # this rank's row published, each flag channel one epoch on
        assert torch.equal(ref.pop("comm"), x["a"].double()) and torch.equal(ref.pop("signal"), x["signal"] + 1)
    eager = _eager(c, x)
    for k in ref:
        assert ref[k].dtype == torch.float64 and ref[k].shape == eager[k].shape
        err = rel(eager[k], ref[k])
        assert err < T.tolerance(c) / 2, (k, err)
    if "new_prefix" in ref:
        assert torch.equal(ref["new_prefix"], eager["new_prefix"].double())  # the bf16 add is exact
    if c["NB"] == 0 and not c["OUT_NORM"]:  # nothing to mix or normalise: y is the (new) prefix
        assert torch.equal(ref["y"], ref["new_prefix"] if c["ADD"] else x["prefix"].double())


@pytest.mark.parametrize("label", ["mini_tp2_b4", "mini_tp4_noprefix_b1"])
def test_local_wiring_is_the_identity(label):
    """Single-GPU emulation and the NCCL fallback call the TP kernel with peer0 = a and zero peers: the
    result equals the TP = 1 kernel's on the same a, bit for bit (k3compile.comm._Local)."""
    from k3compile import comm

    c = T.point(**EXAMPLES[label]).c
    c1 = T.point(**{**EXAMPLES[label], "tp": 1}).c
    x = T.random_inputs(c1, torch.Generator().manual_seed(3))
    wired = comm._Local("cpu").args(x["a"], c["TP"])
    ref = T.reference(c, {**x, **wired})
    ref1 = T.reference(c1, x)
    for k in ref1:
        assert torch.equal(ref[k], ref1[k]), k
    assert torch.equal(ref["comm"], x["a"].double())


def test_local_wiring_check_fails_a_kernel_that_exchanges():
    """``kernel_check.check_local_wiring`` (the GPU test of the kernel's local-wiring branch), run on the CPU
    with stand-in kernels: one that writes the reference's results for a = the sum and touches nothing else
    passes; one that also runs the exchange (copies a into comm, advances the flags) fails on both; one that
    reads the peers as if they were the exchange's does too, as does one that leaves y unwritten."""
    from k3compile import kernel_check

    point = T.point(**EXAMPLES["mini_tp2_b4"])
    c = point.c
    names = [a.name for a in point.args()]

    def stand_in(exchange=False, write_y=True, peers_summed=False):
        def fn(*tensors):
            t = dict(zip(names, tensors))
            assert t["peer_signal0"] is t["signal"] and t["peer_signal1"] is t["signal"] and t["peer0"] is t["a"]
            given = {k: v.clone() for k, v in t.items()}
            if peers_summed:  # a kernel that took the local wiring's zero block for a peer's real row
                given["peer1"] = given["a"]
            ref = T.reference(c, given)
            for k in ("new_prefix", "y")[: 2 if write_y else 1]:
                t[k].copy_(ref[k].to(torch.bfloat16))
            if exchange:
                t["comm"].copy_(t["a"])
                t["signal"].add_(1)
        return fn

    ok = kernel_check.check_local_wiring(point, stand_in(), seed=5, device="cpu")
    assert ok["ok"], ok["problems"]
    bad = kernel_check.check_local_wiring(point, stand_in(exchange=True), seed=5, device="cpu")
    assert {p.split(":")[0] for p in bad["problems"]} == {"comm", "signal"}, bad["problems"]
    doubled = kernel_check.check_local_wiring(point, stand_in(peers_summed=True), seed=5, device="cpu")
    assert {p.split(":")[0] for p in doubled["problems"]} >= {"y", "new_prefix"}, doubled["problems"]
    unwritten = kernel_check.check_local_wiring(point, stand_in(write_y=False), seed=5, device="cpu")
    assert unwritten["problems"][0].startswith("y: ") and "NaN" in unwritten["problems"][0]
    with pytest.raises(ValueError, match="TP > 1"):
        kernel_check.check_local_wiring(T.point(**EXAMPLES["mini_b8"]), stand_in(), seed=5, device="cpu")


def test_reference_detects_wrong_semantics():
    """The inputs make every part of the math matter: plausible mistakes miss the tolerance by far."""
    c = T.point(**{**EXAMPLES["mini_b8"], "nb": 3}).c
    x = T.random_inputs(c, torch.Generator().manual_seed(1))
    ref = T.reference(c, x)["y"]
    tol = T.tolerance(c)
    blocks, nw, pw = stacked_blocks(c, x), x["norm_weight"], x["proj_weight"].reshape(1, -1)
    new_prefix = x["prefix"] + x["a"]
    wrong = {
        # a uniform mix (logits ignored), the add skipped, the output norm weight dropped, the
        # projection weight dropped
        "uniform": dialect.rms_norm_impl(torch.cat([blocks, new_prefix[:, None]], 1).float().mean(1)
                                         .to(torch.bfloat16), x["out_norm_weight"], c["OUT_EPS"]),
        "no_add": dialect.attn_res_rms_norm_impl(x["prefix"], blocks, nw, pw, c["EPS"], x["out_norm_weight"],
                                                 c["OUT_EPS"]),
        "no_weight": dialect.rms_norm_impl(dialect.attn_res_impl(new_prefix, blocks, nw, pw, c["EPS"]),
                                           torch.ones_like(x["out_norm_weight"]), c["OUT_EPS"]),
        "no_proj": dialect.attn_res_rms_norm_impl(new_prefix, blocks, nw, torch.ones_like(pw), c["EPS"],
                                                  x["out_norm_weight"], c["OUT_EPS"]),
    }
    v = torch.cat([blocks, new_prefix[:, None]], 1).float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c["EPS"])
    alpha = torch.softmax((keys * (nw.float() * pw.float().reshape(-1))).sum(-1), -1)
    wrong["keys_mixed"] = dialect.rms_norm_impl((alpha[..., None] * keys).sum(1).to(torch.bfloat16),
                                                x["out_norm_weight"], c["OUT_EPS"])  # pitfall 6
    for name, y in wrong.items():
        assert rel(y, ref) > 5 * tol, name
    # the softmax really mixes: no source takes (almost) everything in most rows
    assert (alpha.max(-1).values < 0.95).float().mean() > 0.5, alpha


def test_compiles_sm90a_without_spills(tmp_path, monkeypatch):
    """Every example compiles (no cache: a fresh directory) for sm_90a; 128-bit global accesses only."""
    monkeypatch.setenv("K3COMPILE_CACHE", str(tmp_path / "cache"))
    for label, (point, rep, ptx) in compile_examples(T, tmp_path / "out").items():
        c = point.c
        env = rendered_constants(T, EXAMPLES[label])
        assert rep["stack_bytes"] == 0, (label, rep)
        assert rep["registers"] <= 65536 // c["THREADS"], (label, rep)
        assert ".target sm_90a" in ptx, label
        loads, stores = re.findall(r"ld\.global\S*", ptx), re.findall(r"st\.global\S*", ptx)
        # 128-bit data accesses; a cluster's CTAs read the row's flag epoch once (one 32-bit load)
        scalar = [s for s in loads + stores if ".v4" not in s]
        assert loads and scalar == (["ld.global.b32"] if c["TP"] > 1 and c["CL"] > 1 else []), (label, scalar)
        assert "ld.local" not in ptx and "st.local" not in ptx, label
        steps = c["D"] // (8 * c["THREADS"] * c["CL"])  # per CTA
        # every input is read at least once, every output written exactly once
        rows_in = sum(1 for a in point.args()
                      if a.role != "out" and a.name not in ("comm", "signal") and "peer_signal" not in a.name)
        assert len(loads) >= rows_in * steps, (label, len(loads))
        # the row's loads are issued before its first store (a load after a possibly aliasing store waits);
        # with TP > 1 the peers' rows come after the comm store and flag exchange, the blocks too unless UPFRONT
        early = rows_in if c["TP"] == 1 else rows_in - c["TP"] - (0 if env["UPFRONT"] else c["NB"])
        before = re.findall(r"ld\.global\S*", ptx[:ptx.index("st.global")])
        assert len(before) >= early * steps, (label, len(before), early)
        assert len(stores) == (1 + c["ADD"] + (c["TP"] > 1)) * steps, (label, len(stores))  # + the comm row
        if env["EXCHANGE"]:  # one early relaxed arrive; each exchange: DSMEM stores to every CTA, then a barrier
            # one reduction of the row's statistics (with GRAM the output norm's too); a second for the output
            # norm only past 8 blocks
            nred, second = env["NRED"], c["OUT_NORM"] and c["NB"] > 0 and not env["GRAM"]
            assert env["GRAM"] == (c["OUT_NORM"] and 0 < c["NB"] <= 8), label
            nstores = nred + second
            assert ptx.count("st.shared::cluster.f32") == nstores and ptx.count("mapa.shared::cluster") == nstores
            assert ptx.count("barrier.cluster.arrive.relaxed") == 1, label
            barriers = (nred > 0) + second + (c["TP"] > 1) + (c["TP"] > 1 and not nred)
            # + the "every CTA runs" wait, in both branches with TP > 1 (exchange, or the local wiring's skip)
            assert ptx.count("barrier.cluster.wait") == barriers + 1 + (c["TP"] > 1), label
        else:
            assert "barrier.cluster" not in ptx and "shared::cluster" not in ptx, label
        flags = re.findall(r"(?:atom|ld)\.\S*sys\S*", ptx)
        if c["TP"] > 1:  # two flag raises (release, system scope); per channel one acquire spin whose lane p
            # watches rank p (its address chosen among the TP flag pads: one poll covers every rank)
            assert ptx.count("fence.acq_rel.sys") == 2 and flags.count("atom.global.sys.release.add.u32") == 2
            assert flags.count("ld.acquire.sys.global.b32") == 4, (label, flags)  # first poll + loop, 2 channels
            assert len(re.findall(r"selp\.b64", ptx)) >= c["TP"] - 1, label
            assert "multimem" not in ptx  # NVLink multicast stays off
        else:
            assert not flags, (label, flags)
        assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1


def test_many_blocks_at_batch_64_take_two_steps_per_thread_and_do_not_spill(tmp_path):
    """default_threads: the real config's o_proj and FFN tails with 7 or 8 sealed blocks at batch 64 (2 CTAs
    per row, 448 chunks of 8 columns each) ran 448 threads, which cap a thread at 128 registers: ptxas spilled
    8-120 bytes in every one of them, at every TP. They now run 224 threads of two steps; the rest keep one step
    per thread. Each compiles here without local memory, at TP 1 and 8, the FFN tail (add_r) and the o_proj
    tail without a prefix (the first layer's)."""
    from k3compile import build
    from k3compile.templates.residual_attn_res import default_threads

    assert [default_threads(3584, nb, True) for nb in range(9)] == [448] * 7 + [224] * 2
    assert default_threads(3584, 8, False) == 448  # no Gram statistics without the output norm
    assert default_threads(1792, 8, True) == 224 and default_threads(1024, 8, True) == 128  # one step already
    pts = {f"nb{nb}_tp{tp}_{kind}": T.point(bucket=64, d=7168, nb=nb, tp=tp, **kw)
           for nb in (7, 8) for tp in (1, 8)
           for kind, kw in (("addr", {"add_r": True}), ("noprefix", {"has_prefix": False}))}
    assert {p.c["THREADS"] for p in pts.values()} == {224}
    reports = build.build([build.job_for(p) for p in pts.values()], tmp_path, workers=2)
    for label, p in pts.items():
        assert reports[p.name]["stack_bytes"] == 0, (label, reports[p.name])
