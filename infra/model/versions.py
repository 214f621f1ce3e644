"""Every chart and image version the stack deploys, pinned in one place.

What flows through here: the Helm releases (device plugins, KubeRay) read their chart
coordinates here, and the RayService reads its default Ray image. Bumping a version is a
one-line, reviewable change; the policy pack rejects anything unpinned.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HelmChart:
    chart: str
    version: str
    repo: str


NVIDIA_DEVICE_PLUGIN = HelmChart(
    chart="nvidia-device-plugin",
    version="0.18.2",
    repo="https://nvidia.github.io/k8s-device-plugin",
)
EFA_DEVICE_PLUGIN = HelmChart(
    chart="aws-efa-k8s-device-plugin",
    version="v0.5.8",
    repo="https://aws.github.io/eks-charts",
)
KUBERAY_OPERATOR = HelmChart(
    chart="kuberay-operator",
    version="1.7.0",
    repo="https://ray-project.github.io/kuberay-helm/",
)

# The metrics pipeline: Prometheus Operator v0.93.1, Prometheus, Alertmanager, Grafana,
# kube-state-metrics 2.20.0 and node-exporter (prometheus-community/helm-charts,
# charts/kube-prometheus-stack/Chart.yaml, 88.5.3).
KUBE_PROMETHEUS_STACK = HelmChart(
    chart="kube-prometheus-stack",
    version="88.5.3",
    repo="https://prometheus-community.github.io/helm-charts",
)
# NVIDIA's GPU metrics (DCGM 4.5.3, exporter 4.8.2; NVIDIA/dcgm-exporter deployment/Chart.yaml).
# 4.9.0 renames the default metrics and changes units: moving there means replacing the
# vendored counter list (infra/k8s/data/) and the names the rules and dashboards use.
DCGM_EXPORTER = HelmChart(
    chart="dcgm-exporter",
    version="4.8.2",
    repo="https://nvidia.github.io/dcgm-exporter/helm-charts",
)

# Ray's own LLM image: Ray 2.60 (the version serving/ is written and tested against), the
# vLLM that Ray 2.60 pins, NIXL built with UCX, CUDA 12.8. See docs/architecture.md, "The Ray image".
RAY_VERSION = "2.60.0"
RAY_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-py311-cu128"

# EKS Kubernetes versions this program accepts; the default is in standard support.
MIN_KUBERNETES_VERSION = (1, 28)
MAX_KUBERNETES_VERSION = (1, 37)
DEFAULT_KUBERNETES_VERSION = "1.35"
