"""What runs on the cluster: pinned images and charts, and the Ray cluster's shape.

What flows through here: every pod template (Pods, workloads, CronJobs, the Ray head and
worker groups), KubeRay's autoscaler options and Helm charts' versions and values -> each
image reference and chart version -> `images-pinned`, `helm-charts-pinned`; the Ray head's
start parameters and resources -> `ray-head-no-gpu`; the worker groups' EFA devices against
the NIXL backends in serveConfigV2 -> `nixl-backend-matches-fabric`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from .inputs import HELM_CHART_V4, HELM_RELEASE_V3, RAY_TYPES, Context, as_list, dig, known
from .manifests import containers, mappings, pod_specs, ray_clusters, serve_doc

GPU_RESOURCE = "nvidia.com/gpu"
# A tag that moves, or no tag at all: the image can change under a running stack.
FLOATING_TAGS = {"latest", "nightly", "main", "master", "edge", "stable", "dev"}


# --- images and charts -------------------------------------------------------------------------
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_EXACT_VERSION = re.compile(r"^v?\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def image_problem(image: Any) -> str | None:
    """Why an image reference is not pinned, or None if it is (a release tag or a digest)."""
    if not isinstance(image, str):
        return None  # unknown during preview, or not set (the chart's or operator's own default)
    if "@" in image:
        return None if _DIGEST.search(image) else f"image {image!r} has a malformed digest"
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image!r} has no tag (it means :latest)"
    tag = last.split(":", 1)[1]
    if tag.lower() in FLOATING_TAGS or tag.lower().startswith("nightly"):
        return f"image {image!r} uses the floating tag {tag!r}"
    return None


def _chart_images(values: Any, path: str = "values") -> Iterator[tuple[str, str]]:
    """(path, reference) for images set in Helm values: `image: repo:tag` or `image: {repository, tag}`."""
    if isinstance(values, Mapping):
        for k, v in values.items():
            here = f"{path}.{k}"
            if k == "image" and isinstance(v, str):
                yield here, v
            elif k == "image" and isinstance(v, Mapping) and isinstance(v.get("tag"), str):
                repo = v.get("repository") or v.get("name") or "image"
                yield here, f"{repo}:{v['tag']}" if v["tag"] else str(repo)
            else:
                yield from _chart_images(v, here)
    elif isinstance(values, list):
        for i, v in enumerate(values):
            yield from _chart_images(v, f"{path}[{i}]")


def check_images_pinned(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    fix = "pin a release tag (e.g. rayproject/ray-llm:2.60.0-py312-cu130) or a digest (@sha256:...)"
    for where, _, pod in pod_specs(type_, props):
        for c in containers(pod):
            problem = image_problem(c.get("image"))
            if problem:
                yield f"{where} container {c.get('name')!r}: {problem}; {fix}"
    if type_ in RAY_TYPES:
        for prefix, cluster in ray_clusters(type_, props.get("spec")):
            problem = image_problem(dig(cluster, "autoscalerOptions", "image"))
            if problem:
                yield f"{prefix}.autoscalerOptions: {problem}; {fix}"
    if type_ in (HELM_CHART_V4, HELM_RELEASE_V3):
        for where, ref in _chart_images(props.get("values")):
            problem = image_problem(ref)
            if problem:
                yield f"{where}: {problem}; pin the tag, or leave it unset so the pinned chart's own image is used"


def check_helm_pinned(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (HELM_CHART_V4, HELM_RELEASE_V3):
        return
    chart = props.get("chart")
    version = props.get("version")
    if not known(chart) or not known(version):
        return
    if isinstance(chart, str) and chart.startswith((".", "/")) and not version:
        return  # a chart vendored in the repository is pinned by the commit
    if not isinstance(version, str) or not _EXACT_VERSION.match(version.strip()):
        yield (
            f"Helm chart {chart!r} has version {version!r}: pin an exact version (e.g. '1.7.0', in "
            "infra/versions.py); ranges, 'latest' or no version install whatever is newest at deploy time"
        )


# --- the Ray head ---------------------------------------------------------------------------------------
def check_ray_head_no_gpu(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in RAY_TYPES:
        return
    for prefix, cluster in ray_clusters(type_, props.get("spec")):
        head = dig(cluster, "headGroupSpec")
        if not known(head) or head is None:
            continue
        gpus = dig(head, "rayStartParams", "num-gpus")
        if known(gpus) and str(gpus).strip() != "0":
            yield (
                f'{prefix}.headGroupSpec.rayStartParams num-gpus is {gpus!r}: set it to "0" so Ray never places '
                "model replicas on the head (it runs the GCS, the Serve controller and the proxy)"
            )
        for c in containers(dig(head, "template", "spec")):
            for kind in ("requests", "limits"):
                n = dig(c, "resources", kind, GPU_RESOURCE)
                if n is not None and known(n) and str(n).strip() not in ("0", ""):
                    yield (
                        f"{prefix}.headGroupSpec container {c.get('name')!r} {kind} {GPU_RESOURCE}: {n}: remove it; "
                        "the head runs on the CPU system nodes and needs no GPU"
                    )


# --- KV transfer over the fabric --------------------------------------------------------------
EFA_RESOURCE = "vpc.amazonaws.com/efa"
NIXL_CONNECTORS = {"NixlConnector", "NixlPushConnector"}
NIXL_DEFAULT_BACKENDS = ["UCX"]  # vLLM NixlConnector's default (nixl/base_worker.py, get_from_extra_config)


def _efa_worker_groups(cluster: Any) -> list[str] | None:
    """Names of the worker groups whose pods ask for EFA devices; None when not known yet."""
    groups = dig(cluster, "workerGroupSpecs")
    if not known(groups):
        return None
    out = []
    for i, group in enumerate(as_list(groups)):
        for c in containers(dig(group, "template", "spec")):
            for kind in ("requests", "limits"):
                n = dig(c, "resources", kind, EFA_RESOURCE)
                if n is not None and known(n) and str(n).strip() not in ("0", ""):
                    out.append(str(dig(group, "groupName", default=i)))
    return sorted(set(out))


def _nixl_configs(serve_config: Any) -> Iterator[tuple[str, list[Any]]]:
    """(path, backends) of every NIXL kv_transfer_config in a serveConfigV2 document."""
    for path, node in mappings(serve_doc(serve_config)):
        kv = node.get("kv_transfer_config")
        if not isinstance(kv, Mapping):
            continue
        # A KV offload tier nests NIXL under vLLM's MultiConnector (`connectors` children).
        nested = (
            dig(kv, "kv_connector_extra_config", "connectors") if kv.get("kv_connector") == "MultiConnector" else None
        )
        candidates = [(f"{path}.kv_transfer_config", kv)] + [
            (f"{path}.kv_transfer_config.kv_connector_extra_config.connectors[{i}]", c)
            for i, c in enumerate(as_list(nested))
            if isinstance(c, Mapping)
        ]
        for where, conf in candidates:
            if conf.get("kv_connector") in NIXL_CONNECTORS:
                extra = conf.get("kv_connector_extra_config")
                backends = extra.get("backends") if isinstance(extra, Mapping) else None
                yield where, list(backends) if backends else list(NIXL_DEFAULT_BACKENDS)


def check_nixl_backend(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    """On EFA worker groups NIXL must use LIBFABRIC: its UCX backend gets no RDMA on EFA and
    silently falls back to TCP (ai-dynamo/nixl#909, ai-dynamo/dynamo#4185). Without EFA there
    is no libfabric EFA device, so LIBFABRIC is wrong there."""
    if not type_.endswith(":RayService"):
        return
    spec = props.get("spec")
    efa_groups = _efa_worker_groups(dig(spec, "rayClusterConfig"))
    if efa_groups is None:
        return
    for path, backends in _nixl_configs(dig(spec, "serveConfigV2")):
        if efa_groups and (backends != ["LIBFABRIC"]):
            yield (
                f"{path} NIXL backends {backends} on EFA worker groups {efa_groups}: UCX gets no RDMA on EFA and "
                'falls back to TCP without a word (ai-dynamo/nixl#909); set kv_connector_extra_config.backends ["LIBFABRIC"]'
            )
        elif not efa_groups and "LIBFABRIC" in backends:
            yield (
                f"{path} NIXL backends {backends} but no worker group has EFA devices: LIBFABRIC has no EFA "
                'device to use; set kv_connector_extra_config.backends ["UCX"]'
            )
