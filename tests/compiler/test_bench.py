"""``k3compile bench`` pieces that need no GPU: per-layer differencing, the plot, the no-GPU error, the
system names, the bf16-experts baseline's patch and the floor when no k3compile row gives it."""

import dataclasses
import inspect
import json
import os
import struct
import zlib

import pytest
import torch

from k3compile import bench
from k3compile.cli import main

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _row(layers, system, us, floor=10.0, launches=10, bucket=1):
    return bench.Row("slice", layers, 8, 1024, bucket, system, us_per_step=us, launches=launches, floor_us=floor)


def test_per_layer_time_is_the_difference_of_depths():
    rows = [_row(1, "k3compile", 100.0, 40.0, 20), _row(2, "k3compile", 250.0, 100.0, 33),
            _row(2, "eager", 900.0, 100.0), _row(3, "k3compile", 390.0, 160.0, 46)]
    got = {(p["layer"], p["system"]): p for p in bench.per_layer(rows)}
    assert set(got) == {(2, "k3compile"), (3, "k3compile")}  # eager has no depth-1 row to subtract
    assert got[2, "k3compile"]["us"] == 150.0 and got[2, "k3compile"]["floor_us"] == 60.0
    assert got[3, "k3compile"]["launches"] == 13
    # a row that did not run (NaN time, launches -1: its note says why) gives no difference, not a NaN line
    failed = _row(1, "k3compile", float("nan"), 40.0, -1)
    assert bench.per_layer([failed, _row(2, "k3compile", 250.0, 100.0, 33)]) == []


def test_per_layer_launches_beside_the_plans_kernels():
    """k3compile rows carry the plan's GPU kernels per layer; the per-layer line shows them beside the
    profiler's count and flags a difference (a torch copy the plan does not know, a kernel that did not run)."""
    rows = [_row(1, "k3compile", 100.0, 40.0, 20), _row(2, "k3compile", 250.0, 100.0, 35),
            _row(3, "k3compile", 390.0, 160.0, 48)]
    for r in rows:
        r.planned_kernels = [8, 15, 12][:r.layers]
    got = {p["layer"]: p for p in bench.per_layer(rows)}
    assert (got[2]["launches"], got[2]["planned"]) == (15, 15) and (got[3]["launches"], got[3]["planned"]) == (13, 12)
    text = bench.table({"rows": [dataclasses.asdict(r) for r in rows], "per_layer": list(got.values())})
    assert "launches 15 (plan 15)" in text and "launches 13 (plan 12: MISMATCH" in text
    (q,) = bench.per_layer([_row(1, "eager", 900.0, 40.0), _row(2, "eager", 1800.0, 100.0)])
    assert q["planned"] is None and "plan" not in bench.table({"rows": [], "per_layer": [q]})


def test_planned_kernels_per_layer_count_only_the_copied_all_gathers():
    """One-GPU TP emulation copies an all-gathered shard (a profiled kernel) unless the kernel before wrote it in
    the gathered layout: the MoE front GEMV writes its router and latent rows into every rank's slot, so the
    MoE layers' all-gathers launch nothing there."""
    from k3compile.models import k3_mini
    from k3compile.plan import plans_for

    plan = plans_for(k3_mini(), tp=2, buckets=(1,), every_layer=True)[1]
    layers = sorted((lp for lp in plan.layers if lp.layer >= 0), key=lambda lp: lp.layer)
    emulated = bench.planned_kernels(plan, emulated=True)
    assert len(emulated) == len(layers) == k3_mini().num_hidden_layers
    for lp, n in zip(layers, emulated):
        c = lp.counts()
        assert n == c["gpu_kernels"] + c["emulated_copies"] and c["gpu_kernels"] >= 8
        assert c["emulated_copies"] == 0, (lp.layer, c)
    assert any(lp.counts()["collectives"].get("all_gather") for lp in layers)  # the MoE layers' router/latent rows
    assert bench.planned_kernels(plan, emulated=False) == []  # real TP: NCCL's kernels are not modelled


def test_per_layer_gpu_busy_time_and_host_bound_rows():
    # layer 1's step is host-bound (wall 320 us, its kernels busy 206 us): the wall difference says 30 us for
    # layer 2, the busy difference the layer's real 114 us
    def prof(layers, wall, busy):
        r = _row(layers, "k3compile", wall, 60.0 * layers)
        r.kernels = [{"name": "a", "calls": 1.0, "us": busy, "exposed_us": busy - 6.0},
                     {"name": "b", "calls": 2.0, "us": 9.0, "exposed_us": 6.0}]
        return r

    l1, l2 = prof(1, 320.0, 206.0), prof(2, 350.0, 320.0)
    assert bench.busy_us(l1) == 206.0 and bench.host_bound(l1) and not bench.host_bound(l2)
    (p,) = bench.per_layer([l1, l2])
    assert p["us"] == 30.0 and p["busy_us"] == 114.0 and p["host_bound"]
    text = bench.table({"rows": [dataclasses.asdict(r) for r in (l1, l2)], "per_layer": [p]})
    assert "GPU busy    114.0 us x 1.90" in text and "HOST-BOUND" in text
    # rows without a kernel profile (eager baselines) have no busy figure and are never flagged
    (q,) = bench.per_layer([_row(1, "eager", 900.0, 40.0), _row(2, "eager", 1800.0, 100.0)])
    assert q["busy_us"] is None and not q["host_bound"]
    assert "GPU busy  " not in bench.table({"rows": [], "per_layer": [q]})
    assert [dataclasses.asdict(r) for r in bench.rows_of({"rows": [dataclasses.asdict(l1)]})] == [
        dataclasses.asdict(l1)]


def test_a_step_that_computed_nan_is_invalid_and_a_layer_below_its_floor_is_flagged(monkeypatch, capsys):
    # 2026-12-03: a moe_down_combine that left rows unwritten (NaN) made batch 8's layer 0.98 x its floor, since NaN
    # router logits collapse the selection; bench printed the time as a result. Now the step's logits are checked.
    assert bench.output_problem(torch.ones(2, 8)) == ""
    logits = torch.ones(2, 8)
    logits[1, 3], logits[0, 0] = float("nan"), float("inf")
    assert bench.output_problem(logits) == "2 of 16 logits not finite (a kernel wrote NaN/Inf)"
    assert "not logits" in bench.output_problem(None)
    rows = [_row(1, "k3compile", 100.0, 40.0), _row(2, "k3compile", 150.0, 100.0), _row(3, "k3compile", 300.0, 160.0)]
    rows[1].invalid = bench.output_problem(logits)
    per = bench.per_layer(rows)
    assert [p["invalid"] for p in per] == [rows[1].invalid] * 2  # either row of the difference
    text = bench.table({"rows": [dataclasses.asdict(r) for r in rows], "per_layer": per})
    layer2, layer3 = (line for line in text.splitlines() if line.startswith("  layer"))
    assert "BELOW THE FLOOR" in layer2 and "INVALID: 2 of 16 logits" in layer2  # 50 us for a 60 us floor
    assert "BELOW THE FLOOR" not in layer3 and "INVALID" in layer3
    assert "INVALID: 2 of 16" in bench._fmt(rows[1]) and "INVALID" not in bench._fmt(rows[0])
    # a host-bound wall difference below the floor is the host's, not a result to question
    assert "BELOW" not in bench.table({"rows": [], "per_layer": [{**per[1], "us": 10.0, "host_bound": True}]})
    # the exit status: 1 when a row is invalid (its JSON written all the same)
    result = {"bandwidth": 4e12, "rows": [dataclasses.asdict(r) for r in rows], "per_layer": per}
    monkeypatch.setattr(bench, "run", lambda *a, **k: result)
    args = type("A", (), {"json": None, "png": None, "config": "slice", "layers": [1, 2, 3], "tp": 8, "buckets": [1],
                          "context": [1024], "package": None, "systems": ["k3compile"], "steps": 8})()
    assert bench.main(args) == 1 and "INVALID rows" in capsys.readouterr().err
    rows[1].invalid = ""
    result["rows"] = [dataclasses.asdict(r) for r in rows]
    assert bench.main(args) == 0


def test_bench_plot_prints_the_table_with_gpu_busy_layers(tmp_path, capsys):
    l1, l2 = _row(1, "k3compile", 300.0, 60.0), _row(2, "k3compile", 420.0, 120.0)
    l1.kernels = [{"name": "a", "calls": 1.0, "us": 200.0, "exposed_us": 200.0}]
    l2.kernels = [{"name": "a", "calls": 1.0, "us": 390.0, "exposed_us": 390.0}]
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": [dataclasses.asdict(r) for r in (l1, l2)], "per_layer": []}))
    assert main(["bench-plot", str(path), str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    assert "layer 2 ctx 1024 b1 k3compile" in out and "GPU busy    190.0 us" in out and "HOST-BOUND" in out


def test_layer_kernels_split_the_layers_busy_time_by_kernel(tmp_path, capsys):
    """bench-plot --by-kernel on a recorded H200 run: per layer, each kernel's share of the GPU busy time
    (T(4) - T(3) of its exposed µs) adds up to the layer's busy time (but for kernels that barely move); with a
    manifest, our kernels get their point, bytes per call times the layer's calls (one call of a template = its
    PTX entries' launches) and a floor at the run's bandwidth; the MLA decode's cache bytes assume the package's
    capacity, so no floor."""
    path = os.path.join(ROOT, "benchmarks", "bench_slice_mla_streams_tp8_h200_2026-12-03.json")
    with open(path) as fh:
        res = json.load(fh)
    rows = bench.rows_of(res)
    layer = next(p for p in bench.per_layer(rows)
                 if (p["context"], p["bucket"], p["system"]) == (1024, 1, "k3compile"))
    manifest = {"kernels": {
        "gemv_ea74823ffa": {"bytes": 52_322_304, "constants": {"M": 1, "N": 3648, "K": 7168},
                            "audit": {"entries": [{}]}},
        "mla_decode_53dd4a4932": {"bytes": 40_908_552, "constants": {"M": 1}, "audit": {"entries": [{}, {}, {}]}}}}
    ks = bench.layer_kernels(rows, 4, 1024, 1, "k3compile", manifest, res["bandwidth"])
    by = {k["kernel"]: k for k in ks}
    assert abs(sum(k["exposed_us"] for k in ks) - layer["busy_us"]) < 0.5  # (moves under 0.05 µs left out)
    assert [k["exposed_us"] for k in ks] == sorted((k["exposed_us"] for k in ks), reverse=True)
    front = by["gemv_ea74823ffa"]
    assert front["calls"] == 1 and front["point"] == "M=1 N=3648 K=7168" and front["bytes"] == 52_322_304
    assert front["floor_us"] == pytest.approx(52_322_304 / res["bandwidth"] * 1e6)
    mla = by["mla_decode_53dd4a4932"]
    assert mla["calls"] == 3 and "bytes" not in mla and "floor_us" not in mla
    # ... and its three PTX entries each on a line of their own, adding up to it
    assert sorted(v["entry"] for v in mla["entries"]) == ["absorb_kernel", "combine_kernel", "kernel"]
    assert all(v["calls"] == 1 for v in mla["entries"])
    assert sum(v["exposed_us"] for v in mla["entries"]) == pytest.approx(mla["exposed_us"])
    assert "entries" not in front  # one entry: no breakdown
    assert "moe_gate_up_5f27ca91aa" in by and "point" not in by["moe_gate_up_5f27ca91aa"]  # not in the manifest
    with pytest.raises(ValueError, match="needs profiled rows of 4 and 5 layers"):
        bench.layer_kernels(rows, 5, 1024, 1, "k3compile")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    assert main(["bench-plot", path, str(tmp_path / "b.png"), "--by-kernel", "--package", str(pkg)]) == 0
    out = capsys.readouterr().out
    assert "layer 4 ctx 32000 b64 k3compile-one-stream: GPU busy" in out
    assert any("gemv_ea74823ffa" in ln and "M=1 N=3648 K=7168" in ln and "floor" in ln for ln in out.splitlines())
    assert any(ln.split()[-1:] == ["combine_kernel"] for ln in out.splitlines())
    # our kernels the manifest lacks are named under the table, torch's are not
    (note,) = [ln for ln in out.splitlines() if ln.startswith("not in the package's manifest")]
    assert "moe_gate_up_5f27ca91aa" in note and "gemv_ea74823ffa" not in note and "elementwise" not in note


def test_plot_of_the_recorded_benchmark(tmp_path):
    with open(os.path.join(ROOT, "benchmarks", "bench_mini_tp1_2026-11-29.json")) as fh:
        res = json.load(fh)
    out = tmp_path / "b.png"
    assert main(["bench-plot", os.path.join(ROOT, "benchmarks", "bench_mini_tp1_2026-11-29.json"), str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (720, 420)
    assert {r["system"] for r in res["rows"]} == {"eager", "inductor", "k3compile"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_bench_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", "--config", "k3_mini", "--json", os.devnull])


def test_an_unknown_system_is_refused_before_anything_runs(capsys):
    assert main(["bench", "--systems", "eager,eager-bf16-grpah", "--json", os.devnull]) == 2
    err = capsys.readouterr().err
    assert "unknown bench system(s) ['eager-bf16-grpah']" in err and "eager-bf16-graph" in err
    with pytest.raises(ValueError, match="no bench systems"):
        bench.check_systems([])
    assert bench.check_systems(bench.DEFAULT_SYSTEMS) == bench.DEFAULT_SYSTEMS
    assert set(bench.DEFAULT_SYSTEMS) <= set(bench.SYSTEMS)


def test_every_system_has_its_own_colour_and_the_legend_wraps(tmp_path):
    assert set(bench.SYSTEMS) <= set(bench.COLORS)
    assert len({bench.COLORS[s] for s in bench.SYSTEMS}) == len(bench.SYSTEMS)
    rows = [_plot_row(s, b, 100.0 * (i + 1) * b ** 0.5) for i, s in enumerate(bench.SYSTEMS) for b in (1, 8)]
    res = {"rows": rows, "per_layer": []}
    bench.plot(res, str(tmp_path / "all.png"))
    px = _pixels((tmp_path / "all.png").read_bytes())
    # the second legend line (y 43..51) holds the swatches of the systems that did not fit the first
    second = {px[y][x] for y in range(44, 51) for x in range(80, 700)}
    assert any(bench.COLORS[s] in second for s in bench.SYSTEMS)


def _plot_row(system, bucket, us):
    return {"config": "slice2", "layers": 2, "tp": 8, "context": 1024, "bucket": bucket, "system": system,
            "us_per_step": us, "launches": 10, "floor_us": 50.0, "extra_mem_mb": 0.0, "note": "", "kernels": []}


def _pixels(png: bytes) -> list:
    """RGB rows of a PNG written by models.train.Canvas (8-bit RGB, one IDAT, filter 0 on every row)."""
    w, h = struct.unpack(">II", png[16:24])
    i, idat = 8, b""
    while i < len(png):
        n = struct.unpack(">I", png[i:i + 4])[0]
        if png[i + 4:i + 8] == b"IDAT":
            idat += png[i + 8:i + 8 + n]
        i += 12 + n
    raw = zlib.decompress(idat)
    stride = 1 + 3 * w
    return [[tuple(raw[y * stride + 1 + 3 * x:y * stride + 4 + 3 * x]) for x in range(w)] for y in range(h)]


@pytest.fixture(scope="module")
def mini_model():
    from k3compile.models import k3_mini

    return bench.build_model(k3_mini(), 1, device="cpu")  # what the bench builds, on the CPU


def _ops(model):
    """The ops module the model's LatentMoE calls (the one bench.bf16_experts patches)."""
    from k3compile.models.layers import LatentMoE

    return inspect.getmodule(LatentMoE).ops


def _decode(model, steps=3, batch=4, ctx=5):
    """Logits of ``steps`` decode steps from a fresh state at context ``ctx``, and the state after them."""
    state = model.new_state(batch, ctx + steps + 1)
    state.lengths.fill_(ctx)
    gen = torch.Generator().manual_seed(7)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(model.decode(torch.randint(0, model.config.vocab_size, (batch,), generator=gen), state))
    return torch.stack(out), state


def test_bf16_experts_give_the_eager_models_output(mini_model, monkeypatch):
    """The pre-dequantised experts are the model's per-token path minus its dequantize: bit for bit that
    path's logits and state. k3-mini's eager default is the dense path (every expert, weighted 0 when not
    picked): the same up to the order of the fp32 sum over experts and the bf16 roundings after it."""
    dense, _ = _decode(mini_model)
    with bench.bf16_experts(mini_model) as copies:
        assert len(copies) == sum(layer.is_moe for layer in mini_model.layers) > 0
        got, state = _decode(mini_model)
    with monkeypatch.context() as m:  # force the per-token path the real model takes (too big for dense)
        m.setattr(_ops(mini_model), "DENSE_EXPERTS_MAX_WEIGHTS", 0)
        per_token, per_token_state = _decode(mini_model)
    assert torch.equal(got, per_token)
    assert all(torch.equal(a, b) for a, b in zip(state.tensors(), per_token_state.tensors()))
    torch.testing.assert_close(got, dense, rtol=1.6e-2, atol=5e-2)  # a logit moves by a bf16 step or two
    assert ((got - dense).norm() / dense.norm()).item() < 1e-2
    # the greedy token agrees wherever the dense path's top two logits are further apart than the two paths'
    # tolerance (a near-tie of the random model flips with the summation order, e.g. with the intra-op threads)
    top2 = dense.float().topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1
    assert clear.sum() >= clear.numel() // 2, clear  # not vacuous: 9 of these 12 rows are clear
    assert torch.equal(got.argmax(-1)[clear], dense.argmax(-1)[clear])


def test_bf16_experts_are_what_runs_and_the_patch_is_undone(mini_model):
    ops = _ops(mini_model)
    original = ops.latent_moe_experts
    ref, _ = _decode(mini_model, steps=1)
    with bench.bf16_experts(mini_model) as copies:
        assert ops.latent_moe_experts is not original
        moe = next(layer.block_sparse_moe for layer in mini_model.layers if layer.is_moe)
        _, w1, w3, w2 = copies[id(moe.experts_w1_packed)]
        assert w1.dtype == torch.bfloat16 and w1.shape[-1] == 2 * moe.experts_w1_packed.shape[-1]
        from k3compile.models.mxfp4 import dequantize

        assert torch.equal(w2, dequantize(moe.experts_w2_packed, moe.experts_w2_scale, torch.bfloat16))
        for w in (w1, w3, w2):  # the decode reads the copies, not the packed weights
            w.zero_()
        zeroed, _ = _decode(mini_model, steps=1)
        assert not torch.equal(zeroed, ref)
    assert ops.latent_moe_experts is original and not copies  # restored, the copies dropped
    assert torch.equal(_decode(mini_model, steps=1)[0], ref)
    with pytest.raises(RuntimeError, match="boom"):  # undone on an exception too (a row that fails)
        with bench.bf16_experts(mini_model):
            raise RuntimeError("boom")
    assert ops.latent_moe_experts is original


def test_the_floor_without_a_k3compile_row(mini_model):
    """With no k3compile system the floor comes from a compile with eager kernels of the unpatched model."""
    state = mini_model.new_state(1, 16)
    state.lengths.fill_(5)
    floor = bench._floor_us(None, mini_model, state, torch.tensor([3]), 1, 1, 5, 1e12)
    assert 0 < floor < float("inf")


def test_a_compiled_model_is_freed_between_depths():
    """The bench builds one model per depth: the previous one must be gone first. After a k3compile row (as on
    the GPU, here with eager kernels) ``del`` alone leaves the model alive in Dynamo's caches; ``free_models``
    frees it."""
    import gc
    import weakref

    import k3compile
    from k3compile.models import k3_mini

    model = bench.build_model(k3_mini(), 1, device="cpu")
    state = model.new_state(1, 16)
    torch._dynamo.reset()
    k3compile.compile(model, buckets=(1,), options={"kernels": "eager"})(torch.tensor([3]), state)
    alive = weakref.ref(next(model.parameters()))
    del model, state
    gc.collect()
    assert alive() is not None  # held by Dynamo: what made the next depth's model run out of memory
    bench.free_models()
    assert alive() is None


def test_the_memory_note_before_each_model_warns_when_it_does_not_fit():
    """The 4-layer TP 2 slice (51.4 GB with its relaid experts) beside 79 GB free fits; beside the 28 GB an 80 GB
    card had left with the 3-layer model still held, the note says its rows will run out of memory."""
    from k3compile.models import k3_slice

    fits = bench.memory_note(k3_slice(4), 2, 16, 4096, int(79e9))
    assert "needs about 51.4 GB" in fits and "relaid experts 22.2" in fits and "WARNING" not in fits
    short = bench.memory_note(k3_slice(4), 2, 16, 4096, int(28e9))
    assert "WARNING" in short and "a larger --tp" in short


def test_a_failed_capture_is_one_line_naming_the_host_sync():
    def check():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    try:
        try:
            check()
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as e:
        note = bench._note(e)
    assert note.startswith("RuntimeError: CUDA error: operation failed due to a previous error during capture "
                           "(after RuntimeError: CUDA error: operation not permitted when stream is capturing)")
    assert note.endswith(" check") and "test_bench.py:" in note and "\n" not in note


def test_the_graph_capture_skips_only_the_input_checks_host_sync():
    import models.model  # noqa: F401  (registers k3model::check_decode_inputs)

    bad_ids, lengths = torch.tensor([-1]), torch.tensor([3])
    with bench._unchecked_inputs():  # what the capture of an eager-*-graph row runs
        pos = torch.ops.k3model.check_decode_inputs(bad_ids, lengths, 10, 100)
        assert torch.equal(pos, lengths) and pos.data_ptr() != lengths.data_ptr()
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the real check is back
        torch.ops.k3model.check_decode_inputs(bad_ids, lengths, 10, 100)


def test_bench_plot_refloor_takes_the_plans_bytes(tmp_path, capsys):
    """--refloor replaces each row's floor by this checkout's plan bytes for its config, TP, bucket and context
    at the JSON's bandwidth (the MLA cache read up to the context)."""
    from k3compile.models import get_config
    from k3compile.plan import plan_for

    rows = [dataclasses.asdict(bench.Row("k3_mini", 13, 1, ctx, 1, "k3compile", us_per_step=900.0, launches=200,
                                         floor_us=1.0)) for ctx in (16, 2048)]
    path, saved = tmp_path / "b.json", tmp_path / "r.json"
    path.write_text(json.dumps({"bandwidth": 4e12, "rows": rows, "per_layer": []}))
    assert main(["bench-plot", str(path), str(tmp_path / "b.png"), "--refloor", "--save", str(saved)]) == 0
    res = json.loads(saved.read_text())
    for r in res["rows"]:
        plan = plan_for(get_config("k3_mini"), tp=1, bucket=1, context=r["context"])
        assert r["floor_us"] == pytest.approx(sum(lp.bytes(1) for lp in plan.layers) / 4e12 * 1e6)
        assert r["x_floor"] == pytest.approx(900.0 / r["floor_us"])
    assert res["rows"][1]["floor_us"] > res["rows"][0]["floor_us"]  # 2048 cached rows read instead of 16
    assert "refloor" in res["floor_source"]


def test_bench_kernels_table_keeps_the_floor_and_says_why_a_column_is_missing():
    """A torch baseline that cannot be timed loses its own column, not the kernel's floor, and the table says
    why under it (nothing is dropped silently)."""
    from k3compile import bench_kernels

    row = {"kernel": "moe_gate_up_0123456789", "example": "moe_gate_up:k3tp8_b8", "ok": True, "bytes": 176.07e6,
           "us": 63.8, "floor_us": 41.8, "pct_of_copy_bw": 65.5,
           "torch_error": "RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture"}
    untimed = {"kernel": "gemv_0123456789", "example": "", "ok": True, "bytes": 1e6,
               "timing_error": "RuntimeError: out of memory"}
    text = bench_kernels.table({"device": "H200", "date": "today", "copy_bandwidth_Bps": 4.2e12,
                                "kernels": [row, untimed], "failed": 0})
    line = next(ln for ln in text.splitlines() if ln.startswith("moe_gate_up:k3tp8_b8 "))
    assert line.split()[1:6] == ["176.07", "41.8", "63.8", "66%", "-"]
    assert "moe_gate_up:k3tp8_b8: torch baseline not timed: RuntimeError: Cannot copy" in text
    assert "gemv_0123456789: not timed: RuntimeError: out of memory" in text


def test_bench_kernels_selects_by_any_of_several_patterns_and_seeds_checks_reproducibly():
    """--only takes comma-separated substrings of names or example labels; --seed gives every kernel the same
    check inputs (an A/B of two packages under a profiler compares like with like), the default fresh ones."""
    from k3compile import bench_kernels

    kernels = {"moe_down_combine_aa": {"example": "moe_down_combine:k3tp8_b8"},
               "moe_down_combine_bb": {"example": "moe_down_combine:k3tp8_b64"},
               "moe_gate_up_cc": {"example": "moe_gate_up:k3tp8_b8"}, "gemv_dd": {}}
    assert bench_kernels.selected(kernels, None) == ["gemv_dd", "moe_down_combine_bb", "moe_down_combine_aa",
                                                     "moe_gate_up_cc"]  # by example label
    assert bench_kernels.selected(kernels, "k3tp8_b8") == ["moe_down_combine_aa", "moe_gate_up_cc"]
    assert bench_kernels.selected(kernels, "moe_down_combine:k3tp8_b64, gemv") == ["gemv_dd", "moe_down_combine_bb"]
    assert bench_kernels.selected(kernels, "b16") == []
    assert bench_kernels.check_seeds(3, 40) == [40, 41, 42]
    fresh = bench_kernels.check_seeds(2, None) + bench_kernels.check_seeds(2, None)
    assert len(set(fresh)) == 4 and all(0 <= s < 2**31 for s in fresh)


def test_bench_kernels_shards_split_a_package_once_and_evenly_by_input_bytes():
    """--shard I/N: N processes check one package side by side; every kernel lands in exactly one shard, the
    split is the same in every process, the shards carry about equal input bytes, and a malformed shard is an
    error that shows the form."""
    from k3compile import bench_kernels

    sizes = {"moe_a": 900, "moe_b": 800, "gemv_c": 100, "gemv_d": 90, "norm_e": 10, "norm_f": 5, "mla_g": 700}
    names = sorted(sizes)
    parts = [bench_kernels.shard_of(names, sizes, f"{i}/3") for i in (1, 2, 3)]
    assert sorted(sum(parts, [])) == names  # each kernel once
    assert all(p == sorted(p) for p in parts)  # the selection's order kept
    loads = [sum(sizes[k] for k in p) for p in parts]
    assert max(loads) - min(loads) <= 200, loads
    assert parts == [bench_kernels.shard_of(names, sizes, f"{i}/3") for i in (1, 2, 3)]
    assert bench_kernels.shard_of(names, sizes, None) == names
    for bad in ("0/3", "4/3", "2", "a/b"):
        with pytest.raises(ValueError, match="I/N"):
            bench_kernels.shard_of(names, sizes, bad)


def test_bench_kernels_merge_counts_a_cut_off_shard_as_not_checked(tmp_path, capsys):
    """The shards' JSONs become one report per template; a kernel no shard reached (a shard cut off by its time
    limit, or one whose file is missing) is listed as not checked, never counted as passed, and the exit status
    says the package is not fully checked; a failed check is named."""
    import json

    from k3compile import bench_kernels

    manifest = {"kernels": {"gemv_a": {"template": "gemv"}, "gemv_b": {"template": "gemv"},
                            "moe_c": {"template": "moe_gate_up"}, "moe_d": {"template": "moe_gate_up"}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    ok = {"checks": [{"errors": {"y": 1e-3}, "problems": [], "ok": True}], "ok": True}
    s1 = {"device": "H200", "kernels": [{"kernel": "gemv_a", "template": "gemv", **ok},
                                        {"kernel": "moe_c", "template": "moe_gate_up",
                                         "checks": [{"errors": {"h": 0.5}, "problems": ["h: ..."], "ok": False}],
                                         "ok": False}], "not_run": []}
    s2 = {"device": "H200", "kernels": [{"kernel": "gemv_b", "template": "gemv", **ok}], "not_run": ["moe_d"]}
    paths = []
    for i, s in enumerate((s1, s2)):
        paths.append(str(tmp_path / f"s{i}.json"))
        (tmp_path / f"s{i}.json").write_text(json.dumps(s))
    out = tmp_path / "report.json"
    rc = bench_kernels.main(["merge", str(tmp_path), str(out), *paths, str(tmp_path / "missing.json")])
    report = json.loads(out.read_text())
    assert rc == 1
    assert (report["kernels"], report["passed"], report["failed"], report["not_checked"]) == (4, 2, ["moe_c"],
                                                                                              ["moe_d"])
    assert report["per_template"]["gemv"]["passed"] == 2
    assert report["worst_error"] == {"gemv.y": 1e-3, "moe_gate_up.h": 0.5}
    printed = capsys.readouterr()
    assert "FAILED moe_c" in printed.out and "missing.json unreadable" in printed.err
    s2["kernels"].append({"kernel": "moe_d", "template": "moe_gate_up", **ok})
    s1["kernels"][1] = {"kernel": "moe_c", "template": "moe_gate_up", **ok}
    for p, s in zip(paths, (s1, s2)):
        open(p, "w").write(json.dumps(s))
    assert bench_kernels.main(["merge", str(tmp_path), str(out), *paths]) == 0


def test_bench_kernels_goes_on_where_an_earlier_check_stopped(tmp_path):
    """--skip-passed: the kernels that passed in earlier shard JSONs are skipped, failed and unreached ones run
    again; an unreadable file is an error naming it; merging the earlier and the new shards counts a kernel as
    the last run says (a failure fixed by a rerun passes, a pass is kept when the rerun skipped it)."""
    import json

    from k3compile import bench_kernels

    ok = {"checks": [{"errors": {"y": 1e-3}, "problems": [], "ok": True}], "ok": True}
    bad = {"checks": [{"errors": {"y": 0.5}, "problems": ["y: ..."], "ok": False}], "ok": False}
    early = {"device": "H100", "kernels": [{"kernel": "gemv_a", "template": "gemv", **ok},
                                          {"kernel": "gemv_b", "template": "gemv", **bad}], "not_run": ["gemv_c"]}
    p = tmp_path / "early.json"
    p.write_text(json.dumps(early))
    assert bench_kernels.passed_in([str(p)]) == {"gemv_a"}
    with pytest.raises(ValueError, match="missing.json: unreadable"):
        bench_kernels.passed_in([str(tmp_path / "missing.json")])
    late = {"device": "H200", "kernels": [{"kernel": "gemv_b", "template": "gemv", **ok},
                                         {"kernel": "gemv_c", "template": "gemv", **ok}], "not_run": []}
    kernels = {k: {"template": "gemv"} for k in ("gemv_a", "gemv_b", "gemv_c")}
    report = bench_kernels.merge_shards([early, late], kernels)
    assert (report["passed"], report["failed"], report["not_checked"]) == (3, [], [])
    assert report["devices"] == ["H100", "H200"]
    assert bench_kernels.merge_shards([late, early], kernels)["failed"] == ["gemv_b"]
    # runs with dates (every bench-kernels JSON has one) count by date, whatever the order of the files
    dated = [{**late, "date": "2026-12-05 17:25:00"}, {**early, "date": "2026-12-05 14:00:00"}]
    assert bench_kernels.merge_shards(dated, kernels)["failed"] == []
    # a check that ran out of GPU memory (shards side by side on one card) is not a wrong kernel: not checked
    late["kernels"][1] = {"kernel": "gemv_c", "template": "gemv", "ok": False,
                          "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.59 GiB"}
    report = bench_kernels.merge_shards([early, late], kernels)
    assert (report["failed"], report["not_checked"], report["out_of_memory"]) == ([], ["gemv_c"], ["gemv_c"])
    assert "Fix: run again with fewer SHARDS and DONE=" in bench_kernels.merge_table(report)


def test_inductor_graph_rows_trace_the_decode_without_the_host_sync(mini_model):
    """inductor-graph compiles the decode under the sync-free input check (a CUDA graph cannot capture the
    real one's host sync): Dynamo inlines it, so the traced graph holds no check op and still gives eager's
    logits; the patch nests (the capture inside the row enters it again) and the real check comes back."""
    import models.model  # noqa: F401  (registers k3model::check_decode_inputs)

    model = mini_model
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    state, ref_state = model.new_state(2, 64), model.new_state(2, 64)
    ids = torch.tensor([3, 5])
    torch._dynamo.reset()
    f = torch.compile(model.decode, backend=backend, dynamic=False)
    with bench._unchecked_inputs():
        with bench._unchecked_inputs():  # _cuda_graph's capture inside the row's patch
            out = f(ids, state)
        assert torch.ops.k3model.check_decode_inputs(torch.tensor([-1]), torch.tensor([3]), 10, 100) is not None
    torch._dynamo.reset()
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and targets and not any("check_decode_inputs" in t for t in targets)
    torch.testing.assert_close(out, model.decode(ids, ref_state), rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # both patches undone
        torch.ops.k3model.check_decode_inputs(torch.tensor([-1]), torch.tensor([3]), 10, 100)
    assert "inductor-graph" in bench.DEFAULT_SYSTEMS and bench.check_systems(["inductor-autotune-graph"])
