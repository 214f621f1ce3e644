"""Where pods, containers and the Serve config sit inside the resources that carry them.

What flows through here: a resource's plain inputs (a Pod, a workload with a pod template, a
CronJob, a RayService/RayCluster/RayJob) -> (path, role, pod spec) for each pod template, the
containers of a pod spec, the Ray cluster spec(s) of a KubeRay resource, and the parsed
serveConfigV2 document with every mapping in it -> the rules that read pods (images, the Ray
head, NIXL, secrets) and the Serve config (NIXL, secrets, the fallback) walk the same shapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from .inputs import RAY_TYPES, WORKLOAD_TYPES, as_list, dig


def pod_specs(type_: str, props: Mapping[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(where, role, pod spec) for every pod template in a workload; role is "head", "worker" or "pod"."""
    spec = props.get("spec")
    if type_ == "kubernetes:core/v1:Pod":
        yield "spec", "pod", spec
    elif type_ in WORKLOAD_TYPES:
        yield "spec.template.spec", "pod", dig(spec, "template", "spec")
    elif type_ == "kubernetes:batch/v1:CronJob":
        yield "spec.jobTemplate.spec.template.spec", "pod", dig(spec, "jobTemplate", "spec", "template", "spec")
    elif type_ in RAY_TYPES:
        for prefix, cluster in ray_clusters(type_, spec):
            yield f"{prefix}.headGroupSpec.template.spec", "head", dig(cluster, "headGroupSpec", "template", "spec")
            for i, group in enumerate(as_list(dig(cluster, "workerGroupSpecs"))):
                name = dig(group, "groupName", default=str(i))
                yield f"{prefix}.workerGroupSpecs[{name}].template.spec", "worker", dig(group, "template", "spec")


def ray_clusters(type_: str, spec: Any) -> Iterator[tuple[str, Any]]:
    if type_.endswith(":RayService"):
        yield "spec.rayClusterConfig", dig(spec, "rayClusterConfig")
    elif type_.endswith(":RayJob"):
        yield "spec.rayClusterSpec", dig(spec, "rayClusterSpec")
    else:
        yield "spec", spec


def containers(pod_spec: Any) -> Iterator[Mapping[str, Any]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in as_list(dig(pod_spec, field)):
            if isinstance(c, Mapping):
                yield c


def serve_doc(serve_config: Any) -> Any:
    """A serveConfigV2 document (YAML text) parsed, or None when it is not readable YAML."""
    if not isinstance(serve_config, str):
        return None
    try:
        return yaml.safe_load(serve_config)
    except yaml.YAMLError:
        return None


def mappings(node: Any, path: str = "serveConfigV2") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, mapping) for every mapping in a parsed serveConfigV2 document, depth first."""
    if isinstance(node, Mapping):
        yield path, node
        for k, v in node.items():
            yield from mappings(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from mappings(v, f"{path}[{i}]")
