"""The resilient relay of one request to its model's engines, and of their answer back.

What flows through here: a chat/completions request the front door has admitted (its typed
body, its model's handle; serving/ingress/pipeline.py) -> `first_chunk`: dispatched to decode
until a first chunk arrives (one retry when the decode replica died or answered 5xx before
the first byte; at most failFastS of waiting while decode is known degraded; Serve's
back-pressure and a request no replica takes in time -> 503 + Retry-After; the first-token
and total deadlines -> 504), raised as `Unservable` for the router to answer or hand to the
fallback -> an engine 4xx is the client's answer (`EngineRefused`) -> a whole answer as JSON,
or `guarded_stream`: the SSE packets of the started stream, cut at the total deadline, a
stream cut after its first byte continued on another replica (serving/ingress/migration.py)
or ended with an OpenAI-style error event, the downstream call cancelled when the client goes
away; each packet's events decoded once, read and edited there by the migration record and
the metering the router adds (serving.ingress.sse.EventPipeline), each encoded once.

The call itself, and which headers cross with it: serving/ingress/dispatch.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from serving.core import metrics
from serving.core.calls import (
    assigned,
    cancel_call,
    first_item,
    is_client_error,
    is_server_error,
    server_error_in,
)
from serving.core.failures import EngineRefused, Reason, Unservable, classify, decode_unavailable, overloaded
from serving.core.metrics import MigrationOutcome
from serving.ingress.dispatch import dispatch_call
from serving.ingress.migration import (
    Migration,
    StreamRecord,
    continue_stream,
    error_events,
    finish_events,
    not_continuable,
    whole_number,
)
from serving.ingress.sse import (
    DONE_EVENTS,
    EventPipeline,
    EventStreamResponse,
    OwnEvents,
    decode_packet,
)
from serving.spec import TEST_HOOKS_ENV, ResilienceSpec

logger = logging.getLogger("ray.serve")


class DecodeHealth:
    """What the ingress has seen of decode: after a replica death, until a request gets a
    first chunk again, new requests wait at most `fail_fast_s` for one (then 503)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._trouble_since: float | None = None

    @property
    def degraded(self) -> bool:
        return self._trouble_since is not None

    def trouble(self) -> None:
        if self._trouble_since is None:
            self._trouble_since = self._clock()

    def ok(self) -> None:
        self._trouble_since = None


async def first_chunk(
    dispatch: Callable[[], Any],
    *,
    cfg: ResilienceSpec,
    health: DecodeHealth,
    started: float,
    is_server_error: Callable[[Any], bool],
    on_retry: Callable[[Reason], None],
    streamed: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Any, Any]:
    """Dispatch to decode until a first chunk arrives; (first chunk, stream) or Unservable.

    Retries (up to decode_attempts) when the decode replica died or answered 5xx before
    the first byte. While decode is degraded (a replica died and nothing has succeeded
    since), a request waits at most fail_fast_s for a replica to take it. A request that no
    replica takes within the first-token budget otherwise is overload (503), and leaves
    the health as it was.
    """
    from ray.serve.exceptions import BackPressureError

    attempts = 0
    while True:
        attempts += 1
        remaining = cfg.total_timeout_s - (clock() - started)
        if remaining <= 0:
            raise Unservable(Reason.DEADLINE, cfg.retry_after_s, "The request deadline passed.")
        stream = dispatch()
        admitted = False
        try:
            # 1. A replica takes the call. While a decode replica is known lost, a live one
            #    must take it at once, else there is none (restarts take minutes): say so now.
            # A non-streamed answer comes whole: only the total deadline bounds it.
            budget = min(remaining, cfg.first_token_timeout_s) if streamed else remaining
            t_admit = clock()
            await asyncio.wait_for(assigned(stream), min(budget, cfg.fail_fast_s) if health.degraded else budget)
            admitted = True
            # 2. Its first chunk, within what is left of the first-token deadline.
            first = await asyncio.wait_for(stream.__anext__(), budget - (clock() - t_admit))
        except asyncio.CancelledError:
            cancel_call(stream)
            raise
        except StopAsyncIteration:
            raise Unservable(Reason.ENGINE_ERROR, cfg.retry_after_s, "The engine returned nothing.") from None
        except TimeoutError:
            cancel_call(stream)  # frees the queue slot or the engine work
            if not admitted and health.degraded:
                raise decode_unavailable(cfg.unavailable_retry_after_s) from None
            if not admitted:
                # Queued past the first-token budget behind busy replicas: overload, not a
                # death. Only a replica death (below) switches the ingress to fail-fast, else
                # one slow queue on saturated replicas would refuse everything after it.
                raise overloaded(cfg.retry_after_s) from None
            raise Unservable(Reason.DEADLINE, cfg.retry_after_s) from None
        except BackPressureError as exc:
            retry_after = int(getattr(exc, "retry_after_s", 0) or cfg.retry_after_s)
            raise overloaded(retry_after) from None
        except Exception as exc:
            cancel_call(stream)
            reason = classify(exc)
            if reason is not Reason.REPLICA_DIED:
                raise
            health.trouble()
            logger.warning("decode replica lost before the first byte: %r", exc)
            if attempts < cfg.decode_attempts:
                on_retry(Reason.DECODE_DIED)
                continue
            raise decode_unavailable(cfg.unavailable_retry_after_s) from None
        if is_server_error(first_item(first)):
            cancel_call(stream)
            if attempts < cfg.decode_attempts:
                on_retry(Reason.ENGINE_ERROR)
                continue
            raise Unservable(Reason.ENGINE_ERROR, cfg.retry_after_s)
        health.ok()
        return first, stream


# The harness's request header: cut this stream after k generated tokens (Migration.cut_after),
# read only where TEST_HOOKS_ENV is "1".
CUT_AFTER_HEADER = "x-pd-test-cut-after"


class Abandon:
    """What a started stream's generator releases in its `finally`, for one that never ran:
    a client gone before the first chunk was asked for (Starlette cancels the sending task at
    a disconnect) leaves the generator unstarted, and an unstarted generator's `finally` never
    runs. Called when the response's ASGI call ends; it does nothing once the generator ran:
    the engine's call cancelled (vLLM aborts the request) and the events' closers run (the
    router's in-flight entry and the usage it meters)."""

    def __init__(self, stream: Any, events: EventPipeline):
        self.stream = stream
        self.events = events
        self.started = False

    def __call__(self) -> None:
        if self.started:
            return
        self.started = True
        cancel_call(self.stream)
        self.events.close()


async def guarded_stream(
    first: Any,
    stream: Any,
    *,
    deadline_at: float,
    to_packet: Callable[[Any], str],
    migration: Migration | None = None,
    events: EventPipeline | None = None,
    abandon: Abandon | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[str]:
    """SSE packets of an already-started stream, cut at the total deadline.

    A stream whose decode replica dies, answers a 5xx error event or stalls after the first
    byte continues on another replica when `migration` allows it (the client sees one
    stream); otherwise, and at the deadline, it ends with an OpenAI-style error event. A client
    gone or a stream ended early cancels the downstream request (`abandon`: one never started).
    Each packet's events are decoded once (serving.ingress.sse.EventPipeline): the migration
    record and the router's metering read and edit the same dicts; a packet (one of Ray Serve
    LLM's batches) goes on as one chunk.
    """
    if abandon is not None:
        abandon.started = True  # from here this generator's own `finally` releases the stream
    done_sent = False
    finished = False
    record = migration.record if migration else None
    pipe = events if events is not None else EventPipeline()
    if record is not None:
        pipe.step = record.relay_event
    current, item = stream, first
    try:
        while True:
            cut: Reason | None = None
            if item is None:
                try:
                    item, cut = await _next(current, deadline_at, migration, clock)
                except StopAsyncIteration:
                    break
            if cut is None:
                packet, item = to_packet(item), None
                sent = _relayed(packet, pipe, server_errors=migration is not None)
                if sent is not None:
                    text, done = sent
                    done_sent = done_sent or done
                    if text:
                        yield text
                    if record is not None and record.stopped and not done_sent:
                        # The ingress matched a stop string (a continuation's engine does not
                        # see one that straddles the cut): the answer is complete.
                        cancel_call(current)
                        yield pipe.own(finish_events(record))
                        finished = done_sent = True
                        return
                    if done_sent or migration is None or not migration.forced_cut():
                        continue
                cut = Reason.STALL if sent is not None else Reason.ENGINE_ERROR
            assert migration is not None
            cancel_call(current)
            resumed = await continue_stream(migration, cut)
            if isinstance(resumed, OwnEvents):
                yield pipe.own(resumed)  # the finish, or the error event: the stream ends here
                finished = done_sent = True
                return
            item, current = resumed
            if migration.record:
                pipe.step = migration.record.reframe_event
        if not done_sent:
            yield pipe.own(DONE_EVENTS)
        finished = True
    except TimeoutError:
        yield pipe.own(error_events("The request deadline passed during generation.", 504, "timeout_error"))
    except Exception as exc:
        logger.warning("stream failed after the first byte: %r", exc)
        yield pipe.own(error_events("The model stream failed; the answer is incomplete.", 500))
    finally:
        try:
            if not finished:
                cancel_call(current)
        finally:
            pipe.close()


async def _next(
    stream: Any, deadline_at: float, migration: Migration | None, clock: Callable[[], float]
) -> tuple[Any, Reason | None]:
    """(the stream's next item, None), or (None, why it is cut: a stall of stallTimeoutS, a
    dead replica); StopAsyncIteration at its end, TimeoutError at the deadline. A dead replica
    is a cut wherever a migration is set up (its cut ends with an error event at least); a
    stall only where a continuation can follow: elsewhere the stream may still recover."""
    stall_s = migration.stall_timeout_s if migration and migration.record else None
    cut_on_death = migration is not None
    remaining = deadline_at - clock()
    if remaining <= 0:
        raise TimeoutError
    try:
        # A timer on this task, not asyncio.wait_for: in Python 3.11 that runs each awaited call
        # as a new task (a task, a future and one more event-loop turn for every packet).
        async with asyncio.timeout(remaining if stall_s is None else min(remaining, stall_s)):
            item = await stream.__anext__()
        return item, None
    except StopAsyncIteration:
        raise
    except TimeoutError:
        if stall_s is None or clock() >= deadline_at:
            raise
        return None, Reason.STALL
    except Exception as exc:
        if not cut_on_death or classify(exc) is not Reason.REPLICA_DIED:
            raise
        logger.warning("decode replica lost mid-stream: %r", exc)
        return None, Reason.REPLICA_DIED


def _relayed(packet: str, pipe: EventPipeline, *, server_errors: bool) -> tuple[str, bool] | None:
    """(text to send, whether it ends the stream with [DONE]) for one packet of the engine's
    stream; None when it is a 5xx error event (looked for where a migration can follow)."""
    if not pipe.reads:  # nothing reads the events: the packet goes on as it came, undecoded
        if server_errors and is_server_error(packet):
            return None
        return packet, packet.rstrip().endswith("data: [DONE]")
    decoded = decode_packet(packet)
    if server_errors and server_error_in(packet, (ev.doc for ev in decoded)):
        return None
    return pipe.engine(packet, decoded)


class Relay:
    """The relay of one ingress replica: its decode health, counters and deadlines."""

    def __init__(self, cfg: ResilienceSpec):
        self.cfg = cfg
        self.health = DecodeHealth()
        self._retries = metrics.counter(metrics.INGRESS_RETRIES)
        self._migrations = metrics.counter(metrics.STREAM_MIGRATIONS)
        # The harness's forced cut (CUT_AFTER_HEADER) in a replica started for it only.
        self._test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"

    async def first(self, dispatch: Callable[[], Any], started: float, streamed: bool) -> tuple[Any, Any]:
        return await first_chunk(
            dispatch,
            cfg=self.cfg,
            health=self.health,
            started=started,
            is_server_error=is_server_error,
            on_retry=lambda r: self._retries.inc(tags={"reason": r.value}),
            streamed=streamed,
        )

    async def answer(
        self,
        *,
        endpoint: str,
        body: Any,
        fields: Mapping[str, Any],
        handle: Callable[[], Any],
        raw_request: Any,
        model_id: str,
        started: float,
        record: StreamRecord | None = None,
    ) -> Any:
        """The engines' answer to `body` (the typed request, built from the client's
        `fields` and, for a stream that can be continued, its `record`'s engine fields): a
        JSONResponse or an EventStreamResponse; raises Unservable before the first byte,
        EngineRefused for an engine 4xx."""
        from starlette.responses import JSONResponse

        from serving import ray_internals as ri

        cfg = self.cfg
        streamed = bool(getattr(body, "stream", False))
        migration = (
            self._migration(endpoint, fields, record, handle, raw_request, model_id, started) if streamed else None
        )

        def dispatch() -> Any:
            return dispatch_call(handle(), body, endpoint, raw_request)

        first, stream = await self.first(dispatch, started, streamed)
        head = first_item(first)
        if is_client_error(head):
            # A 4xx from the engine (bad parameters): the client's to fix, not retried.
            cancel_call(stream)
            raise EngineRefused(head.error.code or 400, head.error.message)
        if isinstance(head, ri.NON_STREAMING_RESPONSE_TYPES):
            # The engines' KV-transfer coordinates are internal: never in an answer.
            return JSONResponse(content=head.model_dump(exclude={"kv_transfer_params", "ec_transfer_params"}))
        # guarded_stream decodes each event once; the router adds its reading of them to
        # `events` (metering) instead of decoding the stream again.
        events = EventPipeline()
        abandon = Abandon(stream, events)
        return EventStreamResponse(
            guarded_stream(
                first,
                stream,
                deadline_at=started + cfg.total_timeout_s,
                to_packet=ri.openai_sse_packet,
                migration=migration,
                events=events,
                abandon=abandon,
            ),
            events=events,
            release=abandon,
            media_type="text/event-stream",
        )

    def continuable(
        self, endpoint: str, fields: Mapping[str, Any], context_len: int | None = None
    ) -> StreamRecord | None:
        """The record of a streamed request that can be continued if its stream is cut, else
        None (migrations off, or a request whose output is shaped whole). Its engine fields
        (token ids, stop strings left to the ingress) go into the engine request.
        `context_len`: the model's context; a chat with no cap runs to its end, and so must
        its continuation (a completion's own default cap is 16), so without it such a chat is
        not continued."""
        if self.cfg.migrations <= 0 or not_continuable(endpoint, fields) is not None:
            return None
        limit = whole_number(fields.get("max_tokens"))
        if endpoint == "completions" and limit is None:
            limit = 16  # vLLM's CompletionRequest default (a null too)
        if endpoint == "chat":
            limit = whole_number(fields.get("max_completion_tokens")) or limit
            if limit is None and context_len is None:
                return None
        return StreamRecord(
            endpoint, fields, limit, client_ids=bool(fields.get("return_token_ids")), context_len=context_len
        )

    def _migration(
        self,
        endpoint: str,
        fields: Mapping[str, Any],
        record: StreamRecord | None,
        handle: Callable[[], Any],
        raw_request: Any,
        model_id: str,
        started: float,
    ) -> Migration | None:
        """How this streamed request continues if its stream is cut (None: migrations off)."""
        from ray.serve.llm.openai_api_models import CompletionRequest

        if self.cfg.migrations <= 0:
            return None
        blocked = None if record is not None else (not_continuable(endpoint, fields) or "no record")

        async def resume(cont: dict[str, Any]) -> tuple[Any, Any]:
            request = CompletionRequest.model_validate({**cont, "model": model_id})

            def dispatch() -> Any:
                return dispatch_call(handle(), request, "completions", raw_request)

            first, stream = await self.first(dispatch, started, True)
            head = first_item(first)
            if is_client_error(head):
                cancel_call(stream)
                raise EngineRefused(head.error.code or 400, head.error.message)
            return first, stream

        def on_outcome(cut: Reason, outcome: MigrationOutcome) -> None:
            self._migrations.inc(tags={"model": model_id, "reason": cut.value, "outcome": outcome.value})

        cut_after = None
        if self._test_hooks and raw_request is not None:
            raw = raw_request.headers.get(CUT_AFTER_HEADER)
            cut_after = int(raw) if raw is not None and raw.isdigit() else None
        return Migration(record, blocked, self.cfg.migrations, self.cfg.stall_timeout_s, resume, on_outcome, cut_after)
