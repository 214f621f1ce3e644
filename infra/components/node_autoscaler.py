"""NodeAutoscaler: the Cluster Autoscaler that adds and removes GPU nodes as Ray asks for them.

What flows through here: the cluster's core (`ClusterCore`: name, region, Kubernetes version,
provider, Pod Identity agent) and the GPU node pools -> an IAM role that only this autoscaler's service account may
assume (EKS Pod Identity), with a least-privilege policy (read the groups; change the desired
size of, and terminate instances in, only the Auto Scaling groups of those node groups) ->
the `cluster-autoscaler` Helm release (chart and image pinned in infra/versions.py)
on the system nodes, discovering exactly those node groups' Auto Scaling groups by their
`eks:nodegroup-name` tag. The chain it closes: Ray Serve asks for a replica -> the KubeRay
autoscaler adds a worker pod -> the pod is Pending -> this adds a node to the pod's pool (in
the pool's zone and placement group, with its EFA interfaces: the node group's launch
template) -> when the KubeRay autoscaler deletes an idle pod, the empty node goes away.
Its metrics (/metrics on the chart's Service, port `http`) are scraped through
`scrape_target`, which the composition root hands to the observability component.

Why Cluster Autoscaler and not Karpenter: docs/scaling.md. Scale from zero: the autoscaler
builds a template node from the instance type and, for EKS managed node groups, from the
group's labels, taints and tags (eks:DescribeNodegroup); the pools carry what it cannot infer
(infra/k8s/node_template.py: the GPU label, the EFA interfaces). Ray pods carry `safe-to-evict: "false"`, so this never
drains a node that still runs Ray work: the KubeRay autoscaler decides what goes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pulumi
import pulumi_aws as aws

from infra import versions
from infra.components.cluster import ClusterCore
from infra.components.helm import release
from infra.components.iam import trusted_by
from infra.k8s.labels import ROLE_LABEL, SYSTEM_ROLE
from infra.k8s.monitoring import ScrapeTarget, node_autoscaler_target

if TYPE_CHECKING:
    from infra.components.gpu_node_pool import GpuNodePool

NAMESPACE = "kube-system"
SERVICE_ACCOUNT = "cluster-autoscaler"
# The Helm release name, stated so that the ServiceMonitor can select the chart's Service by
# its `app.kubernetes.io/instance` label; and the cloud provider, which also names the chart's
# objects (`<cloudProvider>-cluster-autoscaler`).
RELEASE_NAME = "cluster-autoscaler"
CLOUD_PROVIDER = "aws"
# The tags EKS puts on every managed node group's Auto Scaling group.
ASG_NODEGROUP_TAG = "eks:nodegroup-name"
ASG_CLUSTER_TAG = "eks:cluster-name"

# Actions that take no resource-level permissions (AWS Service Authorization Reference,
# Amazon EC2 Auto Scaling and Amazon EC2): "Resource": "*" is the only form they accept.
DESCRIBE_ACTIONS = (
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeAutoScalingInstances",
    "autoscaling:DescribeLaunchConfigurations",
    "autoscaling:DescribeScalingActivities",
    "ec2:DescribeImages",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeLaunchTemplateVersions",
    "ec2:GetInstanceTypesFromInstanceRequirements",
)
SCALE_ACTIONS = ("autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup")


def autoscaler_policy(cluster_name: str, node_group_names: list[str]) -> dict:
    """The autoscaler's IAM policy: read everything it must, change only these node groups."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "Describe", "Effect": "Allow", "Action": list(DESCRIBE_ACTIONS), "Resource": "*"},
            {
                "Sid": "NodeGroupTemplates",
                "Effect": "Allow",
                "Action": ["eks:DescribeNodegroup"],
                "Resource": [f"arn:aws:eks:*:*:nodegroup/{cluster_name}/{ng}/*" for ng in node_group_names],
            },
            {
                "Sid": "ScaleGpuPools",
                "Effect": "Allow",
                "Action": list(SCALE_ACTIONS),
                "Resource": "*",
                "Condition": {
                    "StringEquals": {
                        f"autoscaling:ResourceTag/{ASG_CLUSTER_TAG}": cluster_name,
                        f"autoscaling:ResourceTag/{ASG_NODEGROUP_TAG}": list(node_group_names),
                    }
                },
            },
        ],
    }


def chart_values(cluster_name: str, region: str, kubernetes_version: str, node_group_names: list[str]) -> dict:
    """Helm values: discover exactly the GPU node groups, run on the system nodes, hardened."""
    # The chart renders its own discovery flag from autoDiscovery.tags (all tags ANDed); one
    # flag per node group is what selects these groups and no other (the system group stays
    # at the size Pulumi gives it).
    first, *rest = node_group_names
    return {
        "cloudProvider": CLOUD_PROVIDER,
        "awsRegion": region,
        "autoDiscovery": {"clusterName": cluster_name, "tags": [f"{ASG_NODEGROUP_TAG}={first}"]},
        "customArgs": [f"--node-group-auto-discovery=asg:tag={ASG_NODEGROUP_TAG}={ng}" for ng in rest],
        "image": {
            "repository": versions.CLUSTER_AUTOSCALER_IMAGE,
            "tag": versions.cluster_autoscaler_tag(kubernetes_version),
        },
        "extraArgs": {
            # The pools differ (prefill vs decode): never trade one for the other.
            "expander": "least-waste",
            "balance-similar-node-groups": "false",
            # A p5 takes minutes to join and load a model: keep a new node that long.
            "max-node-provision-time": "25m0s",
            "scale-down-unneeded-time": "10m0s",
            "scale-down-delay-after-add": "10m0s",
            "skip-nodes-with-system-pods": "true",
        },
        "rbac": {"serviceAccount": {"create": True, "name": SERVICE_ACCOUNT}},
        "nodeSelector": {ROLE_LABEL: SYSTEM_ROLE},
        "priorityClassName": "system-cluster-critical",
        "resources": {"requests": {"cpu": "100m", "memory": "300Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65534,
            "runAsGroup": 65534,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containerSecurityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


@dataclass
class NodeAutoscalerArgs:
    cluster: ClusterCore
    """The cluster: its name (its node groups' Auto Scaling groups carry it as
    `eks:cluster-name`), region (where the autoscaler calls the EC2, Auto Scaling and EKS
    APIs), version (picks the autoscaler release line, `infra/versions.py`), Kubernetes
    provider, Pod Identity agent (it serves the autoscaler's credentials, which the webhook
    wires in only at pod admission, with the association created here first) and tags."""
    pools: Sequence[GpuNodePool]
    """The GPU node pools it may scale, and nothing else (their Auto Scaling groups must exist
    to be discovered, so the release comes after them)."""


class NodeAutoscaler(pulumi.ComponentResource):
    role_arn: pulumi.Output[str]
    scrape_target: ScrapeTarget

    def __init__(self, name: str, args: NodeAutoscalerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:nodes:NodeAutoscaler", name, None, opts)
        if not args.pools:
            raise ValueError("NodeAutoscaler needs at least one node group to scale")
        cluster = args.cluster
        # The cluster's and the node groups' names as outputs of them: the policy, the
        # association and the chart values below come after the cluster and the groups.
        names = pulumi.Output.all(cluster.name, *(p.node_group_name for p in args.pools))
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(
            f"{name}-role",
            assume_role_policy=trusted_by("pods.eks.amazonaws.com", ("sts:AssumeRole", "sts:TagSession")),
            tags=cluster.tags,
            opts=child,
        )
        policy = aws.iam.RolePolicy(
            f"{name}-policy",
            role=role.id,
            policy=names.apply(lambda n: json.dumps(autoscaler_policy(n[0], list(n[1:])))),
            opts=child,
        )
        identity = aws.eks.PodIdentityAssociation(
            f"{name}-identity",
            cluster_name=cluster.name,
            namespace=NAMESPACE,
            service_account=SERVICE_ACCOUNT,
            role_arn=role.arn,
            tags=cluster.tags,
            opts=child,
        )
        values = names.apply(lambda n: chart_values(n[0], cluster.region, cluster.kubernetes_version, list(n[1:])))
        release(
            self,
            f"{name}-chart",
            versions.CLUSTER_AUTOSCALER,
            NAMESPACE,
            values,
            cluster.provider,
            # Credentials are wired in at pod admission: the association, its policy and the
            # agent that serves them exist first.
            depends_on=[identity, policy, *args.pools, cluster.pod_identity_agent],
            release_name=RELEASE_NAME,
        )
        self.role_arn = role.arn
        self.scrape_target = node_autoscaler_target(NAMESPACE, RELEASE_NAME, CLOUD_PROVIDER)
        self.register_outputs({"roleArn": self.role_arn, "chartVersion": versions.CLUSTER_AUTOSCALER.version})
