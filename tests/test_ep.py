"""Expert parallelism's token exchange (holotrain/parallel/ep.py) on gloo ranks against one process."""

import pytest

from tests.conftest import run_worker


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_dispatch_and_combine_equal_one_process(ranks):
    """Uneven token counts per rank and expert (one expert empty): the experts' outputs, the tokens' gradients and
    each rank's experts' weight gradients equal the computation with every expert on every rank."""
    run_worker("ep_worker.py", ranks, f"EP OK world={ranks}")
