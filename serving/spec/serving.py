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
and serving/spec/target.py (where it runs); this module composes them and re-exports them
(the spec's one public surface); serving/spec/render.py writes the result for Ray. pydantic
and the standard library only: the Pulumi program imports it, and the Pulumi program must not
need Ray or vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from serving.spec import render
from serving.spec.base import (
    BUFFERED_ENGINE_CLS,
    CONTROL_LOOP_ENV,
    CONTROL_LOOP_INTERVAL_S,
    ENGINE_CLS_ENV,
    HAPROXY_HARD_STOP_ENV,
    IDLE_WORKERS_ENV,
    IDLE_WORKERS_KEPT,
    METRICS_EXPORT_ENV,
    METRICS_EXPORT_INTERVAL_MS,
    PROXY_TIMEOUT_MARGIN_S,
    RESERVED_ENGINE_KWARGS,
    SERVE_PORT,
    TELEMETRY_OFF_ENV,
    VLLM_DEFAULT_KV_LEASE_S,
    AuthMode,
    DataPlane,
    KvConnector,
    Mode,
    Router,
    SpecModel,
)
from serving.spec.drain import DrainPlan
from serving.spec.hybrid import (
    FallbackSpec,
    LimitsSpec,
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
                f"{', '.join(clash)} set by the spec itself (model, prefill/decode, kvTransfer, lora, model.tools, "
                "model.reasoning, model.chatTemplate); "
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
            mapped = list(self.fallback.models_for(self.model.id)) if self.fallback is not None else None
            budget = self.limits.budget_problem(mapped)
            if budget is not None:
                raise ValueError(f"@serving.{budget[0]}@ {budget[1]}")
            stray = self.fallback.unpriced(self.model.id) if self.fallback is not None else None
            if stray is not None:
                raise ValueError(
                    f"@serving.fallback.prices.{stray}@ {stray!r} is not a model the fallback serves "
                    f"(fallback.model maps {', '.join(mapped or ())})"
                )
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
            if spec.router is Router.KV_AWARE:
                problem = self._kv_aware_problem(role, spec)
                if problem:
                    raise ValueError(f"{role}.router: {problem}")
        labels = [self.placement.head, self.placement.prefill, self.placement.decode]
        if len(set(labels)) != 3:
            raise ValueError("placement.head, placement.prefill and placement.decode must differ")
        return self

    def _kv_aware_problem(self, role: str, spec: RoleSpec) -> str | None:
        """Why `router: kv-aware` cannot serve this role, or None (serving/engines/kv_router.py)."""
        if self.mode is not Mode.DISAGGREGATED or role != "prefill":
            return (
                "kv-aware routes the prefill tier of a P/D model (it scores where a prompt's KV "
                "cache already is, before prefill); use prefix-cache-affinity here"
            )
        if spec.data_parallel_size > 1:
            return "kv-aware routing does not cover data-parallel engines (Ray 2.60 tracks one rank per replica)"
        if self.engine_kwargs.get("enable_prefix_caching") is False:
            return "kv-aware routing needs vLLM's prefix cache (engineKwargs.enable_prefix_caching is false)"
        return None

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

    @property
    def kv_routed(self) -> bool:
        """Whether this model's prefill tier routes by KV state (prefill.router kv-aware, P/D)."""
        return self.mode is Mode.DISAGGREGATED and self.prefill.router is Router.KV_AWARE

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
        plane's switches (spec_base.DataPlane), Serve's control-loop and cached-metrics
        intervals (base.CONTROL_LOOP_INTERVAL_S, METRICS_EXPORT_INTERVAL_MS), the engine class whose
        vLLM metrics reach Ray once a second (base.BUFFERED_ENGINE_CLS), no idle worker kept
        (base.IDLE_WORKERS_KEPT), usage reports off (base.TELEMETRY_OFF_ENV), and in HAProxy mode how long an HAProxy
        process replaced by a reload (Serve reloads it whenever the ingress replicas change)
        may finish its open streams before it is stopped: Ray 2.60 stops it after
        RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S, 120 s by default (ray/serve/_private/haproxy.py
        `_graceful_reload`, haproxy_templates.py `hard-stop-after`), which would cut a stream
        that the deadlines allow to run longer. The node drain is that bound, rounded up
        (serving/spec/drain.py), so tuning totalTimeoutS within a step leaves the pods as they are."""
        env = {
            **self.ingress.data_plane.ray_env,
            CONTROL_LOOP_ENV: str(CONTROL_LOOP_INTERVAL_S),
            METRICS_EXPORT_ENV: str(METRICS_EXPORT_INTERVAL_MS),
            ENGINE_CLS_ENV: BUFFERED_ENGINE_CLS,
            IDLE_WORKERS_ENV: str(IDLE_WORKERS_KEPT),
            **TELEMETRY_OFF_ENV,
        }
        if self.ingress.data_plane is DataPlane.HAPROXY:
            env[HAPROXY_HARD_STOP_ENV] = str(self.drain().node_drain_s)
        return env

    def engine_roles(self) -> dict[str, RoleSpec]:
        """The engine roles that run, by the worker group (node label role) they run on."""
        if self.mode is Mode.AGGREGATED:
            return {"decode": self.decode}
        return {"prefill": self.prefill, "decode": self.decode}

    # --- rendering (serving/spec/render.py) -------------------------------------------
    def engine_args(self, target: Target) -> dict[str, Any]:
        """One model's engines as Ray Serve LLM's builders take them (render.engine_args)."""
        return render.engine_args(self, target)

    def app_args(self, target: Target) -> dict[str, Any]:
        """The `args` of the front door application (render.app_args)."""
        return render.app_args(self, target)

    def model_app_args(self, target: Target) -> dict[str, Any]:
        """The `args` of one model's own application (render.model_app_args)."""
        return render.model_app_args(self, target)

    def model_table(self) -> list[dict[str, Any]]:
        """The front door's view of the models, in order (render.model_table)."""
        return render.model_table(self)

    def ingress_user_config(self, targets: Mapping[str, Target] | None = None) -> dict[str, Any]:
        """The ingress deployment's user_config (render.ingress_user_config); `targets`, per
        model id, price each model's tokens."""
        return render.ingress_user_config(self, targets)

    def serve_config(
        self, target: Target, *, port: int = SERVE_PORT, model_targets: Mapping[str, Target] | None = None
    ) -> dict[str, Any]:
        """The Serve config (RayService serveConfigV2 / `serve deploy` file) for `target`
        (render.serve_config)."""
        return render.serve_config(self, target, port=port, model_targets=model_targets)


def pool_label(placement: PlacementSpec, pool: str) -> str:
    """The Ray node label value of a node pool's worker group: the pool's name, except that the
    pools named prefill and decode keep the placement labels they have always had (so a
    one-model stack renders as before)."""
    return str(getattr(placement, pool)) if pool in ("prefill", "decode") else pool
