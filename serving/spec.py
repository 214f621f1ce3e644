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

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from serving.scaling_spec import LoadingSpec, SignalsSpec, policy_config, slo_thresholds

# The application's import path: the builder in serving/app.py.
APP_IMPORT_PATH = "serving.app:build_app"
APP_NAME = "llm"
SERVE_PORT = 8000
# The environment variable that carries the accepted API keys (comma-separated) into the
# ingress replicas; in the cloud it is fed from a Kubernetes Secret.
API_KEYS_ENV = "PD_API_KEYS"

# A Ray node label of our own: `ray.io/` is Ray's reserved prefix (ray/_private/label_utils.py
# `validate_node_labels`, Ray 2.60, rejects custom keys there), and Ray already sets
# `ray.io/node-group` itself from the pod's KubeRay group ("headgroup" on the head).
DEFAULT_LABEL_KEY = "pd-inference/node-group"
RAY_RESERVED_LABEL_PREFIX = "ray.io/"
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
        "data_parallel_size",
        "enable_expert_parallel",
        "load_format",
        "model_loader_extra_config",
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
    # vLLM's NIXL connectors (vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py,
    # 0.29 and 0.32): "NixlConnector" is the pull connector (decode READs prefill's blocks);
    # "NixlPushConnector" has prefill WRITE into blocks decode registered, which is the mode in
    # which a pipeline-parallel prefill sends each stage's layer slice (base_worker.py,
    # "PP>1 (push mode)").
    NIXL = "NixlConnector"
    NIXL_PUSH = "NixlPushConnector"


class MoeParallelism(str, Enum):
    # How a mixture-of-experts model's expert layers are split. "tensor": vLLM's default, every
    # expert's matrices sharded over the TP ranks. "expert": enable_expert_parallel, whole
    # experts spread over the DP x TP ranks of an engine (EP), with all-to-all traffic between them.
    TENSOR = "tensor"
    EXPERT = "expert"


class KvBufferDevice(str, Enum):
    CUDA = "cuda"
    CPU = "cpu"


class KvBackend(str, Enum):
    """NIXL's transfer backend for the KV cache (the plugin NIXL loads: libplugin_<NAME>.so).

    AUTO: whatever the nodes' fabric calls for, from the instance catalog (LIBFABRIC on EFA
    types, UCX elsewhere and on the local CPU run); `Target.kv_backend` carries it here.
    """

    AUTO = "auto"
    UCX = "UCX"
    LIBFABRIC = "LIBFABRIC"


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
    loading: LoadingSpec = Field(default_factory=LoadingSpec)

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
    # Data-parallel ranks of one engine (Ray Serve LLM's DP deployment: one Serve replica per
    # rank, gang-scheduled; the autoscaling bounds below count whole DP groups).
    data_parallel_size: int = Field(default=1, ge=1, le=64)
    moe_parallelism: MoeParallelism = MoeParallelism.TENSOR
    # 0: the role scales to zero when idle (dev and staging only: infra/model/scale_to_zero.py).
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=0)
    max_ongoing_requests: int = Field(default=64, ge=1)
    router: Router = Router.POWER_OF_TWO
    # Ray Serve's request-based autoscaling, per role: Serve keeps each replica near this many
    # ongoing (running + queued) requests, adding replicas after the load has stayed above it
    # for upscaleDelayS and removing them after it has stayed below for downscaleDelayS
    # (ray.serve.config.AutoscalingConfig). Decode batches many sequences per step, so its
    # target is a batch size the engine serves at good per-token speed.
    target_ongoing_requests: float = Field(default=16, gt=0)
    upscale_delay_s: float = Field(default=30, ge=0)
    downscale_delay_s: float = Field(default=300, ge=0)
    # Serve's queue bound in front of the role's replicas (per caller): past it, callers get
    # BackPressureError at once, which the ingress answers as 503 + Retry-After. Bounded by
    # default: an unbounded queue turns overload into requests that wait forever. Serve counts
    # a request as queued until a replica is picked, so a burst that arrives at once is
    # refused past this bound even while replicas have free slots (Ray 2.60
    # ray/serve/_private/router.py, wrap_request_assignment): keep it at least as deep as the
    # bursts one caller (an ingress replica) must absorb.
    max_queued_requests: int = Field(default=64, ge=1)
    # Thresholds of the role's own autoscaling policy (serving/autoscaling.py).
    signals: SignalsSpec = Field(default_factory=SignalsSpec)

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
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"targetOngoingRequests ({self.target_ongoing_requests:g}) is above maxOngoingRequests "
                f"({self.max_ongoing_requests}): a replica could never reach it, so Serve would never scale out"
            )
        return self

    @property
    def starting_replicas(self) -> int:
        """Replicas at deploy time: initialReplicas, else minReplicas, but 1 for a role that
        scales to zero (Serve starts at min_replicas; one replica proves that the engine starts,
        then idles away after downscaleDelayS)."""
        if self.initial_replicas is not None:
            return self.initial_replicas
        return max(self.min_replicas, 1)

    @property
    def gpus_per_rank(self) -> int:
        """GPUs of one Serve replica: TP x PP (one placement-group bundle each)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one engine replica (a whole DP group): TP x PP x DP."""
        return self.gpus_per_rank * self.data_parallel_size


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
    # NIXL backend; auto = from the instance catalog. The stack config refuses a choice that
    # does not match the pools' fabric (UCX on EFA falls back to TCP without a word).
    backend: KvBackend = KvBackend.AUTO
    # vLLM NixlConnector's kv_connector_extra_config.kv_lease_duration (seconds; vLLM's
    # default 30 in 0.29 and 0.32): prefill frees KV blocks that decode has not read when
    # the lease runs out, so a dead or abandoned decode cannot pin prefill memory.
    lease_duration_s: int | None = Field(default=None, ge=1)
    # Passed through as kv_connector_extra_config (e.g. {"kv_lease_duration": 60}); its
    # `backends` is rendered from `backend` (a `backends` here must agree with it).
    extra_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _backends(self) -> KvTransferSpec:
        given = self.extra_config.get("backends")
        if given is None:
            return self
        names = [b.value for b in KvBackend if b is not KvBackend.AUTO]
        if not (isinstance(given, list) and len(given) == 1 and given[0] in names):
            raise ValueError(f"extraConfig.backends must be one of {[[n] for n in names]} (or set kvTransfer.backend)")
        if self.backend is not KvBackend.AUTO and given[0] != self.backend.value:
            raise ValueError(f"extraConfig.backends {given} contradicts backend {self.backend.value}")
        return self

    @property
    def requested_backend(self) -> KvBackend | None:
        """The backend the stack file asks for, or None to take the fabric's (auto)."""
        if self.backend is not KvBackend.AUTO:
            return self.backend
        given = self.extra_config.get("backends")
        return KvBackend(given[0]) if given else None


class StreamingSpec(SpecModel):
    """How engine replicas stream tokens back through Serve."""

    # LLMConfig.experimental_configs.stream_batching_interval_ms (Ray's default 50): several
    # tokens per Ray object. 0 sends every token alone, which cost a third of the output
    # throughput at 16 streams on the local stack (docs/performance.md).
    batch_interval_ms: int = Field(default=50, ge=0, le=1000)
    first_chunk: FirstChunk = FirstChunk.EAGER


class ResilienceSpec(SpecModel):
    """Deadlines (seconds) and retries of the serving path (serving/resilience.py).

    Defaults fit models up to ~70B on H100-class GPUs with prompts up to ~32k tokens
    (prefill well under 5 s); raise prefillTimeoutS for longer prompts or slower GPUs.
    """

    # decode -> prefill: one prefill call, from the moment a prefill replica took it.
    prefill_timeout_s: float = Field(default=5.0, gt=0, le=600)
    # decode -> prefill: how long a prefill call may wait for a replica to take it. Past it
    # the prefill tier is busy (not broken: the circuit does not count it) and the request
    # prefills on decode.
    prefill_queue_timeout_s: float = Field(default=4.0, gt=0, le=600)
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
    # after circuitFailures prefill failures in a row, skip remote prefill this long (then
    # probe with one request; its success closes the circuit).
    circuit_open_s: float = Field(default=5.0, gt=0, le=600)
    circuit_failures: int = Field(default=3, ge=1, le=100)
    # Retry-After on 503/504 answers.
    retry_after_s: int = Field(default=1, ge=1, le=3600)

    @model_validator(mode="after")
    def _order(self) -> ResilienceSpec:
        worst_prefill = (
            self.prefill_queue_timeout_s + self.prefill_timeout_s
        ) * self.prefill_attempts + self.kv_ready_timeout_s
        if worst_prefill >= self.first_token_timeout_s:
            raise ValueError(
                f"firstTokenTimeoutS ({self.first_token_timeout_s}) must exceed "
                f"(prefillQueueTimeoutS + prefillTimeoutS) x prefillAttempts + kvReadyTimeoutS ({worst_prefill}), or "
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
        if v.startswith(RAY_RESERVED_LABEL_PREFIX):
            raise ValueError(f"{v!r}: the {RAY_RESERVED_LABEL_PREFIX} prefix is reserved for Ray's own node labels")
        return v

    @field_validator("head", "prefill", "decode")
    @classmethod
    def _value(cls, v: str) -> str:
        if not _LABEL_VALUE.match(v):
            raise ValueError(f"{v!r} is not a valid label value")
        return v


# vLLM's default histogram bounds (vllm/v1/metrics/buckets.py, vLLM 0.32; the same values
# since vLLM 0.4). An SLO burn rate reads the share of requests under the threshold from the
# bucket whose upper bound IS the threshold, so a threshold must be one of these.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class SloSpec(SpecModel):
    """Latency objectives the alerts burn against: `objective` of requests (30 days) have a
    time to first token under `ttftSeconds`, and tokens arrive under `itlSeconds` apart."""

    ttft_seconds: float = 2.5
    itl_seconds: float = 0.1
    objective: float = Field(default=0.99, ge=0.9, le=0.9999)

    @field_validator("ttft_seconds")
    @classmethod
    def _ttft(cls, v: float) -> float:
        if v not in TTFT_BUCKETS_S:
            raise ValueError(f"{v} is not a bucket bound of vLLM's TTFT histogram (one of {list(TTFT_BUCKETS_S)})")
        return v

    @field_validator("itl_seconds")
    @classmethod
    def _itl(cls, v: float) -> float:
        if v not in ITL_BUCKETS_S:
            raise ValueError(
                f"{v} is not a bucket bound of vLLM's inter-token latency histogram (one of {list(ITL_BUCKETS_S)})"
            )
        return v


# --- hybrid routing: the external fallback and per-key limits (issue 14) ----------------------
# The environment variable holding the fallback provider's API key in the ingress replicas; in
# the cloud it is fed from a Kubernetes Secret (the stack's fallbackApiKey Pulumi secret).
FALLBACK_API_KEY_ENV = "PD_FALLBACK_API_KEY"
# Ray's builders name the ingress deployment after its class (serving.app.AuthenticatedIngress);
# the Serve config addresses it by this name to hand it its user_config.
INGRESS_DEPLOYMENT = "AuthenticatedIngress"
# An API key's id in metric labels and in `limits.keys`: never the key itself.
KEY_ID_RE = re.compile(r"^k-[0-9a-f]{12}$")


def key_id(api_key: str) -> str:
    """`k-` + the first 12 hex digits of the key's SHA-256 (what labels and limits use)."""
    return "k-" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


class FallbackWhen(str, Enum):
    UNAVAILABLE = "unavailable"  # an engine deployment has no running replica, or failed before its first byte
    OVERLOADED = "overloaded"  # ongoing requests per decode replica at overflowAt, or Serve's queue is full
    DEADLINE = "deadline"  # a stream's first token did not come within firstTokenTimeoutS


class FallbackSpec(SpecModel):
    """An external OpenAI-compatible API that takes requests the cluster cannot serve."""

    base_url: str = Field(description="The provider's OpenAI-compatible /v1 root, e.g. https://api.example.com/v1.")
    model: str | dict[str, str] = Field(
        description="The provider's model name for serving.model.id, or a map {our model id: theirs}."
    )
    when: list[FallbackWhen] = Field(default_factory=lambda: list(FallbackWhen))
    overflow_at: int | None = Field(
        default=None,
        ge=1,
        description="Ongoing requests per running decode replica at which new requests overflow "
        "to the fallback (default: the decode role's maxOngoingRequests).",
    )
    first_token_timeout_s: float = Field(default=30.0, gt=0, le=600)
    timeout_s: float = Field(default=120.0, gt=0, le=3600)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=60)
    retries: int = Field(default=2, ge=0, le=5, description="Retries of failed connections (never of answers).")

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        u = urlsplit(v)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{v!r} is not an http(s) URL (an OpenAI-compatible /v1 root)")
        if u.username or u.password:
            raise ValueError("the URL carries credentials: put the key in the fallback API key secret instead")
        if u.query or u.fragment:
            raise ValueError(f"{v!r} has a query or fragment: give the /v1 root only")
        return v.rstrip("/")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | dict[str, str]) -> str | dict[str, str]:
        names = [v] if isinstance(v, str) else [*v.keys(), *v.values()]
        if not names or any(not n.strip() for n in names):
            raise ValueError("model names must not be empty")
        return v

    @field_validator("when")
    @classmethod
    def _when(cls, v: list[FallbackWhen]) -> list[FallbackWhen]:
        if not v:
            raise ValueError("list at least one of unavailable, overloaded, deadline (or drop the fallback section)")
        if len(set(v)) != len(v):
            raise ValueError("an entry is listed twice")
        return v

    @property
    def plain_http(self) -> bool:
        return urlsplit(self.base_url).scheme == "http"

    @property
    def host(self) -> str:
        return urlsplit(self.base_url).hostname or ""

    @property
    def port(self) -> int:
        u = urlsplit(self.base_url)
        return u.port or (80 if u.scheme == "http" else 443)

    def models_for(self, model_id: str) -> dict[str, str]:
        return {model_id: self.model} if isinstance(self.model, str) else dict(self.model)


class KeyLimitSpec(SpecModel):
    """Requests and tokens (prompt + completion) per sliding minute; 0 means no limit."""

    requests_per_minute: int = Field(default=0, ge=0)
    tokens_per_minute: int = Field(default=0, ge=0)


class LimitsSpec(KeyLimitSpec):
    """Per-API-key limits: the defaults above for every key, `keys` overriding them by key id
    (`k-` + 12 hex of the key's SHA-256, as in the usage metrics; `python -m tools.keyid`
    prints a key's id)."""

    keys: dict[str, KeyLimitSpec] = Field(default_factory=dict)
    when_ledger_unreachable: Literal["allow", "refuse"] = Field(
        default="allow",
        description="What a limited key's request gets while the shared limits ledger does not answer: "
        "'allow' (served unmetered, counted in pd_limiter_errors: a limiter outage is no serving outage) "
        "or 'refuse' (503 with Retry-After: limits are never exceeded).",
    )

    @field_validator("keys")
    @classmethod
    def _ids(cls, v: dict[str, KeyLimitSpec]) -> dict[str, KeyLimitSpec]:
        bad = [k for k in v if not KEY_ID_RE.match(k)]
        if bad:
            raise ValueError(
                f"{bad[0]!r} is not a key id (k- and 12 hex digits): never put an API key itself in a "
                "stack; get its id with `python -m tools.keyid`"
            )
        return v


@dataclass(frozen=True)
class Target:
    """Where a rendered application runs: the only thing the cloud and local runs differ in.

    accelerator_type: Ray's accelerator type for GPU engines (e.g. "H100"); None means CPU.
    working_dir: the runtime_env working_dir holding serving/ (an s3:// zip in the cloud).
    engine_env: extra environment for engine replicas (e.g. NIXL/EFA settings, CPU KV size).
    ingress_env: extra environment for the ingress replicas.
    kv_backend: the NIXL backend the nodes' fabric calls for (the catalog's `nixl_backend`:
        LIBFABRIC on EFA types, UCX elsewhere and on CPU); used when the spec says auto.
    role_accelerator_types: per engine role, when the pools differ (e.g. H100 prefill, A100
        decode); a role not listed takes `accelerator_type`.
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
    kv_backend: KvBackend = KvBackend.UCX
    role_accelerator_types: Mapping[str, str] = field(default_factory=dict)
    proxy_location: str = "EveryNode"
    # Per engine role: autoscaling thresholds the planner derived (infra/model/scaling_signals.py)
    # and the PromQL label selector of the role's engine series (none: Serve's signals only).
    role_thresholds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    metrics_selectors: Mapping[str, str] = field(default_factory=dict)

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
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    slo: SloSpec = Field(default_factory=SloSpec)
    # Hybrid routing (serving/hybrid.py): an external provider for what the cluster cannot
    # serve, and per-API-key limits. See docs/hybrid-routing.md.
    fallback: FallbackSpec | None = None
    limits: LimitsSpec = Field(default_factory=LimitsSpec)

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

    def _pd_layout_problem(self) -> str | None:
        """Why the prefill/decode layouts cannot run together, in one line; None when they can.

        Each rule is the upstream one, read in vLLM 0.32 (local) and 0.29 (the cloud image's, for
        Ray 2.60) under vllm/distributed/kv_transfer/kv_connector/: what neither refuses is allowed.
        Rules that need the model's shape (KV heads) are in infra.model.fit.
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
        if spec.data_parallel_size > 1:
            # Ray Serve LLM's P/D builder switches to its DP servers on this key
            # (serving_patterns/prefill_decode/builder.py: DPPDPrefillServer / DPPDDecodeServer).
            engine_kwargs["data_parallel_size"] = spec.data_parallel_size
        if spec.moe_parallelism is MoeParallelism.EXPERT:
            engine_kwargs["enable_expert_parallel"] = True
        if not target.cpu:
            engine_kwargs["gpu_memory_utilization"] = self.model.gpu_memory_utilization
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
        ingress["ray_actor_options"]["runtime_env"] = {"env_vars": {**dict(target.ingress_env), **SERVING_ENV}}
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

    def ingress_user_config(self) -> dict[str, Any]:
        """The ingress deployment's user_config: the fallback and the per-key limits.

        A user_config change reaches the running ingress through `reconfigure` (Serve's
        lightweight update); application `args` changes rebuild every deployment, engines
        included. So what operators tune (limits, provider) lives here, not in args.
        """
        fb = self.fallback
        fallback = None
        if fb is not None:
            fallback = {
                "base_url": fb.base_url,
                "models": fb.models_for(self.model.id),
                "when": [w.value for w in fb.when],
                # The engine deployment the ingress calls: decode (or the aggregated engine).
                "overflow_at": fb.overflow_at or self.decode.max_ongoing_requests,
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
                "requests_per_minute": limits.requests_per_minute,
                "tokens_per_minute": limits.tokens_per_minute,
                "keys": {
                    k: {"requests_per_minute": v.requests_per_minute, "tokens_per_minute": v.tokens_per_minute}
                    for k, v in sorted(limits.keys.items())
                },
                "when_ledger_unreachable": limits.when_ledger_unreachable,
                # Where the shared limits actor lives: with the ingress, on the head.
                "label_selector": {self.placement.label_key: self.placement.head},
            },
        }

    def serve_config(self, target: Target, *, port: int = SERVE_PORT) -> dict[str, Any]:
        """The Serve config (RayService serveConfigV2 / `serve deploy` file) for `target`."""
        app: dict[str, Any] = {
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": APP_IMPORT_PATH,
            "args": self.app_args(target),
            "deployments": [{"name": INGRESS_DEPLOYMENT, "user_config": self.ingress_user_config()}],
        }
        if target.working_dir:
            app["runtime_env"] = {"working_dir": target.working_dir}
        return {
            "proxy_location": target.proxy_location,
            # Serve's own request timeout backs the ingress's total deadline up (a hung
            # ingress still answers), a little later so the ingress's JSON error wins.
            "http_options": {
                "host": "0.0.0.0",
                "port": port,
                "request_timeout_s": self.resilience.total_timeout_s + PROXY_TIMEOUT_MARGIN_S,
            },
            "applications": [app],
        }
