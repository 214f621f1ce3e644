"""The Serve builders: the import paths of the Serve config (`serving.app:build_app`, `:build_model_app`).

What flows through here: the `args` that `serving.spec.ServingSpec` renders (`app_args()`,
`model_app_args()`) -> validated by one typed model per builder (`AppArgs`, `ModelAppArgs`:
unknown keys and a mode's missing parts refused before anything is built) -> a Serve
`Application`:
  disaggregated  the front door (serving/ingress/server.py) -> the resilient decode server ->
                 prefill (serving/engines/pd_server.py), KV moved by the engines' NIXL connector
  aggregated     the front door -> Ray Serve LLM's LLMServer (with the eager first chunk)
  models         the front door alone; each model is its own application (`build_model_app`:
                 its engines, no HTTP route), the models listed in the front door's user_config
Ray Serve LLM's own builders (`build_llm_deployment`, `PDServingArgs`, `LLMServingArgs`) build
and validate the engines; the front door is bound with our route table (`bind_ingress`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray.serve import Application

from serving.engines.pd_server import build_pd_engines, pd_args
from serving.ingress.auth import auth_mode
from serving.ingress.pipeline import DEFAULT_MAX_BODY_BYTES
from serving.ingress.server import AuthenticatedIngress, endpoint_map
from serving.spec import API_KEYS_ENV, MODELS_MODE, AuthMode, ResilienceSpec, offload

# Ray 2.60 registers its NIXL connector backend (per-replica side-channel port, a unique engine id,
# VLLM_NIXL_SIDE_CHANNEL_HOST) under the name "NixlConnector" only
# (ray/llm/_internal/serve/engines/vllm/kv_transfer/factory.py BUILTIN_BACKENDS); any other name
# falls back to a no-op backend, and two engines on one host would then bind the same side-channel
# port. vLLM's push connector runs the same NIXL handshake, so it gets the same backend. No public
# ray.serve.llm API registers a backend, hence the internal module path.
PUSH_CONNECTOR = "NixlPushConnector"
RAY_NIXL_BACKEND = "ray.llm._internal.serve.engines.vllm.kv_transfer.nixl:NixlConnectorBackend"


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AuthArgs(_Args):
    mode: str = AuthMode.API_KEY.value
    api_keys_env: str = API_KEYS_ENV

    @model_validator(mode="after")
    def _mode(self) -> AuthArgs:
        auth_mode(self.mode, "args.auth.mode")
        return self


def _resilience(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """args.resilience as rendered (refused when it is not complete); a config rendered
    before resilience existed gets the spec's defaults."""
    if not value:
        return ResilienceSpec().runtime_args()
    ResilienceSpec.from_args(value)
    return dict(value)


class AppArgs(_Args):
    """`build_app`'s args (ServingSpec.app_args)."""

    mode: str = "disaggregated"
    auth: AuthArgs = Field(default_factory=AuthArgs)
    resilience: dict[str, Any] | None = None
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, gt=0)
    ingress_deployment_config: dict[str, Any] | None = None
    prefill_config: dict[str, Any] | None = None
    decode_config: dict[str, Any] | None = None
    llm_configs: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _parts(self) -> AppArgs:
        modes = ("disaggregated", "aggregated", MODELS_MODE)
        if self.mode not in modes:
            raise ValueError(f"args.mode {self.mode!r} is not 'disaggregated', 'aggregated' or {MODELS_MODE!r}")
        engines = {
            "prefill_config": self.prefill_config,
            "decode_config": self.decode_config,
            "llm_configs": self.llm_configs,
        }
        allowed = {
            "disaggregated": {"prefill_config", "decode_config"},
            "aggregated": {"llm_configs"},
            MODELS_MODE: set(),
        }[self.mode]
        stray = sorted(k for k, v in engines.items() if v is not None and k not in allowed)
        if stray:
            raise ValueError(f"unknown keys in args for mode {self.mode!r}: {', '.join(stray)}")
        self.resilience = _resilience(self.resilience)
        return self

    def ingress_cls_config(self) -> dict[str, Any]:
        """Ray's `ingress_cls_config` for the front door (what its own builders take)."""
        return {"ingress_cls": AuthenticatedIngress, "ingress_extra_kwargs": self.ingress_kwargs()}

    def ingress_kwargs(self) -> dict[str, Any]:
        """The front door's constructor arguments beyond Ray's (ingress_extra_kwargs)."""
        extra: dict[str, Any] = {
            "auth_mode": self.auth.mode,
            "api_keys_env": self.auth.api_keys_env,
            "resilience": self.resilience,
            "max_body_bytes": self.max_body_bytes,
        }
        if self.mode == MODELS_MODE:
            extra["models_mode"] = True
        return extra


class ModelAppArgs(_Args):
    """`build_model_app`'s args (ServingSpec.model_app_args): one model's engines."""

    model_id: str
    mode: str
    resilience: dict[str, Any] | None = None
    prefill_config: dict[str, Any] | None = None
    decode_config: dict[str, Any] | None = None
    llm_configs: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _parts(self) -> ModelAppArgs:
        if self.mode not in ("disaggregated", "aggregated"):
            raise ValueError(f"model {self.model_id!r}: args.mode {self.mode!r} is not 'disaggregated' or 'aggregated'")
        if self.mode == "aggregated" and len(self.llm_configs or []) != 1:
            raise ValueError(f"model {self.model_id!r}: an aggregated model application has one LLM config")
        self.resilience = _resilience(self.resilience)
        return self


def _validated(cls: type[_Args], args: Mapping[str, Any], where: str) -> Any:
    """`args` as `cls`, or ValueError naming the first problem (Serve shows it as the
    application's deploy error)."""
    try:
        return cls.model_validate(dict(args))
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        kind, msg = first.get("type"), str(first.get("msg"))
        if kind == "extra_forbidden":
            raise ValueError(f"unknown keys in {where}: {loc}") from None
        if kind == "value_error":  # our own checks' messages say where themselves
            raise ValueError(msg.removeprefix("Value error, ")) from None
        raise ValueError(f"{where}.{loc} {first.get('input')!r}: {msg}") from None


def _kv_connectors(args: Mapping[str, Any]) -> set[str]:
    """The KV connectors the rendered args' engines use."""
    configs = [args.get("prefill_config"), args.get("decode_config"), *(args.get("llm_configs") or [])]
    kvs = [(c.get("engine_kwargs") or {}).get("kv_transfer_config") or {} for c in configs if isinstance(c, Mapping)]
    # A KV offload tier nests the NIXL connector under MultiConnector (serving/spec/offload.py);
    # Ray 2.60's MultiConnectorBackend looks up each child's backend by its own name.
    return {c.get("kv_connector", "") for kv in kvs if isinstance(kv, Mapping) for c in (kv, *offload.children(kv))}


def register_push_connector_backend() -> None:
    """Give vLLM's NixlPushConnector the NIXL backend Ray 2.60 gives NixlConnector (cluster-wide)."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if not KVConnectorBackendFactory.is_registered(PUSH_CONNECTOR):
        KVConnectorBackendFactory.register_backend(PUSH_CONNECTOR, RAY_NIXL_BACKEND)


def _engine_setup(args: BaseModel) -> None:
    from serving import ray_internals

    ray_internals.check_hooks()  # a Ray without our hooks fails here, loudly, not later in silence
    if PUSH_CONNECTOR in _kv_connectors(args.model_dump()):
        register_push_connector_backend()


def _data_parallel(args: AppArgs) -> bool:
    roles = (args.prefill_config, args.decode_config)
    return any(((c or {}).get("engine_kwargs") or {}).get("data_parallel_size", 1) > 1 for c in roles)


def build_app(args: dict) -> Application:
    """Serve's application builder: `args` as rendered by ServingSpec.app_args()."""
    a: AppArgs = _validated(AppArgs, args, "args")
    _engine_setup(a)
    if a.mode == "disaggregated":
        builder_args = {
            "prefill_config": a.prefill_config,
            "decode_config": a.decode_config,
            "ingress_deployment_config": a.ingress_deployment_config or {},
            "ingress_cls_config": a.ingress_cls_config(),
        }
        pd = pd_args(builder_args)  # Ray's own PDServingArgs: the same inputs accepted and refused
        if _data_parallel(a):
            # Ray's builder picks its data-parallel P/D servers (DPPDPrefillServer /
            # DPPDDecodeServer); the resilient decode tier does not cover them. The front
            # door's deadlines and refusals still apply (but not its extra routes).
            from ray.serve.llm import build_pd_openai_app

            return build_pd_openai_app(builder_args)
        engines = {pd.decode_config.model_id: build_pd_engines(pd, a.resilience or {})}
        return _front_door(a, [pd.decode_config], engines)
    if a.mode == "aggregated":
        from ray.serve.llm import LLMServingArgs, build_llm_deployment

        configs = list(LLMServingArgs.model_validate({"llm_configs": a.llm_configs}).llm_configs)
        return _front_door(a, configs, {c.model_id: build_llm_deployment(c) for c in configs})
    return _front_door(a, [], {})


def _front_door(a: AppArgs, configs: list[Any], engines: Mapping[str, Any]) -> Application:
    """The front door bound to its models' engines (none in the many-model form: its models
    come from its user_config, serving/ingress/catalog.py)."""
    from serving import ray_internals as ri

    return bind_ingress(
        AuthenticatedIngress,
        a.ingress_kwargs(),
        a.ingress_deployment_config,
        configs,
        llm_deployments=engines,
        model_cards={c.model_id: ri.to_model_metadata(c.model_id, c) for c in configs},
        lora_paths={c.model_id: c.lora_config.dynamic_lora_loading_path for c in configs if c.lora_config is not None},
    )


def bind_ingress(
    ingress_cls: Any,
    extra_kwargs: Mapping[str, Any],
    deployment_config: Mapping[str, Any] | None,
    llm_configs: list[Any],
    *,
    llm_deployments: Mapping[str, Any],
    model_cards: Mapping[str, Any],
    lora_paths: Mapping[str, str],
) -> Any:
    """The OpenAI front door deployment bound to its engines, as Ray's builders bind it (the
    class's default options for `llm_configs` under the rendered `deployment_config`), with
    our route table on Ray's middleware stack less its BaseHTTPMiddleware (ingress/asgi.py)."""
    from ray import serve
    from ray.serve.llm.ingress import make_fastapi_ingress

    from serving import ray_internals as ri
    from serving.ingress.asgi import ingress_app

    options = ri.maybe_apply_llm_deployment_config_defaults(
        ingress_cls.get_deployment_options(llm_configs), dict(deployment_config or {})
    )
    deployment: Any = serve.deployment
    return deployment(
        make_fastapi_ingress(ingress_cls, endpoint_map=endpoint_map(), app=ingress_app()), **options
    ).bind(
        llm_deployments=dict(llm_deployments),
        model_cards=dict(model_cards),
        lora_paths=dict(lora_paths),
        **extra_kwargs,
    )


def build_model_app(args: dict) -> Application:
    """One model's own application in the many-model form (`args` as rendered by
    ServingSpec.model_app_args()): its engines with no HTTP ingress. The application's ingress
    deployment is the server that answers chat and completions (P/D: the resilient decode
    tier bound to its prefill tier; aggregated: Ray's LLMServer), which the front door
    reaches by `serve.get_app_handle`. Adding or changing one model's application leaves
    every other application, engines included, as it is."""
    from ray.serve.llm import LLMConfig, build_llm_deployment

    a: ModelAppArgs = _validated(ModelAppArgs, args, "a model application's args")
    _engine_setup(a)
    if a.mode == "disaggregated":
        pd = pd_args({"prefill_config": a.prefill_config, "decode_config": a.decode_config})
        configs = [pd.decode_config, pd.prefill_config]
        app = build_pd_engines(pd, a.resilience or {})
    else:
        configs = [LLMConfig.model_validate((a.llm_configs or [])[0])]
        app = build_llm_deployment(configs[0])
    stray = [c.model_id for c in configs if c.model_id != a.model_id]
    if stray:
        raise ValueError(f"model {a.model_id!r}: its engines serve {stray[0]!r}")
    return app
