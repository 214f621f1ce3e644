"""The serving spec: one typed description of an LLM deployment, rendered to a Serve config.

What flows through here: a stack file's `serving:` block (or the local run's defaults) is
validated into a `ServingSpec`; `ServingSpec.serve_config(target)` renders the Ray Serve
config (`applications:` and friends) whose `args` feed `serving.app:build_app`. The
RayService's `serveConfigV2` and `make serve` both come from this one function; only the
`Target` (GPU type or CPU, where the code lives, extra environment) differs.

A spec holds one model (its keys at the top of `serving:`) or several (`serving.models`, one
front door for all): `served` gives one complete one-model spec per model. With several, the
Serve config has one application per model (`MODEL_APP_PREFIX` + id, no HTTP route, its own
`args`: that model's engine configs, placed on its node pools by their Ray node label) and the
front door application, whose ingress learns the models from its `user_config` (`models`).
Ray 2.60 rebuilds an application, and replaces all its replicas, when its `args` change
(ray/serve/_private/deploy_utils.py `get_app_code_version` hashes import_path, runtime_env
and args); a `user_config` change only reconfigures the running replicas. So adding a model
adds an application and changes the ingress's user_config: no other model's engine restarts.

The spec's parts live in serving/spec/base.py (constants, base model, enums),
serving/spec/roles.py (model, roles, KV transfer, deadlines, SLOs), serving/spec/models.py
(pools per role, LoRA, the `serving.models` entry), serving/spec/hybrid.py (fallback, limits)
and serving/spec/target.py (where it runs); this module composes them, renders, and
re-exports them (the spec's one public surface). pydantic and the standard library only: the Pulumi program imports it, and
the Pulumi program must not need Ray or vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from serving.spec.base import (
    API_KEYS_ENV,
    APP_IMPORT_PATH,
    APP_NAME,
    EAGER_SERVER_CLS,
    FIRST_CHUNK_KEY,
    HAPROXY_HARD_STOP_ENV,
    MODEL_APP_IMPORT_PATH,
    MODEL_APP_PREFIX,
    MODELS_MODE,
    PREFIX_ROUTER_CLS,
    PROXY_TIMEOUT_MARGIN_S,
    RESERVED_ENGINE_KWARGS,
    SERVE_PORT,
    SERVING_ENV,
    VLLM_DEFAULT_KV_LEASE_S,
    AuthMode,
    DataPlane,
    FirstChunk,
    KvBackend,
    KvConnector,
    Mode,
    MoeParallelism,
    Router,
    SpecModel,
)
from serving.spec.drain import DrainPlan
from serving.spec.hybrid import (
    FALLBACK_API_KEY_ENV,
    INGRESS_DEPLOYMENT,
    FallbackSpec,
    KeyLimitSpec,
    LimitsSpec,
    RateLimitSpec,
)
from serving.spec.models import (
    PER_MODEL_KEYS,
    LoraSpec,
    ModelEntry,
    RolePools,
    duplicate_model_ids,
)
from serving.spec.roles import (
    IngressSpec,
    KvTransferSpec,
    ModelSpec,
    PlacementSpec,
    ResilienceSpec,
    RoleSpec,
    SloSpec,
    StreamingSpec,
)
from serving.spec.scaling import policy_config, slo_thresholds
from serving.spec.target import Target

# The validation context of one entry's spec inside the many-model form (`for_entry`): what
# concerns every model (limits naming model ids) is checked by the whole spec, not there.
_ENTRY_OF_MANY = "entry_of_many"


class ServingSpec(SpecModel):
    """One model (the one-model form: the model's keys at the top), or several models behind
    one front door (`models`: a list of entries with those keys, serving/spec/models.py).

    In the many-model form the top-level model keys hold a copy of the first entry (so code
    that asks "the" model's SLO or mode gets the first one); `served` is the list to iterate:
    one complete ServingSpec per model, shared keys included.
    """

    # Declared first so that a bad entry is reported under serving.models[i], not under its
    # copy at the top.
    models: tuple[ModelEntry, ...] = ()
    model: ModelSpec
    mode: Mode = Mode.DISAGGREGATED
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    ingress: IngressSpec = Field(default_factory=IngressSpec)
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    auth: AuthMode = AuthMode.API_KEY
    streaming: StreamingSpec = Field(default_factory=StreamingSpec)
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    slo: SloSpec = Field(default_factory=SloSpec)
    # Hybrid routing (serving/ingress/routing.py): an external provider for what the cluster cannot
    # serve, and per-API-key limits (per model) and model access. See docs/hybrid-routing.md.
    fallback: FallbackSpec | None = None
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    # Where each engine role runs (a nodePools name; default: the pool named after the role),
    # and the model's LoRA adapters. Per model (serving/spec/models.py PER_MODEL_KEYS).
    pools: RolePools = Field(default_factory=RolePools)
    lora: LoraSpec | None = None
    _served: tuple[ServingSpec, ...] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        """The many-model form: no model key at the top; the first entry's keys copied there."""
        if not isinstance(data, dict) or "models" not in data:
            return data
        from pydantic.alias_generators import to_snake

        both = [k for k in PER_MODEL_KEYS if k in data or to_snake(k) in data]
        if both:
            raise ValueError(
                f"models and the one-model keys ({', '.join(both)}) are exclusive: "
                "move them into each serving.models entry"
            )
        models = data["models"]
        if isinstance(models, (list, tuple)) and not models:
            raise ValueError("models: list at least one model (or use the one-model form)")
        first = models[0] if isinstance(models, (list, tuple)) else None
        return {**data, **first} if isinstance(first, dict) else data

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("trust_remote_code"):
            raise ValueError(
                "trust_remote_code runs Python code from the model repository inside the engines; "
                "it is refused (use a model that transformers supports natively)"
            )
        if v.get("enable_log_requests"):
            raise ValueError(
                "enable_log_requests writes every prompt into the engine logs (a privacy leak into "
                "the cluster's log pipeline); it is refused"
            )
        clash = sorted(RESERVED_ENGINE_KWARGS & set(v))
        if clash:
            raise ValueError(
                f"{', '.join(clash)} set by the spec itself (model, prefill/decode, kvTransfer, lora); "
                "remove from engineKwargs"
            )
        return v

    @model_validator(mode="after")
    def _cross(self, info: ValidationInfo) -> ServingSpec:
        if not (info.context or {}).get(_ENTRY_OF_MANY):
            # Limits name the models of the whole spec: checked once, not in each entry's spec.
            unknown = self.limits.unknown_model([m.model.id for m in self.models] or [self.model.id])
            if unknown is not None:
                raise ValueError(f"@serving.{unknown[0]}@ {unknown[1]}")
        if self.models:
            return self._check_models()
        if self.mode is Mode.DISAGGREGATED:
            problem = self._pd_layout_problem()
            if problem:
                raise ValueError(problem)
        if self.fallback is not None and self.model.id not in self.fallback.models_for(self.model.id):
            raise ValueError(
                f"fallback.model maps no external model to serving.model.id {self.model.id!r}: "
                "give one name, or a map with that id as a key"
            )
        if "kv_lease_duration" in self.kv_transfer.extra_config:
            raise ValueError("kvTransfer.extraConfig.kv_lease_duration: set kvTransfer.leaseDurationS instead")
        lease = self.kv_transfer.lease_duration_s or VLLM_DEFAULT_KV_LEASE_S
        if self.mode is Mode.DISAGGREGATED and lease < self.resilience.kv_ready_timeout_s:
            raise ValueError(
                f"kvTransfer.leaseDurationS ({lease}) is shorter than "
                f"resilience.kvReadyTimeoutS ({self.resilience.kv_ready_timeout_s}): prefill "
                "would free the KV blocks while decode still waits for them"
            )
        problem = self.model.loading.problem(self.model.source)
        if problem:
            raise ValueError(f"model.loading: {problem}")
        for role, spec in self.engine_roles().items():
            problem = spec.signals.role_problem("decode" if self.mode is Mode.AGGREGATED else role)
            if problem:
                raise ValueError(f"{role}.signals: {problem}")
        labels = [self.placement.head, self.placement.prefill, self.placement.decode]
        if len(set(labels)) != 3:
            raise ValueError("placement.head, placement.prefill and placement.decode must differ")
        return self

    def _check_models(self) -> ServingSpec:
        """Each entry of the many-model form as a complete spec; the first problem, naming the
        model's entry and the key (`@key@ message`, the stack config's cross-field form)."""
        dup = duplicate_model_ids(self.models)
        if dup:
            raise ValueError(f"models: model id {dup[0]!r} is listed twice (ids are what clients put in `model`)")
        if self.fallback is not None:
            if isinstance(self.fallback.model, str):
                raise ValueError(
                    "fallback.model: with serving.models, map each model id to the provider's model "
                    "({our id: theirs}); models left out have no fallback"
                )
            ids = {e.model.id for e in self.models}
            stray = sorted(set(self.fallback.model) - ids)
            if stray:
                raise ValueError(f"fallback.model: {stray[0]!r} is not the id of a model in serving.models")
        for i, entry in enumerate(self.models):
            if entry.mode is Mode.DISAGGREGATED:
                for role in ("prefill", "decode"):
                    if getattr(entry, role).data_parallel_size > 1:
                        # serving.app.build_model_app composes the resilient P/D tiers
                        # (serving/engines/pd_server.py), which do not cover Ray's data-parallel P/D
                        # servers; Ray's own DP builder binds an HTTP ingress into the model's
                        # application, which would bypass the front door's keys and limits.
                        raise ValueError(
                            f"@serving.models[{i}] ({entry.model.id}).{role}.dataParallelSize@ a P/D model "
                            "in serving.models runs without data parallelism (serve it in the one-model "
                            "form, or aggregated)"
                        )
            try:
                self.for_entry(entry)
            except ValidationError as err:
                e = err.errors(include_url=False)[0]
                where = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
                msg = str(e["msg"]).removeprefix("Value error, ")
                key = f"serving.models[{i}] ({entry.model.id})" + (f".{where}" if where else "")
                raise ValueError(f"@{key}@ {msg}") from None
        return self

    def for_entry(self, entry: ModelEntry) -> ServingSpec:
        """One model of the many-model form as a complete spec: the shared keys and its own.
        The fallback stays only for a model the fallback's map names."""
        shared = self.model_dump(exclude={"models", *ModelEntry.model_fields})
        if self.fallback is not None and entry.model.id not in self.fallback.models_for(entry.model.id):
            shared["fallback"] = None
        return ServingSpec.model_validate({**shared, **entry.model_dump()}, context={_ENTRY_OF_MANY: True})

    @property
    def served(self) -> tuple[ServingSpec, ...]:
        """Every model this spec serves, each as a complete one-model spec, in order."""
        if not self.models:
            return (self,)
        if self._served is None:
            self._served = tuple(self.for_entry(e) for e in self.models)
        return self._served

    @property
    def many(self) -> bool:
        """Whether this is the many-model form (`serving.models`)."""
        return bool(self.models)

    def pool_of(self, role: str) -> str:
        """The node pool (a nodePools name) the engine role runs on."""
        return self.pools.pool(role)

    def pool_label(self, role: str) -> str:
        """The Ray node label value of the role's pool: the pool's name, or for the pools named
        prefill and decode the placement labels they have always had."""
        return pool_label(self.placement, self.pool_of(role))

    def _pd_layout_problem(self) -> str | None:
        """Why the prefill/decode layouts cannot run together, in one line; None when they can.

        Each rule is the upstream one, read in vLLM 0.32 (local) and 0.29 (the cloud image's, for
        Ray 2.60) under vllm/distributed/kv_transfer/kv_connector/: what neither refuses is allowed.
        Rules that need the model's shape (KV heads) are in infra.sizing.fit.
        """
        p, d = self.prefill, self.decode
        if d.pipeline_parallel_size > 1:
            return (
                f"decode.pipelineParallelSize = {d.pipeline_parallel_size} is refused: vLLM cannot receive KV into "
                "a pipeline-parallel decode ('NixlPushConnector consumer (decode) does not support "
                "pipeline_parallel_size > 1', v1/nixl/base_worker.py, vLLM 0.29 and 0.32); keep decode at PP 1 "
                "and span nodes with decode.dataParallelSize (MoE models) or a larger GPU"
            )
        if p.pipeline_parallel_size > 1 and self.kv_transfer.connector is not KvConnector.NIXL_PUSH:
            return (
                f"prefill.pipelineParallelSize = {p.pipeline_parallel_size} needs kvTransfer.connector: "
                f"{KvConnector.NIXL_PUSH.value}: vLLM moves a pipeline-parallel prefill's KV only by push, each "
                "stage writing its layer slice into a PP 1 decode (v1/nixl/base_worker.py 'PP>1 (push mode)', "
                "vLLM 0.29 and 0.32)"
            )
        # Different TP sizes are read head-sharded (P_TP > D_TP) or head-split (D_TP > P_TP); vLLM
        # only asserts that one divides the other (kv_connector/utils.py TransferTopology.tp_ratio),
        # which powers of two always do.
        return None

    # --- what the stack needs to know -------------------------------------------------
    def drain(self) -> DrainPlan:
        """How long each part may take to stop, from the longest stream the deadlines allow
        (serving/spec/drain.py): rendered here per deployment and by the RayService per pod."""
        return DrainPlan.for_deadlines(self.resilience, PROXY_TIMEOUT_MARGIN_S)

    def ray_env(self) -> dict[str, str]:
        """The environment every Ray process of the cluster gets from the spec: the data
        plane's switches (spec_base.DataPlane), and in HAProxy mode how long an HAProxy
        process replaced by a reload (Serve reloads it whenever the ingress replicas change)
        may finish its open streams before it is stopped: Ray 2.60 stops it after
        RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S, 120 s by default (ray/serve/_private/haproxy.py
        `_graceful_reload`, haproxy_templates.py `hard-stop-after`), which would cut a stream
        that the deadlines allow to run longer. The node drain is that bound, rounded up
        (serving/spec/drain.py), so tuning totalTimeoutS within a step leaves the pods as they are."""
        env = self.ingress.data_plane.ray_env
        if self.ingress.data_plane is DataPlane.HAPROXY:
            env[HAPROXY_HARD_STOP_ENV] = str(self.drain().node_drain_s)
        return env

    def engine_roles(self) -> dict[str, RoleSpec]:
        """The engine roles that run, by the worker group (node label role) they run on."""
        if self.mode is Mode.AGGREGATED:
            return {"decode": self.decode}
        return {"prefill": self.prefill, "decode": self.decode}

    # --- rendering ----------------------------------------------------------------------
    def _model_source(self) -> str | dict[str, str]:
        # Ray Serve LLM reads a bucket through its mirror config; a repo id or path as is.
        src = self.model.source
        return {"bucket_uri": src} if src.startswith("s3://") else src

    def _llm_config(self, role: str, spec: RoleSpec, target: Target) -> dict[str, Any]:
        label = self.pool_label(role)
        engine_kwargs: dict[str, Any] = {
            "dtype": self.model.dtype.value,
            "max_model_len": self.model.max_model_len,
            "tensor_parallel_size": spec.tensor_parallel_size,
            "pipeline_parallel_size": spec.pipeline_parallel_size,
            # Prompts stay out of the logs (Ray 2.60 defaults this to False in
            # engines/vllm/vllm_models.py; stated here so that no default can flip it).
            "enable_log_requests": False,
        }
        if spec.data_parallel_size > 1:
            # Ray Serve LLM's P/D builder switches to its DP servers on this key
            # (serving_patterns/prefill_decode/builder.py: DPPDPrefillServer / DPPDDecodeServer).
            engine_kwargs["data_parallel_size"] = spec.data_parallel_size
        if spec.moe_parallelism is MoeParallelism.EXPERT:
            engine_kwargs["enable_expert_parallel"] = True
        if not target.cpu:
            engine_kwargs["gpu_memory_utilization"] = self.model.gpu_memory_utilization
        if target.traces_endpoint:
            engine_kwargs["otlp_traces_endpoint"] = target.traces_endpoint
        if self.mode is Mode.DISAGGREGATED:
            kv: dict[str, Any] = {
                "kv_connector": self.kv_transfer.connector.value,
                "kv_role": self._kv_role(role),
                "kv_buffer_device": "cpu" if target.cpu else self.kv_transfer.buffer_device.value,
                "kv_load_failure_policy": self.kv_transfer.load_failure_policy.value,
            }
            backend = self.kv_transfer.requested_backend or target.kv_backend
            extra = dict(self.kv_transfer.extra_config)
            if self.kv_transfer.lease_duration_s is not None:
                extra["kv_lease_duration"] = self.kv_transfer.lease_duration_s
            # Always explicit: vLLM's NixlConnector defaults to UCX, which on EFA silently
            # falls back to TCP (ai-dynamo/nixl#909); the policy pack reads this key.
            kv["kv_connector_extra_config"] = {**extra, "backends": [KvBackend(backend).value]}
            engine_kwargs["kv_transfer_config"] = kv
        engine_kwargs.update(self.model.loading.engine_kwargs(self.model.source))
        if self.lora is not None:
            engine_kwargs.update(self.lora.engine_kwargs())
        engine_kwargs.update(self.engine_kwargs)

        autoscaling: dict[str, Any] = {
            "min_replicas": spec.min_replicas,
            "max_replicas": spec.max_replicas,
            "target_ongoing_requests": spec.target_ongoing_requests,
            "upscale_delay_s": spec.upscale_delay_s,
            "downscale_delay_s": spec.downscale_delay_s,
        }
        if spec.initial_replicas is not None or spec.min_replicas == 0:
            autoscaling["initial_replicas"] = spec.starting_replicas
        policy = self._policy(role, spec, target)
        if policy is not None:
            autoscaling["policy"] = policy
        # One bundle per GPU worker of one Serve replica (a DP rank): vLLM's Ray executor starts
        # one worker per GPU bundle (vllm/v1/executor/ray_executor.py), so bundles are never
        # per node.
        bundles = spec.gpus_per_rank
        config: dict[str, Any] = {
            "model_loading_config": {"model_id": self.model.id, "model_source": self._model_source()},
            "engine_kwargs": engine_kwargs,
            "deployment_config": {
                "autoscaling_config": autoscaling,
                "max_ongoing_requests": spec.max_ongoing_requests,
                "max_queued_requests": spec.max_queued_requests,
                # Scale-in and restarting updates let the replica's streams finish (serving/spec/drain.py).
                **self.drain().deployment_options("prefill" if role == "prefill" else "engine"),
                # One selector per placement-group bundle (one bundle per GPU/worker).
                "placement_group_bundle_label_selector": [{self.placement.label_key: label} for _ in range(bundles)],
            },
        }
        if self.lora is not None:
            # The same path on both P/D legs (Ray's PDServingArgs refuses a mismatch).
            config["lora_config"] = self.lora.llm_config()
        if spec.router is Router.PREFIX_CACHE_AFFINITY:
            config["deployment_config"]["request_router_config"] = {"request_router_class": PREFIX_ROUTER_CLS}
        config["experimental_configs"] = {
            "stream_batching_interval_ms": self.streaming.batch_interval_ms,
            # Read by serving.engines.streaming's mixin, wherever a server class carries it.
            FIRST_CHUNK_KEY: self.streaming.first_chunk.value,
        }
        if self.streaming.first_chunk is FirstChunk.EAGER and self.mode is Mode.AGGREGATED:
            # Ray's P/D builder fixes the decode class (PDDecodeServer): server_cls counts for
            # the aggregated engine only.
            config["server_cls"] = EAGER_SERVER_CLS
        if target.cpu:
            config["accelerator_config"] = {"kind": "cpu"}
        else:
            config["accelerator_type"] = target.role_accelerator_types.get(role, target.accelerator_type)
        config["runtime_env"] = {"env_vars": {**dict(target.engine_env), **SERVING_ENV}}
        return config

    def _policy(self, role: str, spec: RoleSpec, target: Target) -> dict[str, Any] | None:
        # The aggregated engine runs under the decode role and its policy.
        planned = dict(slo_thresholds(role, self.slo.ttft_seconds, self.slo.itl_seconds, spec.target_ongoing_requests))
        planned.update(target.role_thresholds.get(role, {}))
        return policy_config(
            role,
            spec.signals,
            planned,
            target_ongoing=spec.target_ongoing_requests,
            metrics_selector=target.metrics_selectors.get(role),
        )

    def _kv_role(self, role: str) -> str:
        # Prefill produces KV, decode consumes it, for both NIXL connectors: vLLM deprecates
        # kv_both for NIXL (NixlBaseConnector.__init__, 0.29 and 0.32: "set kv_role='kv_producer'
        # for prefill instances and kv_role='kv_consumer' for decode instances"), and the push
        # connector keys decode's checks on kv_consumer (a PP decode is refused there). A
        # consumer still prefills a request that carries no kv_transfer_params itself, which is
        # what local prefill on decode relies on (the transfer direction comes from the params).
        return "kv_producer" if role == "prefill" else "kv_consumer"

    def engine_args(self, target: Target) -> dict[str, Any]:
        """One model's engines as Ray Serve LLM's builders take them: `llm_configs` (aggregated,
        build_openai_app) or `prefill_config` and `decode_config` (build_pd_openai_app)."""
        roles = self.engine_roles()
        if self.mode is Mode.AGGREGATED:
            return {"llm_configs": [self._llm_config("decode", roles["decode"], target)]}
        return {
            "prefill_config": self._llm_config("prefill", roles["prefill"], target),
            "decode_config": self._llm_config("decode", roles["decode"], target),
        }

    def app_args(self, target: Target) -> dict[str, Any]:
        """The `args` of the front door application: what serving.app:build_app receives.

        One-model form: `mode` and that model's engine args (unchanged). Many-model form:
        `mode: models` and the shared keys only (the models are in the ingress's user_config
        and in their own applications: `model_app_args`), so adding a model leaves them alone.
        """
        ingress: dict[str, Any] = {
            "autoscaling_config": {
                "min_replicas": self.ingress.min_replicas,
                "max_replicas": self.ingress.max_replicas,
            },
            "max_ongoing_requests": self.ingress.max_ongoing_requests,
            "max_queued_requests": self.ingress.max_queued_requests,
            **self.drain().deployment_options("ingress"),
            "ray_actor_options": {
                "label_selector": {self.placement.label_key: self.placement.head},
                # The head offers no CPUs to Serve replicas (it must not take model work);
                # the ingress is I/O-bound and asks for none.
                "num_cpus": 0,
            },
        }
        ingress["ray_actor_options"]["runtime_env"] = {"env_vars": {**dict(target.ingress_env), **SERVING_ENV}}
        args: dict[str, Any] = {
            "auth": {"mode": self.auth.value, "api_keys_env": API_KEYS_ENV},
            # decode serves every request's tokens (the aggregated engine is the decode role).
            "resilience": self.resilience.runtime_args(target.cold_start_s.get("decode")),
            "ingress_deployment_config": ingress,
            "max_body_bytes": self.ingress.max_body_mib << 20,
        }
        if not self.many:
            return {"mode": self.mode.value, **args, **self.engine_args(target)}
        return {"mode": MODELS_MODE, **args}

    def model_app_args(self, target: Target) -> dict[str, Any]:
        """The `args` of one model's own application (many-model form; `self` is one of
        `served`): what serving.app:build_model_app receives."""
        return {
            "model_id": self.model.id,
            "mode": self.mode.value,
            "resilience": self.resilience.runtime_args(),
            **self.engine_args(target),
        }

    def model_table(self) -> list[dict[str, Any]]:
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
            for m in self.served
        ]

    def ingress_user_config(self) -> dict[str, Any]:
        """The ingress deployment's user_config: the fallback, and the per-key limits and
        model access (snake_case, read by serving.ingress.limits.LimitsConfig.from_user_config).

        A user_config change reaches the running ingress through `reconfigure` (Serve's
        lightweight update); application `args` changes rebuild every deployment, engines
        included. So what operators tune (limits, provider) lives here, not in args.
        """
        fb = self.fallback
        fallback = None
        if fb is not None:
            fallback = {
                "base_url": fb.base_url,
                # Many-model form: the map names each model's provider model (spec_models).
                "models": fb.models_for(self.model.id),
                "when": [w.value for w in fb.when],
                # The engine deployment the ingress calls: decode (or the aggregated engine);
                # with several models, the smallest of their bounds.
                "overflow_at": fb.overflow_at or min(m.decode.max_ongoing_requests for m in self.served),
                "first_token_timeout_s": fb.first_token_timeout_s,
                "timeout_s": fb.timeout_s,
                "connect_timeout_s": fb.connect_timeout_s,
                "retries": fb.retries,
                "api_key_env": FALLBACK_API_KEY_ENV,
                # The relay joins the provider's events as the engines batch their tokens.
                "batch_interval_ms": self.streaming.batch_interval_ms,
            }
        limits = self.limits
        return {
            "fallback": fallback,
            "limits": {
                **_rates(limits),
                # A key's own limits when its entry names one; the models it may use when listed.
                "keys": {k: _key_entry(v) for k, v in sorted(limits.keys.items())},
                # Every key's limits on a model, unless the key has its own.
                "models": {m: _rates(v) for m, v in sorted(limits.models.items())},
                "when_ledger_unreachable": limits.when_ledger_unreachable,
                # Where the shared limits actor lives: with the ingress, on the head.
                "label_selector": {self.placement.label_key: self.placement.head},
            },
        }

    def serve_config(
        self, target: Target, *, port: int = SERVE_PORT, model_targets: Mapping[str, Target] | None = None
    ) -> dict[str, Any]:
        """The Serve config (RayService serveConfigV2 / `serve deploy` file) for `target`
        (and, with several models, each model's own Target by id: one application each)."""
        user_config = self.ingress_user_config()
        if self.many:
            user_config["models"] = self.model_table()
        app: dict[str, Any] = {
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": APP_IMPORT_PATH,
            "args": self.app_args(target),
            "deployments": [{"name": INGRESS_DEPLOYMENT, "user_config": user_config}],
        }
        apps = [app]
        if self.many:
            targets = model_targets or {}
            for m in self.served:
                apps.append(
                    {
                        "name": MODEL_APP_PREFIX + m.model.id,
                        # Not over HTTP: the front door calls it through deployment handles.
                        "route_prefix": None,
                        "import_path": MODEL_APP_IMPORT_PATH,
                        "args": m.model_app_args(targets.get(m.model.id, target)),
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
                "request_timeout_s": self.drain().proxy_request_s,
            },
            "applications": apps,
        }


def _rates(limit: RateLimitSpec) -> dict[str, int]:
    return {"requests_per_minute": limit.requests_per_minute, "tokens_per_minute": limit.tokens_per_minute}


def _key_entry(entry: KeyLimitSpec) -> dict[str, Any]:
    own = entry.own_limits
    rendered: dict[str, Any] = _rates(own) if own is not None else {}
    if entry.models is not None:
        rendered["models"] = list(entry.models)
    return rendered


def pool_label(placement: PlacementSpec, pool: str) -> str:
    """The Ray node label value of a node pool's worker group: the pool's name, except that the
    pools named prefill and decode keep the placement labels they have always had (so a
    one-model stack renders as before)."""
    return str(getattr(placement, pool)) if pool in ("prefill", "decode") else pool
