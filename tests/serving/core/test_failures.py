"""serving/core/failures.py: the shared runtime values, reasons and helpers (no Ray started)."""

from __future__ import annotations

import json

import pytest

from serving.core.calls import sse_error
from serving.core.failures import Reason, classify, prefill_failure
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


def _from_replica(cause: BaseException) -> BaseException:
    """`cause` as a caller of the replica that raised it gets it from Serve (Ray 2.60)."""
    from ray.exceptions import RayTaskError

    return RayTaskError("chat", "tb", cause, proctitle="p", pid=1, ip="127.0.0.1").as_instanceof_cause()


def test_a_prefill_failure_is_the_requests_own_only_when_the_replicas_code_raised_it():
    """What the prefill circuit hears of: the tier's failures (the replica gone, Serve failing
    the call, the engine dead, a stall), never what the replica's code raised for this request
    (a LoRA adapter that does not load, a value it refuses)."""
    from ray.exceptions import ActorDiedError
    from vllm.v1.engine.exceptions import EngineDeadError

    assert prefill_failure(_from_replica(ValueError("Failed to load lora model: x"))) is Reason.REQUEST_ERROR
    assert prefill_failure(_from_replica(KeyError("adapter"))) is Reason.REQUEST_ERROR
    assert prefill_failure(_from_replica(EngineDeadError())) is Reason.ERROR  # vLLM's server-side error
    assert prefill_failure(_from_replica(TimeoutError())) is Reason.TIMEOUT
    assert prefill_failure(ActorDiedError()) is Reason.REPLICA_DIED
    assert prefill_failure(RuntimeError("not from a replica's code")) is Reason.ERROR


def test_sse_error_is_one_openai_error_event_then_done():
    ev = sse_error("x", 503)
    first, done = ev.strip().split("\n\n")
    assert json.loads(first[6:]) == {"error": {"message": "x", "type": "server_error", "param": None, "code": 503}}
    assert done == "data: [DONE]"
