"""Alert rules for the KV cache's path, as data: a request that returns 200 while no KV moved.

What flows through here: the stack's KV link from the capacity plan (`planning.kv_link`: the
NIXL backend and the slower side's per-GPU line rate) -> PrometheusRule `spec.groups`
entries (`kv_rule_groups`) and a whole `monitoring.coreos.com/v1` PrometheusRule
(`kv_prometheus_rule`). The observability component puts them next to its own rules; the
metric names are the ones Ray exports for vLLM's engines (`ray_vllm_*`, seen in the live
scrape of the local stack: only the decode engine, which pulls the KV, reports the NIXL
histograms; every engine reports `request_success`).

Two failures look like success from the outside (aws-samples/aws-do-eks#66,
ai-dynamo/dynamo#4185):
- KVTransferMissing: requests succeed for 5 minutes while no KV bytes arrive (a broken
  transfer with `kv_load_failure_policy: recompute` makes decode recompute every prompt);
- KVTransferSlow: a transfer takes more than 3x what the plan's line rate predicts for its
  bytes, the signature of NIXL falling back to TCP. Seconds per byte is compared, which is
  the same as time per request against the planned time for that request's bytes.
"""

from __future__ import annotations

from typing import Any

from infra.plan.planning import KvLink

SUCCESS = "ray_vllm_request_success_total"
KV_BYTES = "ray_vllm_nixl_bytes_transferred"  # histogram: bytes per transfer
KV_SECONDS = "ray_vllm_nixl_xfer_time_seconds"  # histogram: seconds per transfer
METRICS = (SUCCESS, f"{KV_BYTES}_sum", f"{KV_SECONDS}_sum", f"{KV_SECONDS}_count")
SLOW_FACTOR = 3
GROUP = "pd-inference-kv-transfer"


def planned_seconds_per_byte(link: KvLink) -> float:
    """One TP rank moves its share of the KV over its GPU's share of the slower side's line rate."""
    return 8 / (link.gbps_per_gpu * 1e9)


def kv_rule_groups(link: KvLink, *, window: str = "5m", slow_window: str = "10m") -> list[dict[str, Any]]:
    """The PrometheusRule groups for a disaggregated stack whose KV path is `link`."""
    limit = SLOW_FACTOR * planned_seconds_per_byte(link)
    missing = (
        f"(sum by (model_name) (increase({SUCCESS}[{window}])) > 0)\n"
        f"unless on (model_name)\n"
        f"(sum by (model_name) (increase({KV_BYTES}_sum[{window}])) > 0)"
    )
    slow = (
        f"(\n  sum by (model_name) (rate({KV_SECONDS}_sum[{slow_window}]))\n  /\n"
        f"  sum by (model_name) (rate({KV_BYTES}_sum[{slow_window}]))\n) > {limit:.6g}\n"
        f"and on (model_name)\n"
        f"sum by (model_name) (rate({KV_SECONDS}_count[{slow_window}])) > 0"
    )
    planned = f"{link.gbps_per_gpu:g} Gbps per GPU ({link.slower_role} {link.slower_instance}, NIXL {link.backend})"
    return [
        {
            "name": GROUP,
            "rules": [
                {
                    "alert": "KVTransferMissing",
                    "expr": missing,
                    "for": window,
                    "labels": {"severity": "critical"},
                    "annotations": {
                        "summary": "P/D requests succeed but no KV cache arrives at decode",
                        "description": (
                            "{{ $labels.model_name }}: requests finished in the last " + window + " while NIXL "
                            "moved no KV bytes. Decode is recomputing prompts (kv_load_failure_policy: "
                            "recompute) or the transfer is broken; check the NIXL backend and the fabric "
                            "(make efa-check)."
                        ),
                    },
                },
                {
                    "alert": "KVTransferSlow",
                    "expr": slow,
                    "for": slow_window,
                    "labels": {"severity": "warning"},
                    "annotations": {
                        "summary": f"KV transfers take more than {SLOW_FACTOR}x the planned time (TCP fallback?)",
                        "description": (
                            "{{ $labels.model_name }}: {{ $value | humanize }} s per byte; the plan is "
                            f"{planned_seconds_per_byte(link):.3g} s per byte at {planned}. UCX on EFA falls "
                            "back to TCP without a word (ai-dynamo/nixl#909)."
                        ),
                    },
                },
            ],
        }
    ]


def kv_prometheus_rule(name: str, namespace: str, link: KvLink, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A whole PrometheusRule (prometheus-operator) with the KV transfer alerts."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {"groups": kv_rule_groups(link)},
    }
