"""Serving that survives faults and overload: deadlines, retries, fallbacks, fast refusals.

What flows through here: every chat/completions request of the P/D application.
  client -> ingress (ResilientIngressMixin): total deadline, first-token deadline, one retry
            when the decode replica dies before the first byte, fail-fast (503 + Retry-After)
            while decode has no live replica, Serve's queue bound -> 503 + Retry-After, the
            downstream call cancelled when the client goes away or a deadline passes.
         -> decode (ResilientPDDecodeServer): the prefill call, first waiting for a replica
            to take it (a queue bound), then under its own deadline from that moment,
            retried on another prefill replica, then -- or straight away while the prefill
            circuit (serving/circuit.py) is open -- prefill done locally on the decode engine
            (the request runs aggregated there, without kv_transfer_params); a streamed
            decode that gets no first token within the KV-ready deadline while the replica
            had a free sequence slot is aborted (vLLM frees its blocks) and rerun locally.
            Each request's path (remote, remote after a retry, local and why) is counted.
         -> prefill (Ray's PDPrefillServer, unchanged).
Deadlines and attempts come from the spec (serving/spec.py, ResilienceSpec, where the
defaults live) through args["resilience"]. Every retry, fallback and refusal is counted in a
Ray Serve metric with its reason (see METRICS).

`Unservable` is the hook for "the cluster cannot serve this request": before the first byte,
the ingress calls `on_unservable(body, raw_request, failure)`; a subclass (the external
fallback router) may return a Response, else the client gets the JSON error.

Ray internals are reached only through serving/ray_internals.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from serving.circuit import Circuit

logger = logging.getLogger("ray.serve")

# Prometheus names, as Ray exports them: "ray_" + name + "_total" for counters.
METRICS = {
    "prefill_path": "pd_prefill_path",
    "prefill_retries": "pd_prefill_retries",
    "local_prefill": "pd_local_prefill_fallbacks",
    "ingress_retries": "pd_ingress_retries",
    "ingress_refusals": "pd_ingress_refusals",
}


class Reason(str, enum.Enum):
    """Why a hop failed or a request was refused (the metrics' `reason` label)."""

    # prefill hop (decode side)
    REPLICA_DIED = "replica_died"
    TIMEOUT = "timeout"
    ERROR = "error"
    OVERLOADED = "overloaded"
    CIRCUIT_OPEN = "circuit_open"
    KV_TIMEOUT = "kv_timeout"
    KV_LOAD_ERROR = "kv_load_error"
    # n > 1: vLLM's parallel sampling shallow-copies SamplingParams (vllm/v1/engine/
    # parallel_sampling.py, ParentRequest), so the n children share ONE kv_transfer_params
    # dict; NIXL's scheduler marks it consumed after the first child's transfer and the
    # other n - 1 prefill on decode anyway. Such a request prefills locally from the start
    # (its children then share the prompt's blocks through the prefix cache).
    PARALLEL_SAMPLING = "parallel_sampling"
    # ingress hop
    DECODE_DIED = "decode_died"
    DECODE_UNAVAILABLE = "decode_unavailable"
    DEADLINE = "deadline"
    ENGINE_ERROR = "engine_error"


@dataclass(frozen=True)
class ResilienceConfig:
    """Runtime values rendered by serving.spec.ResilienceSpec.runtime_args() (seconds)."""

    prefill_timeout_s: float
    prefill_queue_timeout_s: float
    prefill_attempts: int
    kv_ready_timeout_s: float
    first_token_timeout_s: float
    total_timeout_s: float
    fail_fast_s: float
    decode_attempts: int
    circuit_open_s: float
    circuit_failures: int
    retry_after_s: int

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ResilienceConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - names)
        missing = sorted(names - set(args))
        if unknown or missing:
            raise ValueError(f"args.resilience: unknown keys {unknown or 'none'}, missing keys {missing or 'none'}")
        return cls(**dict(args))


class Unservable(Exception):
    """The cluster cannot serve this request (before any byte went to the client)."""

    def __init__(self, reason: Reason, status: int, message: str, retry_after_s: int):
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}


OVERLOADED_MESSAGE = "The server is overloaded; retry later."
UNAVAILABLE_MESSAGE = "No model replica is available right now; retry shortly."


def overloaded(retry_after_s: int) -> Unservable:
    return Unservable(Reason.OVERLOADED, 503, OVERLOADED_MESSAGE, retry_after_s)


def decode_unavailable(retry_after_s: int) -> Unservable:
    return Unservable(Reason.DECODE_UNAVAILABLE, 503, UNAVAILABLE_MESSAGE, retry_after_s)


class EngineRefused(Exception):
    """The engine answered the request with a client error (4xx): passed on as is.
    Carries status_code and message like Ray's OpenAIHTTPException."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def classify(exc: BaseException) -> Reason:
    """The reason label for an exception raised by a Serve handle call."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return Reason.TIMEOUT
    if isinstance(exc, BackPressureError):
        return Reason.OVERLOADED
    if isinstance(exc, (RayActorError, ActorUnavailableError, DeploymentUnavailableError)):
        return Reason.REPLICA_DIED
    # Serve wraps an upstream replica crash in a RayServeException naming ActorDiedError.
    if "ActorDiedError" in repr(exc) or "actor died" in str(exc).lower():
        return Reason.REPLICA_DIED
    return Reason.ERROR


class CircuitOpened(Exception):
    """Another request found the remote prefill broken while this one waited."""


class QueueTimeout(TimeoutError):
    """No prefill replica took the call within prefill_queue_timeout_s (busy, not broken)."""


async def _race(aw: Awaitable[Any], timeout_s: float, circuit: Circuit) -> Any:
    """`aw`'s result within `timeout_s`, unless the circuit opens first (CircuitOpened)."""
    nxt = asyncio.ensure_future(aw)
    trip = asyncio.ensure_future(circuit.tripped())
    try:
        done, _ = await asyncio.wait({nxt, trip}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        nxt.cancel()
        raise
    finally:
        trip.cancel()
    if nxt in done:
        return nxt.result()
    nxt.cancel()
    if trip in done:
        raise CircuitOpened
    raise TimeoutError


async def _prefill_first(stream: Any, cfg: ResilienceConfig, circuit: Circuit) -> Any:
    """The prefill call's first (only) chunk. Two clocks: a replica must take the call within
    prefill_queue_timeout_s (else QueueTimeout: the prefill tier is busy), and then answer
    within prefill_timeout_s, timed from when it took the call, so queueing under load is
    never mistaken for a broken replica."""
    try:
        await _race(_assigned(stream), cfg.prefill_queue_timeout_s, circuit)
    except TimeoutError:
        raise QueueTimeout from None
    return await _race(stream.__anext__(), cfg.prefill_timeout_s, circuit)


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


# --- decode side: the prefill hop ------------------------------------------------------
class Path(str, enum.Enum):
    """How a P/D request was prefilled (the `path` label of pd_prefill_path)."""

    REMOTE = "remote"  # the prefill tier, first attempt: the designed mode
    REMOTE_RETRY = "remote_retry"  # the prefill tier, after a failed attempt
    LOCAL = "local"  # on the decode engine (aggregated); the reason label says why


@dataclass
class PrefillOutcome:
    chunk: Any = None
    reason: Reason | None = None  # set when falling back to local prefill
    attempts: int = 0  # prefill calls made

    @property
    def path(self) -> Path:
        if self.reason is not None:
            return Path.LOCAL
        return Path.REMOTE if self.attempts <= 1 else Path.REMOTE_RETRY


async def remote_prefill(
    call: Callable[[], Any],
    *,
    is_error: Callable[[Any], bool],
    cfg: ResilienceConfig,
    circuit: Circuit,
    on_retry: Callable[[Reason], None],
) -> PrefillOutcome:
    """Run the prefill call under its deadlines, retrying; the outcome says fall back or not.

    `call()` starts one prefill request and returns its response stream (a Serve
    DeploymentResponseGenerator: async-iterable with .cancel()). A failed or late call is
    cancelled, so the prefill engine drops it. A replica death, an error or a stall (no
    answer within prefill_timeout_s after a replica took the call) counts against the
    circuit and is retried (Serve routes the retry away from a dead replica); a call no
    replica takes in time, or Serve's back-pressure, means the prefill tier is busy, not
    broken: no retry, no verdict on the circuit (except for the probe, which must prove the
    tier works). The probe is never retried: its failure opens the circuit again.
    """
    if not circuit.allow():
        return PrefillOutcome(reason=Reason.CIRCUIT_OPEN)
    probe = circuit.probing  # allowed while not closed: this request is the half-open probe
    reason = Reason.ERROR
    verdict = False
    attempts = 0
    try:
        for attempt in range(cfg.prefill_attempts):
            if attempt and circuit.is_open:
                reason = Reason.CIRCUIT_OPEN
                break
            attempts += 1
            stream = call()
            try:
                chunk = await _prefill_first(stream, cfg, circuit)
            except asyncio.CancelledError:
                _cancel(stream)
                raise
            except CircuitOpened:
                _cancel(stream)
                reason = Reason.CIRCUIT_OPEN
                break
            except QueueTimeout:
                _cancel(stream)
                reason = Reason.OVERLOADED
            except Exception as exc:
                _cancel(stream)
                reason = classify(exc)
                logger.warning("prefill attempt %d failed (%s): %r", attempt + 1, reason.value, exc)
            else:
                if not is_error(chunk):
                    circuit.success()
                    verdict = True
                    return PrefillOutcome(chunk=chunk, attempts=attempts)
                reason = Reason.ERROR
                logger.warning("prefill attempt %d returned an error: %s", attempt + 1, chunk)
            if reason is Reason.OVERLOADED and not probe:
                break
            circuit.failure(probe=probe)
            if probe:
                verdict = True
                break
            if attempt + 1 < cfg.prefill_attempts and not circuit.is_open:
                on_retry(reason)
        return PrefillOutcome(reason=reason, attempts=attempts)
    finally:
        if probe and not verdict:
            circuit.release()


async def first_then_rest(gen: AsyncIterator[Any], timeout_s: float | None) -> tuple[Any, AsyncIterator[Any]]:
    """The first item of `gen` within `timeout_s` (None: no limit), and the rest."""
    if timeout_s is None:
        first = await gen.__anext__()
    else:
        first = await asyncio.wait_for(gen.__anext__(), timeout_s)
    return first, gen


async def orchestrate(
    *,
    prefill: Callable[[], Awaitable[PrefillOutcome]],
    decode_with: Callable[[Any], Awaitable[AsyncIterator[Any]]],
    decode_local: Callable[[], Awaitable[AsyncIterator[Any]]],
    is_server_error: Callable[[Any], bool],
    kv_ready_timeout_s: Callable[[], float | None],
    on_path: Callable[[Path, Reason | None], None],
    local_reason: Reason | None = None,
) -> AsyncIterator[Any]:
    """Remote prefill then decode; local prefill on decode when the remote path fails.

    `kv_ready_timeout_s()` is asked when the decode request starts: the time its first item
    may take (KV pulled from prefill), or None for no bound. `local_reason` set: prefill
    locally straight away (a request the remote path cannot serve well). `on_path` is told
    once how the request was prefilled. Nothing is yielded before the decode engine
    produced its first item, so a fallback never duplicates output.
    """
    if local_reason is not None:
        outcome = PrefillOutcome(reason=local_reason)
    else:
        outcome = await prefill()
    if outcome.reason is None:
        gen = await decode_with(outcome.chunk)
        try:
            first, gen = await first_then_rest(gen, kv_ready_timeout_s())
        except StopAsyncIteration:
            on_path(outcome.path, None)
            return
        except asyncio.CancelledError:
            await _aclose(gen)
            raise
        except TimeoutError:
            await _aclose(gen)  # aborts the engine request: vLLM frees its KV blocks
            outcome.reason = Reason.KV_TIMEOUT
        else:
            if is_server_error(_first(first)):
                await _aclose(gen)
                outcome.reason = Reason.KV_LOAD_ERROR
            else:
                on_path(outcome.path, None)
                yield first
                async for item in gen:
                    yield item
                return
    assert outcome.reason is not None
    on_path(Path.LOCAL, outcome.reason)
    logger.warning("prefill locally on decode (%s)", outcome.reason.value)
    async for item in await decode_local():
        yield item


async def _assigned(stream: Any) -> None:
    """Returns once Serve's router has given the call to a replica (Ray 2.60
    DeploymentResponseGenerator._fetch_future_result_async, see ray_internals); streams
    without that step count as assigned."""
    fetch = getattr(stream, "_fetch_future_result_async", None)
    if fetch is not None:
        await fetch()


def _cancel(stream: Any) -> None:
    """Stop a downstream call: Serve's response streams have cancel() (the replica then
    cancels the request, and vLLM aborts it); a plain async generator is closed."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
    elif hasattr(stream, "aclose"):
        task = asyncio.ensure_future(_aclose(stream))
        _closing.add(task)
        task.add_done_callback(_closing.discard)


def _first(item: Any) -> Any:
    return item[0] if isinstance(item, list) and item else item


_closing: set[asyncio.Future[None]] = set()  # keeps close tasks alive until they finish


async def _aclose(gen: Any) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):  # closing a failed stream must not raise
            await close()


# --- ingress side -----------------------------------------------------------------------
def sse_error(message: str, code: int, type_: str = "server_error") -> str:
    """An OpenAI-style error event for a stream that already sent bytes, plus [DONE]."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


async def first_chunk(
    dispatch: Callable[[], Any],
    *,
    cfg: ResilienceConfig,
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
            raise Unservable(Reason.DEADLINE, 504, "The request deadline passed.", cfg.retry_after_s)
        stream = dispatch()
        admitted = False
        try:
            # 1. A replica takes the call. While a decode replica is known lost, a live one
            #    must take it at once, else there is none (restarts take minutes): say so now.
            # A non-streamed answer comes whole: only the total deadline bounds it.
            budget = min(remaining, cfg.first_token_timeout_s) if streamed else remaining
            t_admit = clock()
            await asyncio.wait_for(_assigned(stream), min(budget, cfg.fail_fast_s) if health.degraded else budget)
            admitted = True
            # 2. Its first chunk, within what is left of the first-token deadline.
            first = await asyncio.wait_for(stream.__anext__(), budget - (clock() - t_admit))
        except asyncio.CancelledError:
            _cancel(stream)
            raise
        except StopAsyncIteration:
            raise Unservable(Reason.ENGINE_ERROR, 503, "The engine returned nothing.", cfg.retry_after_s) from None
        except TimeoutError:
            _cancel(stream)  # frees the queue slot or the engine work
            if not admitted and health.degraded:
                raise decode_unavailable(cfg.retry_after_s) from None
            if not admitted:
                # Queued past the first-token budget behind busy replicas: overload, not a
                # death. Only a replica death (below) switches the ingress to fail-fast, else
                # one slow queue on saturated replicas would refuse everything after it.
                raise overloaded(cfg.retry_after_s) from None
            raise Unservable(
                Reason.DEADLINE,
                504,
                "No first token before the deadline; retry later.",
                cfg.retry_after_s,
            ) from None
        except BackPressureError as exc:
            retry_after = int(getattr(exc, "retry_after_s", 0) or cfg.retry_after_s)
            raise overloaded(retry_after) from None
        except Exception as exc:
            _cancel(stream)
            reason = classify(exc)
            if reason is not Reason.REPLICA_DIED:
                raise
            health.trouble()
            logger.warning("decode replica lost before the first byte: %r", exc)
            if attempts < cfg.decode_attempts:
                on_retry(Reason.DECODE_DIED)
                continue
            raise decode_unavailable(cfg.retry_after_s) from None
        if is_server_error(_first(first)):
            _cancel(stream)
            if attempts < cfg.decode_attempts:
                on_retry(Reason.ENGINE_ERROR)
                continue
            raise Unservable(
                Reason.ENGINE_ERROR,
                503,
                "The model failed to answer; retry shortly.",
                cfg.retry_after_s,
            )
        health.ok()
        return first, stream


async def guarded_stream(
    first: Any,
    stream: Any,
    *,
    deadline_at: float,
    to_packet: Callable[[Any], str],
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[str]:
    """SSE packets of an already-started stream, cut at the total deadline.

    After the first byte nothing is retried: a failure or the deadline ends the stream
    with an OpenAI-style error event. If the client goes away (the task is cancelled) or
    the stream ends early, the downstream request is cancelled so the engine stops.
    """
    done_sent = False
    finished = False
    try:
        packet = to_packet(first)
        done_sent = packet.rstrip().endswith("data: [DONE]")
        yield packet
        while True:
            remaining = deadline_at - clock()
            if remaining <= 0:
                raise TimeoutError
            try:
                item = await asyncio.wait_for(stream.__anext__(), remaining)
            except StopAsyncIteration:
                break
            packet = to_packet(item)
            done_sent = done_sent or packet.rstrip().endswith("data: [DONE]")
            yield packet
        if not done_sent:
            yield "data: [DONE]\n\n"
        finished = True
    except TimeoutError:
        yield sse_error("The request deadline passed during generation.", 504, "timeout_error")
    except Exception as exc:
        logger.warning("stream failed after the first byte: %r", exc)
        yield sse_error("The model stream failed; the answer is incomplete.", 500)
    finally:
        if not finished:
            _cancel(stream)


class ResilientIngressMixin:
    """Chat/completions through `first_chunk` and `guarded_stream`; put it before
    OpenAiIngress in the bases. Other endpoints keep Ray's behaviour.

    `on_unservable` is the hook for "the cluster cannot serve this request": override it
    (e.g. route to an external API) by returning a Response; None sends the JSON error.
    """

    _resilience: ResilienceConfig
    _decode_health: DecodeHealth

    def _init_resilience(self, resilience: Mapping[str, Any]) -> None:
        from ray.serve.metrics import Counter

        self._resilience = ResilienceConfig.from_args(resilience)
        self._decode_health = DecodeHealth()
        self._retry_counter = Counter(
            METRICS["ingress_retries"],
            description="Requests the ingress sent to decode again before the first byte, by reason.",
            tag_keys=("reason",),
        )
        self._refusal_counter = Counter(
            METRICS["ingress_refusals"],
            description="Requests the cluster could not serve (503/504 or fallback), by reason.",
            tag_keys=("reason", "status"),
        )

    async def on_unservable(self, body: Any, raw_request: Any, failure: Unservable) -> Any:
        """Return a Response to send instead of the error (hybrid routing), or None."""
        return None

    async def chat(self, body, request):
        return await self._resilient_call(body, "chat", request)

    async def completions(self, body, request):
        return await self._resilient_call(body, "completions", request)

    async def _resilient_call(self, body: Any, call_method: str, raw_request: Any):
        from starlette.responses import JSONResponse, StreamingResponse

        from serving import ray_internals as ri

        started = time.monotonic()
        cfg = self._resilience
        model_id = await self._get_model_id(body.model)  # type: ignore[attr-defined]

        def dispatch():
            handle = self._get_configured_serve_handle(model_id)  # type: ignore[attr-defined]
            return _call(handle, body, call_method, raw_request)

        try:
            first, stream = await first_chunk(
                dispatch,
                cfg=cfg,
                health=self._decode_health,
                started=started,
                is_server_error=_is_server_error,
                on_retry=lambda r: self._retry_counter.inc(tags={"reason": r.value}),
                streamed=bool(getattr(body, "stream", False)),
            )
        except Unservable as failure:
            self._refusal_counter.inc(tags={"reason": failure.reason.value, "status": str(failure.status)})
            logger.warning("request refused: %s (%s)", failure.reason.value, failure.status)
            alternative = await self.on_unservable(body, raw_request, failure)
            if alternative is not None:
                return alternative
            raise
        head = _first(first)
        if isinstance(head, ri.ErrorResponse):
            # A 4xx from the engine (bad parameters): the client's to fix, not retried.
            _cancel(stream)
            raise EngineRefused(head.error.code or 400, head.error.message)
        if isinstance(head, ri.NON_STREAMING_RESPONSE_TYPES):
            # The engines' KV-transfer coordinates are internal: never in an answer.
            return JSONResponse(content=head.model_dump(exclude={"kv_transfer_params", "ec_transfer_params"}))
        return StreamingResponse(
            guarded_stream(
                first,
                stream,
                deadline_at=started + cfg.total_timeout_s,
                to_packet=ri.openai_sse_packet,
            ),
            media_type="text/event-stream",
        )


def _call(handle: Any, body: Any, call_method: str, raw_request: Any) -> Any:
    """One streaming call to the model deployment (what OpenAiIngress._get_response does,
    keeping hold of the response so it can be cancelled)."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    from serving import ray_internals as ri

    if raw_request is not None:
        session_id = ri.session_id_from_headers(raw_request.headers)
        if session_id:
            handle = handle.options(session_id=session_id)
    if isinstance(body, ChatCompletionRequest):
        body = ri.sanitize_chat_request(body)
    info = ri.RawRequestInfo.from_starlette_request(raw_request) if raw_request is not None else None
    return getattr(handle, call_method).remote(body, info)


def _is_server_error(item: Any) -> bool:
    """An engine answer that is a server-side failure: Ray's ErrorResponse object, or (in a
    stream) vLLM's in-stream error event, `data: {"error": {...}}` (vLLM's
    OpenAIServing.create_streaming_error_response), with a 5xx code (none: 500)."""
    from serving import ray_internals as ri

    if isinstance(item, ri.ErrorResponse):
        return (item.error.code or 500) >= 500
    code = sse_error_code(item)
    return code is not None and code >= 500


def sse_error_code(item: Any) -> int | None:
    """The code of an SSE error event (`data: {"error": ...}`), else None."""
    if isinstance(item, bytes):
        item = item.decode(errors="replace")
    if not isinstance(item, str) or '"error"' not in item[:64]:
        return None
    for line in item.split("\n"):
        if not line.startswith("data:"):
            continue
        try:
            msg = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(msg, dict) and isinstance(msg.get("error"), dict):
            code = msg["error"].get("code")
            return code if isinstance(code, int) else 500
    return None
