"""Where every metric name that a rule or a dashboard uses must come from (test helper).

What flows through here: the PromQL of the PrometheusRule (`infra.k8s.alerts`, with the
KV-transfer groups) and of every dashboard panel (`infra.k8s.dashboards`) -> parsed by
`promql-parser` (a PromQL parser built on the Prometheus grammar; a parse error fails) ->
the metric names of every vector selector -> each checked against its exporter:
- `ray_*` (Ray, Ray Serve, and vLLM's `vllm:` metrics as Ray exports them): the names a live
  scrape of the local stack returned. The e2e test scrapes for real; the snapshot
  `LIVE_SNAPSHOT` is what it found, so the offline tests can check without Ray, and the
  e2e test fails if the snapshot holds a name the live stack does not export.
- `DCGM_*`: the DCGM exporter's counter list that the stack deploys (vendored).
- `kube_*`: kube-state-metrics' published pod-metrics list (vendored).
Any other name has no known exporter and fails.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import promql_parser

from infra.k8s import monitoring

HERE = Path(__file__).resolve().parent
LIVE_SNAPSHOT = HERE / "data" / "ray-live-metric-names.txt"
KSM_POD_METRICS = HERE / "vendor" / "kube-state-metrics-v2.20.0" / "pod-metrics.md"
CRD_DIR = Path(os.environ.get("PROMETHEUS_OPERATOR_CRD_DIR", HERE / "vendor" / "kube-prometheus-stack-88.5.3-crds"))

# Grafana's variables, replaced by values of the same type before parsing.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_VAR = re.compile(r"\$\{?(\w+)\}?")


def manifest_expressions(manifests: dict[str, dict]) -> dict[str, str]:
    """Where -> PromQL, for every rule and every dashboard query in one stack's manifests."""
    out: dict[str, str] = {}
    for obj in manifests.values():
        if obj.get("kind") == "PrometheusRule":
            for g in obj["spec"]["groups"]:
                for i, r in enumerate(g["rules"]):
                    out[f"rule {g['name']}/{r.get('alert') or r.get('record')}[{i}]"] = r["expr"]
        elif obj.get("kind") == "ConfigMap" and (obj["metadata"].get("labels") or {}).get("grafana_dashboard"):
            for key, text in obj["data"].items():
                board = json.loads(text)
                for p in board.get("panels", []):
                    for t in p.get("targets") or []:
                        out[f"dashboard {key} panel {p['title']!r} {t.get('refId')}"] = t["expr"]
                for v in board.get("templating", {}).get("list", []):
                    m = re.fullmatch(r"label_values\((.+),\s*\w+\)", str(v.get("query") or ""))
                    if m:
                        out[f"dashboard {key} variable {v['name']}"] = m.group(1)
    return out


def shipped_expressions(rendered_stacks) -> dict[str, str]:
    """Every rule and dashboard expression of every shipped stack (deduplicated by text)."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    for name, stack in rendered_stacks.items():
        for where, expr in manifest_expressions(stack.manifests()).items():
            if expr not in seen:
                seen.add(expr)
                out[f"{name}: {where}"] = expr
    return out


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    # Template variables inside label matchers ("$role") become a regex that matches anything.
    return _VAR.sub(".*", expr)


def parse(expr: str) -> promql_parser.Expr:
    return promql_parser.parse(grafana_to_promql(expr))


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"a selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(parse(expr), visit)
    return names


def live_snapshot() -> set[str]:
    return {
        line.strip() for line in LIVE_SNAPSHOT.read_text().splitlines() if line.strip() and not line.startswith("#")
    }


def kube_state_metrics_names() -> set[str]:
    return set(re.findall(r"^\|\s*(kube_[a-z0-9_]+)\s*\|", KSM_POD_METRICS.read_text(), flags=re.M))


def unknown_names(exprs: dict[str, str], ray_names: set[str]) -> list[str]:
    """'where: name (why)' for every name no exporter provides."""
    dcgm, ksm = monitoring.dcgm_metric_names(), kube_state_metrics_names()
    problems = []
    for where, expr in exprs.items():
        for name in sorted(metric_names(expr)):
            if name.startswith("ray_"):
                ok, source = name in ray_names, "the live scrape of the local stack"
            elif name.startswith("DCGM_"):
                ok, source = name in dcgm, "the deployed DCGM counter list"
            elif name.startswith("kube_"):
                ok, source = name in ksm, "kube-state-metrics v2.20.0's pod metrics"
            else:
                ok, source = False, "any exporter this stack deploys"
            if not ok:
                problems.append(f"{where}: {name} is not in {source}")
    return problems
