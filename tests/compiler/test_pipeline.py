"""Pass infrastructure: requires -> apply -> ensures, records, per-bucket applicability, dumps, ordering."""

import os

import pytest

from k3compile.compiler import Options, lower
from k3compile.pipeline import (PASS_REGISTRY, K3Pass, PassConditionError, PassConfig, PassContext, PassResult,
                                Pipeline, Stage, copy_graph_module)
from k3compile.pipeline_table import build_pipeline
from k3compile.passes.eliminate_dead_code import EliminateDeadCode
from k3compile.passes.fuse_attn_res_norm import FuseAttnResNorm
from k3compile.passes.lift_dialect import LiftDialect


def _ctx(cap, bucket=1, dump=None):
    return PassContext(bucket=bucket, tp_size=1, inputs=cap.inputs, batch_symbol=cap.batch_symbol, dump_dir=dump)


def _fresh(cap):
    gm = copy_graph_module(cap.graph_module)
    gm.meta["k3_inputs"] = cap.inputs
    return gm


class _BreaksItsPromise(K3Pass):
    """A pass whose ensures fails: it promises no k3.lm_head remains, but leaves it."""

    name = "test_breaks_its_promise"
    stage = Stage.FUSE

    def apply(self, gm, ctx):
        return PassResult(0, False)

    def ensures(self, gm, ctx):
        if any("lm_head" in str(n.target) for n in gm.graph.nodes):
            raise self.fail("ensures", "k3.lm_head is still in the graph")


def test_failed_ensures_stops_pipeline_naming_pass_and_condition(mini_capture):
    after = []

    class _Later(K3Pass):
        name = "test_later"
        stage = Stage.SELECT

        def apply(self, gm, ctx):
            after.append(True)
            return PassResult(0, False)

    pipe = Pipeline([LiftDialect(), _BreaksItsPromise(), _Later()])
    with pytest.raises(PassConditionError, match=r"pass 'test_breaks_its_promise' ensures violated: "
                                                 r"k3.lm_head is still in the graph"):
        pipe.run(_fresh(mini_capture), _ctx(mini_capture))
    assert not after  # nothing ran after the failing pass


def test_requires_is_checked_before_apply(mini_capture):
    with pytest.raises(PassConditionError, match="fuse_attn_res_norm' requires violated: .*lift_dialect"):
        Pipeline([FuseAttnResNorm()]).run(_fresh(mini_capture), _ctx(mini_capture))


def test_records_and_bucket_applicability(mini_capture):
    pipe = Pipeline([LiftDialect(), EliminateDeadCode(), FuseAttnResNorm(buckets=(8, 16))])
    gm1 = pipe.run(_fresh(mini_capture), _ctx(mini_capture, bucket=1))
    lift, dce, fuse = gm1.meta["k3_records"]
    assert lift.applied and lift.changed and lift.match_count > 200
    assert not fuse.applied and "bucket 1" in fuse.notes and fuse.after == fuse.before
    assert any(n.target.__name__.startswith("attn_res.") for n in gm1.graph.nodes if hasattr(n.target, "__name__"))
    gm8 = pipe.run(_fresh(mini_capture), _ctx(mini_capture, bucket=8))
    fuse8 = gm8.meta["k3_records"][2]
    assert fuse8.applied and fuse8.match_count == 25 and fuse8.nodes_removed == 50 and fuse8.nodes_added == 25
    assert fuse8.time_s > 0


def test_typed_config_and_uuid():
    with pytest.raises(TypeError, match="takes a PassConfig"):
        LiftDialect(config=object())
    a, b = FuseAttnResNorm(), FuseAttnResNorm(buckets=(1,))
    assert a.uuid() == FuseAttnResNorm().uuid() != b.uuid()
    assert Pipeline([LiftDialect(), a]).cache_key() != Pipeline([LiftDialect(), b]).cache_key()
    assert isinstance(b.config, PassConfig) and b.config.buckets == (1,)
    assert {"lift_dialect", "eliminate_dead_code", "fuse_attn_res_norm"} <= set(PASS_REGISTRY)


def test_stage_order_is_enforced():
    with pytest.raises(ValueError, match="ordered by stage"):
        Pipeline([FuseAttnResNorm(), LiftDialect()])


def test_pipeline_options_validated():
    with pytest.raises(KeyError, match="unknown pass"):
        build_pipeline({"no_such_pass": {"enabled": False}})
    pipe = build_pipeline({"fuse_attn_res_norm": {"buckets": [2]}})
    by_name = {p.name: p for p in pipe.passes}
    assert by_name["fuse_attn_res_norm"].config.buckets == (2,)
    assert by_name["front_gemm"].config.buckets is None


def test_dump_files_are_sortable_and_complete(mini_capture, tmp_path):
    gm = lower(mini_capture.graph_module, mini_capture.inputs, tp_size=1, bucket=1,
               options=Options.make(dump_dir=str(tmp_path)))
    names = sorted(os.listdir(tmp_path / "tp1_bucket1"))
    passes = [r.name for r in gm.meta["k3_records"]]
    expected = sorted(f"{i:02d}_{p}{s}" for i, p in enumerate(passes, 1) for s in (".before.py", ".after.py", ".diff"))
    assert names == expected
    diff = (tmp_path / "tp1_bucket1" / "04_fuse_attn_res_norm.diff").read_text()
    assert "+attn_res_rms_norm" in diff and "-h2 = k3.attn_res(" in diff
