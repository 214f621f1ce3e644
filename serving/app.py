"""The Ray Serve application: `build_app(args)`, the import path of the Serve config.

What flows through here: the `args` that `serving.spec.ServingSpec.app_args()` renders
(mode, auth, ingress options, and either prefill/decode LLMConfigs or one aggregated
LLMConfig) come in; a Ray Serve `Application` goes out, built by Ray Serve LLM's own
builders (`build_pd_openai_app` / `build_openai_app`): OpenAI ingress -> decode engine ->
prefill engine, KV cache moved by the engines' NIXL connector.

What this module adds to Ray's builder is one ingress subclass, plugged in through the
builders' `ingress_cls_config`:
  * API-key auth (`Authorization: Bearer <key>`), keys from the environment variable named
    in args["auth"]["api_keys_env"]; checked before the body is even parsed. With auth on
    and no key configured, every request is refused (401) rather than served open.
  * One error shape for every failure the ingress answers itself:
    {"error": {"message", "type", "param", "code"}} with 400 / 401 / 404 / 503 / 500.
  * Hybrid routing for chat and completions (serving/ingress/routing.py): per-key limits, the
    cluster or the external fallback, `x-served-by`, usage per key; configured through the
    deployment's user_config (`reconfigure`), so it changes without restarting engines.
Ray Serve's own `/-/healthz` and `/-/routes` are answered by the proxy and stay open.

Only public `ray.serve.llm` APIs are used here.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from functools import cache
from typing import Any

from fastapi import Request
from pydantic import TypeAdapter, ValidationError
from ray.serve import Application
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.llm import build_openai_app, build_pd_openai_app
from ray.serve.llm.ingress import OpenAiIngress
from ray.serve.llm.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
)
from starlette.responses import JSONResponse, Response

from serving.core.failures import OVERLOADED_MESSAGE, Reason, Unservable, in_background
from serving.ingress.catalog import ModelCatalog
from serving.ingress.fallback import SERVED_BY
from serving.ingress.fields import refused_field
from serving.ingress.relay import ResilientIngressMixin, dispatch_call
from serving.ingress.routing import HybridRouting
from serving.spec import (
    API_KEYS_ENV,
    APP_NAME,
    INGRESS_DEPLOYMENT,
    MODELS_MODE,
    AuthMode,
    ResilienceSpec,
    base_model_id,
    parse_api_keys,
)
from serving.spec.models import ADAPTER_SEP

logger = logging.getLogger("ray.serve")

# The spec renders these; one definition, there.
AUTH_API_KEY = AuthMode.API_KEY.value
AUTH_DISABLED = AuthMode.DISABLED.value
DEFAULT_API_KEYS_ENV = API_KEYS_ENV

# OpenAI's error `type` and `code` for each status the ingress answers itself.
_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    408: ("timeout_error", "timeout"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", None),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "overloaded"),
}


def error_response(
    status: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style JSON error: {"error": {"message", "type", "param", "code"}}."""
    default_type, default_code = _ERROR_KINDS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    body = {
        "error": {
            "message": message,
            "type": type or default_type,
            "param": param,
            "code": code if code is not None else default_code,
        }
    }
    return JSONResponse(status_code=status, content=body, headers=dict(headers or {}))


# A model whose application Serve has not deployed yet (it deploys a config's applications
# side by side): retry soon.
MODEL_STARTING_MESSAGE = "The model is not available yet; retry later."
MODEL_STARTING_RETRY_S = 5


def auth_mode(mode: str, where: str = "auth mode") -> AuthMode:
    """The one check of an auth mode (the spec's AuthMode values)."""
    try:
        return AuthMode(mode)
    except ValueError:
        raise ValueError(f"{where} {mode!r} is not one of {AUTH_API_KEY!r}, {AUTH_DISABLED!r}") from None


class ApiKeyAuth:
    """Checks `Authorization: Bearer <key>` against a fixed set of keys."""

    def __init__(self, mode: str, keys: tuple[str, ...]):
        self.enabled = auth_mode(mode) is not AuthMode.DISABLED
        self._keys = tuple(k.encode() for k in keys)

    def check(self, request: Request) -> JSONResponse | None:
        """None when the request may pass, else the 401 response to send."""
        if not self.enabled:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode()
        if scheme.lower() != "bearer" or not presented:
            return error_response(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                headers={"WWW-Authenticate": "Bearer"},
            )
        # Compare against every key, constant-time, so timing says nothing about which.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        if not ok:
            return error_response(401, "Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"})
        return None


def _validation_error(err: ValidationError) -> JSONResponse:
    first: dict[str, Any] = dict(err.errors()[0]) if err.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    msg = first.get("msg", "invalid request body")
    where = f" (at '{loc}')" if loc else ""
    return error_response(400, f"Invalid request body: {msg}{where}.", param=loc)


def _from_exception(exc: BaseException) -> JSONResponse:
    """Map what Ray Serve LLM raises to the OpenAI error shape."""
    if isinstance(exc, ValidationError):
        return _validation_error(exc)
    if isinstance(exc, Unservable):
        return error_response(exc.status, exc.message, code=exc.reason.value, headers=exc.headers)
    if isinstance(exc, BackPressureError):
        retry_after = int(getattr(exc, "retry_after_s", 0) or 1)
        return error_response(503, OVERLOADED_MESSAGE, headers={"Retry-After": str(retry_after)})
    if isinstance(exc, DeploymentUnavailableError):
        return error_response(503, "The model is not available yet; retry later.", headers={"Retry-After": "5"})
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        # fastapi.HTTPException carries `detail`; Ray's OpenAIHTTPException `message`.
        message = getattr(exc, "message", None) or getattr(exc, "detail", None) or str(exc)
        if status >= 500:
            logger.error("ingress error %s: %s", status, message)
            if status == 503:
                return error_response(503, OVERLOADED_MESSAGE)
            return error_response(status, "Internal server error.")
        return error_response(status, str(message))
    logger.exception("unhandled ingress error", exc_info=exc)
    return error_response(500, "Internal server error.", code="internal_error")


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(
            400,
            "We could not parse the JSON body of your request. Send a JSON object "
            "with 'Content-Type: application/json'.",
            code="invalid_json",
        )
    if not isinstance(body, dict):
        return error_response(400, "The request body must be a JSON object.", code="invalid_json")
    return body


class AuthenticatedIngress(ResilientIngressMixin, OpenAiIngress):
    """Ray Serve LLM's OpenAI ingress with API-key auth and uniform OpenAI-style errors.

    Each endpoint takes the raw request, so auth runs before the body is parsed and every
    parse or validation error comes back in the OpenAI error shape; it then hands the
    typed body to the parent's endpoint unchanged.
    """

    def __init__(
        self,
        llm_deployments: Mapping[str, Any],
        model_cards: Mapping[str, Any],
        *,
        auth_mode: str = AUTH_API_KEY,
        api_keys_env: str = DEFAULT_API_KEYS_ENV,
        resilience: Mapping[str, Any] | None = None,
        models_mode: bool = False,
        **kwargs: Any,
    ):
        super().__init__(llm_deployments, model_cards, **kwargs)
        # The many-model front door: its models arrive in user_config (serving/ingress/catalog.py).
        self._catalog = ModelCatalog() if models_mode else None
        # Deadlines, retries, fast refusals for chat/completions (serving/ingress/relay.py).
        self._init_resilience(resilience or ResilienceSpec().runtime_args())
        keys = parse_api_keys(os.environ.get(api_keys_env))
        self._auth = ApiKeyAuth(auth_mode, keys)
        self._waking: set[str] = set()
        self._hybrid = self._make_hybrid()
        if self._auth.enabled and not keys:
            logger.warning(
                "auth is %r but %s holds no keys: every request will get 401",
                auth_mode,
                api_keys_env,
            )

    # --- hybrid routing (serving/ingress/routing.py): limits, cluster or fallback, usage ----------
    def _make_hybrid(self) -> HybridRouting:
        try:
            from ray import serve

            ctx = serve.get_replica_context()
            app_name, own = ctx.app_name, ctx.deployment
        except Exception:  # outside a Serve replica (unit tests)
            app_name, own = APP_NAME, INGRESS_DEPLOYMENT

        def engine(model: str) -> str | None:
            deployment = getattr(self._default_serve_handles.get(model), "deployment_name", None)
            if self._catalog is None or deployment is None:
                return deployment
            # Another application's deployment: ClusterWatch keys those "<app>/<deployment>".
            return f"{self._catalog.entries[model].app_name}/{deployment}" if model in self._catalog.entries else None

        def default_model() -> str | None:
            return next(iter(self._model_cards)) if len(self._model_cards) == 1 else None

        return HybridRouting(
            auth_enabled=self._auth.enabled,
            app_name=app_name,
            own_deployment=own,
            engine_deployment=engine,
            default_model=default_model,
            error_response=error_response,
            wake=self._wake,
            cold_start_retry_after_s=self._resilience.scale_from_zero_retry_after_s,
        )

    def _wake(self, model: str) -> None:
        """One 1-token request to `model`'s engines, in the background, while they have no
        running replica and the fallback answers for them: it queues at the handle, which
        is what makes Serve scale the deployment up from zero. One at a time per model."""
        if model in self._waking or model not in self._default_serve_handles:
            return
        self._waking.add(model)

        async def wake() -> None:
            try:
                body = CompletionRequest(model=model, prompt="Hello", max_tokens=1)
                stream = dispatch_call(self._get_configured_serve_handle(model), body, "completions", None)
                await asyncio.wait_for(_drain(stream), self._resilience.total_timeout_s)
                logger.info("woke %s: its engines answer again", model)
            except Exception as exc:  # the next request tries again
                logger.warning("waking %s failed: %r", model, exc)
            finally:
                self._waking.discard(model)

        in_background(wake())

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's lightweight update: the fallback and limits from the Serve config's
        `deployments[].user_config` (ServingSpec.ingress_user_config), no restart; in the
        many-model form also the models (ServingSpec.model_table), so adding one touches
        neither this replica nor any other model's engines."""
        if self._catalog is not None:
            self._take_models(user_config.get("models"))
        await self._hybrid.reconfigure(user_config)

    def _take_models(self, rows: Any) -> None:
        """The model table into Ray's ingress tables (serving/ingress/catalog.py); handles of models
        that left or moved are dropped, new ones looked up on their first request."""
        assert self._catalog is not None
        added, removed = self._catalog.update(rows)
        self._model_cards = self._catalog.cards()
        self._lora_paths = self._catalog.lora_paths()
        for model_id in list(self._default_serve_handles):
            if self._catalog.handle(model_id) is None:
                del self._default_serve_handles[model_id]
        for model_id in list(self._configured_serve_handles):
            if base_model_id(model_id) not in self._default_serve_handles:
                del self._configured_serve_handles[model_id]
        logger.info(
            "front door models: %s (added %s, removed %s)", sorted(self._model_cards), sorted(added), sorted(removed)
        )

    async def _get_model_id(self, model: str | None) -> str:
        """Ray's choice of model (404 for an unknown one), and in the many-model form the
        handle to its application, looked up on its first request."""
        model_id: str = await super()._get_model_id(model)
        base = base_model_id(model_id)
        if self._catalog is not None and base not in self._default_serve_handles:
            try:
                self._default_serve_handles[base] = await self._catalog.resolve(base)
            except Exception as exc:  # its application is not deployed (yet)
                logger.warning("no handle to model %s yet: %r", base, exc)
                raise Unservable(
                    Reason.DECODE_UNAVAILABLE, 503, MODEL_STARTING_MESSAGE, MODEL_STARTING_RETRY_S
                ) from None
        return model_id

    def _unknown_model(self, model: Any) -> Response | None:
        """OpenAI's 404 for a model (or `<model>:<adapter>`) this front door does not serve,
        before any limit is charged; the same words as for a model the key may not use
        (serving/ingress/routing.py), so a key learns nothing about models outside its own."""
        if not isinstance(model, str):
            return None  # absent: Ray picks the only model, or answers 400
        base, _, adapter = model.partition(ADAPTER_SEP)
        if base in self._model_cards and (not adapter or base in self._lora_paths):
            return None
        return self._hybrid.model_not_found(model)

    async def on_unservable(self, body: Any, raw_request: Request, failure: Any) -> Response | None:
        """The resilience layer's hook: the cluster cannot serve `body` (before any byte was
        sent). The external fallback answers when it is configured for that reason."""
        reason = _UNSERVABLE.get(str(getattr(failure.reason, "value", failure.reason)))
        if reason is None:
            return None
        data = body.model_dump(exclude_unset=True) if hasattr(body, "model_dump") else dict(body)
        endpoint = "chat" if "messages" in data else "completions"
        return await self._hybrid.unservable(endpoint, data, raw_request, reason, str(getattr(failure, "message", "")))

    async def _typed_call(
        self, request: Request, model_cls: Any, parent_method: Callable[..., Awaitable[Any]]
    ) -> Response:
        denied = self._auth.check(request)
        if denied is not None:
            return denied
        return await self._parsed_call(request, model_cls, parent_method)

    async def _parsed_call(
        self,
        request: Request,
        model_cls: Any,
        parent_method: Callable[..., Awaitable[Any]],
        *,
        admit_only: bool = False,
    ) -> Response:
        """An authenticated request: its body parsed, checked and typed, then served
        (`admit_only`: a request that generates nothing, charged one request on its model)."""
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        endpoint = _HYBRID_ENDPOINTS.get(model_cls)
        if endpoint is not None:
            # Before anything reads the body: no client field reaches engine internals.
            refused = refused_field(endpoint, body)
            if refused is not None:
                return error_response(400, refused[1], param=refused[0], code="unsupported_parameter")
        unknown = self._unknown_model(body.get("model"))
        if unknown is not None:
            return unknown
        if admit_only:
            model = body.get("model")
            denied = await self._hybrid.admit_only(request, model if isinstance(model, str) else None)
            if denied is not None:
                return denied
        try:
            typed = _adapter(model_cls).validate_python(body)
        except ValidationError as err:
            return _validation_error(err)
        try:
            if endpoint is None:
                return await parent_method(typed, request)
            # The body may gain stream_options.include_usage (usage is metered): parse again.
            return await self._hybrid.handle(
                request, body, endpoint, lambda b: parent_method(_adapter(model_cls).validate_python(b), request)
            )
        except Exception as exc:
            return _from_exception(exc)

    # --- the OpenAI endpoints (route table: Ray's DEFAULT_ENDPOINTS) -----------------
    async def chat(self, request: Request) -> Response:
        return _served_by(await self._typed_call(request, ChatCompletionRequest, super().chat))

    async def completions(self, request: Request) -> Response:
        return _served_by(await self._typed_call(request, CompletionRequest, super().completions))

    async def models(self, request: Request) -> Any:
        denied = self._auth.check(request)
        if denied is not None:
            return denied
        try:
            listing = await super().models()
        except Exception as exc:
            return _from_exception(exc)
        # A key limited to some models sees only those (and their adapters).
        listing.data = [m for m in listing.data if self._hybrid.may_use(request, m.id)]
        return listing

    async def model_data(self, model: str, request: Request) -> Any:
        denied = self._auth.check(request)
        if denied is not None:
            return denied
        if not self._hybrid.may_use(request, model):
            return self._hybrid.model_not_found(model)
        try:
            return await super().model_data(model)
        except Exception as exc:
            resp = _from_exception(exc)
            if resp.status_code == 404:
                return self._hybrid.model_not_found(model)
            return resp

    # Endpoints a chat model's P/D stack does not serve: refused (after auth, so the answer
    # says nothing to a client without a key), rather than reaching the engines around the
    # limits and routing of chat/completions.
    async def embeddings(self, request: Request) -> Response:
        return self._not_served(request, "/v1/embeddings")

    async def score(self, request: Request) -> Response:
        return self._not_served(request, "/v1/score")

    async def transcriptions(self, request: Request) -> Response:
        return self._not_served(request, "/v1/audio/transcriptions")

    # tokenize/detokenize are cheap and useful to clients: behind auth and the key's
    # requests-per-minute limit (they generate nothing, so no tokens are reserved).
    async def tokenize(self, request: Request) -> Response:
        return await self._limited_call(request, "tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._limited_call(request, "detokenize")

    def _not_served(self, request: Request, path: str) -> Response:
        denied = self._auth.check(request)
        if denied is not None:
            return denied
        return error_response(404, f"{path} is not served by this deployment.", code="endpoint_not_served")

    async def _limited_call(self, request: Request, endpoint: str) -> Response:
        denied = self._auth.check(request)
        if denied is not None:
            return denied
        return await self._parsed_call(request, _body_type(endpoint), getattr(super(), endpoint), admit_only=True)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


@cache
def _adapter(model_cls: Any) -> TypeAdapter:
    return TypeAdapter(model_cls)


# The endpoints hybrid routing handles, and faults13's unservable reasons in `fallback.when` terms.
_HYBRID_ENDPOINTS = {ChatCompletionRequest: "chat", CompletionRequest: "completions"}
_UNSERVABLE = {
    "decode_unavailable": "unavailable",
    "engine_error": "unavailable",
    "overloaded": "overloaded",
    "deadline": "deadline",
}


def _served_by(resp: Response) -> Response:
    """Every chat/completion answer says where it came from; the ingress's own are the cluster's."""
    if SERVED_BY not in resp.headers:
        resp.headers[SERVED_BY] = "cluster"
    return resp


def _body_type(endpoint: str) -> type:
    """The request model the parent's endpoint declares for `body`.

    Read from the parent's signature so the vLLM-specific endpoints (score, tokenize, ...)
    parse exactly as Ray's ingress would, without importing Ray's internal models.
    """
    return inspect.signature(getattr(OpenAiIngress, endpoint)).parameters["body"].annotation


def _ingress_cls_config(
    auth: Mapping[str, Any], resilience: Mapping[str, Any] | None = None, *, models_mode: bool = False
) -> dict[str, Any]:
    mode = auth_mode(auth.get("mode", AUTH_API_KEY), "args.auth.mode").value
    extra: dict[str, Any] = {
        "auth_mode": mode,
        "api_keys_env": auth.get("api_keys_env", DEFAULT_API_KEYS_ENV),
        "resilience": dict(resilience or ResilienceSpec().runtime_args()),
    }
    if models_mode:
        extra["models_mode"] = True
    return {"ingress_cls": AuthenticatedIngress, "ingress_extra_kwargs": extra}


_FRONT_DOOR_KEYS = {"mode", "auth", "resilience", "ingress_deployment_config"}
_PD_KEYS = {*_FRONT_DOOR_KEYS, "prefill_config", "decode_config"}
_AGG_KEYS = {*_FRONT_DOOR_KEYS, "llm_configs"}
_MODEL_APP_KEYS = {"model_id", "mode", "resilience", "prefill_config", "decode_config", "llm_configs"}


# Ray 2.60 registers its NIXL connector backend (per-replica side-channel port, a unique engine id,
# VLLM_NIXL_SIDE_CHANNEL_HOST) under the name "NixlConnector" only
# (ray/llm/_internal/serve/engines/vllm/kv_transfer/factory.py BUILTIN_BACKENDS); any other name
# falls back to a no-op backend, and two engines on one host would then bind the same side-channel
# port. vLLM's push connector runs the same NIXL handshake, so it gets the same backend. No public
# ray.serve.llm API registers a backend, hence the internal module path.
PUSH_CONNECTOR = "NixlPushConnector"
RAY_NIXL_BACKEND = "ray.llm._internal.serve.engines.vllm.kv_transfer.nixl:NixlConnectorBackend"


def _kv_connectors(args: dict) -> set[str]:
    configs = [args.get("prefill_config"), args.get("decode_config"), *(args.get("llm_configs") or [])]
    return {
        ((c.get("engine_kwargs") or {}).get("kv_transfer_config") or {}).get("kv_connector", "")
        for c in configs
        if isinstance(c, dict)
    }


def register_push_connector_backend() -> None:
    """Give vLLM's NixlPushConnector the NIXL backend Ray 2.60 gives NixlConnector (cluster-wide)."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if not KVConnectorBackendFactory.is_registered(PUSH_CONNECTOR):
        KVConnectorBackendFactory.register_backend(PUSH_CONNECTOR, RAY_NIXL_BACKEND)


def _data_parallel(args: Mapping[str, Any]) -> bool:
    roles = (args.get("prefill_config"), args.get("decode_config"))
    return any(((c or {}).get("engine_kwargs") or {}).get("data_parallel_size", 1) > 1 for c in roles)


def build_app(args: dict) -> Application:
    """Serve's application builder: `args` as rendered by ServingSpec.app_args()."""
    from serving import ray_internals

    ray_internals.check_hooks()  # a Ray without our hooks fails here, loudly, not later in silence
    args = dict(args)
    mode = args.get("mode", "disaggregated")
    builder: Callable[[dict], Application] | None
    if mode == "disaggregated":
        allowed, builder = _PD_KEYS, None
    elif mode == "aggregated":
        allowed, builder = _AGG_KEYS, build_openai_app
    elif mode == MODELS_MODE:
        allowed, builder = _FRONT_DOOR_KEYS, _build_front_door
    else:
        raise ValueError(f"args.mode {mode!r} is not 'disaggregated', 'aggregated' or {MODELS_MODE!r}")
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(f"unknown keys in args for mode {mode!r}: {', '.join(unknown)}")

    if PUSH_CONNECTOR in _kv_connectors(args):
        register_push_connector_backend()
    # Defaults live in the spec; a config rendered before resilience existed gets them.
    resilience = args.get("resilience") or ResilienceSpec().runtime_args()
    builder_args = {k: v for k, v in args.items() if k not in ("mode", "auth", "resilience")}
    builder_args["ingress_cls_config"] = _ingress_cls_config(
        args.get("auth") or {}, resilience, models_mode=mode == MODELS_MODE
    )
    if builder is None:
        if _data_parallel(args):
            # Ray's builder picks its data-parallel P/D servers (DPPDPrefillServer /
            # DPPDDecodeServer); the resilient decode tier does not cover them. The ingress's
            # deadlines and fast refusals still apply.
            return build_pd_openai_app(builder_args)
        # Ray's P/D graph with a decode tier that survives prefill failures.
        from serving.engines.pd_server import build_pd_app

        return build_pd_app(builder_args, resilience)
    return builder(builder_args)


def _build_front_door(builder_args: dict) -> Application:
    """The many-model front door: the ingress alone. Its models come from its user_config
    (serving/ingress/catalog.py); each model is its own application (build_model_app)."""
    from serving.engines.pd_server import bind_ingress

    cls_config = builder_args["ingress_cls_config"]
    return bind_ingress(
        cls_config["ingress_cls"],
        cls_config["ingress_extra_kwargs"],
        builder_args.get("ingress_deployment_config"),
        [],
        llm_deployments={},
        model_cards={},
        lora_paths={},
    )


def build_model_app(args: dict) -> Application:
    """One model's own application in the many-model form (`args` as rendered by
    ServingSpec.model_app_args()): its engines with no HTTP ingress. The application's ingress
    deployment is the server that answers chat and completions (P/D: the resilient decode
    tier bound to its prefill tier; aggregated: Ray's LLMServer), which the front door
    reaches by `serve.get_app_handle`. Adding or changing one model's application leaves
    every other application, engines included, as it is."""
    from ray.serve.llm import LLMConfig, build_llm_deployment

    from serving import ray_internals
    from serving.engines.pd_server import build_pd_engines, pd_args

    ray_internals.check_hooks()
    args = dict(args)
    unknown = sorted(set(args) - _MODEL_APP_KEYS)
    if unknown:
        raise ValueError(f"unknown keys in a model application's args: {', '.join(unknown)}")
    model_id, mode = args.get("model_id"), args.get("mode")
    if PUSH_CONNECTOR in _kv_connectors(args):
        register_push_connector_backend()
    resilience = args.get("resilience") or ResilienceSpec().runtime_args()
    if mode == "disaggregated":
        pd = pd_args({"prefill_config": args.get("prefill_config"), "decode_config": args.get("decode_config")})
        configs = [pd.decode_config, pd.prefill_config]
        app = build_pd_engines(pd, resilience)
    elif mode == "aggregated":
        llm_configs = args.get("llm_configs") or []
        if len(llm_configs) != 1:
            raise ValueError(f"model {model_id!r}: an aggregated model application has one LLM config")
        configs = [LLMConfig.model_validate(llm_configs[0])]
        app = build_llm_deployment(configs[0])
    else:
        raise ValueError(f"model {model_id!r}: args.mode {mode!r} is not 'disaggregated' or 'aggregated'")
    stray = [c.model_id for c in configs if c.model_id != model_id]
    if stray:
        raise ValueError(f"model {model_id!r}: its engines serve {stray[0]!r}")
    return app
