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


def _asgi_with_client_gone_at_once(resp):
    """Serve the response to a client that disconnects before the first chunk is asked for:
    Starlette cancels the sending task at the disconnect while the headers are still going
    out, so the body's generator never starts."""
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message["type"])
        await asyncio.sleep(0.2)  # the headers take a while to leave

    asyncio.run(resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    return sent


def test_a_stream_the_client_left_before_its_first_chunk_cancels_its_engine_call_and_closes():
    """Before, the relay's generator never ran, so neither its `finally` (the engine's call
    cancelled: vLLM kept generating) nor the router's closers (its in-flight entry counted as
    ongoing for 15 minutes) ever ran."""
    from serving.ingress.relay import Abandon, guarded_stream
    from serving.ingress.sse import EventPipeline, EventStreamResponse, SseRewriter

    stream = FakeStream(["data: {}\n\n", "hang"])
    events = EventPipeline()
    closed = []
    events.meter(SseRewriter(model=None, keep_usage_event=True, keep_chunk_usage=False), lambda: closed.append(True))
    abandon = Abandon(stream, events)
    body = guarded_stream(
        "data: {}\n\n", stream, deadline_at=10**9, to_packet=lambda x: x, events=events, abandon=abandon
    )
    resp = EventStreamResponse(body, events=events, release=abandon, media_type="text/event-stream")
    sent = _asgi_with_client_gone_at_once(resp)
    assert "http.response.body" not in sent  # the generator never ran
    assert stream.cancelled and closed == [True]
    abandon()  # once only
    assert closed == [True]


def test_a_stream_that_ran_is_released_by_its_own_generator_not_twice():
    from serving.ingress.relay import Abandon, guarded_stream
    from serving.ingress.sse import EventPipeline

    stream = FakeStream(["data: [DONE]\n\n"])
    events = EventPipeline()
    abandon = Abandon(stream, events)
    gen = guarded_stream(
        "data: {}\n\n", stream, deadline_at=10**9, to_packet=lambda x: x, events=events, abandon=abandon
    )
    out = run(collect(gen))
    assert out and abandon.started
    abandon()
    assert not stream.cancelled  # it ended on its own: nothing to cancel
