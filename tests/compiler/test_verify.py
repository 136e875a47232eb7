"""``k3compile verify`` on the CPU (reduced steps): the kernels run as their float64 references, the GPU
checks are listed as skipped, and a run with a fused kernel disabled fails the coverage proof by name."""

import json

import torch

from k3compile.cli import main
from cpu import one_thread


def test_verify_on_cpu_passes_with_every_check_and_names_the_skipped_ones(tmp_path):
    report, js = tmp_path / "verify.md", tmp_path / "verify.json"
    with one_thread():
        rc = main(["verify", "--buckets", "1,4", "--steps", "24", "--report", str(report), "--json", str(js)])
    res = json.loads(js.read_text())
    checks = {c["name"]: c for c in res["checks"]}
    assert list(checks) == ["coverage proof", "kernel checks", "long generation", "cross-bucket consistency",
                            "memory-ordering audit", "scope", "performance sweep"]
    assert res["kernels"] == "reference" and res["device"] == "cpu"
    assert "k3_mini_text" in res["checkpoint"], "verify decodes text with the trained checkpoint"
    assert checks["coverage proof"]["status"] == "pass"
    assert all(r["launched"] >= r["required"] > 0 for r in checks["coverage proof"]["data"]["kernels"])
    kc = "\n".join(checks["kernel checks"]["details"])
    assert "skipped on this machine: the kernels against float64 on the GPU" in kc
    assert "MXFP4 decode bit logic: 2097152 values, 0 mismatches" in kc
    assert "compiled for sm_90a" in kc and checks["kernel checks"]["data"]["passes_bit_exact"]["ok"]
    assert checks["memory-ordering audit"]["status"] == "pass"
    assert checks["performance sweep"]["status"] == "skipped"
    long = checks["long generation"]["data"]
    assert long["steps"] == 24 and long["prompt_lengths"] == [3, 9, 25, 1]
    assert res["verdict"] == "VERIFIED" and rc == 0, [c["details"] for c in res["checks"] if c["status"] == "fail"]
    md = report.read_text()
    assert md.startswith("# k3compile verify: **VERIFIED**") and "| coverage proof | pass |" in md


def test_a_disabled_fused_kernel_fails_the_coverage_proof_by_name(tmp_path, capsys):
    js = tmp_path / "v.json"
    with one_thread():
        rc = main(["verify", "--buckets", "1", "--steps", "2", "--no-compile-check", "--disable", "routed_experts",
                   "--json", str(js)])
    res = json.loads(js.read_text())
    assert rc == 1 and res["verdict"] == "FAILED"
    cov = next(c for c in res["checks"] if c["name"] == "coverage proof")
    problems = "\n".join(cov["details"])
    assert cov["status"] == "fail"
    assert "launched 0 times" in problems and "kernel moe_gate_up_" in problems and "moe_down_combine_" in problems
    assert "(routed_experts) ran eagerly instead of moe_gate_up_" in problems
    assert "# k3compile verify: **FAILED**" in capsys.readouterr().out


def _verify_tp_worker(rank, world, out_dir):
    import os

    from k3compile.verify import verify

    torch.set_num_threads(1)
    res = verify(buckets=(1, 4), steps=8, tp=world, compile_check=False, log=lambda s: None)
    if rank == 0:
        with open(os.path.join(out_dir, "verify_tp.json"), "w") as fh:
            json.dump(res, fh, default=str)


def test_verify_tp2_on_two_gloo_ranks(tmp_path):
    """``verify --tp 2`` on two real ranks (gloo): the same checks on each shard, and the ranks' logits
    identical at every step of the long generation."""
    from cpu import run_gloo

    run_gloo(_verify_tp_worker, 2, str(tmp_path))
    res = json.loads((tmp_path / "verify_tp.json").read_text())
    checks = {c["name"]: c for c in res["checks"]}
    assert res["tp"] == 2 and checks["scope"]["data"]["tp"] == [2] and "2 real ranks" in checks["scope"]["summary"]
    assert checks["long generation"]["data"]["steps_ranks_differ"] == 0
    assert res["verdict"] == "VERIFIED", [c["details"] for c in res["checks"] if c["status"] == "fail"]


def test_verify_tp_without_ranks_is_a_clear_error():
    import pytest

    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2"):
        main(["verify", "--tp", "2", "--steps", "2"])
