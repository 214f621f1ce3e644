"""The one failure taxonomy of the serving path: why a hop failed, and what the client gets.

What flows through here: an exception raised by a Serve handle call, or a decision of the
ingress that the cluster cannot serve a request -> a `Reason` (`classify`: the label of
every retry, local prefill, refusal and cut stream; the counters are serving/core/metrics.py's)
-> for a request the cluster cannot serve before its first byte, an `Unservable` whose
reason carries its answer (`REFUSALS`: HTTP status, message, and which `fallback.when` case
sends it to the external fallback instead). `as_unservable` is the one mapping from what a
cluster call raised to that answer; serving/ingress/errors.py turns it into the OpenAI
error shape, serving/ingress/routing.py reads its fallback rule. A 4xx from the engine
(`EngineRefused`) is the client's answer: never retried, never a fault.

The request's path through the hops:
  client -> ingress (serving/ingress/relay.py): total and first-token deadlines, one retry
            when the decode replica dies before the first byte, fail-fast (503 + Retry-After)
            while decode has no live replica, Serve's queue bound -> 503 + Retry-After, the
            downstream call cancelled when the client goes away or a deadline passes.
         -> decode (serving/engines/pd_server.py, with serving/engines/prefill_hop.py): the
            prefill call under its queue bound and deadline, retried on another prefill
            replica, then -- or straight away while the prefill circuit is open -- prefill
            done locally on the decode engine; each request's path is counted.
         -> prefill (Ray's PDPrefillServer, unchanged).
Standard library only at import time (the Pulumi program reads the reasons' label values).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass


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
    # A completion with a list of prompts: vLLM's completion server returns only the first
    # prompt's kv_transfer_params from prefill (vllm 0.32 entrypoints/openai/completion/
    # serving.py), and `to_sampling_params` hands that one to every prompt's decode request,
    # whose NIXL worker then reads one prompt's blocks for all. Prefilled locally, on purpose.
    PROMPT_BATCH = "prompt_batch"
    # The prefill replica's own code raised for this request (a LoRA adapter that does not
    # load, a value Ray's or vLLM's code refuses): the request's error, not the tier's. Not
    # counted against the circuit, not retried; decode runs the request and answers it as an
    # aggregated engine would (`prefill_failure`).
    REQUEST_ERROR = "request_error"
    # ingress hop
    DECODE_DIED = "decode_died"
    DECODE_UNAVAILABLE = "decode_unavailable"
    DEADLINE = "deadline"
    ENGINE_ERROR = "engine_error"
    # a started stream sent nothing for stallTimeoutS (serving/ingress/migration.py continues it)
    STALL = "stall"

    @classmethod
    def designed_local(cls) -> tuple[Reason, ...]:
        """Reasons a P/D request prefills on decode because of the request itself (its shape,
        or its own error), not because the remote path failed: not faults, not counted
        against the circuit, and not a sign that the stack runs aggregated."""
        return (cls.PARALLEL_SAMPLING, cls.PROMPT_BATCH, cls.REQUEST_ERROR)


OVERLOADED_MESSAGE = "The server is overloaded; retry later."
UNAVAILABLE_MESSAGE = "No model replica is available right now; retry shortly."
# A model whose application Serve has not deployed yet (it deploys a config's applications
# side by side): retry soon.
MODEL_STARTING_MESSAGE = "The model is not available yet; retry later."
MODEL_STARTING_RETRY_S = 5


@dataclass(frozen=True)
class Refusal:
    """How the ingress answers a request the cluster cannot serve, for one reason."""

    status: int
    message: str
    # The `fallback.when` case (serving.spec FallbackWhen values) that hands it to the external
    # fallback instead, when the stack configures one; None: never.
    fallback: str | None


REFUSALS: dict[Reason, Refusal] = {
    Reason.OVERLOADED: Refusal(503, OVERLOADED_MESSAGE, "overloaded"),
    Reason.DECODE_UNAVAILABLE: Refusal(503, UNAVAILABLE_MESSAGE, "unavailable"),
    Reason.ENGINE_ERROR: Refusal(503, "The model failed to answer; retry shortly.", "unavailable"),
    Reason.DEADLINE: Refusal(504, "No first token before the deadline; retry later.", "deadline"),
}


class Unservable(Exception):
    """The cluster cannot serve this request (before any byte went to the client). Its
    status and fallback rule come from `REFUSALS`; `message` may say more than the default."""

    def __init__(self, reason: Reason, retry_after_s: int, message: str | None = None):
        refusal = REFUSALS[reason]
        super().__init__(message or refusal.message)
        self.reason = reason
        self.status = refusal.status
        self.message = message or refusal.message
        self.retry_after_s = retry_after_s

    @property
    def fallback_when(self) -> str | None:
        """The `fallback.when` case that takes this request, if the stack lists it."""
        return REFUSALS[self.reason].fallback

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}


def overloaded(retry_after_s: int) -> Unservable:
    return Unservable(Reason.OVERLOADED, retry_after_s)


def decode_unavailable(retry_after_s: int) -> Unservable:
    return Unservable(Reason.DECODE_UNAVAILABLE, retry_after_s)


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


# What an engine replica's code raises when the replica itself is broken, whatever the request:
# vLLM's server-side errors (vllm/exceptions.py `VLLMServerError`, vLLM 0.32: the engine core
# died, `EngineDeadError`; a failed generate, `EngineGenerateError`). Matched by class name
# along the cause's MRO, so this module imports no vLLM.
TIER_ERROR_CLASSES = frozenset({"VLLMServerError"})


def prefill_failure(exc: BaseException) -> Reason:
    """Why a prefill call raised `exc`: the tier's failure (REPLICA_DIED, TIMEOUT, OVERLOADED,
    ERROR: the prefill circuit hears of it) or the request's own (REQUEST_ERROR: it does not).

    A replica's code that raised ran the request: Serve hands its exception to the caller as
    Ray's RayTaskError, an instance of the cause's class too (ray/exceptions.py
    `as_instanceof_cause`, Ray 2.60). That is the request's error (a LoRA adapter that fails
    to load raises in LLMServer._run_request before the engine sees the request, the same on
    decode), unless its cause is one of TIER_ERROR_CLASSES. Whatever else fails a call (a dead
    or unreachable replica, Serve's own errors) is the tier's."""
    reason = classify(exc)
    if reason is not Reason.ERROR:
        return reason
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        if not {c.__name__ for c in type(cause).__mro__} & TIER_ERROR_CLASSES:
            return Reason.REQUEST_ERROR
    return Reason.ERROR


def as_unservable(exc: BaseException, retry_after_s: int) -> Unservable | None:
    """What a failed cluster call before its first byte means for the client, or None when
    it is not the cluster's inability to serve (a client error, a bug: answered as such)."""
    if isinstance(exc, Unservable):
        return exc
    reason = classify(exc)
    if reason is Reason.TIMEOUT:
        return Unservable(Reason.DEADLINE, retry_after_s)
    if reason is Reason.OVERLOADED:
        retry = int(getattr(exc, "retry_after_s", 0) or retry_after_s)
        return Unservable(Reason.OVERLOADED, retry)
    if reason is Reason.REPLICA_DIED:
        return Unservable(Reason.DECODE_UNAVAILABLE, retry_after_s)
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        if status == 408:
            return Unservable(Reason.DEADLINE, retry_after_s)
        if status == 503:
            return Unservable(Reason.OVERLOADED, retry_after_s)
        if status >= 500:
            return Unservable(Reason.ENGINE_ERROR, retry_after_s)
    return None
