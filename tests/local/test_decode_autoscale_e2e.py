"""e2e: the local stack's decode role scales 1 -> 2 under load and back to 1 when idle.

The shared session stack runs decode with Serve autoscaling (min 1, max 2, target 8 ongoing
requests, short delays: local/config.py). The test drives more than the target,
waits for a second decode replica RUNNING, stops, waits until one is left, and leaves the
stack as it found it (one decode replica) for the tests that follow. It asserts that both
happen, not how fast: the delays are figures, measured by `make bench`
(bench/decode_autoscale.py).
"""

from __future__ import annotations

import pytest

from local.config import LOCAL_DECODE_TARGET

pytestmark = pytest.mark.e2e


def test_decode_scales_out_under_load_and_back_in(stack):
    from local.decode_autoscale import decode_replicas, measure_decode_scaling

    dashboard = stack.state["dashboard_url"]
    assert decode_replicas(dashboard) == (1, 1), "the shared stack should start with one decode replica"
    run = measure_decode_scaling(
        dashboard, stack.urls["disaggregated"], stack.api_key, stack.model, clients=3 * LOCAL_DECODE_TARGET
    )
    assert run.scale_out_s is not None, f"decode never reached 2 running replicas: {run.timeline[-5:]}"
    assert run.max_running == 2, run.timeline[-5:]
    assert run.scale_in_s is not None, f"decode did not scale back to 1: {run.timeline[-5:]}"
    assert run.requests_failed == 0, run.errors[:5]
    assert run.requests_ok > 0
    assert decode_replicas(dashboard) == (1, 1)
