"""Where every metric name that a rule or a dashboard uses must come from (test helper).

What flows through here: the PromQL of the PrometheusRule (`infra.k8s.alerts`, with the
KV-transfer groups) and of every dashboard panel (`infra.k8s.dashboards`) -> parsed by
`promql-parser` (a PromQL parser built on the Prometheus grammar; a parse error fails) ->
the metric names of every vector selector -> each checked against its exporter:
- `ray_*` (Ray, Ray Serve, and vLLM's `vllm:` metrics as Ray exports them): the names a live
  scrape of the local stack returned. The e2e test scrapes for real; the snapshot
  `LIVE_SNAPSHOT` is what it found, so the offline tests can check without Ray, and the
  e2e test fails if the snapshot holds a name the live stack does not export.
  Except the serving code's own event counters (usage, 429s, fallbacks, limiter errors:
  `serving.ingress.limits`; retries, local prefills, refusals: `serving.core.failures`): a labelled Ray counter has no series until its first event, so an
  idle stack's scrape cannot show them. Those are checked statically instead:
  `event_counter_names()` reads every counter the serving code records (its source, each
  resolved in the registry serving/core/metrics.py) and maps each as Ray exports a counter.
  Except the KV offload tier's series (`infra.k8s.kv_offload.METRICS`): the local stack
  cannot run the tier, so they are checked against both vLLMs' recorded metric names.
- `DCGM_*`: the DCGM exporter's counter list that the stack deploys (vendored).
- `kube_*`: kube-state-metrics' published pod-metrics list (vendored).
- `cluster_autoscaler_*`: the names the Cluster Autoscaler registers, read from its source at
  every release tag the stack can deploy (`CLUSTER_AUTOSCALER_METRICS`, with its origin).
- `node_filesystem_*`: the filesystem collector's names, read from node-exporter's source
  (`NODE_EXPORTER_METRICS`, with its origin).
Any other name has no known exporter and fails.

Serve's HTTP ingress series (`ray_serve_num_http_*`, `ray_serve_http_request_latency_ms_*`)
are also checked label by label against what Ray's HAProxy mode records
(`haproxy_http_series`), since serving.ingress.dataPlane haproxy moves them out of the proxy.
"""

from __future__ import annotations

import ast
import json
import os
import re
from functools import cache
from pathlib import Path

import promql_parser

from infra.k8s import kv_offload, monitoring
from infra.vllm_options import IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION, surface

HERE = Path(__file__).resolve().parent
LIVE_SNAPSHOT = HERE / "data" / "ray-live-metric-names.txt"
KSM_POD_METRICS = HERE / "vendor" / "kube-state-metrics-v2.20.0" / "pod-metrics.md"
CLUSTER_AUTOSCALER_METRICS = HERE / "data" / "cluster-autoscaler-metric-names.txt"
NODE_EXPORTER_METRICS = HERE / "data" / "node-exporter-filesystem-metric-names.txt"
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


def _names_file(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def live_snapshot() -> set[str]:
    return _names_file(LIVE_SNAPSHOT)


def cluster_autoscaler_names() -> set[str]:
    return _names_file(CLUSTER_AUTOSCALER_METRICS)


SERVING = Path(__file__).resolve().parents[3] / "serving"
RAY_METRICS_MODULES = ("ray.serve.metrics", "ray.util.metrics")


@cache
def declared_counters() -> frozenset[str]:
    """The names of the counters the serving code records: every `metrics.counter(metrics.X)`
    in serving/, X resolved in the registry (serving/core/metrics.py), read from the source
    (nothing imported, so no Ray). A Ray `Counter(...)` built anywhere but the registry's
    `counter()` fails: it would bypass the registry that the dashboards and alerts read."""
    from serving.core import metrics as registry

    names: set[str] = set()
    for path in sorted(SERVING.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            own = isinstance(node, ast.ImportFrom) and node.module in RAY_METRICS_MODULES
            if own and path.name != "metrics.py" and any(a.name == "Counter" for a in node.names):  # type: ignore[attr-defined]
                raise AssertionError(f"{path}: a Ray Counter outside serving/core/metrics.py")
            if not (isinstance(node, ast.Call) and node.args):
                continue
            f, arg = node.func, node.args[0]
            called = (isinstance(f, ast.Attribute) and f.attr == "counter") or (
                isinstance(f, ast.Name) and f.id == "counter"
            )
            if (
                called
                and isinstance(arg, ast.Attribute)
                and isinstance(getattr(registry, arg.attr, None), registry.Metric)
            ):
                names.add(getattr(registry, arg.attr).name)
    return frozenset(names)


def event_counter_names() -> set[str]:
    """Prometheus names of the serving code's event counters, as Ray exports them."""
    return {f"ray_{n}_total" for n in declared_counters()}


def node_exporter_names() -> set[str]:
    lines = NODE_EXPORTER_METRICS.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def kube_state_metrics_names() -> set[str]:
    return set(re.findall(r"^\|\s*(kube_[a-z0-9_]+)\s*\|", KSM_POD_METRICS.read_text(), flags=re.M))


def offload_name_in_both_vllms(name: str) -> bool:
    """A KV offload tier series (infra/k8s/kv_offload.py), which no local scrape can show: vLLM's
    CPU build cannot run the tier's worker. Checked against both vLLMs' own metric names
    (tools.vllm_surface), mapped as Ray exports them (`vllm:x` -> `ray_vllm_x`, counters `_total`)."""
    base = "vllm:" + re.sub(r"_(total|sum|count|bucket)$", "", name.removeprefix("ray_vllm_"))
    return all(base in surface(v)["metrics"] for v in (IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION))


def unknown_names(exprs: dict[str, str], ray_names: set[str]) -> list[str]:
    """'where: name (why)' for every name no exporter provides."""
    dcgm, ksm, ca = monitoring.dcgm_metric_names(), kube_state_metrics_names(), cluster_autoscaler_names()
    events = event_counter_names()
    problems = []
    for where, expr in exprs.items():
        for name in sorted(metric_names(expr)):
            if name.startswith("ray_") and name in events:
                ok, source = True, "the serving code's event counters"
            elif name in kv_offload.METRICS:
                ok, source = offload_name_in_both_vllms(name), "both vLLMs' recorded metric names"
            elif name.startswith("ray_"):
                ok, source = name in ray_names, "the live scrape of the local stack (nor a serving event counter)"
            elif name.startswith("DCGM_"):
                ok, source = name in dcgm, "the deployed DCGM counter list"
            elif name.startswith("kube_"):
                ok, source = name in ksm, "kube-state-metrics v2.20.0's pod metrics"
            elif name.startswith("cluster_autoscaler_"):
                ok, source = name in ca, "the Cluster Autoscaler's registered metrics"
            elif name.startswith("node_"):
                ok, source = name in node_exporter_names(), "node-exporter's filesystem collector"
            else:
                ok, source = False, "any exporter this stack deploys"
            if not ok:
                problems.append(f"{where}: {name} is not in {source}")
    return problems


# --- Serve's HTTP ingress series, which Ray 2.60 records in the proxy or in HAProxy's manager ------
# Serve's HTTP request counters and latency histogram (ray/serve/_private/request_ingress_metrics.py
# RequestIngressMetrics). With serving.ingress.dataPlane haproxy they come from the HAProxyManager
# on each proxy node, one HAProxy log datagram per request (haproxy_metrics.py
# HAProxyMetricsCollector, on by default: constants.py RAY_SERVE_HAPROXY_METRICS_ENABLED), and
# the Python proxy stops recording them (proxy.py `_should_emit_request_ingress_metrics`).
HTTP_INGRESS_PREFIXES = ("ray_serve_num_http_", "ray_serve_http_")
# One request as HAProxy's http_frontend logs it (haproxy_templates.py `log-format-sd`: string
# variables quoted, status, latency and termination state bare): a 503 from the ingress.
HAPROXY_REQUEST_LOG = (
    b'<143>1 2026-12-01T00:00:00Z node haproxy - - [serve@1 app="llm" route="/" method=POST '
    b'status=503 latency_ms=12 deployment="OpenAiIngress" term_state=--] -'
)


def labels_read(expr: str) -> dict[str, set[str]]:
    """Metric name -> the labels the expression reads from its series: its matchers, and the
    `by` and `on` labels of the aggregations and operations above it (up to the nearest `by`,
    which sets what the series below must carry)."""
    out: dict[str, set[str]] = {}

    def visit(node, need: frozenset[str]) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names = {m.name for m in node.matchers.matchers if m.name != "__name__"}
            out.setdefault(node.name, set()).update(names | need)
        elif isinstance(node, promql_parser.AggregateExpr):
            mod = node.modifier
            by = mod is not None and mod.type == promql_parser.AggModifierType.By
            visit(node.expr, frozenset(mod.labels) if by else need)
        elif isinstance(node, promql_parser.BinaryExpr):
            match = node.modifier.matching if node.modifier is not None else None
            extra = frozenset(match.labels) if match is not None else frozenset()
            visit(node.lhs, need | extra)
            visit(node.rhs, need | extra)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                visit(arg, need)
        elif isinstance(node, promql_parser.MatrixSelector):
            visit(node.vector_selector, need)
        elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            visit(node.expr, need)

    visit(parse(expr), frozenset())
    return out


def haproxy_http_series() -> dict[str, set[str]]:
    """Prometheus name -> label keys of every HTTP ingress series that Ray 2.60's HAProxy mode
    records for one request (HAPROXY_REQUEST_LOG), read by driving Ray's own collector: its
    parser, then its recorder, with each metric's `inc`/`observe` captured (no Ray started)."""
    from ray.serve._private.haproxy_metrics import HAProxyMetricsCollector
    from ray.util import metrics

    collector = HAProxyMetricsCollector(haproxy_api=None, node_id="node")
    seen: dict[str, set[str]] = {}

    def capture(names: list[str]):
        def record(*_args, tags=None, **_kw):
            for n in names:
                seen.setdefault(n, set()).update(tags or {})

        return record

    for metric in vars(collector.request_ingress_metrics).values():
        if isinstance(metric, metrics.Counter):
            metric.inc = capture([f"ray_{metric._name}_total"])
        elif isinstance(metric, metrics.Histogram):
            base = f"ray_{metric._name}"
            metric.observe = capture([f"{base}_bucket", f"{base}_sum", f"{base}_count"])
    parsed = collector.parse_line(HAPROXY_REQUEST_LOG)
    assert parsed is not None and parsed.status_code == "503", "Ray no longer parses HAProxy's request log line"
    collector.record(parsed)
    return seen


def http_ingress_label_problems(exprs: dict[str, str], emitted: dict[str, set[str]]) -> list[str]:
    """'where: name{label} (why)' for each Serve HTTP ingress series or label an expression
    reads that `emitted` lacks."""
    problems = []
    for where, expr in exprs.items():
        for name, labels in sorted(labels_read(expr).items()):
            if not name.startswith(HTTP_INGRESS_PREFIXES):
                continue
            if name not in emitted:
                problems.append(f"{where}: {name} is not recorded in HAProxy mode")
                continue
            problems += [
                f"{where}: {name}{{{label}}} has no such label in HAProxy mode"
                for label in sorted(labels - emitted[name])
            ]
    return problems
