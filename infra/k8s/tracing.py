"""Request traces, as plain data: the collector, Tempo, and what the Ray pods need to export.

What flows through here: the stack's `observability.tracing` block and its environment ->
- `TraceExport` (the collector's OTLP address and the sampling ratio), or None when tracing
  is off; the RayService renders from it (infra/k8s/rayservice.py):
  - on every Ray pod (head and workers): Ray Serve's tracing switches
    (`RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH`, `RAY_SERVE_TRACING_SAMPLING_RATIO`,
    ray/serve/_private/constants.py, Ray 2.60), the OTLP endpoint and sampler variables of
    the OpenTelemetry SDK (which vLLM's engine processes also read), a service name per
    role, and the exporter factory `serving/tracing.py` mounted from a ConfigMap onto
    PYTHONPATH: Serve's proxy and controller run without the application's runtime_env, so
    the factory cannot come from the code zip;
  - on every engine: vLLM's `otlp_traces_endpoint` engine argument (serving/spec/serving.py);
- the OpenTelemetry collector's chart values (OTLP/gRPC in, batch, OTLP/gRPC out to Tempo);
- Tempo's chart values (single binary on the system nodes, traces in the stack's S3 bucket,
  a WAL on an encrypted volume, retention from the stack file) and its IAM policy (that
  bucket only, the actions Tempo's S3 backend documents);
- NetworkPolicies: only the LLM namespace may send spans to the collector, only the
  monitoring namespace (collector, Grafana) may reach Tempo;
- Grafana's Tempo data source (kube-prometheus-stack `grafana.additionalDataSources`), whose
  uid the dashboard's trace links name (infra/k8s/dashboards.py).
No Pulumi here: infra/components/tracing.py registers these; the tests validate them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import Tracing
from infra.k8s.labels import ROLE_LABEL, SYSTEM_ROLE
from infra.k8s.monitoring import MONITORING_NAMESPACE, STORAGE_CLASS
from infra.paths import SERVING_DIR
from infra.versions import OTEL_COLLECTOR_IMAGE
from serving.tracing import ENDPOINT_ENV

# --- the collector (open-telemetry/opentelemetry-helm-charts, opentelemetry-collector) -------
# The chart names its Deployment, Service and ServiceAccount `fullnameOverride`, and labels the
# pods app.kubernetes.io/name = the chart name, app.kubernetes.io/instance = the release
# (templates/_helpers.tpl `fullname`, `selectorLabels`, chart 0.170.0).
COLLECTOR_RELEASE = "otel-collector"
COLLECTOR_OTLP_GRPC_PORT = 4317
COLLECTOR_ENDPOINT = f"http://{COLLECTOR_RELEASE}.{MONITORING_NAMESPACE}.svc.cluster.local:{COLLECTOR_OTLP_GRPC_PORT}"
COLLECTOR_POD_LABELS = {
    "app.kubernetes.io/name": "opentelemetry-collector",
    "app.kubernetes.io/instance": COLLECTOR_RELEASE,
}

# --- Tempo (grafana-community/helm-charts, tempo) ---------------------------------------------
# Release "tempo": fullname, Service and ServiceAccount are "tempo" (templates/_helpers.tpl,
# chart 2.2.4); the Service serves the query API on 3200 and OTLP/gRPC on 4317 (_ports.tpl).
TEMPO_RELEASE = "tempo"
TEMPO_SERVICE_ACCOUNT = "tempo"
TEMPO_HTTP_PORT = 3200
TEMPO_OTLP_GRPC_PORT = 4317
TEMPO_HOST = f"{TEMPO_RELEASE}.{MONITORING_NAMESPACE}.svc.cluster.local"
TEMPO_URL = f"http://{TEMPO_HOST}:{TEMPO_HTTP_PORT}"
TEMPO_POD_LABELS = {"app.kubernetes.io/name": "tempo", "app.kubernetes.io/instance": TEMPO_RELEASE}
TEMPO_WAL_GIB = 10
# Grafana's Tempo data source; the dashboard's trace links name it by this uid.
GRAFANA_TEMPO_UID = "tempo"

# --- the exporter factory on the Ray pods ------------------------------------------------------
EXPORTER_SOURCE = SERVING_DIR / "tracing.py"
EXPORTER_MODULE = "pd_serve_tracing"  # not `serving.tracing`: that package comes with the code zip
EXPORTER_IMPORT_PATH = f"{EXPORTER_MODULE}:span_processors"
EXPORTER_DIR = "/opt/pd-inference/tracing"
EXPORTER_VOLUME = "serve-tracing"
# Ray 2.60 ray/serve/_private/constants.py.
SERVE_EXPORTER_ENV = "RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH"
SERVE_RATIO_ENV = "RAY_SERVE_TRACING_SAMPLING_RATIO"
# OpenTelemetry SDK (opentelemetry/sdk/trace/sampling.py): a TracerProvider built without a
# sampler, as vLLM's own is (vllm/tracing/otel.py), samples by these.
SAMPLER_ENV = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG_ENV = "OTEL_TRACES_SAMPLER_ARG"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"


@dataclass(frozen=True)
class TraceExport:
    """Where the Ray pods send spans and how many requests they keep."""

    endpoint: str
    sample_rate: float

    def configmap_name(self, rayservice: str) -> str:
        return f"{rayservice}-serve-tracing"


def export_for(tracing: Tracing, environment: str) -> TraceExport | None:
    """The export settings of a stack's tracing block (None: tracing off)."""
    if not tracing.enabled:
        return None
    return TraceExport(endpoint=COLLECTOR_ENDPOINT, sample_rate=tracing.rate_for(environment))


def pod_env(export: TraceExport, service_name: str) -> list[dict[str, Any]]:
    """Environment of a Ray container: Serve's tracing, the SDK's endpoint and sampler, the
    factory's folder on PYTHONPATH (Ray's runtime_env prepends the code zip to it)."""
    rate = repr(export.sample_rate)
    return [
        {"name": SERVE_EXPORTER_ENV, "value": EXPORTER_IMPORT_PATH},
        {"name": SERVE_RATIO_ENV, "value": rate},
        {"name": ENDPOINT_ENV, "value": export.endpoint},
        {"name": SAMPLER_ENV, "value": "parentbased_traceidratio"},
        {"name": SAMPLER_ARG_ENV, "value": rate},
        {"name": SERVICE_NAME_ENV, "value": service_name},
        {"name": "PYTHONPATH", "value": EXPORTER_DIR},
    ]


def exporter_volume(export: TraceExport, rayservice: str) -> dict[str, Any]:
    return {"name": EXPORTER_VOLUME, "configMap": {"name": export.configmap_name(rayservice), "defaultMode": 0o444}}


def exporter_mount() -> dict[str, Any]:
    return {"name": EXPORTER_VOLUME, "mountPath": EXPORTER_DIR, "readOnly": True}


def exporter_configmap(export: TraceExport, rayservice: str, namespace: str) -> dict[str, Any]:
    """serving/tracing.py, as the module EXPORTER_MODULE in the folder EXPORTER_DIR."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": export.configmap_name(rayservice), "namespace": namespace},
        "data": {f"{EXPORTER_MODULE}.py": EXPORTER_SOURCE.read_text()},
    }


def _restricted() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}


def collector_values() -> dict[str, Any]:
    """opentelemetry-collector chart values: one Deployment on the system nodes, OTLP/gRPC in,
    memory limiter and batch, OTLP/gRPC out to Tempo. The chart's default receivers (jaeger,
    zipkin, prometheus), its debug exporter and its logs and metrics pipelines are removed
    (a null value deletes a chart default in Helm), and so are their ports."""
    return {
        "mode": "deployment",
        "fullnameOverride": COLLECTOR_RELEASE,
        "image": {"repository": OTEL_COLLECTOR_IMAGE},
        "nodeSelector": {ROLE_LABEL: SYSTEM_ROLE},
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "securityContext": _restricted(),
        "serviceAccount": {"automountServiceAccountToken": False},
        "ports": {
            "otlp": {"enabled": True},
            **{
                p: {"enabled": False} for p in ("otlp-http", "jaeger-compact", "jaeger-thrift", "jaeger-grpc", "zipkin")
            },
        },
        "config": {
            "receivers": {
                "otlp": {
                    "protocols": {"grpc": {"endpoint": f"${{env:MY_POD_IP}}:{COLLECTOR_OTLP_GRPC_PORT}"}, "http": None}
                },
                "jaeger": None,
                "zipkin": None,
                "prometheus": None,
            },
            "exporters": {
                "debug": None,
                # Plain gRPC to Tempo inside the namespace, like the spans' way in.
                "otlp": {"endpoint": f"{TEMPO_HOST}:{TEMPO_OTLP_GRPC_PORT}", "tls": {"insecure": True}},
            },
            "service": {
                "pipelines": {
                    "logs": None,
                    "metrics": None,
                    "traces": {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"], "exporters": ["otlp"]},
                }
            },
        },
    }


def tempo_values(bucket: Any, region: str | None, retention_days: int) -> dict[str, Any]:
    """tempo chart values: traces in `bucket` (S3, credentials from EKS Pod Identity, which
    Tempo's S3 backend supports: Tempo docs "Amazon S3 permissions"), the WAL on an encrypted
    volume, blocks kept `retention_days`, no usage reports to Grafana Labs."""
    s3: dict[str, Any] = {"bucket": bucket, "endpoint": f"s3.{region}.amazonaws.com" if region else "s3.amazonaws.com"}
    if region:
        s3["region"] = region
    return {
        "nodeSelector": {ROLE_LABEL: SYSTEM_ROLE},
        "serviceAccount": {"create": True, "name": TEMPO_SERVICE_ACCOUNT, "automountServiceAccountToken": False},
        "persistence": {"enabled": True, "storageClassName": STORAGE_CLASS, "size": f"{TEMPO_WAL_GIB}Gi"},
        "tempo": {
            "reportingEnabled": False,
            "retention": f"{retention_days * 24}h",
            "securityContext": _restricted(),
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
            "storage": {
                "trace": {"backend": "s3", "s3": s3, "wal": {"path": "/var/tempo/wal"}},
            },
        },
    }


def tempo_bucket_policy(bucket_arn: str) -> dict[str, Any]:
    """Tempo's S3 permissions (Tempo docs, "Amazon S3 permissions"), on its bucket only."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "TempoTraces",
                "Effect": "Allow",
                "Action": [
                    "s3:PutObject",
                    "s3:GetObject",
                    "s3:ListBucket",
                    "s3:DeleteObject",
                    "s3:GetObjectTagging",
                    "s3:PutObjectTagging",
                ],
                "Resource": [bucket_arn, f"{bucket_arn}/*"],
            }
        ],
    }


def grafana_tempo_datasource() -> dict[str, Any]:
    """An entry of kube-prometheus-stack's `grafana.additionalDataSources`."""
    return {"name": "Tempo", "type": "tempo", "uid": GRAFANA_TEMPO_UID, "access": "proxy", "url": TEMPO_URL}


def _policy(name: str, pods: dict[str, str], sources: list[dict[str, Any]], ports: list[int]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": MONITORING_NAMESPACE},
        "spec": {
            "podSelector": {"matchLabels": dict(pods)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": [{"port": p, "protocol": "TCP"} for p in ports]}],
        },
    }


def network_policies(llm_namespace: str) -> list[dict[str, Any]]:
    """Spans only from the LLM namespace's pods to the collector; Tempo only from monitoring."""

    def ns(name: str) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}

    return [
        _policy("otel-collector-otlp", COLLECTOR_POD_LABELS, [ns(llm_namespace)], [COLLECTOR_OTLP_GRPC_PORT]),
        _policy(
            "tempo-in-monitoring", TEMPO_POD_LABELS, [ns(MONITORING_NAMESPACE)], [TEMPO_OTLP_GRPC_PORT, TEMPO_HTTP_PORT]
        ),
    ]
