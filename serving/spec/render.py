"""The serving spec written for Ray: one validated `ServingSpec` -> the Serve config.

What flows through here: a `ServingSpec` and a `Target` (GPU type or CPU, where the code lives,
extra environment) -> each engine role's Ray Serve LLM `LLMConfig` as a dict (`llm_config`:
engine kwargs, KV transfer, autoscaling, placement) -> one model's builder args
(`engine_args`), the front door application's `args` (`app_args`) and its ingress's
`user_config` (`ingress_user_config`, with the model table in the many-model form) -> the
Serve config (`serve_config`) that the RayService's `serveConfigV2` and `make serve` both use.
`ServingSpec` exposes each as a method; the spec says what a deployment is, this module how
Ray is told. pydantic-free: plain dicts from the validated spec, the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from serving.spec.base import (
    API_KEYS_ENV,
    APP_IMPORT_PATH,
    APP_NAME,
    BATCH_FROM_STREAMS_KEY,
    EAGER_SERVER_CLS,
    FIRST_CHUNK_KEY,
    KV_EVENTS_PORT_BASE,
    KV_PORT_STRIDE,
    KV_REPLAY_PORT_OFFSET,
    KV_ROUTER_CLS,
    KV_ROUTING_STATS_PERIOD_S,
    KV_TOKEN_PORT_BASE,
    MODEL_APP_IMPORT_PATH,
    MODEL_APP_PREFIX,
    MODELS_MODE,
    PREFIX_ROUTER_CLS,
    SERVE_PORT,
    SERVING_ENV,
    TOKENIZE_ONCE_KEY,
    FirstChunk,
    KvBackend,
    Mode,
    MoeParallelism,
    Router,
)
from serving.spec.hybrid import FALLBACK_API_KEY_ENV, INGRESS_DEPLOYMENT, KeyLimitSpec, RateLimitSpec, TokenPrice
from serving.spec.offload import compose
from serving.spec.roles import RoleSpec
from serving.spec.scaling import policy_config, slo_thresholds
from serving.spec.target import Target

if TYPE_CHECKING:
    from serving.spec.serving import ServingSpec


# --- one engine role -------------------------------------------------------------------------
def _model_source(spec: ServingSpec) -> str | dict[str, str]:
    # Ray Serve LLM reads a bucket through its mirror config; a repo id or path as is.
    src = spec.model.source
    return {"bucket_uri": src} if src.startswith("s3://") else src


def _kv_role(role: str) -> str:
    # Prefill produces KV, decode consumes it, for both NIXL connectors: vLLM deprecates
    # kv_both for NIXL (NixlBaseConnector.__init__, 0.29 and 0.32: "set kv_role='kv_producer'
    # for prefill instances and kv_role='kv_consumer' for decode instances"), and the push
    # connector keys decode's checks on kv_consumer (a PP decode is refused there). A
    # consumer still prefills a request that carries no kv_transfer_params itself, which is
    # what local prefill on decode relies on (the transfer direction comes from the params).
    return "kv_producer" if role == "prefill" else "kv_consumer"


def _kv_transfer_config(spec: ServingSpec, role: str, target: Target) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "kv_connector": spec.kv_transfer.connector.value,
        "kv_role": _kv_role(role),
        "kv_buffer_device": "cpu" if target.cpu else spec.kv_transfer.buffer_device.value,
        "kv_load_failure_policy": spec.kv_transfer.load_failure_policy.value,
    }
    backend = spec.kv_transfer.requested_backend or target.kv_backend
    extra = dict(spec.kv_transfer.extra_config)
    if spec.kv_transfer.lease_duration_s is not None:
        extra["kv_lease_duration"] = spec.kv_transfer.lease_duration_s
    # Always explicit: vLLM's NixlConnector defaults to UCX, which on EFA silently
    # falls back to TCP (ai-dynamo/nixl#909); the policy pack reads this key.
    kv["kv_connector_extra_config"] = {**extra, "backends": [KvBackend(backend).value]}
    # A pool with a KV offload tier: NIXL and vLLM's OffloadingConnector under MultiConnector.
    return compose(kv, target.role_kv_offload.get(role))


def _engine_kwargs(spec: ServingSpec, role: str, rs: RoleSpec, target: Target) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": spec.model.dtype.value,
        "max_model_len": spec.model.max_model_len,
        "tensor_parallel_size": rs.tensor_parallel_size,
        "pipeline_parallel_size": rs.pipeline_parallel_size,
        # Prompts stay out of the logs (Ray 2.60 defaults this to False in
        # engines/vllm/vllm_models.py; stated here so that no default can flip it).
        "enable_log_requests": False,
        # usage.prompt_tokens_details.cached_tokens on every answer: the prompt tokens the
        # prefix cache served, which a request's cost leaves out (serving/ingress/costs.py). A
        # FrontendArgs field in vLLM 0.29 and 0.32, which Ray hands vLLM's OpenAI layer.
        "enable_prompt_tokens_details": True,
    }
    if rs.data_parallel_size > 1:
        # Ray Serve LLM's P/D builder switches to its DP servers on this key
        # (serving_patterns/prefill_decode/builder.py: DPPDPrefillServer / DPPDDecodeServer).
        kwargs["data_parallel_size"] = rs.data_parallel_size
    if rs.moe_parallelism is MoeParallelism.EXPERT:
        kwargs["enable_expert_parallel"] = True
    if not target.cpu:
        kwargs["gpu_memory_utilization"] = spec.model.gpu_memory_utilization
    if target.traces_endpoint:
        kwargs["otlp_traces_endpoint"] = target.traces_endpoint
    if spec.mode is Mode.DISAGGREGATED:
        kwargs["kv_transfer_config"] = _kv_transfer_config(spec, role, target)
    kwargs.update(spec.model.loading.engine_kwargs(spec.model.source))
    # The same on every role: prefill preprocesses the same chat request (serving/spec/tools.py).
    kwargs.update(spec.model.openai_kwargs())
    if spec.lora is not None:
        kwargs.update(spec.lora.engine_kwargs())
    kwargs.update(spec.engine_kwargs)
    return kwargs


def _policy(spec: ServingSpec, role: str, rs: RoleSpec, target: Target) -> dict[str, Any] | None:
    # The aggregated engine runs under the decode role and its policy.
    planned = dict(slo_thresholds(role, spec.slo.ttft_seconds, spec.slo.itl_seconds, rs.target_ongoing_requests))
    planned.update(target.role_thresholds.get(role, {}))
    return policy_config(
        role,
        rs.signals,
        planned,
        target_ongoing=rs.target_ongoing_requests,
        metrics_selector=target.metrics_selectors.get(role),
    )


def _autoscaling(spec: ServingSpec, role: str, rs: RoleSpec, target: Target) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {
        "min_replicas": rs.min_replicas,
        "max_replicas": rs.max_replicas,
        "target_ongoing_requests": rs.target_ongoing_requests,
        "upscale_delay_s": rs.upscale_delay_s,
        "downscale_delay_s": rs.downscale_delay_s,
    }
    if rs.initial_replicas is not None or rs.min_replicas == 0:
        autoscaling["initial_replicas"] = rs.starting_replicas
    policy = _policy(spec, role, rs, target)
    if policy is not None:
        autoscaling["policy"] = policy
    return autoscaling


def llm_config(spec: ServingSpec, role: str, rs: RoleSpec, target: Target) -> dict[str, Any]:
    """One engine role as Ray Serve LLM's `LLMConfig` (a dict its builders validate)."""
    # One bundle per GPU worker of one Serve replica (a DP rank): vLLM's Ray executor starts
    # one worker per GPU bundle (vllm/v1/executor/ray_executor.py), so bundles are never
    # per node.
    label = spec.pool_label(role)
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": spec.model.id, "model_source": _model_source(spec)},
        "engine_kwargs": _engine_kwargs(spec, role, rs, target),
        "deployment_config": {
            "autoscaling_config": _autoscaling(spec, role, rs, target),
            "max_ongoing_requests": rs.max_ongoing_requests,
            "max_queued_requests": rs.max_queued_requests,
            # Scale-in and restarting updates let the replica's streams finish (serving/spec/drain.py).
            **spec.drain().deployment_options("prefill" if role == "prefill" else "engine"),
            # One selector per placement-group bundle (one bundle per GPU/worker).
            "placement_group_bundle_label_selector": [
                {spec.placement.label_key: label} for _ in range(rs.gpus_per_rank)
            ],
        },
    }
    if role in target.replica_cpus:
        # The replica actor's own CPUs (its API side: vLLM's front end, Serve's streaming); Ray
        # Serve LLM adds them to the first bundle (llm_server.py get_deployment_options).
        config["deployment_config"]["ray_actor_options"] = {"num_cpus": target.replica_cpus[role]}
    if spec.lora is not None:
        # The same path on both P/D legs (Ray's PDServingArgs refuses a mismatch).
        config["lora_config"] = spec.lora.llm_config()
    if rs.router is Router.PREFIX_CACHE_AFFINITY:
        config["deployment_config"]["request_router_config"] = {"request_router_class": PREFIX_ROUTER_CLS}
    config["experimental_configs"] = {
        "stream_batching_interval_ms": spec.streaming.batch_interval_ms,
        # Read by serving.engines.streaming's mixin, wherever a server class carries it.
        FIRST_CHUNK_KEY: spec.streaming.first_chunk.value,
        BATCH_FROM_STREAMS_KEY: spec.streaming.batch_from_streams,
    }
    if rs.router is Router.KV_AWARE:
        # Ray's builder sees a KVAwareRouter subclass and configures the engines' KV events
        # itself (routing_policies/kv_aware/utils.py); the ports come from kv_ports().
        config["deployment_config"]["request_router_config"] = {
            "request_router_class": KV_ROUTER_CLS,
            "request_routing_stats_period_s": KV_ROUTING_STATS_PERIOD_S,
        }
        config["experimental_configs"].update(kv_ports(0))
    if role == "decode" and spec.mode is Mode.DISAGGREGATED and spec.kv_transfer.reuse_prompt_token_ids:
        config["experimental_configs"][TOKENIZE_ONCE_KEY] = True
    if spec.streaming.first_chunk is FirstChunk.EAGER and spec.mode is Mode.AGGREGATED:
        # Ray's P/D builder fixes the decode class (PDDecodeServer): server_cls counts for
        # the aggregated engine only.
        config["server_cls"] = EAGER_SERVER_CLS
    if target.cpu:
        config["accelerator_config"] = {"kind": "cpu"}
    else:
        config["accelerator_type"] = target.role_accelerator_types.get(role, target.accelerator_type)
    config["runtime_env"] = {"env_vars": {**dict(target.engine_env), **SERVING_ENV}}
    return config


def kv_ports(slot: int) -> dict[str, int]:
    """The KV-routed engines' port bases of the `slot`-th model (Ray's experimental_configs keys)."""
    return {
        "KV_EVENTS_PORT_BASE": KV_EVENTS_PORT_BASE + slot * KV_PORT_STRIDE,
        "KV_TOKEN_PORT_BASE": KV_TOKEN_PORT_BASE + slot * KV_PORT_STRIDE,
    }


def kv_bound_ports(slot: int, replicas: int, dp_size: int = 1) -> list[tuple[str, int]]:
    """(name, port) of every socket the `slot`-th model's KV-routed engines bind on a node holding
    `replicas` of them (Ray 2.60 routing_policies/kv_aware/vllm/kv_events.py): the KV-event PUB
    socket at its base + the replica's node-local rank and the replay socket 1000 above (with
    data parallelism vLLM offsets both by the global dp_rank instead, any of 0..dp_size-1 on any
    node), and the prompt-token PULL socket at its own base + the node-local rank."""
    ports = kv_ports(slot)
    events, tokens = ports["KV_EVENTS_PORT_BASE"], ports["KV_TOKEN_PORT_BASE"]
    offsets = range(dp_size) if dp_size > 1 else range(replicas)
    return [
        *(
            port
            for rank in offsets
            for port in (
                (f"kv{slot}-ev{rank}", events + rank),
                (f"kv{slot}-rp{rank}", events + KV_REPLAY_PORT_OFFSET + rank),
            )
        ),
        *((f"kv{slot}-tk{rank}", tokens + rank) for rank in range(replicas)),
    ]


# --- one model, the front door, the applications -----------------------------------------------
def engine_args(spec: ServingSpec, target: Target) -> dict[str, Any]:
    """One model's engines as Ray Serve LLM's builders take them: `llm_configs` (aggregated,
    build_openai_app) or `prefill_config` and `decode_config` (build_pd_openai_app)."""
    roles = spec.engine_roles()
    if spec.mode is Mode.AGGREGATED:
        return {"llm_configs": [llm_config(spec, "decode", roles["decode"], target)]}
    return {
        "prefill_config": llm_config(spec, "prefill", roles["prefill"], target),
        "decode_config": llm_config(spec, "decode", roles["decode"], target),
    }


def app_args(spec: ServingSpec, target: Target) -> dict[str, Any]:
    """The `args` of the front door application: what serving.app:build_app receives.

    One-model form: `mode` and that model's engine args (unchanged). Many-model form:
    `mode: models` and the shared keys only (the models are in the ingress's user_config
    and in their own applications: `model_app_args`), so adding a model leaves them alone.
    """
    ingress: dict[str, Any] = {
        "autoscaling_config": {
            "min_replicas": spec.ingress.min_replicas,
            "max_replicas": spec.ingress.max_replicas,
        },
        "max_ongoing_requests": spec.ingress.max_ongoing_requests,
        "max_queued_requests": spec.ingress.max_queued_requests,
        **spec.drain().deployment_options("ingress"),
        "ray_actor_options": {
            "label_selector": {spec.placement.label_key: spec.placement.head},
            # The head offers no CPUs to Serve replicas (it must not take model work);
            # the ingress is I/O-bound and asks for none.
            "num_cpus": 0,
            "runtime_env": {"env_vars": {**dict(target.ingress_env), **SERVING_ENV}},
        },
    }
    args: dict[str, Any] = {
        "auth": {"mode": spec.auth.value, "api_keys_env": API_KEYS_ENV},
        # decode serves every request's tokens (the aggregated engine is the decode role).
        "resilience": spec.resilience.runtime_args(target.cold_start_s.get("decode")),
        "ingress_deployment_config": ingress,
        "max_body_bytes": spec.ingress.max_body_mib << 20,
    }
    if not spec.many:
        return {"mode": spec.mode.value, **args, **engine_args(spec, target)}
    return {"mode": MODELS_MODE, **args}


def model_app_args(spec: ServingSpec, target: Target) -> dict[str, Any]:
    """The `args` of one model's own application (many-model form; `spec` is one of
    `served`): what serving.app:build_model_app receives."""
    return {
        "model_id": spec.model.id,
        "mode": spec.mode.value,
        "resilience": spec.resilience.runtime_args(),
        **engine_args(spec, target),
    }


def model_table(spec: ServingSpec) -> list[dict[str, Any]]:
    """The front door's view of the models (ingress user_config `models`), in order: the id
    clients send, the application and mode that serve it, its context length (its card in
    `/v1/models`) and its adapters' path."""
    return [
        {
            "model_id": m.model.id,
            "app_name": MODEL_APP_PREFIX + m.model.id,
            "mode": m.mode.value,
            "max_model_len": m.model.max_model_len,
            "lora_path": m.lora.adapters_path if m.lora is not None else None,
        }
        for m in spec.served
    ]


def _rates(limit: RateLimitSpec) -> dict[str, int]:
    return {"requests_per_minute": limit.requests_per_minute, "tokens_per_minute": limit.tokens_per_minute}


def _key_entry(entry: KeyLimitSpec) -> dict[str, Any]:
    own = entry.own_limits
    rendered: dict[str, Any] = _rates(own) if own is not None else {}
    if entry.models is not None:
        rendered["models"] = list(entry.models)
    if entry.budget is not None:
        b = entry.budget
        rendered["budget"] = {"usd": b.usd, "period": b.period.value, "when_exceeded": b.when_exceeded}
    if entry.cache_group is not None:
        rendered["cache_group"] = entry.cache_group
    return rendered


def _per_token(price: TokenPrice) -> dict[str, float]:
    """A provider's price per million tokens as USD per token (what the ingress multiplies)."""
    cached = price.cached_prompt_per_million
    return {
        "prompt": price.prompt_per_million / 1e6,
        "completion": price.completion_per_million / 1e6,
        "cached_prompt": (price.prompt_per_million if cached is None else cached) / 1e6,
    }


def costs(spec: ServingSpec, targets: Mapping[str, Target] | None) -> dict[str, Any]:
    """Per served model id, what its tokens cost on the cluster (USD per token, by phase: the
    Target's prices from the capacity plan) and whether it runs P/D (its usage's cached
    tokens are then the prefill engine's only where vLLM hands them to decode:
    serving/ingress/costs.py); models with no priced Target are left out (counted in tokens
    only)."""
    out: dict[str, Any] = {}
    for m in spec.served:
        target = (targets or {}).get(m.model.id)
        if target is None or not target.token_prices:
            continue
        out[m.model.id] = {
            **{f"{phase}_usd_per_token": usd for phase, usd in sorted(target.token_prices.items())},
            "disaggregated": m.mode is Mode.DISAGGREGATED,
        }
    return out


def _fallback(spec: ServingSpec) -> dict[str, Any] | None:
    fb = spec.fallback
    if fb is None:
        return None
    return {
        "base_url": fb.base_url,
        # Many-model form: the map names each model's provider model (spec_models).
        "models": fb.models_for(spec.model.id),
        "when": [w.value for w in fb.when],
        # The engine deployment the ingress calls: decode (or the aggregated engine);
        # with several models, the smallest of their bounds.
        "overflow_at": fb.overflow_at or min(m.decode.max_ongoing_requests for m in spec.served),
        "first_token_timeout_s": fb.first_token_timeout_s,
        "timeout_s": fb.timeout_s,
        "connect_timeout_s": fb.connect_timeout_s,
        "retries": fb.retries,
        "api_key_env": FALLBACK_API_KEY_ENV,
        # The relay joins the provider's events as the engines batch their tokens.
        "batch_interval_ms": spec.streaming.batch_interval_ms,
        # What a request the provider serves costs its key, per our model id (USD per token).
        "prices": {m: _per_token(p) for m, p in sorted(fb.prices.items())},
    }


def ingress_user_config(spec: ServingSpec, targets: Mapping[str, Target] | None = None) -> dict[str, Any]:
    """The ingress deployment's user_config: the fallback, the per-key limits, budgets, model
    access and prefix-cache isolation (snake_case, read by
    serving.ingress.limits.LimitsConfig.from_user_config), and what each model's tokens cost
    on the cluster where `targets` (per model id) carry the plan's prices.

    A user_config change reaches the running ingress through `reconfigure` (Serve's
    lightweight update); application `args` changes rebuild every deployment, engines
    included. So what operators tune (limits, provider) lives here, not in args.
    """
    limits = spec.limits
    return {
        "fallback": _fallback(spec),
        "limits": {
            **_rates(limits),
            # A key's own limits when its entry names one; the models it may use when listed.
            "keys": {k: _key_entry(v) for k, v in sorted(limits.keys.items())},
            # Every key's limits on a model, unless the key has its own.
            "models": {m: _rates(v) for m, v in sorted(limits.models.items())},
            "when_ledger_unreachable": limits.when_ledger_unreachable,
            # Where the shared limits actor lives: with the ingress, on the head.
            "label_selector": {spec.placement.label_key: spec.placement.head},
            # Each key's own prefix cache (its cache_salt), or one shared by every key.
            "cache_isolation": limits.cache_isolation,
        },
        "costs": costs(spec, targets),
    }


def serve_config(
    spec: ServingSpec, target: Target, *, port: int = SERVE_PORT, model_targets: Mapping[str, Target] | None = None
) -> dict[str, Any]:
    """The Serve config (RayService serveConfigV2 / `serve deploy` file) for `target`
    (and, with several models, each model's own Target by id: one application each)."""
    # Each model's tokens priced by the Target its engines run on.
    priced = {m.model.id: (model_targets or {}).get(m.model.id, target) for m in spec.served}
    user_config = ingress_user_config(spec, priced)
    if spec.many:
        user_config["models"] = model_table(spec)
    app: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": APP_IMPORT_PATH,
        "args": app_args(spec, target),
        "deployments": [{"name": INGRESS_DEPLOYMENT, "user_config": user_config}],
    }
    apps = [app]
    if spec.many:
        targets = model_targets or {}
        for slot, m in enumerate(spec.served):
            args = model_app_args(m, targets.get(m.model.id, target))
            if m.kv_routed:
                args["prefill_config"]["experimental_configs"].update(kv_ports(slot))
            apps.append(
                {
                    "name": MODEL_APP_PREFIX + m.model.id,
                    # Not over HTTP: the front door calls it through deployment handles.
                    "route_prefix": None,
                    "import_path": MODEL_APP_IMPORT_PATH,
                    "args": args,
                }
            )
    if target.working_dir:
        for a in apps:
            a["runtime_env"] = {"working_dir": target.working_dir}
    return {
        "proxy_location": target.proxy_location,
        # Serve's own request timeout backs the ingress's total deadline up (a hung
        # ingress still answers), a little later so the ingress's JSON error wins.
        "http_options": {
            "host": "0.0.0.0",
            "port": port,
            "request_timeout_s": spec.drain().proxy_request_s,
        },
        "applications": apps,
    }
