"""e2e: the local stack's decode role scales 1 -> 2 under load and back to 1 when idle.

The shared session stack runs decode with Serve autoscaling (min 1, max 2, target 8 ongoing
requests, short delays: serving/local/config.py). The test drives more than the target,
waits for a second decode replica RUNNING, stops, waits until one is left, and leaves the
stack as it found it (one decode replica) for the tests that follow. Both delays are written
to build/test-logs/scaling.json and printed.
"""

from __future__ import annotations

import json

import pytest

from serving.local.config import LOCAL_DECODE_TARGET
from tests.serving.conftest import LOG_DIR

pytestmark = pytest.mark.e2e


def test_decode_scales_out_under_load_and_back_in(stack):
    from serving.local.scaling import decode_replicas, measure_decode_scaling

    dashboard = stack.state["dashboard_url"]
    assert decode_replicas(dashboard) == (1, 1), "the shared stack should start with one decode replica"
    run = measure_decode_scaling(
        dashboard, stack.urls["disaggregated"], stack.api_key, stack.model, clients=3 * LOCAL_DECODE_TARGET
    )
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "scaling.json").write_text(json.dumps(run.as_dict(), indent=2))
    print(f"\ndecode scale-out {run.scale_out_s}s (decision {run.decision_s}s), scale-in {run.scale_in_s}s")
    assert run.scale_out_s is not None, f"decode never reached 2 running replicas: {run.timeline[-5:]}"
    assert run.scale_in_s is not None, f"decode did not scale back to 1: {run.timeline[-5:]}"
    assert run.requests_failed == 0, run.errors[:5]
    assert run.requests_ok > 0
    assert decode_replicas(dashboard) == (1, 1)
