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
# vLLM NixlConnector's kv_lease_duration default (nixl/base_scheduler.py, 0.29 and 0.32).
VLLM_DEFAULT_KV_LEASE_S = 30
PROXY_TIMEOUT_MARGIN_S = 5.0

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
    # Serve's queue bound in front of the role's replicas (per caller): past it, callers get
    # BackPressureError at once, which the ingress answers as 503 + Retry-After. Bounded by
    # default: an unbounded queue turns overload into requests that wait forever.
    max_queued_requests: int = Field(default=64, ge=1)

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
    # Per ingress replica; past both, Serve's proxy answers 503 with Retry-After itself.
    max_ongoing_requests: int = Field(default=1000, ge=1)
    max_queued_requests: int = Field(default=200, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> IngressSpec:
        check_order(("minReplicas", self.min_replicas), ("maxReplicas", self.max_replicas))
        return self


class KvTransferSpec(SpecModel):
    connector: KvConnector = KvConnector.NIXL
    buffer_device: KvBufferDevice = KvBufferDevice.CUDA
    load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.RECOMPUTE
    # vLLM NixlConnector's kv_connector_extra_config.kv_lease_duration (seconds; vLLM's
    # default 30 in 0.29 and 0.32): prefill frees KV blocks that decode has not read when
    # the lease runs out, so a dead or abandoned decode cannot pin prefill memory.
    lease_duration_s: int | None = Field(default=None, ge=1)
    # Passed through as kv_connector_extra_config (e.g. {"backends": ["UCX"]}).
    extra_config: dict[str, Any] = Field(default_factory=dict)


class ResilienceSpec(SpecModel):
    """Deadlines (seconds) and retries of the serving path (serving/resilience.py).

    Defaults fit models up to ~70B on H100-class GPUs with prompts up to ~32k tokens
    (prefill well under 5 s); raise prefillTimeoutS for longer prompts or slower GPUs.
    """

    # ingress -> prefill: one prefill call, queueing included.
    prefill_timeout_s: float = Field(default=5.0, gt=0, le=600)
    # prefill calls per request (the next one lands on another replica when one is
    # healthy); then decode prefills locally.
    prefill_attempts: int = Field(default=2, ge=1, le=5)
    # prefill -> KV ready: a streamed decode must emit its first token this long after
    # prefill answered, else it is aborted (vLLM frees its blocks) and rerun locally.
    kv_ready_timeout_s: float = Field(default=10.0, gt=0, le=600)
    # decode -> first token, seen from the ingress (whole path, queueing included).
    first_token_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # the whole request, streaming included.
    total_timeout_s: float = Field(default=600.0, gt=0, le=86400)
    # while a decode replica is known lost: wait this long for one before answering 503.
    fail_fast_s: float = Field(default=2.0, gt=0, le=60)
    # decode calls per request before the first byte (another replica on retry).
    decode_attempts: int = Field(default=2, ge=1, le=5)
    # after a prefill failure, skip remote prefill this long (then probe with one request).
    circuit_open_s: float = Field(default=5.0, gt=0, le=600)
    # Retry-After on 503/504 answers.
    retry_after_s: int = Field(default=1, ge=1, le=3600)

    @model_validator(mode="after")
    def _order(self) -> ResilienceSpec:
        worst_prefill = self.prefill_timeout_s * self.prefill_attempts + self.kv_ready_timeout_s
        if worst_prefill >= self.first_token_timeout_s:
            raise ValueError(
                f"firstTokenTimeoutS ({self.first_token_timeout_s}) must exceed "
                f"prefillTimeoutS x prefillAttempts + kvReadyTimeoutS ({worst_prefill}), or "
                "the ingress gives up before decode can fall back to local prefill"
            )
        if self.first_token_timeout_s > self.total_timeout_s:
            raise ValueError("firstTokenTimeoutS must not exceed totalTimeoutS")
        if self.fail_fast_s > self.first_token_timeout_s:
            raise ValueError("failFastS must not exceed firstTokenTimeoutS")
        return self

    def runtime_args(self) -> dict[str, Any]:
        """args["resilience"]: what serving.resilience.ResilienceConfig reads."""
        return self.model_dump(by_alias=False)


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
    """

    accelerator_type: str | None = None
    working_dir: str | None = None
    engine_env: Mapping[str, str] = field(default_factory=dict)
    ingress_env: Mapping[str, str] = field(default_factory=dict)

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
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("trust_remote_code"):
            raise ValueError(
                "trust_remote_code runs Python code from the model repository inside the engines; "
                "it is refused (use a model that transformers supports natively)"
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
        if "kv_lease_duration" in self.kv_transfer.extra_config:
            raise ValueError("kvTransfer.extraConfig.kv_lease_duration: set kvTransfer.leaseDurationS instead")
        lease = self.kv_transfer.lease_duration_s or VLLM_DEFAULT_KV_LEASE_S
        if self.mode is Mode.DISAGGREGATED and lease < self.resilience.kv_ready_timeout_s:
            raise ValueError(
                f"kvTransfer.leaseDurationS ({lease}) is shorter than "
                f"resilience.kvReadyTimeoutS ({self.resilience.kv_ready_timeout_s}): prefill "
                "would free the KV blocks while decode still waits for them"
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
            extra = dict(self.kv_transfer.extra_config)
            if self.kv_transfer.lease_duration_s is not None:
                extra["kv_lease_duration"] = self.kv_transfer.lease_duration_s
            if extra:
                kv["kv_connector_extra_config"] = extra
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
                "max_queued_requests": spec.max_queued_requests,
                # One selector per placement-group bundle (one bundle per GPU/worker).
                "placement_group_bundle_label_selector": [{self.placement.label_key: label} for _ in range(bundles)],
            },
        }
        if target.cpu:
            config["accelerator_config"] = {"kind": "cpu"}
        else:
            config["accelerator_type"] = target.accelerator_type
        if target.engine_env:
            config["runtime_env"] = {"env_vars": dict(target.engine_env)}
        return config

    def app_args(self, target: Target) -> dict[str, Any]:
        """The `args` of the application: what serving.app:build_app receives."""
        ingress: dict[str, Any] = {
            "autoscaling_config": {
                "min_replicas": self.ingress.min_replicas,
                "max_replicas": self.ingress.max_replicas,
            },
            "max_ongoing_requests": self.ingress.max_ongoing_requests,
            "max_queued_requests": self.ingress.max_queued_requests,
            "ray_actor_options": {
                "label_selector": {self.placement.label_key: self.placement.head},
                # The head offers no CPUs to Serve replicas (it must not take model work);
                # the ingress is I/O-bound and asks for none.
                "num_cpus": 0,
            },
        }
        if target.ingress_env:
            ingress["ray_actor_options"]["runtime_env"] = {"env_vars": dict(target.ingress_env)}
        args: dict[str, Any] = {
            "mode": self.mode.value,
            "auth": {"mode": self.auth.value, "api_keys_env": API_KEYS_ENV},
            "resilience": self.resilience.runtime_args(),
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
            # The ingress is pinned to the head, so only the head needs a proxy.
            "proxy_location": "HeadOnly",
            # Serve's own request timeout backs the ingress's total deadline up (a hung
            # ingress still answers), a little later so the ingress's JSON error wins.
            "http_options": {
                "host": "0.0.0.0",
                "port": port,
                "request_timeout_s": self.resilience.total_timeout_s + PROXY_TIMEOUT_MARGIN_S,
            },
            "applications": [app],
        }
