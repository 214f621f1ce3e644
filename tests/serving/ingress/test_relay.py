"""serving/ingress/relay.py against fake Serve streams: the first chunk (retry, fail-fast,
refusals, deadlines) and the stream after the first byte."""

from __future__ import annotations

import asyncio
import json

import pytest

from serving.core.failures import Reason, Unservable
from serving.ingress.relay import DecodeHealth, first_chunk, guarded_stream
from tests.serving.fakes import CFG, Err, FakeStream, collect, is_5xx, run


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
    cfg = CFG.model_copy(update={"first_token_timeout_s": 3600.0, "total_timeout_s": 3600.0})
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
