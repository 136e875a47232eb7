"""Every pass, numerically: the whole decode step compiled with the pipeline cut after each pass equals
the eager model bit for bit (and advances the state identically), for TP 1, 2 and 4 (gloo) at buckets
1, 8 and 64. Exact equality is the stated tolerance: on the CPU every dialect op runs a reference
implementation composed of the eager model's own operations in the same order and dtypes."""

import pytest
import torch

from cpu import run_gloo
from harness import BUCKETS, PASSES, check_every_cut, tp_worker


def _assert_exact(results, who):
    bad = {k: v for k, v in results.items() if v != (0.0, True)}
    assert not bad, f"{who}: (pass, bucket) -> (max |diff|, state equal): {bad}"
    assert set(results) == {(p, b) for p in PASSES for b in BUCKETS}


def test_tp1_every_pass_every_bucket(mini_model):
    _assert_exact(check_every_cut(mini_model), "TP1")


@pytest.mark.parametrize("world", [2, 4])
def test_tp_gloo_every_pass_every_bucket(world, mini_ckpt, tmp_path):
    run_gloo(tp_worker, world, mini_ckpt, str(tmp_path))
    for rank in range(world):
        _assert_exact(torch.load(tmp_path / f"rank{rank}.pt"), f"TP{world} rank {rank}")
