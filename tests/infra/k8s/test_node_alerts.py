"""`PDNodeDiskNearEviction` fires before the kubelet evicts, under `promtool test rules`.

Contract: the kubelet's default hard eviction threshold for the node filesystem is
`nodefs.available<10%` (Kubernetes docs, "Node-pressure Eviction", Linux defaults); node-exporter
serves `node_filesystem_avail_bytes` / `node_filesystem_size_bytes` with labels device,
mountpoint, fstype (prometheus/node_exporter collector/filesystem_common.go). Each case feeds
series as that exporter names them and checks when the alert fires: on a disk filling towards
the threshold before it is reached, not on a steady or a tmpfs one.
"""

from __future__ import annotations

import subprocess

import promql_parser
import yaml

from infra.k8s import node_alerts
from tests.infra.k8s.test_alert_rules import promtool

GIB = 1 << 30
SIZE = 1000 * GIB
LABELS = 'instance="10.0.1.7:9100", device="/dev/md127", mountpoint="/", fstype="xfs"'


def _fs(avail: str, labels: str = LABELS) -> list[dict]:
    return [
        {"series": f"node_filesystem_size_bytes{{{labels}}}", "values": f"{SIZE}x120"},
        {"series": f"node_filesystem_avail_bytes{{{labels}}}", "values": avail},
    ]


def _firing(eval_time: str) -> dict:
    (rule,) = node_alerts.node_rule_groups()[0]["rules"]
    annotations = {k: v.replace("{{ $labels.instance }}", "10.0.1.7:9100") for k, v in rule["annotations"].items()}
    annotations["description"] = annotations["description"].replace("{{ $labels.mountpoint }}", "/")
    return {
        "eval_time": eval_time,
        "alertname": rule["alert"],
        "exp_alerts": [
            {
                "exp_labels": {
                    "severity": "warning",
                    **dict(p.split("=") for p in LABELS.replace('"', "").split(", ")),
                },
                "exp_annotations": annotations,
            }
        ],
    }


def _quiet(eval_time: str) -> dict:
    return {"eval_time": eval_time, "alertname": "PDNodeDiskNearEviction", "exp_alerts": []}


def test_the_rule_parses_and_reads_only_node_exporter_series():
    (rule,) = node_alerts.node_rule_groups()[0]["rules"]
    promql_parser.parse(rule["expr"])
    assert set(node_alerts.METRICS) == {"node_filesystem_avail_bytes", "node_filesystem_size_bytes"}


def test_it_fires_on_a_filling_disk_before_the_kubelet_evicts_and_not_on_a_steady_one(tmp_path):
    # 4 GiB a minute from 400 GiB available: 10% (100 GiB) is reached at minute 75. The trend
    # alert holds from ~minute 15 (within the hour) + 5 minutes.
    filling = {"interval": "1m", "input_series": _fs(f"{400 * GIB}-{4 * GIB}x120"), "alert_rule_test": []}
    filling["alert_rule_test"] = [_quiet("10m"), _firing("30m"), _firing("70m")]
    # 12% available and steady: within 5 points of the threshold.
    near = {"interval": "1m", "input_series": _fs(f"{120 * GIB}x60"), "alert_rule_test": [_firing("20m")]}
    # Half the disk free, steady; and a tmpfs (memory, not the kubelet's disk) nearly full.
    tmpfs = LABELS.replace('fstype="xfs"', 'fstype="tmpfs"').replace('mountpoint="/"', 'mountpoint="/dev/shm"')
    steady = {
        "interval": "1m",
        "input_series": _fs(f"{500 * GIB}x60") + _fs(f"{GIB}x60", tmpfs),
        "alert_rule_test": [_quiet("40m")],
    }
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": node_alerts.node_rule_groups()}))
    (tmp_path / "t.yaml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [filling, near, steady]},
            width=1000,
        )
    )
    r = subprocess.run(
        [promtool(), "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
