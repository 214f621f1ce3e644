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
    # aws/eks-charts stable/aws-efa-k8s-device-plugin: chart v0.5.30 ships plugin v0.5.20.
    version="v0.5.30",
    repo="https://aws.github.io/eks-charts",
)
KUBERAY_OPERATOR = HelmChart(
    chart="kuberay-operator",
    version="1.7.0",
    repo="https://ray-project.github.io/kuberay-helm/",
)

# Ray's own LLM image: Ray 2.60 (the version serving/ is written and tested against), the
# vLLM that Ray 2.60 pins, NIXL built with UCX, CUDA 12.8. See docs/architecture.md, "The Ray image".
RAY_VERSION = "2.60.0"
RAY_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-py311-cu128"

# EKS Kubernetes versions this program accepts; the default is in standard support.
MIN_KUBERNETES_VERSION = (1, 28)
MAX_KUBERNETES_VERSION = (1, 37)
DEFAULT_KUBERNETES_VERSION = "1.35"

# The EKS-optimized AMI release that new stacks pin (`amiReleaseVersion`; every stack file
# names its own). awslabs/amazon-eks-ami release v20260714: Kubernetes 1.35 release version
# 1.35.6-20260714; AL2023_x86_64_NVIDIA carries kmod-nvidia-latest-dkms 580.159.03 (CUDA 13.0
# needs a >= 580 driver) and nvidia-container-toolkit 1.19.1.
AMI_RELEASE_VERSION = "1.35.6-20260714"

# ElastiCache engine of `gcsFaultTolerance: managed` (Valkey: Redis OSS-compatible, AUTH + TLS).
GCS_REDIS_ENGINE = "valkey"
GCS_REDIS_ENGINE_VERSION = "8.0"
