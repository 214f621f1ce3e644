"""KubeRayOperator: the operator that turns a RayService into a Ray cluster running Serve.

What flows through here: the cluster's core (its provider) and the workload namespaces it
manages -> those namespaces (Pod Security
"baseline" enforced, "restricted" warned) and the KubeRay operator Helm release (version
pinned in infra/versions.py) on the system nodes, with namespace-scoped RBAC for just those
namespaces (least privilege) instead of cluster-wide rights. The operator creates the
namespaces because its Roles live in them and must come after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.components.cluster import ClusterCore
from infra.components.helm import release
from infra.components.outputs import output_of
from infra.k8s.labels import KUBERAY_NAMESPACE as NAMESPACE
from infra.k8s.labels import ROLE_LABEL, SYSTEM_ROLE


@dataclass
class KubeRayOperatorArgs:
    cluster: ClusterCore
    """The cluster the operator runs in (through its Kubernetes provider)."""
    watch_namespaces: list[str]
    """Namespaces the operator watches (its RBAC is limited to them)."""


class KubeRayOperator(pulumi.ComponentResource):
    namespaces: dict[str, pulumi.Output[str]]
    """Namespace name -> that name as an output of its Namespace resource, for the operator's
    namespace and every workload namespace: objects other components put there take their
    namespace from here, so they are created after it."""

    def __init__(self, name: str, args: KubeRayOperatorArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:kuberay:KubeRayOperator", name, None, opts)
        provider = args.cluster.provider
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=provider)
        ns = k8s.core.v1.Namespace(f"{name}-ns", metadata={"name": NAMESPACE}, opts=k8s_opts)
        self.workload_namespaces = [
            k8s.core.v1.Namespace(
                f"{name}-{wn}-ns",
                metadata={
                    "name": wn,
                    "labels": {
                        "pod-security.kubernetes.io/enforce": "baseline",
                        "pod-security.kubernetes.io/warn": "restricted",
                    },
                },
                opts=k8s_opts,
            )
            for wn in args.watch_namespaces
        ]
        self.namespaces = {
            NAMESPACE: output_of(ns, NAMESPACE),
            **{wn: output_of(n, wn) for wn, n in zip(args.watch_namespaces, self.workload_namespaces, strict=True)},
        }
        chart = versions.KUBERAY_OPERATOR
        values = {
            "nodeSelector": {ROLE_LABEL: SYSTEM_ROLE},
            "singleNamespaceInstall": True,
            "watchNamespace": list(args.watch_namespaces),
            "resources": {
                "requests": {"cpu": "100m", "memory": "512Mi"},
                "limits": {"cpu": "1", "memory": "1Gi"},
            },
        }
        # Its Roles live in the namespaces it watches: those must exist first.
        self.chart = release(
            self, f"{name}-chart", chart, NAMESPACE, values, provider, depends_on=[ns, *self.workload_namespaces]
        )
        self.register_outputs({"chartVersion": chart.version, "namespace": NAMESPACE})
