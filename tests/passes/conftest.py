import pytest
import torch

from k3compile.models import k3_mini, load_pretrained, save_random_checkpoint


@pytest.fixture(scope="session")
def mini_ckpt(tmp_path_factory):
    return save_random_checkpoint(str(tmp_path_factory.mktemp("k3mini_passes")), k3_mini(), seed=2)


@pytest.fixture(scope="session")
def mini_model(mini_ckpt):
    return load_pretrained(mini_ckpt)


@pytest.fixture(scope="session")
def lowered_tp2():
    """k3-mini at TP 2, lowered for every bucket of the tests (records per pass on gm.meta)."""
    from k3compile.capture import capture_config
    from k3compile.compiler import Options, lower

    cap = capture_config(k3_mini(), tp_size=2)
    return {b: lower(cap.graph_module, cap.inputs, tp_size=2, bucket=b, options=Options.make(buckets=(b,)))
            for b in (1, 8, 64)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
