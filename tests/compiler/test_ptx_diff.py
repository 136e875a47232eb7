"""`k3compile ptx-diff`: kernels paired across a rename by template, constants and arch; PTX compared with the
old name written as the new one; GPU checks carried only where the PTX is the same."""

import json

from k3compile.cli import main
from k3compile.ptx_diff import ptx_diff


def _out(root, kernels: dict):
    """A codegen output: {name: (template, constants, ptx or None)}."""
    manifest = {}
    for name, (tmpl, consts, ptx) in kernels.items():
        manifest[name] = {"template": tmpl, "constants": consts, "arch": "sm_90a"}
        d = root / "kernels" / name
        d.mkdir(parents=True)
        if ptx is not None:
            (d / "kernel.ptx").write_text(ptx)
    (root / "manifest.json").write_text(json.dumps({"kernels": manifest}))
    return str(root)


def _entry(name, body):
    return f".visible .entry {name}_kernel(\n  .param .u64 {name}_param_0\n)\n{{\n{body}\n}}\n"


def test_a_refactor_that_renames_kernels_changes_none(tmp_path, capsys):
    old = _out(tmp_path / "old", {
        "gemv_aaaaaaaaaa": ("gemv", {"M": 1}, _entry("gemv_aaaaaaaaaa", "ret;")),
        "moe_gate_up_1111111111": ("moe_gate_up", {"M": 1}, _entry("moe_gate_up_1111111111", "bar.sync 0; ret;")),
        "moe_gate_up_2222222222": ("moe_gate_up", {"M": 8}, _entry("moe_gate_up_2222222222", "ret;")),
        "rms_norm_3333333333": ("rms_norm", {"N": 64}, _entry("rms_norm_3333333333", "ret;"))})
    new = _out(tmp_path / "new", {
        "gemv_aaaaaaaaaa": ("gemv", {"M": 1}, _entry("gemv_aaaaaaaaaa", "ret;")),  # untouched template
        "moe_gate_up_4444444444": ("moe_gate_up", {"M": 1}, _entry("moe_gate_up_4444444444", "bar.sync 0; ret;")),
        "moe_gate_up_5555555555": ("moe_gate_up", {"M": 8}, _entry("moe_gate_up_5555555555", "nop; ret;")),
        "rms_norm_6666666666": ("rms_norm", {"N": 128}, _entry("rms_norm_6666666666", "ret;"))})
    d = ptx_diff(old, new)
    assert d.same == [("gemv_aaaaaaaaaa", "gemv_aaaaaaaaaa"), ("moe_gate_up_1111111111", "moe_gate_up_4444444444")]
    assert d.changed == [("moe_gate_up_2222222222", "moe_gate_up_5555555555")]
    assert d.only_old == ["rms_norm_3333333333"] and d.only_new == ["rms_norm_6666666666"]
    # a GPU check carries to a renamed kernel only through the same PTX
    passed = {"gemv_aaaaaaaaaa", "moe_gate_up_1111111111", "moe_gate_up_2222222222", "rms_norm_3333333333"}
    assert ptx_diff(old, new, passed).unchecked == ["moe_gate_up_5555555555", "rms_norm_6666666666"]

    shard = tmp_path / "shard1.json"
    shard.write_text(json.dumps({"kernels": [{"kernel": k, "ok": True} for k in sorted(passed)]}))
    assert main(["ptx-diff", old, new, "--passed", str(shard), "--json", str(tmp_path / "d.json")]) == 1
    out = capsys.readouterr().out
    assert "2 kernels with the same PTX (1 of them renamed), 1 changed, 1 only in OLD, 1 only in NEW" in out
    assert "changed: moe_gate_up_2222222222 -> moe_gate_up_5555555555" in out
    assert "2 kernels of NEW not covered by a passed GPU check" in out
    assert json.loads((tmp_path / "d.json").read_text())["unchecked"] == ["moe_gate_up_5555555555",
                                                                          "rms_norm_6666666666"]
    assert main(["ptx-diff", old, old]) == 0  # nothing changed: exit 0


def test_a_pruned_or_missing_output_is_named_with_the_fix(tmp_path, capsys):
    old = _out(tmp_path / "old", {"gemv_aaaaaaaaaa": ("gemv", {"M": 1}, _entry("gemv_aaaaaaaaaa", "ret;"))})
    pruned = _out(tmp_path / "new", {"gemv_bbbbbbbbbb": ("gemv", {"M": 1}, None)})
    assert main(["ptx-diff", old, pruned]) == 2
    err = capsys.readouterr().err
    assert "gemv_bbbbbbbbbb/kernel.ptx: no PTX" in err and "not pruned" in err
    assert main(["ptx-diff", old, str(tmp_path / "nowhere")]) == 2
    assert "not a codegen output" in capsys.readouterr().err


def test_a_knob_a_template_gained_is_left_out_of_the_pairing(tmp_path):
    """NEW's gemv kernels carry a constant OLD's have not (HOLD): kernels equal in the other constants pair, and
    the PTX decides (the knob off: same program; on: changed)."""
    old = _out(tmp_path / "old", {
        "gemv_aaaaaaaaaa": ("gemv", {"M": 1, "N": 64}, _entry("gemv_aaaaaaaaaa", "ret;")),
        "gemv_bbbbbbbbbb": ("gemv", {"M": 4, "N": 64}, _entry("gemv_bbbbbbbbbb", "ret;"))})
    new = _out(tmp_path / "new", {
        "gemv_cccccccccc": ("gemv", {"M": 1, "N": 64, "HOLD": False}, _entry("gemv_cccccccccc", "ret;")),
        "gemv_dddddddddd": ("gemv", {"M": 4, "N": 64, "HOLD": True}, _entry("gemv_dddddddddd", "ld; ret;"))})
    d = ptx_diff(old, new)
    assert d.same == [("gemv_aaaaaaaaaa", "gemv_cccccccccc")]
    assert d.changed == [("gemv_bbbbbbbbbb", "gemv_dddddddddd")] and not d.only_old and not d.only_new
