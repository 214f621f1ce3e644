"""What every hop of the resilient serving path shares: reasons, deadlines, refusals.

What flows through here: nothing on its own. The runtime values the spec renders
(serving.spec.ResilienceSpec -> args["resilience"] -> ResilienceConfig), the reason labels of
every retry, fallback and refusal (Reason; the counters are serving/core/metrics.py's), the "cannot serve" answer the ingress
gives before the first byte (Unservable), how a Serve handle failure is classified, and the
small helpers that cancel or close a downstream call and recognise an engine's server error
(a Ray ErrorResponse, or vLLM's in-stream `data: {"error": ...}` event).

The request's path through the hops:
  client -> ingress (serving/ingress/relay.py): total and first-token deadlines, one retry
            when the decode replica dies before the first byte, fail-fast (503 + Retry-After)
            while decode has no live replica, Serve's queue bound -> 503 + Retry-After, the
            downstream call cancelled when the client goes away or a deadline passes.
         -> decode (serving/engines/pd_server.py ResilientPDDecodeServer, with serving/engines/prefill_hop.py):
            the prefill call, first waiting for a replica to take it (a queue bound), then
            under its own deadline from that moment, retried on another prefill replica, then
            -- or straight away while the prefill circuit (serving/engines/circuit.py) is open --
            prefill done locally on the decode engine; each request's path is counted.
         -> prefill (Ray's PDPrefillServer, unchanged).
Deadlines and attempts come from the spec (serving/spec/serving.py, ResilienceSpec, where the
defaults live). Ray internals are reached only through serving/ray_internals.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

logger = logging.getLogger("ray.serve")


class Reason(str, enum.Enum):
    """Why a hop failed or a request was refused (the metrics' `reason` label)."""

    # prefill hop (decode side)
    REPLICA_DIED = "replica_died"
    NO_REPLICA = "no_replica"  # Serve reports no running replica of the deployment
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
    # a started stream sent nothing for stallTimeoutS (serving/ingress/migration.py continues it)
    STALL = "stall"

    @classmethod
    def designed_local(cls) -> tuple[Reason, ...]:
        """Reasons a P/D request prefills on decode by design (the request's shape), not
        because the remote path failed: not faults, and not counted against the circuit."""
        return (cls.PARALLEL_SAMPLING,)


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
    migrations: int
    stall_timeout_s: float
    circuit_open_s: float
    circuit_failures: int
    retry_after_s: int
    # Retry-After of a 503 while decode has no running replica: the planner's time to serve
    # when decode may scale to zero (serving.spec ResilienceSpec.cold_start_retry_after_s).
    # None (args rendered before it existed): retry_after_s.
    cold_start_retry_after_s: int | None = None

    @property
    def unavailable_retry_after_s(self) -> int:
        return self.cold_start_retry_after_s or self.retry_after_s

    @property
    def scale_from_zero_retry_after_s(self) -> int | None:
        """The cold-start Retry-After when it says more than retry_after_s (decode may scale
        to zero), else None."""
        cold = self.cold_start_retry_after_s
        return cold if cold is not None and cold > self.retry_after_s else None

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ResilienceConfig:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        unknown = sorted(set(args) - names)
        missing = sorted(required - set(args))
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


async def assigned(stream: Any) -> None:
    """Returns once Serve's router has given the call to a replica (Ray 2.60
    DeploymentResponseGenerator._fetch_future_result_async, see ray_internals); streams
    without that step count as assigned."""
    fetch = getattr(stream, "_fetch_future_result_async", None)
    if fetch is not None:
        await fetch()


def cancel_call(stream: Any) -> None:
    """Stop a downstream call: Serve's response streams have cancel() (the replica then
    cancels the request, and vLLM aborts it); a plain async generator is closed."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
    elif hasattr(stream, "aclose"):
        in_background(aclose_quietly(stream))


def first_item(item: Any) -> Any:
    return item[0] if isinstance(item, list) and item else item


_background: set[asyncio.Future[Any]] = set()  # keeps fire-and-forget tasks alive until they finish


def in_background(aw: Awaitable[Any]) -> None:
    """Run `aw` on the current loop without awaiting it (closing a stream or a client), held
    until it finishes: asyncio keeps only weak references to tasks."""
    task = asyncio.ensure_future(aw)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def aclose_quietly(gen: Any) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):  # closing a failed stream must not raise
            await close()


def sse_error_doc(message: str, code: int | str, type_: str = "server_error") -> dict[str, Any]:
    """The JSON of an OpenAI-style error event."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def sse_error(message: str, code: int | str, type_: str = "server_error", *, done: bool = True) -> str:
    """An OpenAI-style error event for a stream that already sent bytes, plus [DONE] (unless
    `done` is False: the stream already sent it)."""
    return f"data: {json.dumps(sse_error_doc(message, code, type_))}\n\n" + ("data: [DONE]\n\n" if done else "")


def is_server_error(item: Any) -> bool:
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
        code = _error_code(msg)
        if code is not None:
            return code
    return None


def server_error_in(packet: str, docs: Iterable[Any]) -> bool:
    """`is_server_error(packet)` for a packet whose events' JSON (`docs`) is decoded already."""
    if '"error"' not in packet[:64]:
        return False
    for doc in docs:
        code = _error_code(doc)
        if code is not None:
            return code >= 500
    return False


def _error_code(msg: Any) -> int | None:
    if isinstance(msg, dict) and isinstance(msg.get("error"), dict):
        code = msg["error"].get("code")
        return code if isinstance(code, int) else 500
    return None
