"""Cluster: the EKS control plane, its KMS key, the node IAM role, the CPU system node group
and the `kubernetes.Provider` every in-cluster resource uses.

What flows through here: the network's VPC and subnets and the stack's cluster settings
(version, endpoint access, admin roles) -> an `eks.Cluster` with API authentication and
access entries, all control-plane logs, envelope encryption of Secrets with a rotating KMS
key, the core add-ons plus the Pod Identity agent, an OIDC provider -> `core` (a
`ClusterCore`: what every component built on the cluster reads from it, as pulumi-eks hands
its node groups a `Cluster | CoreData`) and the outputs the stack exports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks
import pulumi_kubernetes as k8s

from infra.components.iam import trusted_by
from infra.components.launch_templates import IMDSV2, encrypted_root_volume
from infra.components.outputs import output_of
from infra.config import EndpointAccess, SystemNodes
from infra.k8s.labels import ROLE_LABEL, SYSTEM_ROLE

LOG_TYPES = ["api", "audit", "authenticator", "controllerManager", "scheduler"]
ADMIN_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
# Read-only (get/list/watch) on the cluster: enough for a `pulumi preview` of the Kubernetes
# resources; the kubernetes provider falls back to a client-side diff where its server-side
# dry-run needs `patch` (pulumi/pulumi-kubernetes#2419).
VIEW_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSViewPolicy"
NODE_POLICIES = {
    "worker": "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy",
    "cni": "arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy",
    "ecr": "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryPullOnly",
    "ssm": "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore",
}


@dataclass(frozen=True)
class ClusterCore:
    """The cluster as the components built on it see it (`Cluster.core`): a GPU node pool, an
    add-on or the LLM service takes this one object instead of a dozen of its fields, and
    parents its own resources under itself."""

    name: pulumi.Output[str]
    """EKS cluster name, as an output of the cluster: node group names, Pod Identity
    associations, add-ons, IAM policies and chart values take it through `apply`/`Output.all`,
    so each is created after the cluster (a copied `str` would carry no dependency)."""
    eks: eks.Cluster
    """The pulumi-eks cluster a managed node group joins."""
    provider: k8s.Provider
    """The Kubernetes provider every in-cluster resource goes through."""
    node_role: aws.iam.Role
    """The IAM role every node group's instances run as (system and GPU)."""
    cluster_security_group_id: pulumi.Output[str]
    """The EKS-managed cluster security group (node <-> control plane, node <-> node): what a
    launch template that names security groups must name too."""
    pod_identity_agent: aws.eks.Addon
    """The EKS Pod Identity agent: pods whose credentials it serves are created after it."""
    kubernetes_version: str
    """EKS control-plane version, e.g. "1.35"."""
    ami_release_version: str
    """The pinned EKS AMI release (`amiReleaseVersion`) of every node group."""
    vpc_id: pulumi.Input[str]
    """VPC of the cluster and its nodes."""
    vpc_cidr: str
    """The VPC's range (the nodes' addresses)."""
    private_subnet_ids: pulumi.Input[list[str]]
    """The private subnets: the control plane's ENIs and the nodes of multi-zone pools."""
    efa_subnet_id: pulumi.Input[str]
    """The private subnet in the EFA zone: EFA and Capacity Block pools live in this one."""
    efa_zone: str
    """Availability zone of that subnet (and so of the EFA placement groups)."""
    region: str
    """The stack's AWS region (aws:region), where add-ons call the AWS APIs."""
    tags: dict[str, str]
    """The stack's tags, for every AWS resource built on the cluster."""


@dataclass
class ClusterArgs:
    cluster_name: str
    """EKS cluster name (`pd-inference-<stack>`); also names the node groups and roles."""
    kubernetes_version: str
    """EKS control-plane version, e.g. "1.35"."""
    vpc_id: pulumi.Input[str]
    """VPC of the cluster and its nodes."""
    vpc_cidr: str
    """The VPC's range (passed on in `core`)."""
    private_subnet_ids: pulumi.Input[list[str]]
    """Subnets of the control-plane ENIs and the system nodes."""
    public_subnet_ids: pulumi.Input[list[str]]
    """Public subnets (tagged for internet-facing load balancers only)."""
    efa_subnet_id: pulumi.Input[str]
    """The private subnet in the EFA zone (passed on in `core` to the GPU node pools)."""
    efa_zone: str
    """Availability zone of that subnet."""
    region: str
    """The stack's AWS region (passed on in `core`)."""
    ami_release_version: str
    """EKS AMI release (`amiReleaseVersion`) of the system node group (and, through `core`, of
    the GPU pools)."""
    endpoint_access: EndpointAccess
    """Private only, or public and private with `public_access_cidrs`."""
    public_access_cidrs: list[str]
    """CIDRs allowed to a public API endpoint."""
    admin_role_arns: list[str]
    """IAM roles given cluster-admin access entries."""
    system_nodes: SystemNodes
    """The CPU node group of the Ray head and the operators."""
    view_role_arns: list[str] = field(default_factory=list)
    """IAM roles given read-only access entries (AmazonEKSViewPolicy), e.g. the CI preview role."""
    system_security_group_ids: list[pulumi.Input[str]] = field(default_factory=list)
    """Security groups the system nodes carry besides the EKS cluster security group (e.g. the
    GCS Redis clients group: the Ray head runs there). Non-empty: a launch template of ours."""
    deletion_protection: bool = False
    """EKS deletion protection (on for prod)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags for every AWS resource of the component."""


class Cluster(pulumi.ComponentResource):
    core: ClusterCore
    cluster_name: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    oidc_issuer: pulumi.Output[str]
    system_node_group_name: pulumi.Output[str]

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:cluster:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        key = _secrets_key(name, args, child)
        node_role = _node_role(name, args, child)
        control_plane = _control_plane(name, args, key, child)
        # The name as an output of the cluster: what takes it is created after the cluster.
        self.cluster_name = output_of(control_plane, args.cluster_name)
        # Pod Identity: how the Ray pods get their S3 role without node-wide credentials.
        # Pods whose credentials come from it wait for it (LlmService, NodeAutoscaler).
        pod_identity_agent = aws.eks.Addon(
            f"{name}-pod-identity-agent",
            cluster_name=self.cluster_name,
            addon_name="eks-pod-identity-agent",
            opts=child,
        )
        # The EKS-managed cluster security group: what managed nodes get when EKS builds their
        # launch template, so every template of ours names it too.
        cluster_sg = aws.eks.get_cluster_output(
            name=self.cluster_name, opts=pulumi.InvokeOutputOptions(depends_on=[control_plane])
        ).vpc_config.cluster_security_group_id
        template = _system_template(name, args, cluster_sg, child)
        system = _system_node_group(name, args, control_plane, node_role, template, child)
        self.system_node_group_name = output_of(system, f"{args.cluster_name}-system")

        self.kubeconfig = pulumi.Output.secret(control_plane.kubeconfig_json)
        self.oidc_issuer = control_plane.oidc_issuer
        provider = k8s.Provider(
            f"{name}-k8s",
            kubeconfig=self.kubeconfig,
            enable_server_side_apply=True,
            opts=child,
        )
        self.core = ClusterCore(
            name=self.cluster_name,
            eks=control_plane,
            provider=provider,
            node_role=node_role,
            cluster_security_group_id=cluster_sg,
            pod_identity_agent=pod_identity_agent,
            kubernetes_version=args.kubernetes_version,
            ami_release_version=args.ami_release_version,
            vpc_id=args.vpc_id,
            vpc_cidr=args.vpc_cidr,
            private_subnet_ids=args.private_subnet_ids,
            efa_subnet_id=args.efa_subnet_id,
            efa_zone=args.efa_zone,
            region=args.region,
            tags=dict(args.tags),
        )
        self.register_outputs(
            {
                "clusterName": self.cluster_name,
                "kubeconfig": self.kubeconfig,
                "oidcIssuer": self.oidc_issuer,
                "systemNodeGroupName": self.system_node_group_name,
            }
        )


def _system_template(
    name: str, args: ClusterArgs, cluster_sg: pulumi.Input[str], child: pulumi.ResourceOptions
) -> aws.eks.NodeGroupLaunchTemplateArgs:
    """The system nodes' launch template: an encrypted gp3 root volume sized for the ray-llm
    image (EKS's default is 20 GiB, encrypted only if the account says so), the extra security
    groups, IMDSv2, no image and no user data (EKS still picks the AMI from amiType and
    releaseVersion and bootstraps).

    A template that names security groups replaces the ones EKS would attach, so the EKS
    cluster security group (node <-> control plane, node <-> node) is named here too, as EKS's
    own template would have it (EKS user guide, "Customizing managed nodes with launch
    templates": security groups)."""
    lt = aws.ec2.LaunchTemplate(
        f"{name}-system-lt",
        description=f"System nodes of {args.cluster_name}: EKS cluster SG + {len(args.system_security_group_ids)} more",
        vpc_security_group_ids=[cluster_sg, *args.system_security_group_ids],
        metadata_options=IMDSV2,
        block_device_mappings=[encrypted_root_volume(args.system_nodes.root_volume_gib)],
        tags=dict(args.tags),
        opts=child,
    )
    return aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str))


def _secrets_key(name: str, args: ClusterArgs, child: pulumi.ResourceOptions) -> aws.kms.Key:
    """The rotating KMS key (and its alias) that envelope-encrypts the cluster's Secrets."""
    key = aws.kms.Key(
        f"{name}-secrets-key",
        description=f"Envelope encryption of Kubernetes Secrets in EKS cluster {args.cluster_name}",
        enable_key_rotation=True,
        deletion_window_in_days=30,
        tags=dict(args.tags),
        opts=child,
    )
    aws.kms.Alias(
        f"{name}-secrets-key-alias", name=f"alias/{args.cluster_name}-secrets", target_key_id=key.key_id, opts=child
    )
    return key


def _node_role(name: str, args: ClusterArgs, child: pulumi.ResourceOptions) -> aws.iam.Role:
    """The IAM role every node group's instances run as, with EKS's node policies."""
    role = aws.iam.Role(
        f"{name}-node-role",
        assume_role_policy=trusted_by("ec2.amazonaws.com"),
        tags=dict(args.tags),
        opts=child,
    )
    for suffix, arn in NODE_POLICIES.items():
        aws.iam.RolePolicyAttachment(f"{name}-node-{suffix}", role=role.name, policy_arn=arn, opts=child)
    return role


def _access_entries(args: ClusterArgs) -> dict[str, eks.AccessEntryArgs]:
    """Cluster-admin entries for `admin_role_arns`, read-only ones for `view_role_arns`."""

    def entry(arn: str, policy_name: str, policy_arn: str) -> eks.AccessEntryArgs:
        return eks.AccessEntryArgs(
            principal_arn=arn,
            access_policies={
                policy_name: eks.AccessPolicyAssociationArgs(
                    policy_arn=policy_arn,
                    access_scope=aws.eks.AccessPolicyAssociationAccessScopeArgs(type="cluster"),
                )
            },
        )

    admins = {f"admin-{i}": entry(arn, "cluster-admin", ADMIN_POLICY) for i, arn in enumerate(args.admin_role_arns)}
    viewers = {f"view-{i}": entry(arn, "view", VIEW_POLICY) for i, arn in enumerate(args.view_role_arns)}
    return admins | viewers


def _control_plane(name: str, args: ClusterArgs, key: aws.kms.Key, child: pulumi.ResourceOptions) -> eks.Cluster:
    """The EKS control plane: endpoint access, API authentication with access entries, all
    control-plane logs, Secrets encrypted with `key`, an OIDC provider and the core add-ons."""
    public = args.endpoint_access is EndpointAccess.PUBLIC_AND_PRIVATE
    return eks.Cluster(
        f"{name}-eks",
        name=args.cluster_name,
        version=args.kubernetes_version,
        vpc_id=args.vpc_id,
        private_subnet_ids=args.private_subnet_ids,
        public_subnet_ids=args.public_subnet_ids,
        node_associate_public_ip_address=False,
        endpoint_private_access=True,
        endpoint_public_access=public,
        public_access_cidrs=args.public_access_cidrs if public else None,
        authentication_mode=eks.AuthenticationMode.API,
        access_entries=_access_entries(args),
        enabled_cluster_log_types=LOG_TYPES,
        encryption_config_key_arn=key.arn,
        create_oidc_provider=True,
        skip_default_node_group=True,
        coredns_addon_options=eks.CoreDnsAddonOptionsArgs(enabled=True),
        kube_proxy_addon_options=eks.KubeProxyAddonOptionsArgs(enabled=True),
        # The VPC CNI enforces NetworkPolicy (the LLM namespace has one).
        vpc_cni_options=eks.VpcCniOptionsArgs(enable_network_policy=True),
        deletion_protection=args.deletion_protection,
        tags=dict(args.tags),
        opts=child,
    )


def _system_node_group(
    name: str,
    args: ClusterArgs,
    cluster: eks.Cluster,
    node_role: aws.iam.Role,
    launch_template: aws.eks.NodeGroupLaunchTemplateArgs,
    child: pulumi.ResourceOptions,
) -> eks.ManagedNodeGroup:
    """The CPU node group of the Ray head, the operators and the other system pods."""
    system = args.system_nodes
    return eks.ManagedNodeGroup(
        f"{name}-system",
        cluster=cluster,
        node_role=node_role,
        node_group_name=f"{args.cluster_name}-system",
        instance_types=[system.instance_type],
        ami_type="AL2023_x86_64_STANDARD",
        # EKS-managed AMI (no custom user data): pinned by release, rolled only when it changes.
        release_version=args.ami_release_version,
        capacity_type="ON_DEMAND",
        subnet_ids=args.private_subnet_ids,
        scaling_config=aws.eks.NodeGroupScalingConfigArgs(
            min_size=system.min_size, desired_size=system.desired_size, max_size=system.max_size
        ),
        labels={ROLE_LABEL: SYSTEM_ROLE},
        tags=dict(args.tags),
        opts=child,
        launch_template=launch_template,
    )
