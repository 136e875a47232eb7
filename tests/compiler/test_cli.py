"""The k3compile command line: --help/--version, `diff` text and HTML, errors for bad input."""

import subprocess
import sys
from html.parser import HTMLParser

from k3compile import __version__
from k3compile.cli import main
from k3compile.pipeline_table import default_passes

VOID = {"meta", "col", "br", "img", "input", "link", "hr"}


def run(*args):
    return subprocess.run([sys.executable, "-m", "k3compile.cli", *args], capture_output=True, text=True, timeout=600)


def test_help_and_version():
    r = run("--help")
    assert r.returncode == 0 and "diff" in r.stdout
    r = run("--version")
    assert r.returncode == 0 and __version__ in r.stdout


class _Checker(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.sections, self.titles, self.errors = [], [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a.get("data-pass"))
        if tag == "td" and "title" in a:
            self.titles += 1
        if tag in ("script", "link") and (a.get("src") or a.get("href")):
            self.errors.append(f"external resource {a}")
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unbalanced </{tag}> (open: {self.stack[-3:]})")
        else:
            self.stack.pop()


def test_diff_one_pass_and_html(tmp_path, capsys):
    html_path = tmp_path / "diff.html"
    rc = main(["diff", "--config", "k3_mini", "--tp", "2", "--bucket", "1", "--pass", "fuse_attn_res_norm",
               "--html", str(html_path)])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("=== 04 fuse_attn_res_norm") and "matches=25" in lines[0]
    assert "+25/-50 nodes" in lines[0]
    assert lines[1] == "--- 04_fuse_attn_res_norm.before.py" and lines[2] == "+++ 04_fuse_attn_res_norm.after.py"
    assert "lift_dialect" not in out  # only the pass asked for
    assert any(l.startswith("-h2 = k3.attn_res(tp_all_reduce") for l in lines)  # TP2: inputs are all-reduced
    assert any(l.startswith("+attn_res_rms_norm") for l in lines)
    page = html_path.read_text()
    checker = _Checker()
    checker.feed(page)
    assert not checker.errors and not checker.stack
    assert checker.sections == [p.name for p in default_passes()]
    assert checker.titles > 25  # provenance on hover for rewritten nodes
    assert "del" in page and "add" in page


def test_bad_input_errors():
    r = run("diff", "--tp", "3")
    assert r.returncode == 2 and "unsupported TP size 3" in r.stderr
    r = run("diff", "--config", "no_such_model")
    assert r.returncode == 2 and "unknown config 'no_such_model'" in r.stderr
    r = run("diff", "--pass", "no_such_pass")
    assert r.returncode == 2 and "no pass named 'no_such_pass'" in r.stderr


def test_plan_and_bench_plot_bad_input_errors(tmp_path, capsys):
    """A bucket below 1, a context outside the config's positions and a missing JSON are one clear line each."""
    cases = [
        (["plan", "--bucket", "0"], "--bucket 0: a bucket is a positive batch size"),
        (["plan", "--context", "-5"], "context -5 must be in 0..8191"),
        (["plan", "--context", "8192"], "context 8192 must be in 0..8191"),
        (["bench-plot", str(tmp_path / "none.json"), str(tmp_path / "p.png")], "No such file or directory"),
    ]
    for argv, msg in cases:
        if argv[0] == "plan":
            argv = [*argv, "--config", "k3_mini", "--tp", "1"]
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and msg in err and "Traceback" not in err, (argv, err)


def test_codegen_sources_only(tmp_path, capsys):
    import json

    out = tmp_path / "k"
    assert main(["codegen", "--config", "k3_mini", "--tp", "1", "--buckets", "1", "--no-compile", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert not m["compiled"] and m["max_context"] == 8192 and m["kernels"]
    assert f"{len(m['kernels'])} kernels for {m['coverage']['plan_launches']} plan launches" in text
    assert "coverage: " in text and all((out / "kernels" / n / "kernel.py").exists() for n in m["kernels"])


def test_codegen_skip_passed_leaves_out_the_kernels_a_gpu_check_passed(tmp_path, capsys):
    """--skip-passed: a package of only the kernels no earlier check passed (names are source hashes), so a
    change's kernels are checked without rebuilding and carrying the rest; the manifest says how many went."""
    import json

    full = tmp_path / "full"
    assert main(["codegen", "--config", "k3_mini", "--tp", "1", "--buckets", "1", "--no-compile", "-o", str(full)]) == 0
    names = sorted(json.loads((full / "manifest.json").read_text())["kernels"])
    passed = {"kernels": [{"kernel": n, "ok": True} for n in names[:3]] + [{"kernel": names[3], "ok": False}]}
    shard = tmp_path / "shard1.json"
    shard.write_text(json.dumps(passed))
    capsys.readouterr()
    part = tmp_path / "part"
    assert main(["codegen", "--config", "k3_mini", "--tp", "1", "--buckets", "1", "--no-compile", "-o", str(part),
                 "--skip-passed", str(shard)]) == 0
    m = json.loads((part / "manifest.json").read_text())
    assert sorted(m["kernels"]) == names[3:] and m["skipped_passed"] == 3  # a failed one is checked again
    assert f"left out 3 kernels that passed in {shard}" in capsys.readouterr().out
    assert "skipped_passed" not in json.loads((full / "manifest.json").read_text())


def test_codegen_templates_cuts_a_plan_to_one_template(tmp_path, capsys):
    """--templates with a plan: only that template's kernels (every TP and bucket asked for), the package for a
    GPU check of a template's change; the manifest says so and still maps every plan launch. A wrong name is
    refused with the list of templates."""
    import json

    out = tmp_path / "gu"
    assert main(["codegen", "--config", "k3_mini", "--tp", "1,2", "--buckets", "1,2", "--no-compile", "-o", str(out),
                 "--templates", "moe_gate_up"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["kernels"] and {k["template"] for k in m["kernels"].values()} == {"moe_gate_up"}
    assert {(e["tp"], e["bucket"]) for k in m["kernels"].values() for e in k["implements"]} == {
        (1, 1), (1, 2), (2, 1), (2, 2)}
    assert m["only_templates"] == ["moe_gate_up"]
    assert "kernels of other templates" in capsys.readouterr().out
    assert main(["codegen", "--config", "k3_mini", "--tp", "1", "--buckets", "1", "--no-compile", "-o",
                 str(tmp_path / "bad"), "--templates", "moe_gate"]) == 2
    err = capsys.readouterr().err
    assert "unknown template(s) moe_gate" in err and "moe_gate_up" in err


def test_codegen_bad_input_names_problem_and_fix(tmp_path, capsys):
    cases = [
        (["--tp", "3"], "3"),
        (["--max-context", "0"], "max_context 0 must be in 1..8192"),
        (["--buckets", "0"], "bucket"),
        (["--arch", "sm_80"], "pass --arch sm_90a"),
    ]
    for extra, msg in cases:
        rc = main(["codegen", "--config", "k3_mini", "--buckets", "1", "--no-compile", "-o", str(tmp_path / "x"),
                   *extra])
        err = capsys.readouterr().err
        assert rc == 2 and msg in err, (extra, err)
    rc = main(["codegen", "--examples", "--templates", "no_such", "--no-compile", "-o", str(tmp_path / "y")])
    assert rc == 2 and "no kernel template named 'no_such'" in capsys.readouterr().err


def test_bench_kernels_without_gpu_says_so(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        return  # on a GPU host this command runs for real (tests/gpu)
    assert main(["bench-kernels", "--package", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
