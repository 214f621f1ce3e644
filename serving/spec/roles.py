"""The serving spec's parts for the model and its engines: what each role runs and how.

What flows through here: the `serving:` keys of a stack file for the model (source,
architecture, loading), each engine role (parallelism, replicas, autoscaling, queue bounds),
the ingress, the KV transfer, streaming, the resilience deadlines, placement labels and the
SLOs -> validated pydantic models that serving/spec/serving.py's ServingSpec composes and renders.
pydantic and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from serving.spec.base import (
    _LABEL_KEY,
    _LABEL_VALUE,
    _MODEL_ID,
    _MODEL_SOURCE,
    BATCH_FROM_STREAMS,
    DEFAULT_LABEL_KEY,
    RAY_RESERVED_LABEL_PREFIX,
    DataPlane,
    Dtype,
    FirstChunk,
    KvBackend,
    KvBufferDevice,
    KvConnector,
    KvLoadFailurePolicy,
    MoeParallelism,
    Router,
    SpecModel,
    check_order,
)
from serving.spec.scaling import LoadingSpec, SignalsSpec
from serving.spec.tools import ReasoningSpec, ToolsSpec, chat_template_kwargs, chat_template_path


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


class ModelThroughput(SpecModel):
    """One replica's measured tokens per second, for the cost of a request (what a token costs
    is a replica's price per hour over these); each left out comes from the capacity plan's
    roofline, which no engine reaches (so a cost from it is a lower bound)."""

    prefill_tokens_per_s: float | None = Field(default=None, gt=0, description="Prompt tokens/s one replica computes.")
    decode_tokens_per_s: float | None = Field(
        default=None, gt=0, description="Output tokens/s one decode replica emits at the batch it usually runs."
    )


class ModelSpec(SpecModel):
    id: str = Field(description="Served model name: what clients put in `model`.")
    source: str = Field(description="Hugging Face repo id, s3:// prefix, or a local path.")
    dtype: Dtype = Dtype.BFLOAT16
    max_model_len: int = Field(default=8192, ge=16, le=1_048_576)
    gpu_memory_utilization: float = Field(default=0.90, gt=0.05, le=0.98)
    architecture: ModelArchitecture | None = None
    throughput: ModelThroughput = Field(default_factory=ModelThroughput)
    loading: LoadingSpec = Field(default_factory=LoadingSpec)
    # Tool calling, reasoning and a chat template in place of the model's (serving/spec/tools.py).
    tools: ToolsSpec | None = None
    reasoning: ReasoningSpec | None = None
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        return chat_template_path(v) if v is not None else None

    def openai_kwargs(self) -> dict[str, object]:
        """vLLM OpenAI-layer arguments for tools, reasoning and the template (every role's)."""
        kwargs: dict[str, object] = {}
        if self.tools is not None:
            kwargs.update(self.tools.engine_kwargs())
        if self.reasoning is not None:
            kwargs.update(self.reasoning.engine_kwargs())
        if self.chat_template is not None:
            kwargs.update(chat_template_kwargs(self.chat_template))
        return kwargs

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
    # 0: the role scales to zero when idle (dev and staging only: infra/sizing/scale_to_zero.py).
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
    # Thresholds of the role's own autoscaling policy (serving/engines/autoscaling.py).
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
    # Set in every Ray pod's environment (spec_base.DataPlane); haproxy is Ray's
    # high-throughput mode, measured in docs/performance.md (`make bench-data-plane`).
    data_plane: DataPlane = DataPlane.HAPROXY
    # A request body larger than this gets 413 before it is read whole (in the HAProxy data
    # plane the ingress reads and parses bodies on its replica's own event loop). 4 MiB holds
    # a 128k-token prompt of text several times over; the serving path is text only.
    max_body_mib: int = Field(default=4, ge=1, le=64)

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
    # Decode renders the prompt with the token ids prefill returns, instead of tokenizing it a
    # second time (Ray 2.60's LLMConfig.experimental_configs.pd_tokenize_once, which the
    # resilient decode server honours too: serving/engines/pd_server.py). A prompt that
    # prefills on decode (prefill down, n > 1, a batch) is tokenized there, as before.
    reuse_prompt_token_ids: bool = True

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
    # Batching follows the load: an engine replica batches a stream's tokens only while it
    # has at least this many streams open; below, each engine step's tokens go at once, so a
    # client's inter-token latency is the engine's step, not a burst every interval. 0: always.
    batch_from_streams: int = Field(default=BATCH_FROM_STREAMS, ge=0, le=100_000)


class ResilienceSpec(SpecModel):
    """Deadlines (seconds) and retries of the serving path (serving/core/failures.py).

    The same model at run time: the spec renders `runtime_args()` into args["resilience"],
    and the ingress and the decode server read it back with `from_args` (one model, so the
    stack file's keys, the rendered args and what the replicas read cannot drift apart).

    Defaults fit models up to ~70B on H100-class GPUs with prompts up to ~32k tokens
    (prefill well under 5 s); raise prefillTimeoutS for longer prompts or slower GPUs.
    """

    # decode -> prefill: one prefill call, from the moment a prefill replica took it.
    prefill_timeout_s: float = Field(default=5.0, gt=0, le=600)
    # decode -> prefill: added to prefillTimeoutS for each prompt token (milliseconds), so a
    # long prompt's prefill is not taken for a stalled tier. Decode bounds the prompt's tokens
    # from the request (serving/engines/prefill_hop.py prompt_tokens_bound: one per UTF-8 byte
    # of text); the sum is capped at totalTimeoutS.
    prefill_timeout_per_token_ms: float = Field(default=0.1, ge=0, le=100)
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
    # after the first byte: a stream whose decode replica died, answered a 5xx event or
    # stalled continues on another replica (serving/ingress/migration.py), at most this many times.
    # 2: a rolling update or a lost node can take the replica that took the first
    # continuation too; each continuation prefills the prompt and the answer so far again.
    migrations: int = Field(default=2, ge=0, le=5)
    # a started stream that sends nothing for this long counts as cut (then continued).
    stall_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # after circuitFailures prefill failures in a row, skip remote prefill this long (then
    # probe with one request; its success closes the circuit).
    circuit_open_s: float = Field(default=5.0, gt=0, le=600)
    circuit_failures: int = Field(default=3, ge=1, le=100)
    # Retry-After on 503/504 answers.
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    # Retry-After on a 503 sent because decode (or the aggregated engine) has no running
    # replica. Unset: the planner's "first request after idle" of the decode role when it
    # may scale to zero (minReplicas 0: a new engine, and maybe a new node, must start;
    # infra/plan/planning.py cold_start_seconds), else retryAfterS.
    cold_start_retry_after_s: int | None = Field(default=None, ge=1, le=3600)

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
        if self.stall_timeout_s > self.total_timeout_s:
            raise ValueError("stallTimeoutS must not exceed totalTimeoutS")
        return self

    def runtime_args(self, cold_start_s: float | None = None) -> dict[str, Any]:
        """args["resilience"]: every field, by its Python name, for `from_args` in the
        replicas. `cold_start_s`: the planner's first request after idle for the decode
        role, when it may scale to zero (None: it keeps a replica, or the time is not known)."""
        args = self.model_dump(by_alias=False)
        if self.cold_start_retry_after_s is None:
            cold = self.retry_after_s if cold_start_s is None else math.ceil(cold_start_s)
            args["cold_start_retry_after_s"] = max(self.retry_after_s, cold)
        return args

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ResilienceSpec:
        """What a replica reads from args["resilience"]: every field rendered (a partial block
        is a config rendered by another version of this code), none unknown, the same checks
        as the stack file's."""
        names = set(cls.model_fields)
        # A field without a default of its own (None: derived) came with the rendered args.
        required = {n for n, f in cls.model_fields.items() if f.default is not None}
        unknown, missing = sorted(set(args) - names), sorted(required - set(args))
        if unknown or missing:
            raise ValueError(f"args.resilience: unknown keys {unknown or 'none'}, missing keys {missing or 'none'}")
        return cls.model_validate(dict(args))

    @property
    def unavailable_retry_after_s(self) -> int:
        """Retry-After of a 503 while decode has no running replica."""
        return self.cold_start_retry_after_s or self.retry_after_s

    @property
    def scale_from_zero_retry_after_s(self) -> int | None:
        """The cold-start Retry-After when it says more than retry_after_s (decode may scale
        to zero), else None."""
        cold = self.cold_start_retry_after_s
        return cold if cold is not None and cold > self.retry_after_s else None


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
