"""A node's disk nearing the kubelet's eviction threshold: one PrometheusRule group.

What flows through here: node-exporter's filesystem series (prometheus/node_exporter
collector/filesystem_common.go: `node_filesystem_avail_bytes`, `node_filesystem_size_bytes`,
labels device, mountpoint, fstype), from every node (the chart's node-exporter tolerates the
GPU taint: infra/k8s/monitoring.py) -> `PDNodeDiskNearEviction`, which fires before the
kubelet evicts.

Why: the kubelet evicts pods from a node whose filesystem has less than 10% available (its
default hard threshold `nodefs.available<10%`, Kubernetes docs "Node-pressure Eviction"), and
a pod whose emptyDir passes its sizeLimit (what vLLM's unbounded disk KV tier did, now refused:
infra/config/kv_offload.py). A Ray worker pod holds a whole engine: a new one takes 5-14
minutes (make plan's time to serve), and P/D loses that role meanwhile. The kubelet's storage,
the images, the model cache, /tmp/ray and every emptyDir that is not in memory live on the
node's real filesystems (ext4/xfs; the RAID0 of `localStorage: raid0`).
"""

from __future__ import annotations

from typing import Any

from infra.k8s.alerts import runbook

GROUP = "pd-inference-nodes"
AVAIL = "node_filesystem_avail_bytes"
SIZE = "node_filesystem_size_bytes"
METRICS = (AVAIL, SIZE)
# The kubelet's default hard eviction threshold for the node filesystem (share available).
EVICTION_AVAILABLE = 0.10
# Fire this far above it...
MARGIN = 0.05
# ...or when the last WINDOW's trend reaches it within HORIZON_S.
WINDOW = "30m"
HORIZON_S = 3600
_FS = 'fstype=~"ext4|xfs"'


def node_rule_groups() -> list[dict[str, Any]]:
    avail, size = f"{AVAIL}{{{_FS}}}", f"{SIZE}{{{_FS}}}"
    near = f"{avail} / {size} < {EVICTION_AVAILABLE + MARGIN:g}"
    soon = f"predict_linear({avail}[{WINDOW}], {HORIZON_S}) < {EVICTION_AVAILABLE:g} * {size}"
    name = "PDNodeDiskNearEviction"
    return [
        {
            "name": GROUP,
            "rules": [
                {
                    "alert": name,
                    "expr": f"({near}) or ({soon})",
                    "for": "5m",
                    "labels": {"severity": "warning"},
                    "annotations": {
                        "summary": "A node's disk nears the kubelet's eviction threshold",
                        "description": (
                            "{{ $labels.instance }} {{ $labels.mountpoint }}: "
                            f"under {EVICTION_AVAILABLE + MARGIN:.0%} available, or on course to pass "
                            f"{EVICTION_AVAILABLE:.0%} within {HORIZON_S // 60} minutes at the last {WINDOW}'s rate. "
                            "Below 10% the kubelet evicts pods; a Ray worker pod holds a whole engine."
                        ),
                        "runbook_url": runbook(name),
                    },
                }
            ],
        }
    ]
