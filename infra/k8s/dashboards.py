"""Grafana dashboards as code: built with grafana-foundation-sdk, shipped as ConfigMaps.

What flows through here: the panels of `infra.k8s.dashboard_panels` (`ROWS`: every PromQL
expression, per engine role: latency, requests and errors, queues, KV cache, NIXL KV transfer,
hybrid routing and limits, faults, GPUs from DCGM, the node autoscaler's view) ->
`pd_service_dashboard()`, a Grafana dashboard model built with Grafana's own SDK (no
hand-written JSON) with its variables (data source, Ray cluster, model, role) ->
`dashboard_configmaps()`, ConfigMaps labelled for Grafana's dashboard sidecar. With request
tracing on, the latency panels carry data links to Grafana Explore on the Tempo data source
(infra/k8s/tracing.py), with a TraceQL query over the dashboard's time range (`explore_url`).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from grafana_foundation_sdk.builders.dashboard import Dashboard, DashboardLink, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as TimeSeries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from infra.k8s.dashboard_panels import ROWS, PanelSpec
from infra.k8s.kv_offload import OFFLOAD_ROW
from infra.k8s.monitoring import DASHBOARD_LABEL, MONITORING_NAMESPACE, RAY_CLUSTER, ROLE
from infra.k8s.serving_metrics import REQUESTS
from infra.k8s.tracing import GRAFANA_TEMPO_UID

DATASOURCE = "datasource"
# Grafana data-link variables (Grafana docs, "Data links", variables): the dashboard's range
# and the clicked point's value.
LINK_VARS = ("${__from}", "${__to}", "${__value.numeric}")


def explore_url(traceql: str) -> str:
    """Grafana Explore on the Tempo data source with `traceql` over the dashboard's range; the
    data-link variables stay unencoded so that Grafana fills them in."""
    pane = {
        "traces": {
            "datasource": GRAFANA_TEMPO_UID,
            "queries": [
                {
                    "refId": "A",
                    "datasource": {"type": "tempo", "uid": GRAFANA_TEMPO_UID},
                    "queryType": "traceql",
                    "query": traceql,
                }
            ],
            "range": {"from": "${__from}", "to": "${__to}"},
        }
    }
    url = "/explore?schemaVersion=1&panes=" + quote(json.dumps(pane, separators=(",", ":")), safe="")
    for var in LINK_VARS:
        url = url.replace(quote(var, safe=""), var)
    return url


def _panel(spec: PanelSpec, ds: DataSourceRef, trace_links: bool) -> TimeSeries:
    panel = TimeSeries().title(spec.title).unit(spec.unit).datasource(ds).height(8).span(8)
    if spec.description:
        panel = panel.description(spec.description)
    if trace_links and spec.traces:
        panel = panel.data_links(
            [DashboardLink(title).url(explore_url(query)).target_blank(True) for title, query in spec.traces]
        )
    for i, q in enumerate(spec.queries):
        panel = panel.with_target(Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)))
    return panel


def pd_service_dashboard(trace_links: bool = False, kv_offload: bool = False) -> dict[str, Any]:
    """The dashboard; `trace_links`: the latency panels link to Tempo (tracing on); `kv_offload`:
    a pool has a KV offload tier, whose row comes last (infra/k8s/kv_offload.py)."""
    ds = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE}}}")
    board = (
        Dashboard("P/D service")
        .uid("pd-service")
        .tags(["pd-inference", "ray", "vllm"])
        .refresh("30s")
        .time("now-3h", "now")
        .with_variable(DatasourceVariable(DATASOURCE).label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("cluster")
            .label("Ray cluster")
            .datasource(ds)
            .query(f"label_values(ray_vllm_num_requests_running, {RAY_CLUSTER})")
            .include_all(True)
            .multi(True)
        )
        .with_variable(
            QueryVariable("model")
            .label("Model")
            .datasource(ds)
            # The serving code's own `model` label: every answered request counts here.
            .query(f"label_values({REQUESTS}, model)")
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
        .with_variable(
            QueryVariable("role")
            .label("Role")
            .datasource(ds)
            .query(f"label_values(ray_vllm_num_requests_running, {ROLE})")
            .include_all(True)
            .multi(True)
        )
    )
    rows = (*ROWS, OFFLOAD_ROW) if kv_offload else ROWS
    for title, panels in rows:
        board = board.with_row(Row(title))
        for spec in panels:
            board = board.with_panel(_panel(spec, ds, trace_links))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def dashboard_configmaps(trace_links: bool = False, kv_offload: bool = False) -> list[dict[str, Any]]:
    board = pd_service_dashboard(trace_links, kv_offload)
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": f"dashboard-{board['uid']}",
                "namespace": MONITORING_NAMESPACE,
                "labels": dict(DASHBOARD_LABEL),
            },
            "data": {f"{board['uid']}.json": json.dumps(board, sort_keys=True)},
        }
    ]
