"""The KV offload tier in the cluster (infra/k8s/kv_offload.py): pods, metric names, alerts.

Contract:
- the metric names are vLLM's own constants (kv_connector/v1/offloading/metrics.py,
  v1/kv_offload/cpu/common.py, v1/kv_offload/tiering/base.py, v1/metrics/loggers.py for the
  external prefix-cache counters), read from the installed package, under Ray's export names
  (`vllm:x` -> `ray_vllm_x`, counters `_total`; tests/infra/k8s/test_kv_alerts.py);
- the alerts behave under Prometheus's own rule engine (`promtool test rules`);
- the worker pod's /dev/shm holds vLLM's CPU tier (cpu/shared_offload_region.py keeps it in
  /dev/shm) and still fits the pod's memory limit; Ray's object store stays what Ray would
  have chosen without the tier (ray/_private/utils.py resolve_object_store_memory).
"""

from __future__ import annotations

import re
import subprocess

import promql_parser
import yaml

from infra import catalog
from infra.config.kv_offload import KvOffload
from infra.k8s import kv_offload
from tests.infra.k8s.test_alert_rules import promtool


def _vllm_names() -> set[str]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as om
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

    consts = [
        *vars(om._TransferMetricName).values(),
        *vars(om._ConnectorMetricName).values(),
        *vars(CPUOffloadingMetrics).values(),
        *vars(TieringOffloadingMetrics).values(),
    ]
    return {c for c in consts if isinstance(c, str) and c.startswith("vllm:")}


def _exported_as_vllm(name: str) -> str:
    return "vllm:" + re.sub(r"_(total|sum|count|bucket)$", "", name.removeprefix("ray_vllm_"))


def test_every_offload_metric_is_one_vllm_defines() -> None:
    names = _vllm_names()
    from infra.vllm_options import LOCAL_VLLM_VERSION, surface

    prefix_cache = set(surface(LOCAL_VLLM_VERSION)["metrics"])
    for m in kv_offload.METRICS:
        assert _exported_as_vllm(m) in names | prefix_cache, m


def test_dashboard_row_and_rules_parse_and_read_only_those_metrics() -> None:
    exprs = [q.expr for p in kv_offload.OFFLOAD_ROW[1] for q in p.queries]
    exprs += [r["expr"] for g in kv_offload.offload_rule_groups() for r in g["rules"]]
    for e in exprs:
        promql_parser.parse(
            e.replace("$__rate_interval", "5m").replace("$role", ".*").replace("$cluster", ".*").replace("$model", ".*")
        )
        for m in re.findall(r"\bray_vllm_[a-z_]+\b", e):
            assert m in kv_offload.METRICS, m


def test_pod_dev_shm_holds_the_cpu_tier_within_the_pod_limit() -> None:
    inst = catalog.lookup("p4de.24xlarge")
    off = KvOffload(cpuGiB=256)
    volumes, mounts, params = kv_offload.pod_parts(inst, off)
    shm = next(v for v in volumes if v["name"] == "dshm")
    size = int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi"))
    assert size == inst.shm_gib + 256 <= inst.pod_memory_gib
    assert [v["name"] for v in volumes] == ["dshm"], "no disk tier: nothing that fills and gets the pod evicted"
    assert mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]
    # Ray's default without the tier: 30% of memory, at most 200 GB and 95% of /dev/shm.
    assert int(params["object-store-memory"]) == min(
        int(inst.pod_memory_gib * (1 << 30) * 0.3), 200 * 10**9, int(inst.shm_gib * (1 << 30) * 0.95)
    )
    assert kv_offload.pod_parts(inst, None)[2] == {}, "no tier: Ray chooses as before"


def _series(name: str, values: str) -> dict:
    return {"series": f'{name}{{model_name="m", role="prefill"}}', "values": values}


def test_alerts_fire_on_thrash_and_failed_stores_and_not_on_a_paying_tier(tmp_path) -> None:
    gib = 1 << 30
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": kv_offload.offload_rule_groups()}))
    thrash = {
        "interval": "1m",
        # 1 GiB stored a minute, nothing ever loaded back (no load series at all).
        "input_series": [_series(kv_offload.STORE_BYTES, f"0+{gib}x60")],
        "alert_rule_test": [
            {
                "eval_time": "50m",
                "alertname": "KVOffloadThrashing",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "model_name": "m", "role": "prefill"},
                        "exp_annotations": _annotations("KVOffloadThrashing"),
                    }
                ],
            },
            {"eval_time": "50m", "alertname": "KVOffloadStoresFailing", "exp_alerts": []},
        ],
    }
    paying = {
        "interval": "1m",
        # Half of what is stored comes back: the tier pays.
        "input_series": [
            _series(kv_offload.STORE_BYTES, f"0+{gib}x60"),
            _series(kv_offload.LOAD_BYTES, f"0+{gib // 2}x60"),
        ],
        "alert_rule_test": [{"eval_time": "50m", "alertname": "KVOffloadThrashing", "exp_alerts": []}],
    }
    failing = {
        "interval": "1m",
        "input_series": [_series(kv_offload.ALLOCATION_FAILURES, "0+3x60")],
        "alert_rule_test": [
            {
                "eval_time": "40m",
                "alertname": "KVOffloadStoresFailing",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "model_name": "m", "role": "prefill"},
                        "exp_annotations": _annotations("KVOffloadStoresFailing"),
                    }
                ],
            }
        ],
    }
    (tmp_path / "t.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [thrash, paying, failing]})
    )
    r = subprocess.run(
        [promtool(), "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _annotations(alert: str) -> dict:
    (rule,) = [r for g in kv_offload.offload_rule_groups() for r in g["rules"] if r["alert"] == alert]
    # promtool expands the templates: the series' labels.
    return {
        k: v.replace("{{ $labels.model_name }}", "m").replace("{{ $labels.role }}", "prefill")
        for k, v in rule["annotations"].items()
    }
