"""Values that carry the resource they come from, so whatever takes them waits for it.

What flows through here: a resource and a value it stands for (a cluster and its name, a
Namespace and its name, a node group and its name) -> that value as an `Output` of the
resource; and a Kubernetes object's metadata -> the same metadata with its namespace taken
from the Namespace resource that creates it.

Why: Pulumi orders creation by the dependencies an input carries (pulumi/pulumi
sdk/python/lib/pulumi/runtime/resource.py `prepare_resource`: explicit depends_on plus the
resources behind every Output in the inputs). A name copied into a plain `str` carries none,
so the resource that takes it is created in parallel with the one it names: an EKS Pod
Identity association before its cluster exists (ResourceNotFoundException), a Secret before
its namespace (NotFound). `tools/creation_order.py` checks every stack for that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import pulumi

T = TypeVar("T")


def output_of(resource: pulumi.Resource, value: pulumi.Input[T]) -> pulumi.Output[T]:
    """`value` as an output of `resource`: it resolves when the resource's registration returns
    (for a custom resource once the engine has created it; for a remote component, such as
    pulumi-eks's cluster, once its children exist) and carries the resource as a dependency."""
    return resource.urn.apply(lambda _: pulumi.Output.from_input(value))


def placed(meta: Mapping[str, Any], namespaces: Mapping[str, pulumi.Input[str]]) -> Any:
    """`meta` (a Kubernetes object's metadata) with its namespace from `namespaces` (name -> that
    name as an output of the Namespace resource) when the stack creates that namespace; as it
    was otherwise (kube-system, or no namespace). Typed Any, as the plain-data metadata it
    stands for: the Kubernetes SDK takes it as its ObjectMeta TypedDict."""
    ns = meta.get("namespace")
    return {**meta, "namespace": namespaces[ns]} if isinstance(ns, str) and ns in namespaces else dict(meta)
