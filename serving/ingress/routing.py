"""Routing an admitted request: the cluster or the external fallback, then its usage.

What flows through here, per chat or completion request the front door has admitted (its
key id, model route and token reservation: serving/ingress/context.py `RequestContext`):
  1. the routing rules pick a destination before the cluster is asked:
       unavailable  the deployment that serves the model's tokens (decode, or the aggregated
                    engine) has no running replica (Serve's status); prefill down is not
                    unavailable: decode prefills locally, at no provider cost
       overloaded   this replica's ongoing requests of the model >= fallback.overflowAt per
                    running decode replica (its share: decode capacity / ingress replicas)
     -> the external fallback (serving/ingress/fallback.py) when the rule's name is in
     `fallback.when`;
  2. otherwise the cluster (serving/ingress/relay.py); a request it cannot serve before its
     first byte (serving/core/failures.py `Unservable`: back-pressure, no replica, a dead
     replica, an engine 5xx, a deadline; or, while waiting here, decode going away or no
     first token within fallback.firstTokenTimeoutS for a stream) goes to the fallback when
     its reason's `fallback.when` case is configured; after the first byte nothing is re-sent
     anywhere. Every such request is counted (pd_ingress_refusals). A 503 no fallback takes
     while decode has no running replica and may scale to zero gets the planner's time to
     serve as Retry-After;
  3. the response is marked `x-served-by: cluster|fallback`; its usage (prompt, completion and
     cached prompt tokens, read from the answer itself) and its cost (serving/ingress/costs.py)
     are counted per key id, model and destination, and settle the request's token
     reservation and the key's spend. A stream of the relay's own
     (serving.ingress.sse.EventStreamResponse) is read in the same pass as its events are
     decoded for stream migration: the rewriter is added to that pass.
A key past its budget whose budget sends it to the fallback (`budget.whenExceeded: fallback`)
goes there at once, before the rules. Configuration arrives as the ingress deployment's
`user_config`, so changing the fallback or the prices in a stack updates the ingress in place
without restarting engines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from serving.core import metrics
from serving.core.cluster_watch import ClusterWatch, serve_running
from serving.core.failures import UNAVAILABLE_MESSAGE, Reason, Unservable, as_unservable
from serving.ingress.costs import Costs
from serving.ingress.errors import SERVED_BY, error_response
from serving.ingress.fallback import FallbackClient, FallbackConfig, FallbackError
from serving.ingress.limits import OVER_BUDGET_FALLBACK, Spend, UsageMeter
from serving.ingress.sse import EventStreamResponse, SseRewriter, Usage, estimated_usage
from serving.spec import TEST_HOOKS_ENV, FallbackWhen

if TYPE_CHECKING:
    from serving.ingress.catalog import ModelRoute
    from serving.ingress.context import RequestContext

logger = logging.getLogger("ray.serve")

UNAVAILABLE = FallbackWhen.UNAVAILABLE.value
OVERLOADED = FallbackWhen.OVERLOADED.value
DEADLINE = FallbackWhen.DEADLINE.value
# The fallback's `reason` for a key past its budget that its budget sends there.
OVER_BUDGET = "budget"
# How often a request waiting for the cluster's first byte looks at the routing rules again.
WATCH_TICK_S = 0.5


# The conformance harness's request header: `fallback` sends the request to the fallback, read
# only where TEST_HOOKS_ENV is "1" (Router._forced).
ROUTE_HEADER = "x-pd-test-route"


class Inflight:
    """Open cluster requests of this replica, per base model. An entry older than
    `max_age_s` is dropped when counting: a stream whose generator never ran (client gone at
    once) must not count forever."""

    def __init__(self, max_age_s: float = 900.0):
        self.max_age_s = max_age_s
        self._open: dict[int, tuple[str, float]] = {}
        self._next = 0

    def open(self, model: str = "") -> int:
        self._next += 1
        self._open[self._next] = (model, time.monotonic())
        return self._next

    def close(self, ticket: int) -> None:
        self._open.pop(ticket, None)

    def count(self, model: str | None = None) -> int:
        """Open requests of `model` (None: of every model)."""
        cutoff = time.monotonic() - self.max_age_s
        for t in [t for t, (_, at) in self._open.items() if at < cutoff]:
            del self._open[t]
        return sum(1 for m, _ in self._open.values() if model is None or m == model)


class Router:
    """One per ingress replica."""

    def __init__(
        self,
        *,
        app_name: str,
        own_deployment: str,
        retry_after_s: int = 1,
        wake: Callable[[ModelRoute], None] | None = None,
        cold_start_retry_after_s: int | None = None,
        meter: UsageMeter | None = None,
    ):
        self.app_name = app_name
        self.own_deployment = own_deployment
        self.retry_after_s = retry_after_s
        # Set when decode may scale to zero (args.resilience.cold_start_retry_after_s above
        # retry_after_s): a 503 sent while Serve reports no running decode replica carries it.
        self.cold_start_retry_after_s = cold_start_retry_after_s
        # Starts the model's engines when they are at zero replicas (see pre_route).
        self._wake = wake
        self.meter = meter if meter is not None else UsageMeter()
        self._refusals = metrics.counter(metrics.INGRESS_REFUSALS)
        # The conformance harness's forced fallback (ROUTE_HEADER), in a replica started for it.
        self._test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
        self.fallback: FallbackClient | None = None
        # What requests cost per model and destination (the user_config's `costs` and
        # `fallback.prices`; serving/ingress/costs.py); unpriced until configured.
        self.costs = Costs()
        self.watch: ClusterWatch | None = None
        self.inflight = Inflight()  # cluster requests this replica has open (streams until their end)

    # --- configuration (the ingress's reconfigure, with its user_config's `fallback`) --------
    def reconfigure(self, fallback: Mapping[str, Any] | None) -> FallbackConfig | None:
        cfg = FallbackConfig.from_user_config(fallback)
        old = self.fallback
        self.fallback = FallbackClient(cfg) if cfg else None
        if old is not None:
            old.retire()  # closes when the answers it is relaying have ended
        self.watch_models(cfg is not None and (cfg.wants(UNAVAILABLE) or cfg.wants(OVERLOADED)))
        return cfg

    def watch_models(self, needed: bool) -> None:
        """Watch Serve's running replicas of the engines while a rule or the cold-start
        Retry-After reads them (pushed by the controller: serving.core.cluster_watch)."""
        if needed or self.cold_start_retry_after_s is not None:
            if self.watch is None:
                self.watch = ClusterWatch(self.app_name, self.own_deployment)
                self.watch.start()
        elif self.watch is not None:
            self.watch.stop()
            self.watch = None

    async def running(self, max_age_s: float = 2.0) -> Mapping[str, int]:
        """Running replicas per deployment of every application, as Serve said at most
        `max_age_s` ago: one read of the controller's details per process at a time, shared
        by every caller (a burst of /health starts one)."""
        return await serve_running(self.app_name, max_age_s)

    @property
    def fallback_config(self) -> FallbackConfig | None:
        return self.fallback.config if self.fallback else None

    def wants(self, rule: str | None) -> bool:
        cfg = self.fallback_config
        return rule is not None and cfg is not None and cfg.wants(rule)

    # --- the routing rules --------------------------------------------------------------------
    def decode_down(self, route: ModelRoute) -> str | None:
        """The deployment that serves the model's tokens when Serve says it has no running
        replica (None when it runs, or when Serve's status is not fresh: do not guess)."""
        if self.watch is None or not route.engine:
            return None
        return route.engine if self.watch.replicas(route.engine) == 0 else None

    def pre_route(self, route: ModelRoute) -> tuple[str, str] | None:
        """(reason, detail) when the request should skip the cluster, else None."""
        cfg = self.fallback_config
        if cfg is None or self.watch is None:
            return None
        if cfg.wants(UNAVAILABLE):
            down = self.decode_down(route)
            if down:
                # Serve scales a deployment up from zero only for a request queued at one of
                # its handles (ray/serve/autoscaling_policy.py, the cold-start path); a request
                # the fallback answers never gets there, so the engines are woken apart.
                if self._wake is not None:
                    self._wake(route)
                return UNAVAILABLE, f"no running replica of {down}"
        if cfg.wants(OVERLOADED) and cfg.overflow_at:
            replicas = self.watch.replicas(route.engine) if route.engine else None
            ingresses = self.watch.replicas(self.own_deployment) or 1
            if replicas:
                # This replica's share of the model's decode capacity: Serve's proxy spreads
                # requests evenly over the ingress replicas.
                limit = cfg.overflow_at * replicas / ingresses
                ongoing = self.inflight.count(route.base)
                if ongoing >= limit:
                    return OVERLOADED, f"{ongoing} ongoing requests >= {limit:g} for {replicas} decode replica(s)"
        return None

    def _forced(self, ctx: RequestContext) -> tuple[str, str] | None:
        """The test hook (TEST_HOOKS_ENV only): a request whose ROUTE_HEADER says `fallback`
        goes to the fallback as an overloaded cluster's would, streamed or not (the harness
        compares the fallback path on every body)."""
        if not self._test_hooks or self.fallback is None or ctx.request is None:
            return None
        if ctx.request.headers.get(ROUTE_HEADER) != "fallback":
            return None
        return OVERLOADED, f"sent to the fallback by {ROUTE_HEADER}"

    # --- one request ----------------------------------------------------------------------------
    async def handle(self, ctx: RequestContext, call_cluster: Callable[[], Awaitable[Response]]) -> Response:
        """The answer to an admitted request: the cluster's, or the fallback's. Raises what
        the pipeline answers itself (a request the cluster cannot serve and no fallback
        takes, an engine's 4xx)."""
        if ctx.overflow == OVER_BUDGET_FALLBACK and self.fallback is not None:
            return await self._to_fallback(ctx, OVER_BUDGET, "the key's budget is spent")
        skip = self.pre_route(ctx.route) or self._forced(ctx)
        if skip is not None:
            self._refused(ctx, *skip)
            return await self._to_fallback(ctx, *skip)
        ticket = self.inflight.open(ctx.route.base)
        handed_off = False
        try:
            resp = await self._cluster(call_cluster(), ctx)
            handed_off = True
        except Exception as exc:
            failure = as_unservable(exc, self.retry_after_s)
            if failure is None:
                raise
            self._refused(ctx, failure.reason.value, str(failure.status))
            rule = failure.fallback_when
            if self.wants(rule):
                assert rule is not None
                logger.warning("cluster cannot serve (%s: %s); using the fallback", rule, failure.message)
                return await self._to_fallback(ctx, rule, failure.message)
            raise self._cold_start(failure, ctx.route) or failure from None
        finally:
            if not handed_off:
                self.inflight.close(ticket)
        return self._metered(resp, ctx, ticket)

    def _refused(self, ctx: RequestContext, reason: str, status: str) -> None:
        self._refusals.inc(tags={"model": ctx.route.model, "reason": reason, "status": status})

    async def _cluster(self, call: Awaitable[Response], ctx: RequestContext) -> Response:
        """Await the relay (it returns once the first chunk exists), but give up when the
        fallback would take the request: the engines went away while it waited (e.g. queued
        for a replica that is restarting), or a stream's first token is late."""
        cfg = self.fallback_config
        if cfg is None or (self.watch is None and not cfg.wants(DEADLINE)):
            return await call
        task = asyncio.ensure_future(call)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.first_token_timeout_s if ctx.stream and cfg.wants(DEADLINE) else None
        try:
            while True:
                wait = WATCH_TICK_S if deadline is None else max(0.0, min(WATCH_TICK_S, deadline - loop.time()))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                if self.watch is not None and cfg.wants(UNAVAILABLE):
                    down = self.decode_down(ctx.route)
                    if down:
                        raise Unservable(Reason.DECODE_UNAVAILABLE, self.retry_after_s, f"no running replica of {down}")
                if deadline is not None and loop.time() >= deadline:
                    message = f"no first token within {cfg.first_token_timeout_s:g}s"
                    raise Unservable(Reason.DEADLINE, self.retry_after_s, message)
        finally:
            if not task.done():
                task.cancel()  # Serve cancels the request in the engines too

    def _cold_start(self, failure: Unservable, route: ModelRoute) -> Unservable | None:
        """The 503 for a request no fallback takes while the model's decode deployment has no
        running replica and may scale to zero: Retry-After is the planner's time to serve
        (the engine is starting from zero). None: `failure` is answered as it is."""
        if self.cold_start_retry_after_s is None or failure.status != 503:
            return None
        down = self.decode_down(route)
        if down is None:
            return None
        logger.warning(
            "no running replica of %s (scaled to zero): 503, retry after %ss", down, self.cold_start_retry_after_s
        )
        return Unservable(Reason.DECODE_UNAVAILABLE, self.cold_start_retry_after_s, UNAVAILABLE_MESSAGE)

    async def _to_fallback(self, ctx: RequestContext, reason: str, detail: str) -> Response:
        assert self.fallback is not None

        def done(usage: Usage, ok: bool) -> None:
            self._count(ctx, metrics.DESTINATION_FALLBACK, usage)
            self.meter.fallback(reason, "ok" if ok else "failed")

        try:
            return await self.fallback.forward(
                ctx.endpoint,
                ctx.body,
                model=ctx.route.model,
                reason=reason,
                client_asked_usage=ctx.asked_usage,
                on_done=done,
            )
        except FallbackError as err:
            self.meter.fallback(reason, "failed")
            ctx.reservation.settle(0)
            headers = {SERVED_BY: "fallback"}
            if err.retry_after_s:
                headers["Retry-After"] = str(err.retry_after_s)
            return error_response(err.status, f"{err.message} (cluster: {detail})", code=err.code, headers=headers)

    def _count(self, ctx: RequestContext, destination: str, usage: Usage) -> None:
        # The model as asked (an adapter by name); the limits window is its base model's.
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        cached = max(0, min(usage.cached_tokens, prompt))
        cost = self.costs.of(ctx.route.model, destination, prompt, completion, cached)
        parts = (cost.prefill, cost.decode) if cost is not None else None
        self.meter.served(ctx.key_id, ctx.route.model, destination, prompt, completion, cached, parts)
        spend = Spend(cost.total if cost is not None else 0.0, 1, prompt, completion, cached)
        ctx.reservation.settle(prompt + completion, spend)

    def _metered(self, resp: Response, ctx: RequestContext, ticket: int) -> Response:
        resp.headers[SERVED_BY] = metrics.DESTINATION_CLUSTER
        if isinstance(resp, StreamingResponse):
            rewriter = SseRewriter(model=None, keep_usage_event=ctx.asked_usage, keep_chunk_usage=False)

            def settle() -> None:
                self.inflight.close(ticket)
                # Usage so far comes with every chunk: a stream cut before its usage
                # event (the client went away) still counts what was generated.
                usage = rewriter.usage if rewriter.usage.seen else estimated_usage(rewriter)
                self._count(ctx, metrics.DESTINATION_CLUSTER, usage)

            if isinstance(resp, EventStreamResponse):
                # The relay's own stream: the rewriter reads the events it decodes anyway.
                resp.events.meter(rewriter, settle)
            else:
                resp.body_iterator = _rewritten(resp.body_iterator, rewriter, settle)
            return resp
        self.inflight.close(ticket)
        usage = Usage()
        try:
            doc = json.loads(bytes(resp.body))
            usage.take(doc.get("usage") if isinstance(doc, dict) else None)
        except (ValueError, AttributeError, RecursionError):
            pass
        self._count(ctx, metrics.DESTINATION_CLUSTER, usage)
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
