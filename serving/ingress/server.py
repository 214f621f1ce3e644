"""The front door's Serve deployment: Ray Serve LLM's OpenAI ingress, every route through our pipeline.

What flows through here: each HTTP request Serve hands the ingress replica -> its route:
chat and completions walk the pipeline (serving/ingress/pipeline.py: auth, fields, model,
limits, route, call, meter); /tokenize and /detokenize the same up to limits; /v1/models and
/v1/models/<id> answer from the model tables with a key's models only and no storage
locations; /v1/usage answers a key its own spend and budget (nothing of other keys); /health, /ping and /version answer without a key, as vLLM's own server does
(benchmark clients check /health first); the endpoints a chat stack does not serve are refused
after auth. Configuration arrives as the deployment's user_config (`reconfigure`): the external
fallback, limits and, in the many-model form, the models, without restarting engines.

Why a subclass of Ray's OpenAiIngress: its route table, model tables, LoRA multiplexing and
deployment options are Ray's (`make_fastapi_ingress`); what this class adds is the pipeline.
Ray Serve's own `/-/healthz` and `/-/routes` are answered by the proxy (or HAProxy) and stay open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from ray.serve.llm.ingress import OpenAiIngress
from starlette.responses import JSONResponse, Response

from serving.core.calls import in_background
from serving.ingress.auth import ApiKeyAuth
from serving.ingress.catalog import ModelCatalog, ModelNotFound, ModelRoute, Models
from serving.ingress.costs import Costs, installed_vllm
from serving.ingress.dispatch import dispatch_call
from serving.ingress.errors import answer_for, error_response, model_not_found
from serving.ingress.limits import LEDGER_RETRY_S, Limiter, LimitsConfig, UsageMeter, get_ledger
from serving.ingress.pipeline import DEFAULT_MAX_BODY_BYTES, FrontDoor
from serving.ingress.relay import Relay
from serving.ingress.routing import Router
from serving.ingress.tenancy import CacheSalts
from serving.spec import API_KEYS_ENV, APP_NAME, INGRESS_DEPLOYMENT, AuthMode, ResilienceSpec

logger = logging.getLogger("ray.serve")

# A key's own spend, budget and tokens in the current UTC day and month.
USAGE_PATH = "/v1/usage"
# The routes this ingress adds to Ray's table (make_fastapi_ingress's endpoint map).
EXTRA_ENDPOINTS = {
    "health": lambda app: app.get("/health"),
    "ping": lambda app: app.get("/ping"),
    "ping_post": lambda app: app.post("/ping"),
    "version": lambda app: app.get("/version"),
    "responses": lambda app: app.post("/v1/responses"),
    "usage": lambda app: app.get(USAGE_PATH),
}


def endpoint_map() -> dict[str, Any]:
    """Ray's OpenAI routes plus ours."""
    from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS

    return {**DEFAULT_ENDPOINTS, **EXTRA_ENDPOINTS}


class AuthenticatedIngress(OpenAiIngress):
    """Ray Serve LLM's OpenAI ingress with API-key auth, per-key limits, hybrid routing, the
    resilient relay and uniform OpenAI-style errors. Each route takes the raw request, so auth
    runs before the body is read and every error comes back in the OpenAI error shape."""

    def __init__(
        self,
        llm_deployments: Mapping[str, Any],
        model_cards: Mapping[str, Any],
        *,
        auth_mode: str = AuthMode.API_KEY.value,
        api_keys_env: str = API_KEYS_ENV,
        resilience: Mapping[str, Any] | None = None,
        models_mode: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        **kwargs: Any,
    ):
        super().__init__(llm_deployments, model_cards, **kwargs)
        cfg = ResilienceSpec.from_args(resilience or ResilienceSpec().runtime_args())
        app_name, own = _replica_names()
        self._ledger_selector: dict[str, str] = {}
        meter = UsageMeter()
        self._waking: set[str] = set()
        self._door = FrontDoor(
            auth=ApiKeyAuth.from_env(auth_mode, api_keys_env),
            # The many-model front door: its models arrive in user_config (catalog.py).
            models=Models(self, ModelCatalog() if models_mode else None),
            limiter=Limiter(
                LimitsConfig.from_user_config(None), lambda: get_ledger(app_name, own, self._ledger_selector), meter
            ),
            router=Router(
                app_name=app_name,
                own_deployment=own,
                retry_after_s=cfg.retry_after_s,
                wake=self._wake,
                cold_start_retry_after_s=cfg.scale_from_zero_retry_after_s,
                meter=meter,
            ),
            relay=Relay(cfg),
            max_body_bytes=max_body_bytes,
            salts=CacheSalts.from_env(api_keys_env),
        )

    # --- configuration ------------------------------------------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's lightweight update: the fallback and limits from the Serve config's
        `deployments[].user_config` (ServingSpec.ingress_user_config), no restart; in the
        many-model form also the models (ServingSpec.model_table), so adding one touches
        neither this replica nor any other model's engines."""
        door = self._door
        if door.models.catalog is not None:
            added, removed = door.models.take(user_config.get("models"))
            logger.info("front door models: %s (added %s, removed %s)", sorted(self._model_cards), added, removed)
        limits = user_config.get("limits") or {}
        door.limiter.config = LimitsConfig.from_user_config(limits)
        self._ledger_selector = dict(limits.get("label_selector") or {})
        if door.limiter.config.any:
            # Before traffic: a ledger actor that is still starting is not an outage.
            await door.limiter.warm_up()
        fallback = door.router.reconfigure(user_config.get("fallback"))
        door.router.costs = Costs.from_user_config(user_config.get("costs"), user_config.get("fallback"))
        lc = door.limiter.config
        logger.info(
            "hybrid routing: fallback %s; limits default rpm=%s tpm=%s, %d per-key, %d per-model; "
            "%d key(s) limited to some models, %d with a budget; prefix cache per %s; priced models %s",
            f"to {fallback.base_url} when {sorted(fallback.when)}" if fallback else "off",
            lc.default.requests_per_minute,
            lc.default.tokens_per_minute,
            len(lc.keys),
            len(lc.models),
            len(lc.access),
            len(lc.budgets),
            lc.cache_isolation,
            sorted(door.router.costs.cluster),
        )

    def _wake(self, route: ModelRoute) -> None:
        """One 1-token request to a model's engines, in the background, while they have no
        running replica and the fallback answers for them: it queues at the handle, which
        is what makes Serve scale the deployment up from zero. One at a time per model."""
        from ray.serve.llm.openai_api_models import CompletionRequest

        if route.base in self._waking:
            return
        self._waking.add(route.base)
        relay = self._door.relay

        async def wake() -> None:
            try:
                body = CompletionRequest(model=route.base, prompt="Hello", max_tokens=1)
                stream = dispatch_call(route.handle(), body, "completions", None)
                await asyncio.wait_for(_drain(stream), relay.cfg.total_timeout_s)
                logger.info("woke %s: its engines answer again", route.base)
            except Exception as exc:  # the next request tries again
                logger.warning("waking %s failed: %r", route.base, exc)
            finally:
                self._waking.discard(route.base)

        in_background(wake())

    # --- the OpenAI endpoints (route table: Ray's DEFAULT_ENDPOINTS, plus EXTRA_ENDPOINTS) ------
    async def chat(self, request: Request) -> Response:
        return await self._door.generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._door.generate(request, "completions")

    # tokenize/detokenize are cheap and useful to clients: behind auth and the key's
    # requests-per-minute limit (they generate nothing, so no tokens are reserved).
    async def tokenize(self, request: Request) -> Response:
        return await self._door.counted(request, "tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._door.counted(request, "detokenize")

    async def models(self, request: Request) -> Any:
        kid = self._door.auth.key_id(request)
        if isinstance(kid, Response):
            return kid
        try:
            cards = await self._door.models.listing()
        except Exception as exc:
            return answer_for(exc)
        from serving.ray_internals import ModelList

        # A key limited to some models sees only those (and their adapters).
        return ModelList(data=[c for c in cards if self._door.limiter.config.may_use(kid, c.id)])

    async def model_data(self, model: str, request: Request) -> Any:
        kid = self._door.auth.key_id(request)
        if isinstance(kid, Response):
            return kid
        if not self._door.limiter.config.may_use(kid, model):
            return model_not_found(model)
        try:
            route = await self._door.models.resolve(model)
        except ModelNotFound:
            return model_not_found(model)
        except Exception as exc:
            return answer_for(exc)
        if route.model == route.base:
            return self._model_cards[route.base]
        return self._door.models.adapter_card(route.model)

    async def usage(self, request: Request) -> Response:
        """The calling key's own spend and tokens in the current UTC day and month, its budget
        and what is left of it; nothing of any other key (the key id comes from the key the
        request presents, never from the request's parameters)."""
        kid = self._door.auth.key_id(request)
        if isinstance(kid, Response):
            return kid
        limiter = self._door.limiter
        try:
            periods = await limiter.spend(kid)
        except Exception as exc:
            logger.warning("usage: limits ledger did not answer: %r", exc)
            return error_response(
                503,
                "Usage cannot be read right now; retry shortly.",
                code="limits_unavailable",
                headers={"Retry-After": str(int(LEDGER_RETRY_S))},
            )
        return JSONResponse(usage_report(kid, periods, limiter.config))

    # --- what every OpenAI-compatible server answers without a key (vLLM's own routes) ----------
    async def health(self) -> Response:
        """200 while the engines that serve some model's tokens have a running replica
        (Serve's status), 503 otherwise: the answer vLLM's /health gives for its one engine."""
        models = self._door.models
        try:
            running = await self._door.router.running()
        except Exception as exc:  # Serve's controller did not answer: say so, do not guess
            logger.warning("health: no word from Serve's controller: %r", exc)
            return Response(status_code=503)
        for base in list(self._model_cards):
            try:
                route = await models.resolve(base)
            except Exception:  # a model whose application is not deployed yet
                continue
            if route.engine and running.get(route.engine, 0) > 0:
                return Response(status_code=200)
        return Response(status_code=503)

    async def ping(self) -> Response:
        return await self.health()

    async def ping_post(self) -> Response:
        return await self.health()

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": _vllm_version()})

    # Endpoints a chat model's P/D stack does not serve: refused (after auth, so the answer
    # says nothing to a client without a key), rather than reaching the engines around the
    # limits and routing of chat/completions.
    async def embeddings(self, request: Request) -> Response:
        return self._not_served(request, "/v1/embeddings")

    async def score(self, request: Request) -> Response:
        return self._not_served(request, "/v1/score")

    async def transcriptions(self, request: Request) -> Response:
        return self._not_served(request, "/v1/audio/transcriptions")

    async def responses(self, request: Request) -> Response:
        # Ray Serve LLM 2.60's ingress and LLMServer have no Responses API; use
        # /v1/chat/completions (docs/hybrid-routing.md, "Endpoints").
        return self._not_served(request, "/v1/responses", " Use /v1/chat/completions.")

    def _not_served(self, request: Request, path: str, hint: str = "") -> Response:
        denied = self._door.auth.check(request)
        if denied is not None:
            return denied
        return error_response(404, f"{path} is not served by this deployment.{hint}", code="endpoint_not_served")


def usage_report(kid: str, periods: Mapping[str, Any], config: LimitsConfig) -> dict[str, Any]:
    """The /v1/usage answer: the key's day and month (USD and tokens, with each period's UTC
    bounds) and its budget with what is left of it in the budget's period."""
    budget = config.budgets.get(kid)
    out: dict[str, Any] = {"object": "usage", "key": kid, "budget": None}
    for period, spent in periods.items():
        out[period] = {
            "start": spent["start"],
            "end": spent["end"],
            "spend_usd": round(float(spent["usd"]), 6),
            "requests": int(spent["requests"]),
            "prompt_tokens": int(spent["prompt"]),
            "completion_tokens": int(spent["completion"]),
            "cached_tokens": int(spent["cached"]),
        }
    if budget is not None:
        spent_usd = float(periods.get(budget.period, {}).get("usd", 0.0))
        out["budget"] = {
            "usd": budget.usd,
            "period": budget.period,
            "remaining_usd": round(max(0.0, budget.usd - spent_usd), 6),
            "when_exceeded": budget.when_exceeded,
            "resets_at": periods.get(budget.period, {}).get("end"),
        }
    return out


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def _replica_names() -> tuple[str, str]:
    """(application, own deployment) of this replica; the spec's names outside Serve (tests)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.app_name, ctx.deployment
    except Exception:
        return APP_NAME, INGRESS_DEPLOYMENT


def _vllm_version() -> str:
    return installed_vllm()
