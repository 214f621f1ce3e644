"""The observability objects every stack renders, checked against what really consumes them.

What flows through here: each shipped stack's rendered manifests (Pulumi mocks) ->
- the PodMonitor, ServiceMonitors and PrometheusRule against the Prometheus Operator CRDs
  that the pinned kube-prometheus-stack installs (vendored, jsonschema);
- the Helm releases: kube-prometheus-stack and the DCGM exporter pinned, DCGM on GPU nodes
  only, tolerating the GPU taint; Prometheus on the system nodes with retention and encrypted
  storage from the stack file;
- every PromQL expression of every rule and dashboard panel parsed by promql-parser, and
  every metric name traced to its exporter (see tests/infra/k8s/metric_sources.py);
- the node autoscaler's ServiceMonitor against the labels and port that the pinned
  cluster-autoscaler chart gives its Service (kubernetes/autoscaler chart 9.59.0 templates).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from infra import catalog, versions
from infra.k8s import monitoring
from infra.k8s.labels import GPU_TAINT_KEY, ROLE_LABEL, SYSTEM_ROLE
from tests.conftest import STACKS
from tests.infra.k8s import metric_sources as ms

CRD_FILES = {
    "PodMonitor": "crd-podmonitors.yaml",
    "ServiceMonitor": "crd-servicemonitors.yaml",
    "PrometheusRule": "crd-prometheusrules.yaml",
}


def _schema(kind: str) -> dict:
    path = ms.CRD_DIR / CRD_FILES[kind]
    assert path.is_file(), f"Prometheus Operator CRD not found at {path}: set PROMETHEUS_OPERATOR_CRD_DIR"
    crd = next(d for d in yaml.safe_load_all(path.read_text()) if d)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def _validate(obj: dict, schema: dict) -> None:
    # Not jsonschema.validate(): that first checks the schema itself, and the CRDs hold Go
    # regexes (e.g. "^(?i)(abort|warn)?$") that Python's re does not accept; patterns are only
    # compiled here for fields an object sets.
    jsonschema.Draft202012Validator(schema).validate(obj)


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _objects(stack, kind: str) -> list[dict]:
    return [o for o in stack.manifests().values() if o.get("kind") == kind]


def _helm(stack, chart: str) -> dict:
    (doc,) = [o for o in stack.manifests().values() if o.get("chart") == chart]
    return doc


def test_monitors_and_rules_validate_against_the_prometheus_operator_crds(stack):
    seen = set()
    for kind in CRD_FILES:
        schema = _schema(kind)
        for obj in _objects(stack, kind):
            _validate(obj, schema)
            seen.add(kind)
    assert seen == set(CRD_FILES)


def test_the_crd_schema_rejects_a_broken_monitor(stack):
    """The validation can fail: a string where the CRD wants a list of endpoints."""
    (pm,) = [o for o in _objects(stack, "PodMonitor") if o["metadata"]["name"] == "ray"]
    bad = json.loads(json.dumps(pm))
    bad["spec"]["podMetricsEndpoints"] = "metrics"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad, _schema("PodMonitor"))


def test_ray_pods_are_scraped_on_kuberays_metrics_port_with_their_role(stack):
    """KubeRay v1.7.0 (ray-operator/controllers/ray/common/pod.go): the Ray container gets a
    port named `metrics` (8080) unless it has one, Ray starts with --metrics-export-port=8080,
    and `labelPod` sets ray.io/is-ray-node=yes, ray.io/node-type and ray.io/group (= groupName)."""
    (pm,) = [o for o in _objects(stack, "PodMonitor") if o["metadata"]["name"] == "ray"]
    ns = stack.config.namespace
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [ns]}
    assert pm["spec"]["selector"] == {"matchLabels": {"ray.io/is-ray-node": "yes"}}
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "metrics"
    role_rules = [r for r in ep["relabelings"] if r["targetLabel"] == monitoring.ROLE]
    # The group name first (prefill, decode), then the head's own value.
    assert [r["sourceLabels"] for r in role_rules] == [
        ["__meta_kubernetes_pod_label_ray_io_group"],
        ["__meta_kubernetes_pod_label_ray_io_node_type"],
    ]
    assert role_rules[1]["regex"] == "head" and role_rules[1]["replacement"] == "head"
    # The worker groups are named after the pools the models' roles run on (one-model stacks:
    # the roles the dashboards and rules group by).
    rs = next(o for o in stack.manifests().values() if o.get("kind") == "RayService")
    groups = {g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups == {m.pool_of(r) for m in stack.config.serving.served for r in m.engine_roles()}
    for c in [rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]]:
        # No port of ours may take the name or number KubeRay's metrics port needs.
        assert all(p.get("name") != "metrics" and p["containerPort"] != 8080 for p in c.get("ports", []))
    # Prometheus may reach that port from the monitoring namespace.
    (np_,) = [o for o in _objects(stack, "NetworkPolicy") if o["metadata"]["name"] == "allow-prometheus-scrape"]
    assert np_["metadata"]["namespace"] == ns
    assert np_["spec"]["ingress"][0]["ports"] == [{"port": 8080, "protocol": "TCP"}]


def test_kuberay_operator_is_scraped_on_its_service_port(stack):
    """helm-chart/kuberay-operator/templates/service.yaml (v1.7.0): port `http` (8080, /metrics),
    selector app.kubernetes.io/name = the chart name."""
    (sm,) = [o for o in _objects(stack, "ServiceMonitor") if o["metadata"]["name"] == "kuberay-operator"]
    assert sm["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert sm["metadata"]["namespace"] == "kuberay-system"


def _chart_service_labels(chart_name: str, release: str, values: dict) -> dict[str, str]:
    """What kubernetes/autoscaler's cluster-autoscaler chart 9.59.0 puts on its Service and pods
    (tag cluster-autoscaler-chart-9.59.0, cluster-autoscaler/charts/cluster-autoscaler/
    templates/_helpers.tpl `cluster-autoscaler.instance-name`, used by templates/service.yaml's
    labels and templates/deployment.yaml's pod labels): app.kubernetes.io/instance = the
    release name; app.kubernetes.io/name = `cluster-autoscaler.name` = nameOverride, else
    "<cloudProvider>-<chart name>" (values.yaml defaults: cloudProvider aws, nameOverride "")."""
    name = values.get("nameOverride") or f"{values.get('cloudProvider', 'aws')}-{chart_name}"
    return {"app.kubernetes.io/instance": release, "app.kubernetes.io/name": name}


def test_node_autoscaler_is_scraped_on_its_charts_service(stack):
    """The ServiceMonitor selects the Service that the pinned cluster-autoscaler chart (9.59.0)
    renders, on the port it names: templates/service.yaml creates it unless service.create is
    false, with one port named service.portName (default `http`, port and targetPort 8085,
    where the container serves /metrics: templates/deployment.yaml `containerPort: 8085`), in
    the release's namespace. A new chart version must be checked against its templates again."""
    (chart,) = [
        r for r in stack.result.of_type("kubernetes:helm.sh/v4:Chart") if r.inputs["chart"] == "cluster-autoscaler"
    ]
    assert chart.inputs["version"] == "9.59.0" == versions.CLUSTER_AUTOSCALER.version, "re-check the chart's templates"
    values = chart.inputs["values"]
    release = chart.inputs.get("name")
    assert release, "the release name must be stated: the Service's instance label is the release name"
    service = values.get("service", {})
    assert service.get("create", True) is not False
    assert "selector" not in service and "labels" not in service
    assert not values.get("fullnameOverride") and not values.get("serviceMonitor", {}).get("enabled")
    port = service.get("portName", "http")  # values.yaml default

    (sm,) = [o for o in _objects(stack, "ServiceMonitor") if o["metadata"]["name"] == "cluster-autoscaler"]
    assert sm["metadata"]["namespace"] == chart.inputs["namespace"] == "kube-system"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [chart.inputs["namespace"]]}
    want = sm["spec"]["selector"]["matchLabels"]
    have = _chart_service_labels("cluster-autoscaler", release, values)
    assert want.items() <= have.items(), (want, have)
    assert want, "an empty selector would scrape every Service in kube-system"
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == port and ep["path"] == "/metrics"


def test_the_node_autoscaler_contract_can_fail(stack):
    """A release renamed, or a chart rendered for another cloud provider, no longer matches."""
    (sm,) = [o for o in _objects(stack, "ServiceMonitor") if o["metadata"]["name"] == "cluster-autoscaler"]
    want = sm["spec"]["selector"]["matchLabels"]
    for release, values in (
        ("node-autoscaler-chart", {"cloudProvider": "aws"}),
        ("cluster-autoscaler", {"cloudProvider": "gce"}),
    ):
        assert not want.items() <= _chart_service_labels("cluster-autoscaler", release, values).items()


def test_every_monitor_and_rule_is_selected_by_prometheus(stack):
    values = _helm(stack, "kube-prometheus-stack")["values"]["prometheus"]["prometheusSpec"]
    for kind, sel in (
        ("PodMonitor", "podMonitorSelector"),
        ("ServiceMonitor", "serviceMonitorSelector"),
        ("PrometheusRule", "ruleSelector"),
    ):
        want = values[sel]["matchLabels"]
        for obj in _objects(stack, kind):
            assert want.items() <= obj["metadata"]["labels"].items(), obj["metadata"]["name"]
    dcgm = _helm(stack, "dcgm-exporter")["values"]["serviceMonitor"]
    assert (
        dcgm["enabled"] and values["serviceMonitorSelector"]["matchLabels"].items() <= dcgm["additionalLabels"].items()
    )


def test_metrics_stack_runs_on_system_nodes_with_sized_encrypted_storage(stack):
    doc = _helm(stack, "kube-prometheus-stack")
    assert doc["version"] == versions.KUBE_PROMETHEUS_STACK.version
    assert doc["repository"] == versions.KUBE_PROMETHEUS_STACK.repo
    spec = doc["values"]["prometheus"]["prometheusSpec"]
    obs = stack.config.observability
    assert spec["nodeSelector"] == {ROLE_LABEL: SYSTEM_ROLE}
    assert spec["retention"] == f"{obs.retention_days}d"
    claim = spec["storageSpec"]["volumeClaimTemplate"]["spec"]
    assert claim["resources"]["requests"]["storage"] == f"{obs.storage_gib}Gi"
    assert claim["storageClassName"] == monitoring.STORAGE_CLASS
    # The size cap leaves room on the volume for the WAL and compaction.
    assert int(spec["retentionSize"].removesuffix("GB")) * 1e9 < obs.storage_gib * 2**30
    (sc,) = [o for o in _objects(stack, "StorageClass") if o["metadata"]["name"] == monitoring.STORAGE_CLASS]
    assert sc["parameters"]["encrypted"] == "true" and sc["provisioner"] == "ebs.csi.aws.com"


def test_dcgm_exporter_runs_only_on_gpu_nodes_and_tolerates_their_taint(stack):
    doc = _helm(stack, "dcgm-exporter")
    assert doc["version"] == versions.DCGM_EXPORTER.version
    values = doc["values"]
    (term,) = values["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (expr,) = term["matchExpressions"]
    assert expr["key"] == "node.kubernetes.io/instance-type" and expr["operator"] == "In"
    assert set(expr["values"]) == set(catalog.CATALOG)  # every GPU type, nothing else
    assert {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in values["tolerations"]
    # The deployed counters are the vendored list the metric-name check reads.
    assert values["customMetrics"] == monitoring.dcgm_counters_csv()


def test_dashboards_are_provisioned_configmaps_built_by_the_sdk(stack):
    maps = [o for o in _objects(stack, "ConfigMap") if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert maps, "no dashboard ConfigMap"
    (board,) = [json.loads(v) for v in maps[0]["data"].values()]
    titles = {p["title"] for p in board["panels"]}
    for needle in (
        "Time to first token",
        "Inter-token latency",
        "Time per output token",
        "Waiting requests",
        "KV-cache usage",
        "Prefix-cache hit rate",
        "KV bytes per request",
        "KV transfer time",
        "GPU utilisation",
        "HBM used",
        "Power",
        "XID errors (last XID per GPU)",
        "Requests by status (ingress)",
        "Fallback share",
        "Requests per key and destination",
        "Tokens per key and destination",
        "Rate-limited requests (429) per key and limit",
        "Fallback requests by reason and outcome",
        "Limiter errors",
        "Refused requests by reason and status (ingress)",
        "Ingress retries by reason",
        "Prefill retries and local prefills (decode)",
        "Stream migrations",
        "Unschedulable pods (node autoscaler)",
        "Node scale-ups per hour",
    ):
        assert needle in titles, needle


def test_every_expression_parses_and_every_metric_has_an_exporter(rendered_stacks):
    exprs = ms.shipped_expressions(rendered_stacks)
    assert len(exprs) > 20
    problems = ms.unknown_names(exprs, ms.live_snapshot())
    assert not problems, "\n".join(problems)


def test_a_renamed_metric_is_caught(rendered_stacks):
    """The check can fail: rename one metric in one rule, as a careless edit would."""
    exprs = ms.shipped_expressions(rendered_stacks)
    where = next(k for k, v in exprs.items() if ": rule " in k and "ray_vllm_time_to_first_token_seconds" in v)
    broken = {**exprs, where: exprs[where].replace("ray_vllm_time_to_first_token_seconds", "ray_vllm_ttft_seconds")}
    assert any("ray_vllm_ttft_seconds_bucket" in p for p in ms.unknown_names(broken, ms.live_snapshot()))
    with pytest.raises(ValueError):
        ms.parse("sum(rate(ray_vllm_num_requests_running[5m])")


def test_haproxy_mode_records_every_http_series_and_label_the_rules_and_panels_read(rendered_stacks):
    """serving.ingress.dataPlane haproxy (the default): Serve's HTTP request counters and
    latency come from the HAProxyManager, not the proxy actor (Ray 2.60
    ray/serve/_private/haproxy_metrics.py, proxy.py `_should_emit_request_ingress_metrics`).
    Every such series a rule or panel reads, with every label it reads (application,
    status_code, error_code), is what Ray records there for a request."""
    exprs = ms.shipped_expressions(rendered_stacks)
    emitted = ms.haproxy_http_series()
    used = {n for e in exprs.values() for n in ms.labels_read(e) if n.startswith(ms.HTTP_INGRESS_PREFIXES)}
    assert {"ray_serve_num_http_requests_total", "ray_serve_num_http_error_requests_total"} <= used
    assert ms.http_ingress_label_problems(exprs, emitted) == []


def test_the_haproxy_label_check_can_fail(rendered_stacks):
    exprs = ms.shipped_expressions(rendered_stacks)
    where, expr = next((k, v) for k, v in exprs.items() if ": rule " in k and 'error_code=~"5.."' in v)
    broken = {where: expr.replace("error_code=~", "code=~")}
    emitted = ms.haproxy_http_series()
    problems = ms.http_ingress_label_problems(broken, emitted)
    assert problems == [f"{where}: ray_serve_num_http_error_requests_total{{code}} has no such label in HAProxy mode"]
    renamed = {where: expr.replace("ray_serve_num_http_requests_total", "ray_serve_num_http_request_total")}
    problems = ms.http_ingress_label_problems(renamed, emitted)
    assert problems == [f"{where}: ray_serve_num_http_request_total is not recorded in HAProxy mode"]


def test_event_counters_are_checked_against_the_serving_codes_declarations(rendered_stacks):
    """The usage/429/fallback/limiter counters have no series before their first event, so
    they are found in the serving code's declarations, not the scrape; a renamed one fails.
    Every counter of the registry is recorded by the serving code, and none other is."""
    from serving.core import metrics as registry

    declared = ms.declared_counters()
    assert declared == {m.name for m in registry.ALL}
    exprs = ms.shipped_expressions(rendered_stacks)
    used = {n for e in exprs.values() for n in ms.metric_names(e)}
    assert ms.event_counter_names() <= used, "a declared serving counter that no panel or rule reads"
    assert not (ms.event_counter_names() & ms.live_snapshot()), "event counters do not belong in the live snapshot"
    where = next(k for k, v in exprs.items() if ": rule " in k and "ray_pd_usage_requests_total" in v)
    broken = {where: exprs[where].replace("ray_pd_usage_requests_total", "ray_pd_usage_request_total")}
    assert any("ray_pd_usage_request_total" in p for p in ms.unknown_names(broken, ms.live_snapshot()))
    # Ray's name for a counter: without `_total` the series is the deprecated gauge, not the counter.
    bare = {where: exprs[where].replace("ray_pd_usage_requests_total", "ray_pd_usage_requests")}
    assert ms.unknown_names(bare, ms.live_snapshot())


def test_stream_migrations_are_shown_by_reason_and_outcome_and_filtered_by_model():
    """The panel splits what the ingress counts (serving/ingress/relay.py), and every panel
    on a serving counter with a `model` label follows the dashboard's model filter."""
    from infra.k8s.dashboards import pd_service_dashboard
    from infra.k8s.serving_metrics import PREFILL_PATH, REQUESTS, STREAM_MIGRATIONS

    board = pd_service_dashboard()
    assert "model" in {v["name"] for v in board["templating"]["list"]}
    (panel,) = [p for p in board["panels"] if p["title"] == "Stream migrations"]
    (expr,) = [t["expr"] for t in panel["targets"]]
    assert STREAM_MIGRATIONS in expr and "by (model, reason, outcome)" in expr
    per_model = (STREAM_MIGRATIONS, REQUESTS, PREFILL_PATH)
    for p in board["panels"]:
        for t in p.get("targets") or []:
            if any(m in t["expr"] for m in per_model):
                assert 'model=~"$model"' in t["expr"], p["title"]


def test_every_engine_panel_follows_the_model_filter():
    """vLLM's engine series carry the served model id as `model_name` (as the many-model e2e
    test reads them): every panel on them, and on the serving counters with a `model` tag
    (requests refused, rate-limited), follows the dashboard's Model variable."""
    from infra.k8s.dashboards import pd_service_dashboard
    from infra.k8s.serving_metrics import INGRESS_REFUSALS, RATE_LIMITED

    board = pd_service_dashboard()
    checked = 0
    for p in board["panels"]:
        for t in p.get("targets") or []:
            if "ray_vllm_" in t["expr"]:
                # every selector of a vLLM series in the expression, not only the first
                assert t["expr"].count("ray_vllm_") == t["expr"].count('model_name=~"$model"'), p["title"]
                checked += 1
            if INGRESS_REFUSALS in t["expr"] or RATE_LIMITED in t["expr"]:
                assert 'model=~"$model"' in t["expr"], p["title"]
    assert checked >= 10


def test_a_renamed_node_autoscaler_metric_is_caught(rendered_stacks):
    exprs = ms.shipped_expressions(rendered_stacks)
    where = next(k for k, v in exprs.items() if ": rule " in k and "cluster_autoscaler_failed_scale_ups_total" in v)
    broken = {where: exprs[where].replace("failed_scale_ups_total", "failed_scaleups_total")}
    assert any("cluster_autoscaler_failed_scaleups_total" in p for p in ms.unknown_names(broken, ms.live_snapshot()))


def test_slo_thresholds_are_bucket_bounds_in_the_rules(stack):
    slo = stack.config.serving.slo
    rule = _objects(stack, "PrometheusRule")[0]
    exprs = "\n".join(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])
    assert f'le="{float(slo.ttft_seconds)!r}"' in exprs
    assert f'le="{float(slo.itl_seconds)!r}"' in exprs


def test_every_vllm_metric_the_rules_and_panels_read_exists_in_the_images_vllm(rendered_stacks):
    """The live scrape runs vLLM 0.32; the cloud runs the image's (infra/vllm_options.py
    IMAGE_VLLM_VERSION, 0.29.0 for Ray 2.60). A name only the newer engine exports leaves its
    panel empty in every real cluster (vLLM 0.29's metric list as recorded from its source in
    infra/vllm/0.29.0.json by tools/vllm_surface.py): e.g. vllm:num_requests_kv_fetch_by_stage,
    registered for KV consumers in 0.32 only (vllm/v1/metrics/loggers.py)."""
    from infra import vllm_options

    exported = set(vllm_options.surface(vllm_options.IMAGE_VLLM_VERSION)["metrics"])
    used = set()
    for expr in ms.shipped_expressions(rendered_stacks).values():
        for name in ms.metric_names(expr):
            if name.startswith("ray_vllm_"):
                base = "vllm:" + name.removeprefix("ray_vllm_")
                for suffix in ("_bucket", "_sum", "_count", "_total"):
                    base = base.removesuffix(suffix) if base not in exported else base
                used.add(base)
    assert used, "no vLLM metric read: the expressions were not found"
    assert used <= exported, sorted(used - exported)
