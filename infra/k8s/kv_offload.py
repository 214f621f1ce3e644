"""The KV offload tier in the cluster: worker pod volumes, its dashboard row and its alerts.

What flows through here: a pool's validated `kvOffload` (infra/config/kv_offload.py) -> the
worker pod's /dev/shm size and Ray's object store size
(`pod_parts`); vLLM's offloading metrics under the names Ray's exporter gives them (`vllm:x`
-> `ray_vllm_x`, counters `_total`) -> a dashboard row (`OFFLOAD_ROW`) and one PrometheusRule
group (`offload_rule_groups`). Only stacks with a tier get any of it.

The metric names are vLLM's own (0.29 and 0.32 alike):
kv_connector/v1/offloading/metrics.py `_TransferMetricName` (load/store bytes and seconds,
flat counters), `_ConnectorMetricName.ALLOCATION_FAILURE` (a store found no free CPU chunk),
v1/kv_offload/cpu/common.py `CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC` (share of the CPU
tier pinned by transfers). The prefix-cache hits that came from outside the GPU cache are
`vllm:external_prefix_cache_hits`/`_queries`: on prefill (where NIXL loads nothing) those are
the tier's hits.
"""

from __future__ import annotations

from typing import Any

from infra import catalog
from infra.config.kv_offload import KvOffload, shm_gib
from infra.k8s.alerts import runbook
from infra.k8s.dashboard_panels import RATE, SEL, PanelSpec, Query
from infra.k8s.monitoring import ROLE
from serving.spec.offload import GIB

STORE_BYTES = "ray_vllm_kv_offload_store_bytes_total"
LOAD_BYTES = "ray_vllm_kv_offload_load_bytes_total"
STORE_SECONDS = "ray_vllm_kv_offload_store_time_total"
LOAD_SECONDS = "ray_vllm_kv_offload_load_time_total"
ALLOCATION_FAILURES = "ray_vllm_kv_offload_allocation_failure_total"
CPU_PINNED = "ray_vllm_kv_offload_cpu_cache_usage_perc"
EXTERNAL_HITS = "ray_vllm_external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "ray_vllm_external_prefix_cache_queries_total"
METRICS = (
    STORE_BYTES,
    LOAD_BYTES,
    STORE_SECONDS,
    LOAD_SECONDS,
    ALLOCATION_FAILURES,
    CPU_PINNED,
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
)

GROUP = "pd-inference-kv-offload"
# Thrashing: the tier writes at least this many bytes per byte it gives back. A tier that
# pays reads back a fair share of what it stores (repeated prefixes); one that does not only
# costs PCIe bandwidth and host memory.
THRASH_STORE_PER_LOAD = 20
# Ray's default object store is min(30% of memory, 200 GB, 95% of /dev/shm's free space)
# (ray/_private/utils.py resolve_object_store_memory, ray_constants.py, Ray 2.60).
_OBJECT_STORE_MAX = 200 * 10**9


def ray_object_store_bytes(inst: catalog.InstanceType) -> int:
    """Ray's default object store on a worker pod WITHOUT the tier: pinned when the tier grows
    /dev/shm, so that Ray does not take the room meant for vLLM's CPU tier."""
    return min(int(inst.pod_memory_gib * GIB * 0.3), _OBJECT_STORE_MAX, int(inst.shm_gib * GIB * 0.95))


def pod_parts(inst: catalog.InstanceType, off: KvOffload | None) -> tuple[list[dict], list[dict], dict[str, str]]:
    """(volumes, mounts, rayStartParams) of a worker pod on a pool with tier `off`."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(inst, off)}Gi"}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if off is None:
        return volumes, mounts, {}
    return volumes, mounts, {"object-store-memory": str(ray_object_store_bytes(inst))}


def _by(metric: str) -> str:
    return f"sum by ({ROLE}) (rate({metric}{{{SEL}}}[{RATE}]))"


OFFLOAD_ROW: tuple[str, tuple[PanelSpec, ...]] = (
    "KV offload tier",
    (
        PanelSpec(
            "Offload hit rate (tokens from outside the GPU cache)",
            "percentunit",
            (Query(f"{_by(EXTERNAL_HITS)} / {_by(EXTERNAL_QUERIES)}", "{{role}}"),),
            "Prompt tokens found outside the GPU prefix cache / tokens looked up. On prefill these are the "
            "offload tier's hits (NIXL loads nothing there); on decode NIXL's transfers count too.",
        ),
        PanelSpec(
            "Offload bytes",
            "Bps",
            (Query(_by(STORE_BYTES), "stored {{role}}"), Query(_by(LOAD_BYTES), "loaded {{role}}")),
            "GPU -> tier (stored) and tier -> GPU (loaded). Stored far above loaded: the tier thrashes.",
        ),
        PanelSpec(
            "Offload transfer time per GiB",
            "s",
            (
                Query(f"{_by(STORE_SECONDS)} / ({_by(STORE_BYTES)} / {GIB})", "store {{role}}"),
                Query(f"{_by(LOAD_SECONDS)} / ({_by(LOAD_BYTES)} / {GIB})", "load {{role}}"),
            ),
            "Seconds per GiB moved between the GPU and the CPU tier (PCIe).",
        ),
        PanelSpec(
            "CPU tier pinned by transfers; failed stores",
            "short",
            (
                Query(f"max by ({ROLE}) ({CPU_PINNED}{{{SEL}}})", "pinned share {{role}}"),
                Query(_by(ALLOCATION_FAILURES), "failed stores/s {{role}}"),
            ),
            "Share of the CPU tier held by in-flight transfers, and stores dropped for want of a free chunk.",
        ),
    ),
)


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description, "runbook_url": runbook(name)},
    }


def offload_rule_groups(window: str = "15m") -> list[dict[str, Any]]:
    """The tier's alerts: it writes far more than it reads back, or its stores fail."""
    by = f"model_name, {ROLE}"
    store = f"sum by ({by}) (rate({STORE_BYTES}[{window}]))"
    load = f"sum by ({by}) (rate({LOAD_BYTES}[{window}]))"
    # A tier that never loaded has no load series yet: count it as zero.
    thrash = f"{store} > {THRASH_STORE_PER_LOAD} * ({load} or {store} * 0)"
    failing = f"sum by ({by}) (rate({ALLOCATION_FAILURES}[{window}])) > 0"
    return [
        {
            "name": GROUP,
            "rules": [
                _alert(
                    "KVOffloadThrashing",
                    thrash,
                    "30m",
                    "warning",
                    f"The KV offload tier stores more than {THRASH_STORE_PER_LOAD}x what it loads back",
                    "{{ $labels.model_name }} {{ $labels.role }}: blocks are evicted before they are reused; the "
                    "tier costs PCIe bandwidth and host memory and saves little prefill. Grow kvOffload.cpuGiB, "
                    "or turn the tier off on this pool.",
                ),
                _alert(
                    "KVOffloadStoresFailing",
                    failing,
                    "15m",
                    "warning",
                    "KV offload stores fail: no free chunk in the CPU tier",
                    "{{ $labels.model_name }} {{ $labels.role }}: every CPU chunk is pinned by in-flight transfers; "
                    "blocks are dropped instead of offloaded. Grow kvOffload.cpuGiB.",
                ),
            ],
        }
    ]
