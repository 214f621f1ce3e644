"""Device plugins: how Kubernetes learns a node's GPUs and EFA interfaces.

What flows through here: the GPU and EFA instance types of the catalog -> two Helm releases
(versions from infra/versions.py, through the provider of the cluster's core) whose DaemonSets tolerate the GPU taint and run only on
those types: the NVIDIA device plugin (`nvidia.com/gpu`) and the AWS EFA device plugin
(`vpc.amazonaws.com/efa`). The AL2023 NVIDIA AMI ships drivers and EFA host software but
neither plugin. The EFA plugin must stay off nodes without EFA, or they never get Ready.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra import catalog, versions
from infra.components.cluster import ClusterCore
from infra.components.helm import release
from infra.k8s.labels import (
    GPU_TOLERATION,
    INSTANCE_TYPE_LABEL,
    NVIDIA_DEVICE_PLUGIN_NAMESPACE,
    instance_type_affinity,
)

GPU_TYPES = sorted(catalog.CATALOG)
EFA_TYPES = sorted(t.name for t in catalog.CATALOG.values() if t.efa)


@dataclass
class DevicePluginArgs:
    cluster: ClusterCore
    """The cluster the plugins are installed in (through its Kubernetes provider)."""


class NvidiaDevicePlugin(pulumi.ComponentResource):
    NAMESPACE = NVIDIA_DEVICE_PLUGIN_NAMESPACE

    def __init__(self, name: str, args: DevicePluginArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:addons:NvidiaDevicePlugin", name, None, opts)
        ns = k8s.core.v1.Namespace(
            f"{name}-ns",
            metadata={"name": self.NAMESPACE},
            opts=pulumi.ResourceOptions(parent=self, provider=args.cluster.provider),
        )
        values = {
            # EKS nodes carry no Node Feature Discovery labels: select on the GPU types instead.
            "affinity": instance_type_affinity(GPU_TYPES),
            "tolerations": [GPU_TOLERATION],
            "nfd": {"enabled": False},
            "gfd": {"enabled": False},
            "priorityClassName": "system-node-critical",
        }
        self.chart = release(
            self,
            f"{name}-chart",
            versions.NVIDIA_DEVICE_PLUGIN,
            self.NAMESPACE,
            values,
            args.cluster.provider,
            depends_on=[ns],
        )
        self.register_outputs({"chartVersion": versions.NVIDIA_DEVICE_PLUGIN.version})


class EfaDevicePlugin(pulumi.ComponentResource):
    NAMESPACE = "kube-system"

    def __init__(self, name: str, args: DevicePluginArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:addons:EfaDevicePlugin", name, None, opts)
        values = {
            # The chart builds the DaemonSet's node affinity from this key only (its `affinity`
            # value is never read; aws/eks-charts stable/aws-efa-k8s-device-plugin
            # templates/daemonset.yaml). Its own list names types this catalog runs without EFA.
            "supportedInstanceLabels": {"keys": [INSTANCE_TYPE_LABEL], "values": EFA_TYPES},
            "tolerations": [GPU_TOLERATION],
        }
        self.chart = release(
            self, f"{name}-chart", versions.EFA_DEVICE_PLUGIN, self.NAMESPACE, values, args.cluster.provider
        )
        self.register_outputs({"chartVersion": versions.EFA_DEVICE_PLUGIN.version})
