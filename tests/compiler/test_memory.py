"""The memory one TP rank needs (``k3compile.memory``, ``k3compile plan``): from a meta-device model, equal to what a
real model and state allocate, and the relaid expert copy equal to what the runtime kept on the H200."""

import json
import subprocess
import sys

import pytest

from k3compile.memory import H200_BYTES, rank_memory
from k3compile.models import k3_mini, k3_slice, kimi_k3
from models.random_init import random_model


@pytest.mark.parametrize("tp", [1, 2])
def test_equals_what_a_real_model_and_state_allocate(tp):
    cfg = k3_mini()
    model = random_model(cfg, tp_rank=0, tp_size=tp, device="cpu")
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    mem = rank_memory(cfg, tp=tp, bucket=4, max_context=512)
    assert mem.bf16 + mem.experts == sum(nbytes(t) for t in (*model.parameters(), *model.buffers()))
    assert mem.experts == sum(nbytes(b) for n, b in model.named_buffers() if "experts_" in n) > 0
    assert mem.relaid == sum(nbytes(b) for n, b in model.named_buffers() if n.endswith("_packed")) < mem.experts
    assert mem.state == sum(nbytes(t) for t in model.new_state(4, 512).tensors())
    assert mem.total == mem.bf16 + mem.experts + mem.relaid + mem.state


def test_relaid_copy_matches_the_runtime_on_the_h200():
    """``runtime.relaid_bytes`` after the first step of ``k3compile bench`` (BENCHMARKS.md 2026-12-05: +3528 / +5292
    MB relaid on the 3- / 4-layer TP 8 slice, +21168 on the 4-layer TP 2 slice; MB = 2**20 bytes there)."""
    for layers, tp, mib in ((3, 8, 3528), (4, 8, 5292), (4, 2, 21168)):
        assert rank_memory(k3_slice(layers), tp=tp, bucket=1, max_context=4096).relaid == mib * 2**20


def test_text_names_the_fix_when_a_rank_does_not_fit():
    big = rank_memory(kimi_k3(), tp=8, bucket=1, max_context=32768)
    assert big.total > H200_BYTES and "a larger TP size" in big.text() and "use relay_in_place" in big.text()
    assert "a larger TP size" not in rank_memory(kimi_k3(), tp=16, bucket=1).text()  # 16 is the largest
    # the real config at TP 16 with room for every position fits one H200 only without the relaid copy
    tp16, tp16_in_place = (rank_memory(kimi_k3(), tp=16, bucket=1, relay_in_place=p) for p in (False, True))
    assert tp16.total > H200_BYTES > tp16_in_place.total and tp16_in_place.relaid == 0
    assert tp16.total - tp16_in_place.total == tp16.relaid and "more than" not in tp16_in_place.text()
    assert "relaid in place" in tp16_in_place.text()
    small = rank_memory(k3_slice(4), tp=8, bucket=16, max_context=4096)
    assert small.total < H200_BYTES and "more than" not in small.text()
    with pytest.raises(ValueError, match="bucket"):
        rank_memory(k3_mini(), tp=1, bucket=0)
    with pytest.raises(ValueError, match="max_context"):
        rank_memory(k3_mini(), tp=1, bucket=1, max_context=10**9)


def test_plan_prints_and_writes_the_memory():
    run = lambda *a: subprocess.run([sys.executable, "-m", "k3compile.cli", "plan", "--config", "k3_mini", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    res = run("--tp", "2", "--bucket", "4", "--max-context", "512", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["memory"] == rank_memory(k3_mini(), tp=2, bucket=4, max_context=512).to_json()
    res = run("--bucket", "1")
    assert res.returncode == 0 and "memory per rank (k3_mini, TP1, bucket 1" in res.stdout, res.stderr
    res = run("--bucket", "1", "--relay-in-place", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["memory"] == rank_memory(k3_mini(), tp=1, bucket=1, relay_in_place=True).to_json()
    res = run("--context", "600", "--max-context", "512")
    assert res.returncode != 0 and "--max-context 512 must be above --context 600" in res.stderr
    assert "Traceback" not in res.stderr
