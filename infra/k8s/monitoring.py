"""What Prometheus scrapes, as plain data: the monitors and the metrics stack's Helm values.

What flows through here: the LLM namespace, the stack's `observability` block and the
targets other components expose (KubeRay operator, node autoscaler, ...) ->
- a PodMonitor for every Ray pod (head and workers) on KubeRay's `metrics` port, which
  carries Ray's, Ray Serve's and vLLM's metrics (vLLM's `vllm:` names arrive as `ray_vllm_*`),
  relabelled with the pod's engine `role` (head, prefill, decode) and its Ray cluster;
- a ServiceMonitor per `ScrapeTarget` (the monitor list is data: a new component adds a
  target, not code here);
- kube-prometheus-stack's values (Prometheus Operator, Prometheus, Alertmanager, Grafana,
  kube-state-metrics, node-exporter) on the system nodes, retention and encrypted storage
  sized from the stack file, selecting only objects that carry `MONITORING_LABEL`;
- the DCGM exporter's values: GPU nodes only, tolerating the GPU taint, exporting exactly the
  counters of the vendored list `DCGM_COUNTERS_FILE`.
No Pulumi here: `infra.components.observability` registers these, the tests validate them
against the Prometheus Operator CRDs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.config import MetricsStack, Observability
from infra.k8s.labels import GPU_TOLERATION, INSTANCE_TYPE_LABEL, ROLE_LABEL, SYSTEM_ROLE

MONITORING_NAMESPACE = "monitoring"
# The Prometheus Operator's governing Service for every Prometheus it runs (prometheus-operated,
# port 9090): the in-cluster query address, in both local-volume and remote-write setups.
PROMETHEUS_URL = f"http://prometheus-operated.{MONITORING_NAMESPACE}.svc.cluster.local:9090"
# kube-prometheus-stack's Helm release. Its Prometheus selects monitors and rules labelled
# `release: <release>`, as the chart's own (kube-state-metrics, node-exporter, default rules)
# are; ours carry the same label.
METRICS_RELEASE = "kube-prometheus-stack"
MONITORING_LABEL = {"release": METRICS_RELEASE}
# Grafana's dashboard sidecar loads ConfigMaps with this label (kube-prometheus-stack default).
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
# KubeRay names the Ray container's metrics port `metrics` (8080) and starts Ray with
# --metrics-export-port on it (ray-operator/controllers/ray/common/pod.go, v1.7.0).
RAY_METRICS_PORT_NAME = "metrics"
RAY_METRICS_PORT = 8080
# Labels the monitors put on every Ray series; dashboards and rules group by them.
ROLE = "role"
RAY_CLUSTER = "ray_cluster"
STORAGE_CLASS = "gp3-encrypted"
ALERTMANAGER_GIB = 10  # silences and notification state: small
GRAFANA_GIB = 10
# NVIDIA dcgm-exporter's published default counters, vendored (see the file's header).
DCGM_COUNTERS_FILE = Path(__file__).resolve().parent / "data" / "dcgm-exporter-4.8.2-default-counters.csv"


@dataclass(frozen=True)
class ScrapeTarget:
    """A Service whose endpoints serve Prometheus metrics: one ServiceMonitor.

    name: the monitor's name; namespace: the Service's; selector: the Service's labels;
    port: the Service port's *name*; path: the metrics path.
    """

    name: str
    namespace: str
    selector: dict[str, str]
    port: str
    path: str = "/metrics"
    interval: str = "30s"


def _meta(name: str, namespace: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {**MONITORING_LABEL, **(extra or {})}}


def ray_pod_monitor(namespace: str, interval_s: int) -> dict[str, Any]:
    """Every Ray pod of every RayCluster in `namespace`, on KubeRay's metrics port.

    KubeRay labels its pods `ray.io/is-ray-node: yes`, `ray.io/node-type` (head/worker) and
    `ray.io/group` (the worker group's name: the engine role here), and these cannot be
    overridden by the template (pod.go `labelPod`, v1.7.0).
    """
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta("ray", namespace),
        "spec": {
            "jobLabel": "ray.io/node-type",
            "namespaceSelector": {"matchNames": [namespace]},
            "selector": {"matchLabels": {"ray.io/is-ray-node": "yes"}},
            "podMetricsEndpoints": [
                {
                    "port": RAY_METRICS_PORT_NAME,
                    "path": "/metrics",
                    "interval": f"{interval_s}s",
                    "relabelings": [
                        # The worker group is named after the engine role; the head's is not.
                        {
                            "action": "replace",
                            "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_group"],
                            "targetLabel": ROLE,
                        },
                        {
                            "action": "replace",
                            "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_node_type"],
                            "regex": "head",
                            "targetLabel": ROLE,
                            "replacement": "head",
                        },
                        # Two clusters run side by side during a NewCluster upgrade.
                        {
                            "action": "replace",
                            "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                            "targetLabel": RAY_CLUSTER,
                        },
                    ],
                }
            ],
        },
    }


def service_monitor(target: ScrapeTarget) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(target.name, target.namespace),
        "spec": {
            "namespaceSelector": {"matchNames": [target.namespace]},
            "selector": {"matchLabels": dict(target.selector)},
            "endpoints": [{"port": target.port, "path": target.path, "interval": target.interval}],
        },
    }


def kuberay_operator_target(namespace: str) -> ScrapeTarget:
    """The KubeRay operator's Service: port `http` (8080) serves /metrics, selected by the
    chart name (helm-chart/kuberay-operator/templates/service.yaml, v1.7.0)."""
    return ScrapeTarget(
        name="kuberay-operator",
        namespace=namespace,
        selector={"app.kubernetes.io/name": "kuberay-operator"},
        port="http",
    )


# kubernetes/autoscaler, cluster-autoscaler/charts/cluster-autoscaler (chart 9.59.0, tag
# cluster-autoscaler-chart-9.59.0): templates/service.yaml names its one port
# `.Values.service.portName` (default `http`, port and targetPort 8085, where the container
# serves /metrics), labels the Service with `cluster-autoscaler.labels` (_helpers.tpl:
# app.kubernetes.io/instance = the release name, app.kubernetes.io/name = nameOverride or
# "<cloudProvider>-cluster-autoscaler"), and the pods with the same two.
CLUSTER_AUTOSCALER_PORT_NAME = "http"
CLUSTER_AUTOSCALER_CHART_NAME = "cluster-autoscaler"


def node_autoscaler_target(namespace: str, release: str, cloud_provider: str) -> ScrapeTarget:
    """The Cluster Autoscaler's Service (chart `cluster-autoscaler`, release `release`)."""
    return ScrapeTarget(
        name="cluster-autoscaler",
        namespace=namespace,
        selector={
            "app.kubernetes.io/instance": release,
            "app.kubernetes.io/name": f"{cloud_provider}-{CLUSTER_AUTOSCALER_CHART_NAME}",
        },
        port=CLUSTER_AUTOSCALER_PORT_NAME,
    )


def storage_class() -> dict[str, Any]:
    """gp3 EBS volumes, encrypted, bound where the pod lands (one zone per volume)."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS},
        "provisioner": "ebs.csi.aws.com",
        "parameters": {"type": "gp3", "encrypted": "true", "csi.storage.k8s.io/fstype": "ext4"},
        "reclaimPolicy": "Retain",
        "volumeBindingMode": "WaitForFirstConsumer",
        "allowVolumeExpansion": True,
    }


def _claim(gib: int) -> dict[str, Any]:
    return {
        "volumeClaimTemplate": {
            "spec": {
                "storageClassName": STORAGE_CLASS,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": f"{gib}Gi"}},
            }
        }
    }


def metrics_stack_values(
    obs: Observability, *, prometheus_service_account: str, remote_write_url: Any = None, region: str | None = None
) -> dict[str, Any]:
    """kube-prometheus-stack values: everything on the system nodes, encrypted volumes.

    remote_write_url: the AMP workspace's remote-write URL (a Pulumi Output in the program)
    when metrics also go to Amazon Managed Service for Prometheus.
    """
    system = {ROLE_LABEL: SYSTEM_ROLE}
    selector = {"matchLabels": dict(MONITORING_LABEL)}
    in_cluster_grafana = obs.stack is MetricsStack.KUBE_PROMETHEUS_STACK
    prometheus_spec: dict[str, Any] = {
        "nodeSelector": system,
        "retention": f"{obs.retention_days}d",
        # Prometheus drops the oldest blocks before the volume fills (WAL and compaction need room).
        "retentionSize": f"{obs.retention_size_gb}GB",
        "scrapeInterval": f"{obs.scrape_interval_seconds}s",
        "evaluationInterval": f"{obs.scrape_interval_seconds}s",
        "storageSpec": _claim(obs.storage_gib),
        # Monitors and rules of this release (the chart's and ours), from any namespace.
        "serviceMonitorSelector": selector,
        "podMonitorSelector": selector,
        "ruleSelector": selector,
        "serviceMonitorNamespaceSelector": {},
        "podMonitorNamespaceSelector": {},
        "ruleNamespaceSelector": {},
        "resources": {"requests": {"cpu": "500m", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
    }
    if remote_write_url is not None:
        # SigV4 with the Pod Identity credentials of the Prometheus service account.
        prometheus_spec["remoteWrite"] = [{"url": remote_write_url, "sigv4": {"region": region}}]
    return {
        "crds": {"enabled": True},
        # EKS runs these on the managed control plane: nothing to scrape.
        "kubeControllerManager": {"enabled": False},
        "kubeScheduler": {"enabled": False},
        "kubeEtcd": {"enabled": False},
        "kubeProxy": {"enabled": False},
        "prometheusOperator": {"nodeSelector": system, "admissionWebhooks": {"patch": {"nodeSelector": system}}},
        "prometheus": {"serviceAccount": {"name": prometheus_service_account}, "prometheusSpec": prometheus_spec},
        "alertmanager": {"alertmanagerSpec": {"nodeSelector": system, "storage": _claim(ALERTMANAGER_GIB)}},
        "grafana": {
            "enabled": in_cluster_grafana,
            "nodeSelector": system,
            "persistence": {"enabled": True, "storageClassName": STORAGE_CLASS, "size": f"{GRAFANA_GIB}Gi"},
            # Dashboards come from ConfigMaps with DASHBOARD_LABEL, in any namespace.
            "sidecar": {
                "dashboards": {
                    "enabled": True,
                    "label": next(iter(DASHBOARD_LABEL)),
                    "labelValue": next(iter(DASHBOARD_LABEL.values())),
                    "searchNamespace": "ALL",
                }
            },
        },
        "kube-state-metrics": {"nodeSelector": system},
        # node-exporter is a DaemonSet: every node, the GPU nodes too.
        "prometheus-node-exporter": {"tolerations": [GPU_TOLERATION]},
    }


def dcgm_exporter_values(gpu_instance_types: list[str]) -> dict[str, Any]:
    """NVIDIA's DCGM exporter: only on GPU instance types, tolerating their taint."""
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": INSTANCE_TYPE_LABEL, "operator": "In", "values": sorted(gpu_instance_types)}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [GPU_TOLERATION],
        # Exactly the vendored counter list, so the metric names the rules use are the ones deployed.
        "customMetrics": dcgm_counters_csv(),
        "serviceMonitor": {"enabled": True, "interval": "15s", "additionalLabels": dict(MONITORING_LABEL)},
    }


def dcgm_counters_csv() -> str:
    return DCGM_COUNTERS_FILE.read_text()


def dcgm_metric_names() -> set[str]:
    """Field names in the counter list: dcgm-exporter exports each under that name."""
    names = set()
    for line in dcgm_counters_csv().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            field, kind = (p.strip() for p in line.split(",")[:2])
            if kind != "label":
                names.add(field)
    return names


def metrics_network_policy(namespace: str) -> dict[str, Any]:
    """Let Prometheus (in MONITORING_NAMESPACE) reach the Ray pods' metrics port.

    NetworkPolicies add up: this opens one port, from one namespace, next to the LLM
    service's own policy.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "allow-prometheus-scrape", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}}}
                    ],
                    "ports": [{"port": RAY_METRICS_PORT, "protocol": "TCP"}],
                }
            ],
        },
    }
