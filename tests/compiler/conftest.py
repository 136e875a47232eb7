import pytest
import torch

from k3compile.models import k3_mini, load_pretrained, save_random_checkpoint


@pytest.fixture(scope="session")
def mini_ckpt(tmp_path_factory):
    """One random k3-mini checkpoint for the compiler tests."""
    return save_random_checkpoint(str(tmp_path_factory.mktemp("k3mini_compiler")), k3_mini(), seed=1)


@pytest.fixture(scope="session")
def mini_model(mini_ckpt):
    return load_pretrained(mini_ckpt)


@pytest.fixture(scope="session")
def mini_capture():
    from k3compile.capture import capture_config

    return capture_config(k3_mini(), tp_size=1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
