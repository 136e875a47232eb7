"""Capture: one FX graph, symbolic batch, explicit state updates, clear errors on graph breaks."""

import pytest
import sympy

from k3compile.capture import CaptureError, capture, capture_config
from k3compile.models import K3Model, k3_mini
from k3compile.models.model import DecodeState


def test_batch_is_one_sympy_symbol(mini_capture):
    assert isinstance(mini_capture.batch_symbol, sympy.Symbol)
    tok = next(n for n in mini_capture.graph_module.graph.nodes if n.op == "placeholder" and "token_ids" in n.name)
    assert tok.meta["example_value"].shape[0].node.expr == mini_capture.batch_symbol


def test_inputs_are_classified(mini_capture):
    model = K3Model(k3_mini(), device="meta")
    kinds = [i.kind for i in mini_capture.inputs]
    assert kinds.count("token_ids") == 1
    # every KDA layer: conv q/k/v + recurrent; every MLA layer: its latent cache; plus lengths
    n_state = len(DecodeState(model, 1, 4).tensors())
    assert kinds.count("state") == n_state == 1 + 9 * 4 + 4
    n_weights = len(list(model.parameters())) + len(list(model.buffers()))
    # layer 0 has no pre-attention AttnRes read, so its two res weights never enter the graph
    assert kinds.count("weight") == n_weights - 2


def test_state_updates_are_explicit_nodes(mini_capture):
    g = mini_capture.graph_module.graph
    copies = [n for n in g.nodes if n.op == "call_method" and n.target == "copy_"]
    index_puts = [n for n in g.nodes if n.op == "call_method" and n.target == "index_put_"]
    assert len(copies) == 9 * 4 + 1  # conv q/k/v + recurrent per KDA layer, lengths
    assert len(index_puts) == 4  # one latent-cache append per MLA layer
    state_names = {i.name for i in mini_capture.inputs if i.kind == "state"}

    def root(n):
        while n.op != "placeholder":
            n = n.args[0]
        return n.name

    assert {root(n) for n in copies + index_puts} == state_names


def test_collectives_are_nodes_under_tp():
    cap = capture_config(k3_mini(), tp_size=2)
    ars = [n for n in cap.graph_module.graph.nodes if "all_reduce" in str(n.target)]
    # embedding + 13 attention o_proj + dense MLP + 12 x (latent partial + shared partial)
    assert len(ars) == 1 + 13 + 1 + 2 * 12


class _Untraceable(K3Model):
    def decode(self, token_ids, state):
        if int(token_ids.sum()) > 10**9:  # data-dependent Python control flow: a graph break
            return None
        return super().decode(token_ids, state)


def test_graph_break_names_source_location():
    model = _Untraceable(k3_mini(), device="meta")
    with pytest.raises(CaptureError) as exc:
        capture(model)
    msg = str(exc.value)
    assert "graph break" in msg
    assert "test_capture.py:" in msg  # the offending line, not somewhere inside Dynamo
