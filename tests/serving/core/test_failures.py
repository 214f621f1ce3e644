"""serving/core/failures.py: the shared runtime values, reasons and helpers (no Ray started)."""

from __future__ import annotations

import json

import pytest

from serving.core.calls import sse_error
from serving.core.failures import Reason, classify
from serving.spec import ResilienceSpec


# --- config ------------------------------------------------------------------------------------
def test_config_refuses_unknown_and_missing_keys():
    args = {**ResilienceSpec().runtime_args(), "decode_attempts": 1}
    assert ResilienceSpec.from_args(args).decode_attempts == 1
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        ResilienceSpec.from_args({**args, "bogus": 1})
    del args["fail_fast_s"]
    with pytest.raises(ValueError, match="missing keys \\['fail_fast_s'\\]"):
        ResilienceSpec.from_args(args)


# --- classify -----------------------------------------------------------------------------------
def test_classify_maps_serve_failures_to_reasons():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    assert classify(TimeoutError()) is Reason.TIMEOUT
    assert classify(ActorDiedError()) is Reason.REPLICA_DIED
    assert classify(BackPressureError(num_queued_requests=3, max_queued_requests=2)) is Reason.OVERLOADED
    assert classify(RuntimeError("boom")) is Reason.ERROR


def test_sse_error_is_one_openai_error_event_then_done():
    ev = sse_error("x", 503)
    first, done = ev.strip().split("\n\n")
    assert json.loads(first[6:]) == {"error": {"message": "x", "type": "server_error", "param": None, "code": 503}}
    assert done == "data: [DONE]"
