import pytest

from k3compile.models import k3_mini


@pytest.fixture(scope="session")
def lowered_tp2():
    """k3-mini at TP 2, lowered for every bucket of the tests (records per pass on gm.meta)."""
    from k3compile.capture import capture_config
    from k3compile.compiler import Options, lower

    cap = capture_config(k3_mini(), tp_size=2)
    return {b: lower(cap.graph_module, cap.inputs, tp_size=2, bucket=b, options=Options.make(buckets=(b,)))
            for b in (1, 8, 64)}
