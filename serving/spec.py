"""The serving spec: one typed description of an LLM deployment, rendered to a Serve config.

What flows through here: a stack file's `serving:` block (or the local run's defaults) is
validated into a `ServingSpec`; `ServingSpec.serve_config(target)` renders the Ray Serve
config (`applications:` and friends) whose `args` feed `serving.app:build_app`. The
RayService's `serveConfigV2` and `make serve` both come from this one function; only the
`Target` (GPU type or CPU, where the code lives, extra environment) differs.

This module imports pydantic and the standard library only: the Pulumi program imports it,
and the Pulumi program must not need Ray or vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

# The application's import path: the builder in serving/app.py.
APP_IMPORT_PATH = "serving.app:build_app"
APP_NAME = "llm"
SERVE_PORT = 8000
# The environment variable that carries the accepted API keys (comma-separated) into the
# ingress replicas; in the cloud it is fed from a Kubernetes Secret.
API_KEYS_ENV = "PD_API_KEYS"

DEFAULT_LABEL_KEY = "ray.io/node-group"
# Ray Serve LLM's prefix-cache affinity router (public API: ray.serve.llm.request_router).
PREFIX_ROUTER_CLS = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
# The engine server class that sends the first streamed chunk at once (serving/streaming.py).
EAGER_SERVER_CLS = "serving.streaming:EagerLLMServer"
# The LLMConfig.experimental_configs key that carries streaming.firstChunk to the engines.
FIRST_CHUNK_KEY = "pd_first_chunk"
# Environment of every Serve replica the spec renders (engines and ingress).
SERVING_ENV = {
    # Ray Serve LLM 2.60 defines this switch (constants.py, default on) and reads it nowhere;
    # off, so that a release that starts reading it does not log prompts.
    "RAYLLM_ENABLE_REQUEST_PROMPT_LOGS": "0",
}

_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Hugging Face repo id (org/name), an S3 prefix, or an absolute local path (local runs).
_MODEL_SOURCE = re.compile(
    r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
    r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](?:/[A-Za-z0-9._/-]*)?"
    r"|/[A-Za-z0-9._/-]+)$"
)
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")

# Engine settings the spec owns: setting them through engineKwargs would fork the truth.
RESERVED_ENGINE_KWARGS = frozenset(
    {
        "model",
        "served_model_name",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "kv_transfer_config",
        "dtype",
        "max_model_len",
        "gpu_memory_utilization",
        "distributed_executor_backend",
    }
)


def parse_api_keys(raw: str | None) -> tuple[str, ...]:
    """Comma-separated keys (the value of $PD_API_KEYS); blanks dropped."""
    return tuple(k.strip() for k in (raw or "").split(",") if k.strip())


def check_order(*named: tuple[str, int | None]) -> None:
    """ValueError unless the named values (None: not set, skipped) never decrease, in order.

    One rule for every size range in a stack file: node pools' minSize <= desiredSize <=
    maxSize, replicas' minReplicas <= initialReplicas <= maxReplicas.
    """
    present = [(n, v) for n, v in named if v is not None]
    if any(a > b for (_, a), (_, b) in pairwise(present)):
        rule = " <= ".join(n for n, _ in named)
        got = ", ".join(f"{n} {v}" for n, v in present)
        raise ValueError(f"sizes must satisfy {rule} (got {got})")


class SpecModel(BaseModel):
    """Base of every config model: camelCase keys as in stack files, unknown keys rejected."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        use_enum_values=False,
    )


class Mode(str, Enum):
    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"


class Dtype(str, Enum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class KvConnector(str, Enum):
    NIXL = "NixlConnector"


class KvBufferDevice(str, Enum):
    CUDA = "cuda"
    CPU = "cpu"


class KvLoadFailurePolicy(str, Enum):
    # vLLM's kv_load_failure_policy: "fail" ends the request (HTTP 500); "recompute" lets
    # decode recompute the prompt itself when prefill's KV cannot be read.
    FAIL = "fail"
    RECOMPUTE = "recompute"


class Router(str, Enum):
    """How Serve picks a replica of a role when it has several.

    power-of-two: Serve's default (two random replicas, the less loaded one).
    prefix-cache-affinity: Ray Serve LLM's PrefixCacheAffinityRouter (public API,
    `ray.serve.llm.request_router`): the replica that served the same prompt prefix, so
    vLLM's prefix cache hits; power-of-two when the load is uneven.
    """

    POWER_OF_TWO = "power-of-two"
    PREFIX_CACHE_AFFINITY = "prefix-cache-affinity"


class FirstChunk(str, Enum):
    # eager: the first streamed chunk leaves the engine replica at once (serving/streaming.py);
    # batched: Ray Serve LLM's own batcher, which holds it back for a whole interval.
    EAGER = "eager"
    BATCHED = "batched"


class AuthMode(str, Enum):
    API_KEY = "api-key"
    DISABLED = "disabled"


class ModelArchitecture(SpecModel):
    """Shape of the model, for capacity planning when the model is not in the built-in catalog."""

    parameters_billions: float = Field(gt=0)
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _heads(self) -> ModelArchitecture:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("numAttentionHeads must be a multiple of numKvHeads")
        return self


class ModelSpec(SpecModel):
    id: str = Field(description="Served model name: what clients put in `model`.")
    source: str = Field(description="Hugging Face repo id, s3:// prefix, or a local path.")
    dtype: Dtype = Dtype.BFLOAT16
    max_model_len: int = Field(default=8192, ge=16, le=1_048_576)
    gpu_memory_utilization: float = Field(default=0.90, gt=0.05, le=0.98)
    architecture: ModelArchitecture | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _MODEL_ID.match(v):
            raise ValueError(f"{v!r} is not a valid model id (letters, digits, '.', '_', '-'; at most 128)")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not _MODEL_SOURCE.match(v) or ".." in v:
            raise ValueError(
                f"{v!r} is not a valid model source (a Hugging Face repo id 'org/name', "
                "an 's3://bucket/prefix', or an absolute local path)"
            )
        return v


class RoleSpec(SpecModel):
    """One engine role (prefill, decode, or the single engine of aggregated mode)."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=16)
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=1)
    max_ongoing_requests: int = Field(default=64, ge=1)
    router: Router = Router.POWER_OF_TWO

    @field_validator("tensor_parallel_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two (1, 2, 4, 8, ...)")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> RoleSpec:
        check_order(
            ("minReplicas", self.min_replicas),
            ("initialReplicas", self.initial_replicas),
            ("maxReplicas", self.max_replicas),
        )
        return self

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class IngressSpec(SpecModel):
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> IngressSpec:
        check_order(("minReplicas", self.min_replicas), ("maxReplicas", self.max_replicas))
        return self


class KvTransferSpec(SpecModel):
    connector: KvConnector = KvConnector.NIXL
    buffer_device: KvBufferDevice = KvBufferDevice.CUDA
    load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.RECOMPUTE
    # Passed through as kv_connector_extra_config (e.g. {"backends": ["UCX"]}).
    extra_config: dict[str, Any] = Field(default_factory=dict)


class StreamingSpec(SpecModel):
    """How engine replicas stream tokens back through Serve."""

    # LLMConfig.experimental_configs.stream_batching_interval_ms (Ray's default 50): several
    # tokens per Ray object. 0 sends every token alone, which cost a third of the output
    # throughput at 16 streams on the local stack (docs/performance.md).
    batch_interval_ms: int = Field(default=50, ge=0, le=1000)
    first_chunk: FirstChunk = FirstChunk.EAGER


class PlacementSpec(SpecModel):
    """Ray node labels that place each part; the RayService gives its groups these labels."""

    label_key: str = DEFAULT_LABEL_KEY
    head: str = "head"
    prefill: str = "prefill"
    decode: str = "decode"

    @field_validator("label_key")
    @classmethod
    def _key(cls, v: str) -> str:
        if not _LABEL_KEY.match(v):
            raise ValueError(f"{v!r} is not a valid label key")
        return v

    @field_validator("head", "prefill", "decode")
    @classmethod
    def _value(cls, v: str) -> str:
        if not _LABEL_VALUE.match(v):
            raise ValueError(f"{v!r} is not a valid label value")
        return v


@dataclass(frozen=True)
class Target:
    """Where a rendered application runs: the only thing the cloud and local runs differ in.

    accelerator_type: Ray's accelerator type for GPU engines (e.g. "H100"); None means CPU.
    working_dir: the runtime_env working_dir holding serving/ (an s3:// zip in the cloud).
    engine_env: extra environment for engine replicas (e.g. NIXL/EFA settings, CPU KV size).
    ingress_env: extra environment for the ingress replicas.
    proxy_location: where Serve runs HTTP proxies. "EveryNode" (Serve's default) in the cloud:
      KubeRay 1.7 gives RayService worker pods a readiness probe on the proxy's /-/healthz and
      puts them in the serve Service (ray.io/serve=true), so each worker must run a proxy
      (Serve starts one on the head and on every node holding a replica). "HeadOnly" locally,
      where several Ray nodes share one host and would fight over the port.
    """

    accelerator_type: str | None = None
    working_dir: str | None = None
    engine_env: Mapping[str, str] = field(default_factory=dict)
    ingress_env: Mapping[str, str] = field(default_factory=dict)
    proxy_location: str = "EveryNode"

    @property
    def cpu(self) -> bool:
        return self.accelerator_type is None


class ServingSpec(SpecModel):
    model: ModelSpec
    mode: Mode = Mode.DISAGGREGATED
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    ingress: IngressSpec = Field(default_factory=IngressSpec)
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    auth: AuthMode = AuthMode.API_KEY
    streaming: StreamingSpec = Field(default_factory=StreamingSpec)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

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
                f"{', '.join(clash)} set by the spec itself (model, prefill/decode, kvTransfer); "
                "remove from engineKwargs"
            )
        return v

    @model_validator(mode="after")
    def _cross(self) -> ServingSpec:
        if self.mode is Mode.DISAGGREGATED:
            p, d = self.prefill, self.decode
            if p.tensor_parallel_size != d.tensor_parallel_size:
                raise ValueError(
                    f"prefill.tensorParallelSize ({p.tensor_parallel_size}) must equal "
                    f"decode.tensorParallelSize ({d.tensor_parallel_size}): NIXL KV transfer "
                    "needs the same KV layout on both sides"
                )
            if p.pipeline_parallel_size > 1 or d.pipeline_parallel_size > 1:
                raise ValueError(
                    "pipelineParallelSize > 1 is not supported in disaggregated mode "
                    "(P/D with pipeline parallelism fails to launch on Ray, ray#55775); "
                    "use tensorParallelSize, or mode: aggregated"
                )
        labels = [self.placement.head, self.placement.prefill, self.placement.decode]
        if len(set(labels)) != 3:
            raise ValueError("placement.head, placement.prefill and placement.decode must differ")
        return self

    # --- what the stack needs to know -------------------------------------------------
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
        label = getattr(self.placement, role)
        engine_kwargs: dict[str, Any] = {
            "dtype": self.model.dtype.value,
            "max_model_len": self.model.max_model_len,
            "tensor_parallel_size": spec.tensor_parallel_size,
            "pipeline_parallel_size": spec.pipeline_parallel_size,
            # Prompts stay out of the logs (Ray 2.60 defaults this to False in
            # engines/vllm/vllm_models.py; stated here so that no default can flip it).
            "enable_log_requests": False,
        }
        if not target.cpu:
            engine_kwargs["gpu_memory_utilization"] = self.model.gpu_memory_utilization
        if self.mode is Mode.DISAGGREGATED:
            kv: dict[str, Any] = {
                "kv_connector": self.kv_transfer.connector.value,
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu" if target.cpu else self.kv_transfer.buffer_device.value,
                "kv_load_failure_policy": self.kv_transfer.load_failure_policy.value,
            }
            if self.kv_transfer.extra_config:
                kv["kv_connector_extra_config"] = dict(self.kv_transfer.extra_config)
            engine_kwargs["kv_transfer_config"] = kv
        engine_kwargs.update(self.engine_kwargs)

        autoscaling: dict[str, Any] = {
            "min_replicas": spec.min_replicas,
            "max_replicas": spec.max_replicas,
        }
        if spec.initial_replicas is not None:
            autoscaling["initial_replicas"] = spec.initial_replicas
        bundles = spec.gpus_per_replica
        config: dict[str, Any] = {
            "model_loading_config": {"model_id": self.model.id, "model_source": self._model_source()},
            "engine_kwargs": engine_kwargs,
            "deployment_config": {
                "autoscaling_config": autoscaling,
                "max_ongoing_requests": spec.max_ongoing_requests,
                # One selector per placement-group bundle (one bundle per GPU/worker).
                "placement_group_bundle_label_selector": [{self.placement.label_key: label} for _ in range(bundles)],
            },
        }
        if spec.router is Router.PREFIX_CACHE_AFFINITY:
            config["deployment_config"]["request_router_config"] = {"request_router_class": PREFIX_ROUTER_CLS}
        config["experimental_configs"] = {
            "stream_batching_interval_ms": self.streaming.batch_interval_ms,
            # Read by serving.streaming's mixin, wherever a server class carries it.
            FIRST_CHUNK_KEY: self.streaming.first_chunk.value,
        }
        if self.streaming.first_chunk is FirstChunk.EAGER and self.mode is Mode.AGGREGATED:
            # Ray's P/D builder fixes the decode class (PDDecodeServer): server_cls counts for
            # the aggregated engine only.
            config["server_cls"] = EAGER_SERVER_CLS
        if target.cpu:
            config["accelerator_config"] = {"kind": "cpu"}
        else:
            config["accelerator_type"] = target.accelerator_type
        config["runtime_env"] = {"env_vars": {**dict(target.engine_env), **SERVING_ENV}}
        return config

    def app_args(self, target: Target) -> dict[str, Any]:
        """The `args` of the application: what serving.app:build_app receives."""
        ingress: dict[str, Any] = {
            "autoscaling_config": {
                "min_replicas": self.ingress.min_replicas,
                "max_replicas": self.ingress.max_replicas,
            },
            "ray_actor_options": {
                "label_selector": {self.placement.label_key: self.placement.head},
                # The head offers no CPUs to Serve replicas (it must not take model work);
                # the ingress is I/O-bound and asks for none.
                "num_cpus": 0,
            },
        }
        ingress["ray_actor_options"]["runtime_env"] = {"env_vars": {**dict(target.ingress_env), **SERVING_ENV}}
        args: dict[str, Any] = {
            "mode": self.mode.value,
            "auth": {"mode": self.auth.value, "api_keys_env": API_KEYS_ENV},
            "ingress_deployment_config": ingress,
        }
        roles = self.engine_roles()
        if self.mode is Mode.AGGREGATED:
            args["llm_configs"] = [self._llm_config("decode", roles["decode"], target)]
        else:
            args["prefill_config"] = self._llm_config("prefill", roles["prefill"], target)
            args["decode_config"] = self._llm_config("decode", roles["decode"], target)
        return args

    def serve_config(self, target: Target, *, port: int = SERVE_PORT) -> dict[str, Any]:
        """The Serve config (RayService serveConfigV2 / `serve deploy` file) for `target`."""
        app: dict[str, Any] = {
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": APP_IMPORT_PATH,
            "args": self.app_args(target),
        }
        if target.working_dir:
            app["runtime_env"] = {"working_dir": target.working_dir}
        return {
            "proxy_location": target.proxy_location,
            "http_options": {"host": "0.0.0.0", "port": port},
            "applications": [app],
        }
