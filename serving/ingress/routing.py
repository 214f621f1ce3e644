"""Hybrid routing in the ingress: access and limits, then the cluster or the external
fallback, then usage.

What flows through here, per chat or completion request that passed auth and parsed as JSON:
  0. the key id (hash of the API key) must be allowed the model the body names
     (`limits.keys.<id>.models`; an adapter `<model>:<adapter>` when its base model is; every
     model when the key lists none or auth is disabled) -> else 404 `model_not_found`,
     before any limit is charged. 404, not 403: it is what OpenAI answers for a model a key
     cannot see ("The model '<id>' does not exist or you do not have access to it."), and
     a 403 would tell a probing client which model ids exist;
  1. the key's requests- and tokens-per-minute limits on that model (its own, the model's, or
     the defaults; counted per key and model) are checked in the application's shared
     ledger (serving.ingress.limits) -> 429 + Retry-After when over;
  2. the routing rules pick a destination:
       unavailable  the deployment that serves the model's tokens (decode, or the aggregated
                    engine) has no running replica (Serve's status); prefill down is not
                    unavailable: decode prefills locally, at no provider cost
       overloaded   ongoing cluster requests per running decode replica >= fallback.overflowAt
     -> the external fallback (serving.ingress.fallback) when the rule's name is in `fallback.when`;
  3. otherwise the cluster (Ray Serve LLM's own path); if it fails BEFORE its first byte
     (Serve's back-pressure, no replica, a dead replica, an engine 5xx, or no first token
     within fallback.firstTokenTimeoutS for a stream) the request goes to the fallback with
     that reason, when configured for it; after the first byte nothing is re-sent anywhere.
     A 503 no fallback takes while decode has no running replica and may scale to zero gets
     the planner's time to serve as Retry-After (args.resilience.cold_start_retry_after_s);
  4. the response is marked `x-served-by: cluster|fallback`; its usage (prompt and completion
     tokens, read from the answer itself) is counted per key id, model and destination, and
     replaces the token reservation in the ledger. A stream of the ingress's own
     (serving.ingress.sse.EventStreamResponse) is read in the same pass as its events are decoded
     for stream migration: the rewriter is added to that pass, not run over the text again.

Configuration arrives as the ingress deployment's `user_config` (`reconfigure`), so changing
limits or the fallback in a stack updates the ingress in place without restarting engines.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.core.cluster_watch import ClusterWatch
from serving.core.failures import UNAVAILABLE_MESSAGE, Reason, Unservable
from serving.ingress.fallback import SERVED_BY, FallbackClient, FallbackConfig, FallbackError
from serving.ingress.limits import UNCHECKED, Decision, Limiter, LimitsConfig, UsageMeter, get_ledger, request_key_id
from serving.ingress.sse import EventStreamResponse, SseRewriter, Usage, ask_for_usage, estimated_usage
from serving.spec import FallbackWhen

logger = logging.getLogger("ray.serve")

UNAVAILABLE = FallbackWhen.UNAVAILABLE.value
OVERLOADED = FallbackWhen.OVERLOADED.value
DEADLINE = FallbackWhen.DEADLINE.value
ErrorFn = Callable[..., JSONResponse]
# How often a request waiting for the cluster's first byte looks at the routing rules again.
WATCH_TICK_S = 0.5
# OpenAI's answer for a model that does not exist or that the key may not use (the same words
# for both, so that a refusal tells no client which ids exist).
MODEL_NOT_FOUND = "The model '{model}' does not exist or you do not have access to it."


def _with_running_usage(body: dict[str, Any]) -> dict[str, Any]:
    """The cluster's copy of a streamed body asks vLLM for usage in every chunk
    (stream_options.continuous_usage_stats), so the tokens of a stream that ends early are
    known; the rewriter strips it from the chunks again. The provider never sees the option."""
    opts = body.get("stream_options")
    if not body.get("stream") or not isinstance(opts, dict):
        return body
    return {**body, "stream_options": {**opts, "continuous_usage_stats": True}}


def reason_for(exc: BaseException) -> str | None:
    """Which `fallback.when` case a failure of the cluster call before its first byte is."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return DEADLINE
    if isinstance(exc, BackPressureError):
        return OVERLOADED
    if isinstance(exc, (DeploymentUnavailableError, RayActorError)):
        return UNAVAILABLE
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        if status == 408:
            return DEADLINE
        if status == 503:
            return OVERLOADED
        if status >= 500:
            return UNAVAILABLE
    return None


@dataclass(frozen=True)
class AdmittedRequest:
    """The request `handle` admitted and is working on (its key id, limits decision, whether the
    client asked for usage, model), for `unservable`, called from deeper in the stack."""

    kid: str
    decision: Decision
    asked_usage: bool
    model: str


_IN_HAND: contextvars.ContextVar[AdmittedRequest] = contextvars.ContextVar("pd_hybrid_request")


class _SkipCluster(Exception):
    """The request leaves the cluster for the fallback (only raised for a reason in `when`)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class Inflight:
    """Open cluster requests of this replica. An entry older than `max_age_s` is dropped
    when counting: a stream whose generator never ran (client gone at once) must not
    count forever."""

    def __init__(self, max_age_s: float = 900.0):
        self.max_age_s = max_age_s
        self._open: dict[int, float] = {}
        self._next = 0

    def open(self) -> int:
        self._next += 1
        self._open[self._next] = time.monotonic()
        return self._next

    def close(self, ticket: int) -> None:
        self._open.pop(ticket, None)

    def count(self) -> int:
        cutoff = time.monotonic() - self.max_age_s
        for t in [t for t, at in self._open.items() if at < cutoff]:
            del self._open[t]
        return len(self._open)


class HybridRouting:
    """One per ingress replica."""

    def __init__(
        self,
        *,
        auth_enabled: bool,
        app_name: str,
        own_deployment: str,
        engine_deployment: Callable[[str], str | None],
        default_model: Callable[[], str | None],
        error_response: ErrorFn,
        ledger_label_selector: Mapping[str, str] | None = None,
        wake: Callable[[str], None] | None = None,
        cold_start_retry_after_s: int | None = None,
    ):
        self.auth_enabled = auth_enabled
        # Set when decode may scale to zero (args.resilience.cold_start_retry_after_s above
        # retry_after_s): a 503 sent while Serve reports no running decode replica carries it.
        self.cold_start_retry_after_s = cold_start_retry_after_s
        self.app_name = app_name
        self.own_deployment = own_deployment
        self._engine_deployment = engine_deployment
        self._default_model = default_model
        self._error = error_response
        # Starts the model's engines when they are at zero replicas (see pre_route).
        self._wake = wake
        self._selector = dict(ledger_label_selector or {})
        self.meter = UsageMeter()
        self.limiter = Limiter(LimitsConfig.from_user_config(None), self._ledger, self.meter)
        self.fallback: FallbackClient | None = None
        self.watch: ClusterWatch | None = None
        self.inflight = Inflight()  # cluster requests this replica has open (streams until their end)

    def _ledger(self) -> Any:
        return get_ledger(self.app_name, self._selector)

    # --- configuration (Serve calls the ingress's reconfigure with its user_config) ---------
    async def reconfigure(self, user_config: Mapping[str, Any] | None) -> None:
        user_config = user_config or {}
        self.limiter.config = LimitsConfig.from_user_config(user_config.get("limits"))
        self._selector = dict((user_config.get("limits") or {}).get("label_selector") or {})
        if self.limiter.config.any:
            # Before traffic: a ledger actor that is still starting is not an outage.
            await self.limiter.warm_up()
        cfg = FallbackConfig.from_user_config(user_config.get("fallback"))
        old = self.fallback
        self.fallback = FallbackClient(cfg) if cfg else None
        if old is not None:
            old.retire()  # closes when the answers it is relaying have ended
        watched = cfg is not None and (cfg.wants(UNAVAILABLE) or cfg.wants(OVERLOADED))
        if watched or self.cold_start_retry_after_s is not None:
            if self.watch is None:
                self.watch = ClusterWatch(self.app_name, self.own_deployment)
                self.watch.start()
        elif self.watch is not None:
            self.watch.stop()
            self.watch = None
        limits = self.limiter.config
        logger.info(
            "hybrid routing: fallback %s; limits default rpm=%s tpm=%s, %d per-key, %d per-model; "
            "%d key(s) limited to some models",
            f"to {cfg.base_url} when {sorted(cfg.when)}" if cfg else "off",
            limits.default.requests_per_minute,
            limits.default.tokens_per_minute,
            len(limits.keys),
            len(limits.models),
            len(limits.access),
        )

    # --- the routing rules ------------------------------------------------------------------
    def decode_down(self, model: str) -> str | None:
        """The deployment that serves `model`'s tokens when Serve says it has no running
        replica (None when it runs, or when Serve's status is not fresh: do not guess)."""
        decode = self._engine_deployment(model)
        if self.watch is None or not decode:
            return None
        return decode if self.watch.replicas(decode) == 0 else None

    def pre_route(self, model: str) -> tuple[str, str] | None:
        """(reason, detail) when the request should skip the cluster, else None."""
        cfg = self.fallback.config if self.fallback else None
        if cfg is None or self.watch is None:
            return None
        if cfg.wants(UNAVAILABLE):
            down = self.decode_down(model)
            if down:
                # Serve scales a deployment up from zero only for a request queued at one of
                # its handles (ray/serve/autoscaling_policy.py, the cold-start path); a request
                # the fallback answers never gets there, so the engines are woken apart.
                if self._wake is not None:
                    self._wake(model)
                return UNAVAILABLE, f"no running replica of {down}"
        if cfg.wants(OVERLOADED) and cfg.overflow_at:
            decode = self._engine_deployment(model)
            replicas = self.watch.replicas(decode) if decode else None
            ingresses = self.watch.replicas(self.own_deployment) or 1
            if replicas:
                # This replica's share of the decode capacity: Serve's proxy spreads requests
                # evenly over the ingress replicas.
                limit = cfg.overflow_at * replicas / ingresses
                ongoing = self.inflight.count()
                if ongoing >= limit:
                    return OVERLOADED, f"{ongoing} ongoing requests >= {limit:g} for {replicas} decode replica(s)"
        return None

    # --- access: which models a key may use ----------------------------------------------------
    def may_use(self, request: Any, model_id: str) -> bool:
        """Whether the (authenticated) request's API key may use `model_id`: a served model
        id, or an adapter `<model>:<adapter>` (allowed when its base model is). True for every
        model when the key lists no models (`limits.keys.<id>.models`) or auth is disabled.
        For the ingress to filter `/v1/models` and guard endpoints that `handle` and
        `admit_only` do not see; it says nothing about whether the model exists."""
        if not self.auth_enabled:
            return True
        kid = request_key_id(request.headers.get("authorization"), self.auth_enabled)
        return self.limiter.config.may_use(kid, model_id)

    def model_not_found(self, model_id: str) -> Response:
        """OpenAI's 404 for a model that does not exist or that the key may not use."""
        return self._error(
            404,
            MODEL_NOT_FOUND.format(model=model_id),
            type="invalid_request_error",
            param="model",
            code="model_not_found",
            headers={SERVED_BY: "cluster"},
        )

    # --- one request --------------------------------------------------------------------------
    async def admit_only(self, request: Any, model: str | None = None) -> Response | None:
        """The key's access and limits for a request that generates nothing (tokenize) on
        `model` (the body's; None: the only model): None to go on, else the 404/429/503 to
        send. It counts as one request and no tokens."""
        model = model or self._default_model() or ""
        if not self.may_use(request, model):
            return self.model_not_found(model)
        kid = request_key_id(request.headers.get("authorization"), self.auth_enabled)
        decision = await self.limiter.admit(kid, model, {})
        if decision.ok:
            self.limiter.settle(kid, model, decision, 0)
            return None
        return self._refusal(decision)

    def _refusal(self, decision: Decision) -> Response:
        unchecked = decision.limit == UNCHECKED  # the ledger is down and the policy refuses
        return self._error(
            503 if unchecked else 429,
            decision.message,
            code="limits_unavailable" if unchecked else "rate_limit_exceeded",
            headers={"Retry-After": str(decision.retry_after_s), SERVED_BY: "cluster"},
        )

    async def handle(
        self,
        request: Any,
        body: dict[str, Any],
        endpoint: str,
        call_cluster: Callable[[dict[str, Any]], Awaitable[Response]],
    ) -> Response:
        model = body.get("model") or self._default_model() or ""
        if not self.may_use(request, model):
            return self.model_not_found(model)  # before any limit is charged
        kid = request_key_id(request.headers.get("authorization"), self.auth_enabled)
        decision = await self.limiter.admit(kid, model, body)
        if not decision.ok:
            return self._refusal(decision)
        asked_usage = ask_for_usage(body)

        skip = self.pre_route(model)
        if skip is not None:
            return await self._to_fallback(endpoint, body, model, kid, decision, asked_usage, *skip)

        cfg = self.fallback.config if self.fallback else None
        _IN_HAND.set(AdmittedRequest(kid, decision, asked_usage, model))
        ticket = self.inflight.open()
        handed_off = False
        try:
            resp = await self._cluster(call_cluster(_with_running_usage(body)), cfg, bool(body.get("stream")), model)
            handed_off = True
        except Exception as exc:
            reason = exc.reason if isinstance(exc, _SkipCluster) else reason_for(exc)
            if reason is None or cfg is None or not cfg.wants(reason):
                cold = self._cold_start_refusal(exc, model)
                if cold is not None:
                    return cold
                raise
            detail = exc.detail if isinstance(exc, _SkipCluster) else type(exc).__name__
            logger.warning("cluster cannot serve (%s: %s); using the fallback", reason, detail)
            return await self._to_fallback(endpoint, body, model, kid, decision, asked_usage, reason, detail)
        finally:
            if not handed_off:
                self.inflight.close(ticket)
        return self._metered(resp, model, kid, decision, asked_usage, ticket)

    async def _cluster(
        self, call: Awaitable[Response], cfg: FallbackConfig | None, stream: bool, model: str
    ) -> Response:
        """Await Ray's ingress path (it returns once the first chunk exists), but give up
        when the fallback would take the request: the engines went away while it waited
        (e.g. queued for a replica that is restarting), or a stream's first token is late."""
        if cfg is None or (self.watch is None and not cfg.wants(DEADLINE)):
            return await call
        task = asyncio.ensure_future(call)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.first_token_timeout_s if stream and cfg.wants(DEADLINE) else None
        try:
            while True:
                wait = WATCH_TICK_S if deadline is None else max(0.0, min(WATCH_TICK_S, deadline - loop.time()))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                if self.watch is not None and cfg.wants(UNAVAILABLE):
                    down = self.decode_down(model)
                    if down:
                        raise _SkipCluster(UNAVAILABLE, f"no running replica of {down}")
                if deadline is not None and loop.time() >= deadline:
                    raise _SkipCluster(DEADLINE, f"no first token within {cfg.first_token_timeout_s:g}s")
        finally:
            if not task.done():
                task.cancel()  # Serve cancels the request in the engines too

    def _cold_start_refusal(self, exc: BaseException, model: str) -> Response | None:
        """The 503 for a request no fallback takes while the model's decode deployment has no
        running replica and may scale to zero: Retry-After is the planner's time to serve
        (the engine is starting from zero). None: `exc` is answered as it is."""
        if self.cold_start_retry_after_s is None or not isinstance(exc, Unservable) or exc.status != 503:
            return None
        down = self.decode_down(model)
        if down is None:
            return None
        logger.warning(
            "no running replica of %s (scaled to zero): 503, retry after %ss", down, self.cold_start_retry_after_s
        )
        return self._error(
            503,
            UNAVAILABLE_MESSAGE,
            code=Reason.DECODE_UNAVAILABLE.value,
            headers={"Retry-After": str(self.cold_start_retry_after_s), SERVED_BY: "cluster"},
        )

    async def unservable(
        self, endpoint: str, body: dict[str, Any], request: Any, reason: str, detail: str
    ) -> Response | None:
        """For a layer below that decided itself that the cluster cannot serve a request
        (the resilience mixin's `on_unservable` hook): the fallback's answer, or None when
        the fallback is not configured for `reason`."""
        cfg = self.fallback.config if self.fallback else None
        if cfg is None or not cfg.wants(reason):
            return None
        cur = _IN_HAND.get(None)
        if cur is None:  # not under handle(): no admission happened
            model = body.get("model") or self._default_model() or ""
            if not self.may_use(request, model):
                return self.model_not_found(model)  # no provider is paid for a model the key may not use
            kid = request_key_id(request.headers.get("authorization"), self.auth_enabled)
            cur = AdmittedRequest(kid, Decision(True), ask_for_usage(body), model)
        else:
            ask_for_usage(body)
        return await self._to_fallback(
            endpoint, body, cur.model, cur.kid, cur.decision, cur.asked_usage, reason, detail
        )

    async def _to_fallback(
        self,
        endpoint: str,
        body: dict[str, Any],
        model: str,
        kid: str,
        decision: Decision,
        asked_usage: bool,
        reason: str,
        detail: str,
    ) -> Response:
        assert self.fallback is not None

        def done(usage: Usage, ok: bool) -> None:
            self._count(kid, model, "fallback", decision, usage)
            self.meter.fallback(reason, "ok" if ok else "failed")

        try:
            return await self.fallback.forward(
                endpoint, body, model=model, reason=reason, client_asked_usage=asked_usage, on_done=done
            )
        except FallbackError as err:
            self.meter.fallback(reason, "failed")
            self.limiter.settle(kid, model, decision, 0)
            headers = {SERVED_BY: "fallback"}
            if err.retry_after_s:
                headers["Retry-After"] = str(err.retry_after_s)
            return self._error(err.status, f"{err.message} (cluster: {detail})", code=err.code, headers=headers)

    def _count(self, kid: str, model: str, destination: str, decision: Decision, usage: Usage) -> None:
        # The model as asked (an adapter by name); the limits window is its base model's.
        self.meter.served(kid, model, destination, usage.prompt_tokens, usage.completion_tokens)
        self.limiter.settle(kid, model, decision, usage.prompt_tokens + usage.completion_tokens)

    def _metered(
        self, resp: Response, model: str, kid: str, decision: Decision, asked_usage: bool, ticket: int
    ) -> Response:
        if resp.headers.get(SERVED_BY) == "fallback":
            self.inflight.close(ticket)  # a layer below handed it to the fallback (metered there)
            return resp
        resp.headers[SERVED_BY] = "cluster"
        if isinstance(resp, StreamingResponse):
            rewriter = SseRewriter(model=None, keep_usage_event=asked_usage, keep_chunk_usage=False)

            def settle() -> None:
                self.inflight.close(ticket)
                # Usage so far comes with every chunk: a stream cut before its usage
                # event (the client went away) still counts what was generated.
                usage = rewriter.usage if rewriter.usage.seen else estimated_usage(rewriter)
                self._count(kid, model, "cluster", decision, usage)

            if isinstance(resp, EventStreamResponse):
                # The ingress's own stream: the rewriter reads the events it decodes anyway.
                resp.events.meter(rewriter, settle)
            else:
                resp.body_iterator = _rewritten(resp.body_iterator, rewriter, settle)
            return resp
        self.inflight.close(ticket)
        usage = Usage()
        try:
            doc = json.loads(bytes(resp.body))
            usage.take(doc.get("usage") if isinstance(doc, dict) else None)
        except (ValueError, AttributeError):
            pass
        self._count(kid, model, "cluster", decision, usage)
        return resp


async def _rewritten(
    inner: AsyncIterable[Any], rewriter: SseRewriter, on_close: Callable[[], None]
) -> AsyncIterator[str]:
    """Any other streamed answer, read and rewritten event by event; `on_close` at its end."""
    try:
        async for chunk in inner:
            text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
            for e in rewriter.feed(text):
                yield e
        for e in rewriter.flush():
            yield e
    finally:
        on_close()
