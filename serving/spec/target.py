"""Where a rendered Serve application runs: the `Target` the cloud and the local run differ in.

What flows through here: nothing at run time; infra/k8s/rayservice.py builds one per model
(its pools' GPU types, fabric, planned thresholds, metric selectors) and serving/local one
for the CPU run; serving/spec/serving.py's ServingSpec renders the Serve config for it. Standard
library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from serving.spec.base import KvBackend
from serving.spec.offload import OffloadTier


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
    # Per engine role: autoscaling thresholds the planner derived (infra/sizing/signals.py)
    # and the PromQL label selector of the role's engine series (none: Serve's signals only).
    role_thresholds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    metrics_selectors: Mapping[str, str] = field(default_factory=dict)
    # Per engine role at minReplicas 0: the planner's first request after idle, seconds
    # (infra/plan/planning.py cold_start_seconds); decode's is the ingress's Retry-After for
    # a 503 while no decode replica runs (ResilienceSpec.coldStartRetryAfterS).
    cold_start_s: Mapping[str, float] = field(default_factory=dict)
    # Per engine role: the CPUs its replica actor asks Ray for (`ray_actor_options.num_cpus`,
    # which Ray Serve LLM puts in the replica's first placement bundle), where the planner
    # sized its API side above Ray's default of 1 from its CPU per output token
    # (infra/sizing/streaming.py); absent: Ray's default.
    replica_cpus: Mapping[str, int] = field(default_factory=dict)
    # The OpenTelemetry collector's OTLP/gRPC address: every engine exports vLLM's request spans
    # there (engine argument `otlp_traces_endpoint`, vLLM 0.29 and 0.32); None: no engine traces.
    traces_endpoint: str | None = None
    # Per engine role: its share of the pool's KV offload tier (kvOffload); a role not listed
    # has none and renders NIXL alone (serving/spec/offload.py).
    role_kv_offload: Mapping[str, OffloadTier] = field(default_factory=dict)
    # Per cost phase, what one token costs on the cluster in USD: "prefill" per prompt token an
    # engine computes (not served from its prefix cache), "decode" per output token; a
    # replica's price per hour over its tokens per second (infra/plan/costs.py). Absent: the
    # cluster's part of a request's cost is not counted (its tokens still are).
    token_prices: Mapping[str, float] = field(default_factory=dict)

    @property
    def cpu(self) -> bool:
        return self.accelerator_type is None
