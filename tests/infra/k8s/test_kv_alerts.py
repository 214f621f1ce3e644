"""KV-transfer alert rules (infra/k8s/kv_alerts.py) as PrometheusRule data.

Contract: every metric the rules read is one that both vLLMs define (the image's 0.29.0 and
the local 0.32.0: `name="vllm:..."` in their source, recorded by tools.vllm_surface) under the
name Ray's exporter gives it (`vllm:x` -> `ray_vllm_x`, histograms `_sum`/`_count`, counters
`_total`; seen in the live scrape of the local stack, e.g. `ray_vllm_nixl_bytes_transferred_sum`
on the decode node). The slow-transfer threshold is 3x the plan's line rate per GPU, on the
slower side when the pools differ.
"""

from __future__ import annotations

import copy
import re

import promql_parser
import pytest

from infra.config import load
from infra.k8s import kv_alerts
from infra.plan import planning
from infra.vllm_options import IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION, surface
from tools import stackfile


def _link(stack: str, **pools: str) -> planning.KvLink:
    values, secrets, others = stackfile.read_as_deployed(stack)
    values = copy.deepcopy(values)
    for role, inst in pools.items():
        values["nodePools"][role]["instanceType"] = inst
    cfg = load(values, secret_keys=secrets, source="x", region=others.get("aws:region"))
    link = planning.kv_link(cfg)
    assert link is not None
    return link


def _vllm_name(exported: str) -> str:
    base = exported.removeprefix("ray_")
    base = re.sub(r"_(sum|count|bucket|total)$", "", base)
    return "vllm:" + base.removeprefix("vllm_")


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\bray_vllm_[a-z_]+\b", expr))


def test_rules_parse_and_read_only_metrics_both_vllms_define() -> None:
    groups = kv_alerts.kv_rule_groups(_link("prod"))
    rules = [r for g in groups for r in g["rules"]]
    assert {r["alert"] for r in rules} == {"KVTransferMissing", "KVTransferSlow"}
    used: set[str] = set()
    for r in rules:
        promql_parser.parse(r["expr"])
        used |= _metrics_in(r["expr"])
        assert r["labels"]["severity"] and r["annotations"]["summary"]
    assert used == set(kv_alerts.METRICS)
    for v in (IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION):
        missing = {m for m in used if _vllm_name(m) not in surface(v)["metrics"]}
        assert not missing, f"vLLM {v} does not define {missing}"


def test_missing_alert_waits_five_minutes_and_needs_successes() -> None:
    (missing,) = [
        r for g in kv_alerts.kv_rule_groups(_link("prod")) for r in g["rules"] if r["alert"] == "KVTransferMissing"
    ]
    assert missing["for"] == "5m"
    assert "increase(ray_vllm_request_success_total[5m])) > 0" in missing["expr"]
    assert "unless" in missing["expr"] and "ray_vllm_nixl_bytes_transferred_sum[5m]" in missing["expr"]


@pytest.mark.parametrize(
    ("pools", "gbps_per_gpu"),
    [({}, 400.0), ({"decode": "p4de.24xlarge"}, 50.0), ({"prefill": "p4de.24xlarge"}, 50.0)],
)
def test_slow_threshold_is_three_times_the_slower_sides_plan(pools, gbps_per_gpu) -> None:
    link = _link("prod", **pools)
    assert link.gbps_per_gpu == gbps_per_gpu
    planned = 8 / (gbps_per_gpu * 1e9)
    assert kv_alerts.planned_seconds_per_byte(link) == pytest.approx(planned)
    (slow,) = [r for g in kv_alerts.kv_rule_groups(link) for r in g["rules"] if r["alert"] == "KVTransferSlow"]
    threshold = float(re.search(r"\) > ([0-9.e+-]+)", slow["expr"]).group(1))
    assert threshold == pytest.approx(3 * planned, rel=1e-5)


def test_prometheus_rule_object() -> None:
    rule = kv_alerts.kv_prometheus_rule("kv-transfer", "monitoring", _link("staging"), {"release": "kps"})
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["metadata"] == {"name": "kv-transfer", "namespace": "monitoring", "labels": {"release": "kps"}}
    assert rule["spec"]["groups"][0]["name"] == kv_alerts.GROUP


def test_aggregated_stacks_have_no_kv_link() -> None:
    values, secrets, others = stackfile.read_as_deployed("dev")
    values = copy.deepcopy(values)
    values["serving"]["mode"] = "aggregated"
    cfg = load(values, secret_keys=secrets, source="x", region=others.get("aws:region"))
    assert planning.kv_link(cfg) is None


def test_every_disaggregated_stack_deploys_the_kv_rules_and_aggregated_ones_do_not(rendered_stacks):
    """The program passes them to the observability stack (__main__.py): a rule that only
    exists in this module would never fire."""
    for stack, rendered in rendered_stacks.items():
        rules = [o for o in rendered.manifests().values() if o.get("kind") == "PrometheusRule"]
        alerts = {r.get("alert") for o in rules for g in o["spec"]["groups"] for r in g["rules"]}
        kv = {"KVTransferMissing", "KVTransferSlow"}
        if rendered.config.serving.mode.value == "disaggregated":
            assert kv <= alerts, stack
        else:
            assert not kv & alerts, stack
