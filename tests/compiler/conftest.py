import pytest

from k3compile.models import k3_mini


@pytest.fixture(scope="session")
def mini_capture():
    from k3compile.capture import capture_config

    return capture_config(k3_mini(), tp_size=1)
