"""``k3compile bench`` pieces that need no GPU: per-layer differencing, the plot, the no-GPU error."""

import json
import os
import struct

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
