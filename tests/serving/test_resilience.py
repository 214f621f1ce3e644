"""The resilience logic (serving/resilience.py) against fake Serve streams: no Ray started.

Each fake stream behaves like a Serve DeploymentResponseGenerator: async-iterable, with
.cancel(); it can fail, hang or answer. The tests check what reaches the client, what is
retried or cancelled, and which reason is counted.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from serving.circuit import Circuit
from serving.resilience import (
    DecodeHealth,
    Path,
    Reason,
    ResilienceConfig,
    Unservable,
    classify,
    first_chunk,
    guarded_stream,
    orchestrate,
    remote_prefill,
    sse_error,
)

CFG = ResilienceConfig(
    prefill_timeout_s=0.2,
    prefill_queue_timeout_s=0.3,
    prefill_attempts=2,
    kv_ready_timeout_s=0.2,
    first_token_timeout_s=0.5,
    total_timeout_s=2.0,
    fail_fast_s=0.1,
    decode_attempts=2,
    circuit_open_s=10.0,
    circuit_failures=3,
    retry_after_s=1,
)


class Err:
    """Stands in for Ray's ErrorResponse."""

    def __init__(self, code: int):
        self.code = code


def is_err(x) -> bool:
    return isinstance(x, Err)


def is_5xx(x) -> bool:
    return isinstance(x, Err) and x.code >= 500


class FakeStream:
    """items: values to yield; an Exception instance is raised; "hang" waits forever."""

    def __init__(self, items, *, assigned=True, assign_after_s=0.0):
        self.items = list(items)
        self.cancelled = False
        self.closed = False
        self.assigned = assigned
        self.assign_after_s = assign_after_s

    async def _fetch_future_result_async(self):
        """Like Serve's: returns once a replica took the call (never, with no replica)."""
        if not self.assigned:
            await asyncio.Event().wait()
        await asyncio.sleep(self.assign_after_s)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item == "hang":
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True

    async def aclose(self):
        self.closed = True


def run(coro):
    return asyncio.run(coro)


async def collect(agen):
    return [x async for x in agen]


# --- config ------------------------------------------------------------------------------------
def test_config_refuses_unknown_and_missing_keys():
    args = {f: 1 for f in CFG.__dataclass_fields__}
    assert ResilienceConfig.from_args(args).decode_attempts == 1
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        ResilienceConfig.from_args({**args, "bogus": 1})
    del args["fail_fast_s"]
    with pytest.raises(ValueError, match="missing keys \\['fail_fast_s'\\]"):
        ResilienceConfig.from_args(args)


# --- classify -----------------------------------------------------------------------------------
def test_classify_maps_serve_failures_to_reasons():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    assert classify(TimeoutError()) is Reason.TIMEOUT
    assert classify(ActorDiedError()) is Reason.REPLICA_DIED
    assert classify(BackPressureError(num_queued_requests=3, max_queued_requests=2)) is Reason.OVERLOADED
    assert classify(RuntimeError("boom")) is Reason.ERROR


# --- prefill hop ----------------------------------------------------------------------------------
def test_prefill_success_first_try():
    streams = [FakeStream(["kv"])]
    retries = []
    out = run(
        remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=Circuit(10), on_retry=retries.append)
    )
    assert out.chunk == "kv" and out.reason is None and retries == []


def test_prefill_replica_death_is_retried_on_another_call():
    from ray.exceptions import ActorDiedError

    dead, good = FakeStream([ActorDiedError()]), FakeStream(["kv"])
    streams = [dead, good]
    retries = []
    circuit = Circuit(10)
    out = run(
        remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append)
    )
    assert out.chunk == "kv"
    assert retries == [Reason.REPLICA_DIED]
    assert dead.cancelled
    assert not circuit.is_open  # the retry succeeded


def test_a_stalled_prefill_is_cancelled_and_retried_and_one_stall_does_not_open_the_circuit():
    first, second = FakeStream(["hang"]), FakeStream(["kv"])
    calls = [first, second]
    retries = []
    circuit = Circuit(10, failures_to_open=3)
    out = run(remote_prefill(lambda: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append))
    assert out.chunk == "kv" and out.path is Path.REMOTE_RETRY
    assert retries == [Reason.TIMEOUT]
    assert first.cancelled
    assert not circuit.is_open


def test_queueing_for_a_prefill_replica_does_not_count_against_the_prefill_deadline():
    # Taken after 0.25 s (longer than prefill_timeout_s 0.2, within the queue bound 0.3),
    # then answered at once: a success, not a timeout.
    queued = FakeStream(["kv"], assign_after_s=0.25)
    circuit = Circuit(10, failures_to_open=1)
    out = run(remote_prefill(lambda: queued, is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None))
    assert out.chunk == "kv" and out.path is Path.REMOTE
    assert not circuit.is_open


def test_a_prefill_call_no_replica_takes_is_overload_not_retried_and_leaves_the_circuit_closed():
    never = FakeStream(["kv"], assigned=False)
    retries = []
    circuit = Circuit(10, failures_to_open=1)
    out = run(remote_prefill(lambda: never, is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append))
    assert out.reason is Reason.OVERLOADED and out.path is Path.LOCAL
    assert retries == [] and never.cancelled
    assert not circuit.is_open


def test_waiting_prefills_go_local_the_moment_another_request_trips_the_circuit():
    circuit = Circuit(10, failures_to_open=1)
    # A prefill budget of an hour: the wait can only end this soon because the circuit opened
    # (a hang is ended by the suite's per-test timeout, pytest.ini), and the reason says so.
    cfg = ResilienceConfig(**{**CFG.__dict__, "prefill_timeout_s": 3600.0, "total_timeout_s": 3600.0})
    waiting = FakeStream(["hang"])

    async def go():
        task = asyncio.ensure_future(
            remote_prefill(lambda: waiting, is_error=is_err, cfg=cfg, circuit=circuit, on_retry=lambda r: None)
        )
        await asyncio.sleep(0.05)
        circuit.failure()  # another request failed
        return await task

    out = run(go())
    # CIRCUIT_OPEN, not TIMEOUT: it stopped waiting when the circuit opened, not at its deadline.
    assert out.reason is Reason.CIRCUIT_OPEN
    assert waiting.cancelled


def test_after_a_prefill_outage_a_successful_probe_brings_every_request_back_to_remote_prefill():
    """The defect of 2026-12-01: the probe found the trip event of the last outage still set,
    gave up, and the replica prefilled locally for the rest of its life."""
    from ray.exceptions import ActorDiedError

    now = [0.0]
    circuit = Circuit(1.0, failures_to_open=2, clock=lambda: now[0])

    def prefill(streams):
        return run(
            remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None)
        )

    outage = prefill([FakeStream([ActorDiedError()]), FakeStream([ActorDiedError()])])
    assert outage.path is Path.LOCAL and circuit.is_open
    assert prefill([]).reason is Reason.CIRCUIT_OPEN  # no call while open
    now[0] = 1.5
    probe = prefill([FakeStream(["kv"])])
    assert probe.path is Path.REMOTE and not circuit.is_open
    assert [prefill([FakeStream(["kv"])]).path for _ in range(3)] == [Path.REMOTE] * 3


def test_a_failed_probe_opens_the_circuit_again_without_a_retry():
    from ray.exceptions import ActorDiedError

    now = [0.0]
    circuit = Circuit(1.0, failures_to_open=1, clock=lambda: now[0])
    circuit.failure()
    now[0] = 1.5
    calls = [FakeStream([ActorDiedError()])]
    out = run(remote_prefill(lambda: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None))
    assert out.reason is Reason.REPLICA_DIED and calls == []  # one call: the probe is not retried
    assert not circuit.allow()  # open again for another open_s
    now[0] = 2.6
    assert circuit.allow()


def test_a_cancelled_probe_lets_the_next_request_probe():
    now = [0.0]
    circuit = Circuit(1.0, failures_to_open=1, clock=lambda: now[0])
    circuit.failure()
    now[0] = 2.0

    async def go():
        task = asyncio.ensure_future(
            remote_prefill(
                lambda: FakeStream(["hang"]), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None
            )
        )
        await asyncio.sleep(0.05)
        assert not circuit.allow()  # the probe is out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert circuit.allow()  # the probe slot is free again


def test_replica_death_twice_opens_a_two_failure_circuit():
    from ray.exceptions import ActorDiedError

    circuit = Circuit(10, failures_to_open=2)
    streams = [FakeStream([ActorDiedError()]), FakeStream([ActorDiedError()])]
    retries = []
    out = run(
        remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append)
    )
    assert out.reason is Reason.REPLICA_DIED and retries == [Reason.REPLICA_DIED]
    assert circuit.is_open


def test_prefill_skipped_while_circuit_open():
    circuit = Circuit(10, failures_to_open=1)
    circuit.failure()
    out = run(
        remote_prefill(
            lambda: pytest.fail("no call while open"),
            is_error=is_err,
            cfg=CFG,
            circuit=circuit,
            on_retry=lambda r: None,
        )
    )
    assert out.reason is Reason.CIRCUIT_OPEN


def test_prefill_overload_does_not_open_the_circuit():
    from ray.serve.exceptions import BackPressureError

    circuit = Circuit(10)
    out = run(
        remote_prefill(
            lambda: FakeStream([BackPressureError(num_queued_requests=1, max_queued_requests=1)]),
            is_error=is_err,
            cfg=CFG,
            circuit=circuit,
            on_retry=lambda r: None,
        )
    )
    assert out.reason is Reason.OVERLOADED
    assert not circuit.is_open


# --- decode orchestration -----------------------------------------------------------------------
def _orchestrate(prefill_outcome, remote_items, local_items, *, stream=True):
    from serving.resilience import PrefillOutcome

    paths, remote, local = [], FakeStream(remote_items), FakeStream(local_items)

    async def prefill():
        return PrefillOutcome(**prefill_outcome)

    async def decode_with(chunk):
        assert chunk == "kv"
        return remote

    async def decode_local():
        return local

    out = run(
        collect(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=is_5xx,
                kv_ready_timeout_s=lambda: CFG.kv_ready_timeout_s if stream else None,
                on_path=lambda p, r: paths.append((p, r)),
            )
        )
    )
    assert len(paths) == 1  # every request is counted once, on exactly one path
    fallbacks = [r for p, r in paths if p is Path.LOCAL]
    return out, fallbacks, remote, local


def test_orchestrate_remote_path_streams_decode_output():
    out, fallbacks, _, local = _orchestrate({"chunk": "kv"}, ["a", "b"], ["x"])
    assert out == ["a", "b"] and fallbacks == [] and local.items == ["x"]


def test_orchestrate_prefill_failure_runs_locally_once():
    out, fallbacks, _, _ = _orchestrate({"reason": Reason.REPLICA_DIED}, ["a"], ["x", "y"])
    assert out == ["x", "y"] and fallbacks == [Reason.REPLICA_DIED]


def test_orchestrate_kv_never_arrives_aborts_decode_and_reruns_locally():
    out, fallbacks, remote, _ = _orchestrate({"chunk": "kv"}, ["hang"], ["x"])
    assert out == ["x"] and fallbacks == [Reason.KV_TIMEOUT]
    assert remote.closed  # the stuck engine request was aborted


def test_orchestrate_kv_load_error_reruns_locally_without_duplicates():
    out, fallbacks, remote, _ = _orchestrate({"chunk": "kv"}, [[Err(500)], "late"], ["x"])
    assert out == ["x"] and fallbacks == [Reason.KV_LOAD_ERROR] and remote.closed


def test_orchestrate_detects_vllms_in_stream_error_event_as_a_kv_load_error():
    from serving.resilience import _is_server_error

    # vLLM's OpenAIServing.create_streaming_error_response, as the engine streams it.
    event = (
        'data: {"error": {"message": "KV load failed", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
    )
    assert _is_server_error(event) and _is_server_error([event][0])
    assert not _is_server_error('data: {"id": "x", "choices": [{"delta": {"content": "error"}}]}\n\n')
    assert not _is_server_error('data: {"error": {"message": "bad", "code": 400}}\n\n')  # the client's, passed on

    paths = []

    async def go():
        async def prefill():
            from serving.resilience import PrefillOutcome

            return PrefillOutcome(chunk="kv")

        remote, local = FakeStream([[event], "late"]), FakeStream(["x"])

        async def decode_with(_):
            return remote

        async def decode_local():
            return local

        out = await collect(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=_is_server_error,
                kv_ready_timeout_s=lambda: 1.0,
                on_path=lambda p, r: paths.append((p, r)),
            )
        )
        return out, remote

    out, remote = run(go())
    assert out == ["x"] and remote.closed
    assert paths == [(Path.LOCAL, Reason.KV_LOAD_ERROR)]


def test_orchestrate_without_a_kv_deadline_waits_for_a_slow_first_token():
    # A saturated decode replica (no free sequence slot): a slow first token is queueing,
    # and rerunning the request with a full prefill here would only add load.
    from serving.resilience import PrefillOutcome

    paths = []

    async def slow():
        await asyncio.sleep(CFG.kv_ready_timeout_s * 2)
        yield "tok"

    async def go():
        async def prefill():
            return PrefillOutcome(chunk="kv", attempts=1)

        async def decode_with(_):
            return slow()

        async def decode_local():
            pytest.fail("no local rerun without a KV deadline")

        return await collect(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=is_5xx,
                kv_ready_timeout_s=lambda: None,
                on_path=lambda p, r: paths.append((p, r)),
            )
        )

    assert run(go()) == ["tok"]
    assert paths == [(Path.REMOTE, None)]


def test_orchestrate_local_reason_skips_the_prefill_tier():
    paths = []

    async def go():
        async def prefill():
            pytest.fail("n > 1 must not call the prefill tier")

        async def decode_with(_):
            pytest.fail("no remote decode")

        async def decode_local():
            return FakeStream(["x"])

        return await collect(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=is_5xx,
                kv_ready_timeout_s=lambda: 1.0,
                on_path=lambda p, r: paths.append((p, r)),
                local_reason=Reason.PARALLEL_SAMPLING,
            )
        )

    assert run(go()) == ["x"]
    assert paths == [(Path.LOCAL, Reason.PARALLEL_SAMPLING)]


def test_orchestrate_non_streamed_request_has_no_kv_deadline():
    from serving.resilience import PrefillOutcome

    async def slow():
        await asyncio.sleep(0.4)  # longer than kv_ready_timeout_s: the whole answer
        yield "answer"

    async def prefill():
        return PrefillOutcome(chunk="kv")

    async def decode_with(_):
        return slow()

    async def decode_local():
        pytest.fail("no fallback for a slow non-streamed answer")

    out = run(
        collect(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=is_5xx,
                kv_ready_timeout_s=lambda: None,
                on_path=lambda p, r: None,
            )
        )
    )
    assert out == ["answer"]


# --- ingress: first chunk ---------------------------------------------------------------------
def _first(streams, health=None, cfg=CFG):
    retries = []
    calls = list(streams)
    health = health or DecodeHealth()

    async def go():
        return await first_chunk(
            lambda: calls.pop(0),
            cfg=cfg,
            health=health,
            started=asyncio.get_running_loop().time() * 0 + __import__("time").monotonic(),
            is_server_error=is_5xx,
            on_retry=retries.append,
        )

    return run(go()), retries, health


def test_first_chunk_retries_once_when_decode_dies_before_the_first_byte():
    from ray.exceptions import ActorDiedError

    dead, good = FakeStream([ActorDiedError()]), FakeStream(["tok", "more"])
    (first, stream), retries, health = _first([dead, good])
    assert first == "tok" and stream is good
    assert retries == [Reason.DECODE_DIED]
    assert dead.cancelled and not health.degraded


def test_first_chunk_fails_fast_while_decode_is_degraded_and_no_replica_takes_it():
    health = DecodeHealth()
    health.trouble()
    waiting = FakeStream(["tok"], assigned=False)
    # First-token and total budgets of an hour, failFastS 0.1 s: the call can only end now
    # because the degraded ingress waited failFastS, not the budget (a hang is ended by the
    # suite's per-test timeout, pytest.ini); the reason (decode unavailable, not overloaded)
    # says which rule ended it.
    cfg = ResilienceConfig(**{**CFG.__dict__, "first_token_timeout_s": 3600.0, "total_timeout_s": 3600.0})
    with pytest.raises(Unservable) as e:
        _first([waiting], health=health, cfg=cfg)
    assert e.value.reason is Reason.DECODE_UNAVAILABLE and e.value.status == 503
    assert e.value.headers == {"Retry-After": "1"}
    assert waiting.cancelled


def test_degraded_but_a_live_replica_takes_it_gets_the_full_first_token_budget():
    health = DecodeHealth()
    health.trouble()

    class Slow(FakeStream):
        async def __anext__(self):
            await asyncio.sleep(CFG.fail_fast_s * 2)  # slower than failFastS, within budget
            return "tok"

    (first, _), _, health = _first([Slow([])], health=health)
    assert first == "tok" and not health.degraded


def test_queued_past_the_first_token_budget_is_overload_and_does_not_switch_to_fail_fast():
    # Seen under `make bench`'s scaling run: replicas saturated on two cores took longer than
    # the budget to take requests; marking decode degraded then refused every later request
    # after 2 s (74 of 279 failed with 503) although no replica had died.
    health = DecodeHealth()
    waiting = FakeStream(["tok"], assigned=False)
    with pytest.raises(Unservable) as e:
        _first([waiting], health=health)
    assert e.value.reason is Reason.OVERLOADED and e.value.status == 503
    assert e.value.headers == {"Retry-After": "1"}
    assert waiting.cancelled and not health.degraded


def test_first_chunk_two_deaths_is_unservable_503():
    from ray.exceptions import ActorDiedError

    with pytest.raises(Unservable) as e:
        _first([FakeStream([ActorDiedError()]), FakeStream([ActorDiedError()])])
    assert e.value.reason is Reason.DECODE_UNAVAILABLE and e.value.status == 503


def test_non_streamed_answer_is_bounded_by_the_total_deadline_only():
    import time

    class Whole(FakeStream):
        async def __anext__(self):
            await asyncio.sleep(CFG.first_token_timeout_s + 0.2)  # the whole answer, later
            return "answer"

    async def go():
        return await first_chunk(
            lambda: Whole([]),
            cfg=CFG,
            health=DecodeHealth(),
            started=time.monotonic(),
            is_server_error=is_5xx,
            on_retry=lambda r: None,
            streamed=False,
        )

    first, _ = run(go())
    assert first == "answer"


def test_first_chunk_deadline_is_504():
    with pytest.raises(Unservable) as e:
        _first([FakeStream(["hang"])])
    assert e.value.reason is Reason.DEADLINE and e.value.status == 504


def test_first_chunk_backpressure_is_503_with_serves_retry_after():
    from ray.serve.exceptions import BackPressureError

    with pytest.raises(Unservable) as e:
        _first([FakeStream([BackPressureError(num_queued_requests=1, max_queued_requests=1)])])
    assert e.value.reason is Reason.OVERLOADED and e.value.status == 503
    assert "Retry-After" in e.value.headers


def test_first_chunk_engine_5xx_retried_then_4xx_passed_through():
    (first, _), retries, _ = _first([FakeStream([Err(500)]), FakeStream([Err(400)])])
    assert isinstance(first, Err) and first.code == 400
    assert retries == [Reason.ENGINE_ERROR]


def test_first_chunk_other_errors_propagate():
    with pytest.raises(KeyError):
        _first([FakeStream([KeyError("model")])])


# --- ingress: the stream after the first byte ------------------------------------------------------
def _stream(items, deadline_in=1.0):
    import time

    s = FakeStream(items)
    out = run(
        collect(guarded_stream("data: first\n\n", s, deadline_at=time.monotonic() + deadline_in, to_packet=lambda x: x))
    )
    return out, s


def test_stream_completes_with_done_and_is_not_cancelled():
    out, s = _stream(["data: a\n\n"])
    assert out == ["data: first\n\n", "data: a\n\n", "data: [DONE]\n\n"] and not s.cancelled


def test_stream_failure_after_first_byte_ends_with_error_event_no_retry():
    out, s = _stream([RuntimeError("replica died")])
    assert out[0] == "data: first\n\n"
    err = json.loads(out[1].split("\n\n")[0][len("data: ") :])
    assert err["error"]["code"] == 500
    assert out[1].endswith("data: [DONE]\n\n")
    assert s.cancelled


def test_stream_total_deadline_cuts_with_504_event_and_cancels():
    out, s = _stream(["hang"], deadline_in=0.1)
    assert json.loads(out[1].split("\n\n")[0][6:])["error"]["code"] == 504
    assert s.cancelled


def test_client_disconnect_cancels_the_downstream_request():
    import time

    s = FakeStream(["data: a\n\n", "hang"])

    async def go():
        agen = guarded_stream("data: first\n\n", s, deadline_at=time.monotonic() + 5, to_packet=lambda x: x)
        await agen.__anext__()
        await agen.__anext__()
        await agen.aclose()  # what Starlette does when the client goes away

    run(go())
    assert s.cancelled


def test_sse_error_is_one_openai_error_event_then_done():
    ev = sse_error("x", 503)
    first, done = ev.strip().split("\n\n")
    assert json.loads(first[6:]) == {"error": {"message": "x", "type": "server_error", "param": None, "code": 503}}
    assert done == "data: [DONE]"
