"""GpuNodePool: one EKS managed node group of GPU instances for one named pool (`nodePools.<name>`).

What flows through here: a pool's config (instance type, capacity type, sizes, storage), the
catalog entry of its type and the cluster's core (`ClusterCore`: node role, cluster security
group, subnets, AMI release, tags) -> an `eks.ManagedNodeGroup` on the AL2023 NVIDIA AMI, tainted
`nvidia.com/gpu=true:NoSchedule` and labelled with the pool's name (the role label) so only
the Ray worker group of that pool lands there. One-model stacks name their pools after the
engine roles (`prefill`, `decode`); with `serving.models` several models' roles share pools.

Every pool gets a launch template this component builds itself: an encrypted gp3 root volume,
IMDSv2 with a hop limit of 1 (infra/components/launch_templates.py: pods cannot reach the
instance metadata service, so not the node role), and the node user data (the RAID0
NodeConfig; on EFA types the containerd memlock drop-in). EFA types add every EFA interface of
the type (card 0 "efa", the rest "efa-only") and an EFA security group that allows all traffic
to and from itself; on-demand and spot EFA pools get a cluster placement group (the pool's one
subnet puts it in the EFA zone); a Capacity Block already carries its placement and is
targeted instead. pulumi-eks's own templates are not used (pulumi/pulumi-eks
nodejs/eks/nodes/nodegroup.ts, createMNGCustomLaunchTemplate): the one behind
`enableEfaSupport` sets only the root volume's size, never `encrypted`, and the one behind
`enableIMDSv2` hard-codes `httpPutResponseHopLimit: 2`.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks

from infra import catalog
from infra.components.cluster import ClusterCore
from infra.components.launch_templates import IMDSV2, encrypted_root_volume
from infra.components.outputs import output_of
from infra.config import CapacityType, NodePool
from infra.k8s.labels import GPU_TAINT_KEY, GPU_TAINT_VALUE, ROLE_LABEL
from infra.k8s.node_template import gpu_node_labels, scale_from_zero_tags

# The EKS API spells the effect NO_SCHEDULE (Kubernetes: NoSchedule).
GPU_TAINT = {"key": GPU_TAINT_KEY, "value": GPU_TAINT_VALUE, "effect": "NO_SCHEDULE"}
AMI_TYPE = "AL2023_x86_64_NVIDIA"
_CAPACITY = {
    CapacityType.ON_DEMAND: "ON_DEMAND",
    CapacityType.SPOT: "SPOT",
    CapacityType.CAPACITY_BLOCK: "CAPACITY_BLOCK",
}

# nodeadm stripes the instance-store NVMe drives into one RAID0 array and puts the kubelet
# and containerd state on it, so model downloads and images land on local NVMe.
RAID0_NODECONFIG = """apiVersion: node.eks.aws/v1alpha1
kind: NodeConfig
spec:
  instance:
    localStorage:
      strategy: RAID0
"""

# EFA registers (pins) memory, which counts against RLIMIT_MEMLOCK unless the process has
# CAP_IPC_LOCK, which the non-root Ray containers lack. On the AL2023 AMIs a container's
# rlimits come from containerd's base runtime spec, which sets only RLIMIT_NOFILE
# (awslabs/amazon-eks-ami nodeadm/internal/containerd/base-runtime-spec.json), so the
# memlock limit is inherited from containerd: systemd's default unless containerd.service
# raises it. This drop-in does, before nodeadm starts containerd: cloud-init runs user-data
# scripts in cloud-final, and nodeadm-run.service (which restarts containerd) runs
# After=cloud-final.service (templates/al2023/runtime/rootfs/etc/systemd/system/). nodeadm
# restarts containerd through systemd's D-Bus API without a daemon-reload, so the script
# reloads. (nodeadm's `containerd.baseRuntimeSpec` cannot say "unlimited": it merges the spec
# through JSON into map[string]interface{}, where RLIM_INFINITY, 2^64-1, does not survive
# float64; nodeadm/internal/util/merge.go.)
CONTAINERD_MEMLOCK_DROP_IN = "/etc/systemd/system/containerd.service.d/90-memlock.conf"
MEMLOCK_SCRIPT = f"""#!/bin/bash
set -euo pipefail
mkdir -p {CONTAINERD_MEMLOCK_DROP_IN.rsplit("/", 1)[0]}
cat > {CONTAINERD_MEMLOCK_DROP_IN} <<'EOF'
[Service]
LimitMEMLOCK=infinity
EOF
systemctl daemon-reload
"""


@dataclass
class GpuNodePoolArgs:
    role: str
    """The pool's name (`nodePools` key): its node label and names (`prefill`, `decode`, ...)."""
    pool: NodePool
    """The pool's validated config: instance type, capacity type, sizes, storage."""
    cluster: ClusterCore
    """The cluster the managed node group joins: its node role, cluster security group,
    private subnets (the EFA zone's one for EFA and Capacity Block pools), VPC, pinned AMI
    release and tags."""


def efa_network_interfaces(instance: catalog.InstanceType, security_groups: Sequence[pulumi.Input[str]]) -> list:
    """All EFA interfaces of the type: card 0 is EFA with ENA, every other card EFA-only."""
    return [
        aws.ec2.LaunchTemplateNetworkInterfaceArgs(
            network_card_index=i,
            device_index=0 if i == 0 else 1,
            interface_type="efa" if i == 0 else "efa-only",
            security_groups=security_groups,
            delete_on_termination="true",
        )
        for i in range(instance.efa_interfaces)
    ]


def mime_user_data(parts: Sequence[tuple[str, str]]) -> str | None:
    """Base64 MIME multi-part user data of (content type, body) parts; None without parts.

    EKS merges a launch template's MIME user data with its own nodeadm bootstrap when the
    template names no image (the node group's amiType and releaseVersion pick it)."""
    if not parts:
        return None
    body = 'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="BOUNDARY"\n\n'
    for content_type, text in parts:
        body += f"--BOUNDARY\nContent-Type: {content_type}\n\n{text}\n"
    body += "--BOUNDARY--\n"
    return base64.b64encode(body.encode()).decode()


def node_user_data_parts(raid: bool, efa: bool) -> list[tuple[str, str]]:
    """The user-data parts of a node from this component's launch template: the RAID0
    NodeConfig (instance-store NVMe), the containerd memlock drop-in (EFA)."""
    parts = []
    if raid:
        parts.append(("application/node.eks.aws", RAID0_NODECONFIG))
    if efa:
        parts.append(("text/x-shellscript", MEMLOCK_SCRIPT))
    return parts


def node_group_name(cluster_name: str, role: str) -> str:
    """The EKS node group of a role's pool (the node autoscaler discovers it by this name)."""
    return f"{cluster_name}-{role}"


class GpuNodePool(pulumi.ComponentResource):
    node_group_name: pulumi.Output[str]
    """The EKS node group's name, as an output of the node group (the node autoscaler's IAM
    policy and discovery flags take it, and so come after the group)."""
    labels: dict[str, str]
    instance: catalog.InstanceType

    def __init__(self, name: str, args: GpuNodePoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:nodes:GpuNodePool", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        pool, inst, cluster = args.pool, args.pool.instance, args.cluster
        self.instance = inst
        # The role (what the engine pods select) and the GPU label the Cluster Autoscaler
        # needs to wait for the device plugin instead of adding another node.
        self.labels = {ROLE_LABEL: args.role, **gpu_node_labels(inst)}
        group_name = cluster.name.apply(lambda cluster_name: node_group_name(cluster_name, args.role))
        raid = pool.raid0
        common: dict[str, Any] = dict(
            cluster=cluster.eks,
            node_role=cluster.node_role,
            node_group_name=group_name,
            instance_types=[inst.name],
            capacity_type=_CAPACITY[pool.capacity_type],
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                min_size=pool.min_size, desired_size=pool.desired_size, max_size=pool.max_size
            ),
            labels=self.labels,
            taints=[aws.eks.NodeGroupTaintArgs(**GPU_TAINT)],
            # The Cluster Autoscaler owns desiredSize once the pool exists; Pulumi keeps min/max.
            ignore_scaling_changes=True,
            # What a node of an empty pool would offer, for the autoscaler's scale from zero.
            tags={**cluster.tags, ROLE_LABEL: args.role, **scale_from_zero_tags(inst)},
        )

        # Our own launch template for every pool (module docstring). The AMI is pinned by the
        # stack's amiReleaseVersion: the template names no image, so EKS picks it from amiType
        # and the node group's releaseVersion.
        lt = self._launch_template(name, args, raid, child)
        one_zone = pool.capacity_type is CapacityType.CAPACITY_BLOCK or inst.efa
        group = eks.ManagedNodeGroup(
            f"{name}-ng",
            # One subnet for EFA (its traffic stays in one zone) and Capacity Blocks (they live
            # in one); every private subnet otherwise.
            subnet_ids=[cluster.efa_subnet_id] if one_zone else cluster.private_subnet_ids,
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str)),
            ami_type=AMI_TYPE,
            gpu=True,
            release_version=cluster.ami_release_version,
            opts=child,
            **common,
        )

        self.node_group_name = output_of(group, group_name)
        self.register_outputs({"nodeGroupName": self.node_group_name, "instanceType": inst.name})

    def _launch_template(
        self, name: str, args: GpuNodePoolArgs, raid: bool, child: pulumi.ResourceOptions
    ) -> aws.ec2.LaunchTemplate:
        """The pool's launch template (see the module docstring)."""
        pool, inst, cluster = args.pool, args.pool.instance, args.cluster
        block = pool.capacity_type is CapacityType.CAPACITY_BLOCK
        # The EKS-managed cluster security group: what MNG nodes get when EKS builds the template.
        sg_ids: list[pulumi.Input[str]] = [cluster.cluster_security_group_id]
        if inst.efa:
            efa_sg = aws.ec2.SecurityGroup(
                f"{name}-efa-sg",
                description="EFA: all traffic to and from members of this group only",
                vpc_id=cluster.vpc_id,
                tags=cluster.tags,
                opts=child,
            )
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-efa-in",
                security_group_id=efa_sg.id,
                ip_protocol="-1",
                referenced_security_group_id=efa_sg.id,
                opts=child,
            )
            aws.vpc.SecurityGroupEgressRule(
                f"{name}-efa-out",
                security_group_id=efa_sg.id,
                ip_protocol="-1",
                referenced_security_group_id=efa_sg.id,
                opts=child,
            )
            sg_ids.append(efa_sg.id)
            interfaces = efa_network_interfaces(inst, sg_ids)
        else:
            interfaces = [
                aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                    device_index=0, security_groups=sg_ids, delete_on_termination="true"
                )
            ]
        placement = None
        if inst.efa and not block:
            # EFA wants the nodes close together: a cluster placement group. Its zone is the
            # one of the pool's only subnet (the EFA zone).
            group = aws.ec2.PlacementGroup(f"{name}-pg", strategy="cluster", tags=cluster.tags, opts=child)
            placement = aws.ec2.LaunchTemplatePlacementArgs(group_name=group.name)
        market: dict[str, Any] = {}
        if block:
            market = dict(
                instance_market_options=aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(market_type="capacity-block"),
                capacity_reservation_specification=aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
                    capacity_reservation_target=aws.ec2.LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs(
                        capacity_reservation_id=pool.capacity_reservation_id
                    )
                ),
            )
        where = f"capacity block {pool.capacity_reservation_id}" if block else f"EFA, {cluster.efa_zone}"
        return aws.ec2.LaunchTemplate(
            f"{name}-lt",
            description=f"{args.role} GPU nodes ({inst.name}, {where})",
            network_interfaces=interfaces,
            placement=placement,
            metadata_options=IMDSV2,
            **market,
            block_device_mappings=[encrypted_root_volume(pool.root_volume_gib)],
            user_data=mime_user_data(node_user_data_parts(raid, inst.efa)),
            tag_specifications=[
                aws.ec2.LaunchTemplateTagSpecificationArgs(
                    resource_type="instance", tags={**cluster.tags, ROLE_LABEL: args.role}
                )
            ],
            tags=cluster.tags,
            opts=child,
        )
