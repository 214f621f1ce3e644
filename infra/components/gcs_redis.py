"""GcsRedis: the Redis that makes the Ray GCS fault tolerant (`gcsFaultTolerance: managed`).

What flows through here: the VPC's private subnets and the stack's `gcsRedis` settings ->
- an ElastiCache replication group, engine Valkey (pinned in `infra.versions`), cluster
  mode disabled (KubeRay's GCS fault tolerance takes a single-shard Redis, one or more
  replicas: Ray docs, kuberay-gcs-ft.md), in a subnet group of the private subnets; TLS
  required in transit, encrypted at rest with its own KMS key; automatic failover and
  Multi-AZ when it has a replica;
- an AUTH token the stack generates (pulumi-random), a Pulumi secret that never leaves
  Pulumi's state except into the Kubernetes Secret the RayService reads;
- two security groups: the group's own, which admits TCP 6379 only from the second, the
  "GCS clients" group, which the Cluster puts on the system nodes: where the Ray head (the
  GCS) and KubeRay's Redis cleanup Job (built from the head's pod template) run. The pods
  use their node's security groups (no security groups for pods in this stack), so the
  node group is the narrowest place a security group can select the head; GPU worker nodes
  do not carry it (only the GCS talks to Redis).
Outputs: `address` (rediss://<primary endpoint>:6379, the form Ray needs for TLS,
ray/_private/services.py get_address), `password` (secret), `client_security_group_id`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_random as random

from infra import versions
from infra.config import GcsRedis as GcsRedisSettings

PORT = 6379
# ElastiCache's AUTH token: 16-128 printable characters; the API allows only !&#$^<>- as
# special characters, the AWS provider rejects @ " / (terraform-provider-aws, which pulumi-aws
# bridges: internal/service/elasticache, validReplicationGroupAuthToken). Letters and digits
# only: valid under both, and nothing to quote wherever the token lands (the Kubernetes
# Secret, KubeRay's `ray start --redis-password`). 64 of them are ~380 bits.
AUTH_TOKEN_LENGTH = 64


def replication_group_id(cluster_name: str) -> str:
    """`<cluster>-gcs` as ElastiCache allows it: 1-40 letters, digits and hyphens, starting
    with a letter, no "--", not ending in "-" (terraform-provider-aws replication_group.go,
    validateReplicationGroupID); lower case, as ElastiCache stores it."""
    rid = re.sub(r"[^a-z0-9-]", "-", f"{cluster_name}-gcs".lower())
    rid = re.sub(r"-{2,}", "-", rid)
    if not rid[0].isalpha():
        rid = "g" + rid
    return rid[:40].rstrip("-")


@dataclass
class GcsRedisArgs:
    cluster_name: str
    """EKS cluster name (`pd-inference-<stack>`): names the group and its subnet group."""
    vpc_id: pulumi.Input[str]
    """VPC of the security groups."""
    subnet_ids: pulumi.Input[list[str]]
    """The private subnets (one per zone): the group's nodes spread over them."""
    settings: GcsRedisSettings
    """Node type and replica count (stack key `gcsRedis`)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags for every AWS resource of the component."""


class GcsRedis(pulumi.ComponentResource):
    address: pulumi.Output[str]
    password: pulumi.Output[str]
    client_security_group_id: pulumi.Output[str]

    def __init__(self, name: str, args: GcsRedisArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:gcs:GcsRedis", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        group_id = replication_group_id(args.cluster_name)
        clients, redis_sg = create_security_groups(name, group_id, args.vpc_id, tags, child)
        group, token = create_replication_group(name, group_id, args, redis_sg, self)

        self.address = pulumi.Output.concat("rediss://", group.primary_endpoint_address, f":{PORT}")
        self.password = pulumi.Output.secret(token.result)
        self.client_security_group_id = clients.id
        self.register_outputs(
            {
                "address": self.address,
                "clientSecurityGroupId": self.client_security_group_id,
                "replicationGroupId": group.id,
            }
        )


def create_security_groups(
    name: str, group_id: str, vpc_id: pulumi.Input[str], tags: dict[str, str], opts: pulumi.ResourceOptions
) -> tuple[aws.ec2.SecurityGroup, aws.ec2.SecurityGroup]:
    """(GCS clients, Redis): the Redis group admits TCP 6379 from the clients group only, and
    the clients group may reach the Redis group on that port only."""
    clients = aws.ec2.SecurityGroup(
        f"{name}-clients-sg",
        description=f"GCS Redis clients ({group_id}): the system nodes of the Ray head",
        vpc_id=vpc_id,
        tags={**tags, "Name": f"{group_id}-clients"},
        opts=opts,
    )
    redis_sg = aws.ec2.SecurityGroup(
        f"{name}-sg",
        description=f"GCS Redis ({group_id}): TCP {PORT} from the GCS clients group only",
        vpc_id=vpc_id,
        tags={**tags, "Name": group_id},
        opts=opts,
    )
    aws.vpc.SecurityGroupIngressRule(
        f"{name}-in",
        security_group_id=redis_sg.id,
        description="Ray GCS (head) and KubeRay's Redis cleanup Job",
        ip_protocol="tcp",
        from_port=PORT,
        to_port=PORT,
        referenced_security_group_id=clients.id,
        opts=opts,
    )
    aws.vpc.SecurityGroupEgressRule(
        f"{name}-clients-out",
        security_group_id=clients.id,
        description="to the GCS Redis",
        ip_protocol="tcp",
        from_port=PORT,
        to_port=PORT,
        referenced_security_group_id=redis_sg.id,
        opts=opts,
    )
    return clients, redis_sg


def create_replication_group(
    name: str, group_id: str, args: GcsRedisArgs, redis_sg: aws.ec2.SecurityGroup, parent: pulumi.Resource
) -> tuple[aws.elasticache.ReplicationGroup, random.RandomPassword]:
    """The single-shard Valkey group in a subnet group of the private subnets: TLS required,
    encrypted at rest with its own KMS key, a generated AUTH token (returned: the password);
    failover and Multi-AZ when it has a replica."""
    child = pulumi.ResourceOptions(parent=parent)
    tags = dict(args.tags)
    subnets = aws.elasticache.SubnetGroup(
        f"{name}-subnets",
        name=group_id,
        description="Private subnets of the GCS Redis",
        subnet_ids=args.subnet_ids,
        tags=tags,
        opts=child,
    )
    key = aws.kms.Key(
        f"{name}-key",
        description=f"At-rest encryption of ElastiCache group {group_id}",
        enable_key_rotation=True,
        deletion_window_in_days=30,
        tags=tags,
        opts=child,
    )
    token = random.RandomPassword(
        f"{name}-auth",
        length=AUTH_TOKEN_LENGTH,
        special=False,
        # Three character types, as AWS recommends for AUTH tokens.
        min_upper=1,
        min_lower=1,
        min_numeric=1,
        opts=child,
    )
    s = args.settings
    group = aws.elasticache.ReplicationGroup(
        f"{name}-group",
        replication_group_id=group_id,
        description="Ray GCS fault tolerance (KubeRay gcsFaultToleranceOptions)",
        engine=versions.GCS_REDIS_ENGINE,
        engine_version=versions.GCS_REDIS_ENGINE_VERSION,
        node_type=s.node_type,
        # One shard (cluster mode disabled): a primary and its replicas.
        cluster_mode="disabled",
        num_cache_clusters=s.nodes,
        automatic_failover_enabled=s.failover,
        multi_az_enabled=s.failover,
        port=PORT,
        subnet_group_name=subnets.name,
        security_group_ids=[redis_sg.id],
        transit_encryption_enabled=True,
        transit_encryption_mode="required",
        at_rest_encryption_enabled=True,
        kms_key_id=key.arn,
        # Output.secret's generic parameter defeats mypy's inference (pulumi 3.272), as in llm_service.py.
        auth_token=pulumi.Output.secret(token.result),  # type: ignore[arg-type]
        tags=tags,
        opts=pulumi.ResourceOptions(parent=parent, additional_secret_outputs=["authToken"]),
    )
    return group, token
