"""Fault tolerance of Ray's GCS: none, an external Redis, or a stack-created ElastiCache group."""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from infra.config.cluster import Environment
from serving.spec import SpecModel

if TYPE_CHECKING:
    from infra.config import StackConfig

# Ray's GCS Redis address (ray/_private/services.py get_address): host:port, redis://host:port,
# or rediss://host:port for TLS (what ElastiCache in-transit encryption needs). The shape is
# checked here; gcs_errors then requires TLS for an external Redis.
_REDIS_ADDRESS = re.compile(r"^(rediss?://)?[A-Za-z0-9.-]+:\d{1,5}$")
TLS_SCHEME = "rediss://"
# ElastiCache node types: cache.<family>.<size> (cache.t4g.medium, cache.m7g.large, ...).
_CACHE_NODE_TYPE = re.compile(r"^cache\.[a-z][a-z0-9-]*\.[0-9]*(micro|small|medium|large|xlarge)$")


class GcsFaultTolerance(str, Enum):
    DISABLED = "disabled"
    EXTERNAL_REDIS = "external-redis"  # the stack's gcsRedisAddress (rediss://) + gcsRedisPassword secret
    MANAGED = "managed"  # a stack-created ElastiCache (Valkey) group, TLS + AUTH (gcsRedis: its size)


class GcsRedis(SpecModel):
    """The ElastiCache (Valkey) replication group of `gcsFaultTolerance: managed`."""

    # The GCS keeps cluster metadata (nodes, actors, placement groups, jobs): megabytes.
    node_type: str = "cache.m7g.large"
    # Read replicas next to the primary (ElastiCache: 0-5 per shard). With one or more the
    # group fails over automatically and spreads over the zones (Multi-AZ).
    replicas: int = Field(default=1, ge=0, le=5)

    @field_validator("node_type")
    @classmethod
    def _node_type(cls, v: str) -> str:
        if not _CACHE_NODE_TYPE.match(v):
            raise ValueError(f"{v!r} is not an ElastiCache node type (cache.<family>.<size>, e.g. cache.m7g.large)")
        return v

    @property
    def nodes(self) -> int:
        return 1 + self.replicas

    @property
    def failover(self) -> bool:
        """Automatic failover and Multi-AZ: only with a replica to fail over to."""
        return self.replicas > 0


class GcsKeys(SpecModel):
    gcs_fault_tolerance: GcsFaultTolerance = GcsFaultTolerance.DISABLED
    gcs_redis_address: str | None = None
    # The managed group's size (gcsFaultTolerance managed only).
    gcs_redis: GcsRedis = Field(default_factory=GcsRedis)

    @field_validator("gcs_redis_address")
    @classmethod
    def _redis(cls, v: str | None) -> str | None:
        if v is not None and not _REDIS_ADDRESS.match(v):
            raise ValueError(f"{v!r} is not host:port, redis://host:port or rediss://host:port (TLS)")
        return v


def _unreachable(address: str, vpc_cidr: str) -> str:
    """Why an external Redis cannot serve a stack that creates its own VPC.

    An ElastiCache cache is reached from its own VPC, or from another one through VPC peering or
    a Transit Gateway, and only through a security group it admits (Amazon ElastiCache User
    Guide, "Access patterns for accessing an ElastiCache cache in an Amazon VPC"). A VPC the
    stack creates exists only once `pulumi up` runs: nothing peers it with the Redis's, and
    the system nodes carry no security group of that other VPC. `pulumi up` would succeed (the
    RayService is not awaited) and the head's GCS would crash-loop."""
    return (
        f"external-redis reaches {address}, outside the VPC this stack creates (vpcCidr {vpc_cidr}): nothing "
        "peers the two and the Ray head's nodes carry no security group the Redis admits, so the GCS could "
        "not connect; use existingVpc (the Redis's VPC, or one routed to it, whose Redis admits the VPC's "
        "nodes) or gcsFaultTolerance managed (a Redis the stack creates in its own VPC)"
    )


def gcs_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """Each GCS key only with the mode that uses it; an external Redis over TLS only (its AUTH
    secret: infra/config/secrets.py) and from a VPC that exists already (existingVpc); prod keeps
    a replica to fail over to.

    Ray's GCS keeps the cluster's control state in that Redis (nodes, actors, placement groups,
    jobs, the Serve controller's checkpoints): whoever can read or write it unencrypted or
    without AUTH can rewrite what the cluster runs. The managed group has both by construction
    (infra/components/gcs_redis.py); an external one must say so in its address."""
    errors = []
    mode = cfg.gcs_fault_tolerance
    if mode is GcsFaultTolerance.EXTERNAL_REDIS and not cfg.gcs_redis_address:
        errors.append(("gcsRedisAddress", "gcsFaultTolerance external-redis needs gcsRedisAddress"))
    address = cfg.gcs_redis_address
    if mode is GcsFaultTolerance.EXTERNAL_REDIS and address and not address.startswith(TLS_SCHEME):
        errors.append(
            (
                "gcsRedisAddress",
                f"{address!r} is a plaintext Redis: Ray's control state would cross the network unencrypted; "
                f"use {TLS_SCHEME}host:port (ElastiCache: in-transit encryption on, with an AUTH token in "
                "gcsRedisPassword)",
            )
        )
    if mode is GcsFaultTolerance.EXTERNAL_REDIS and address and cfg.existing_vpc is None:
        errors.append(("gcsFaultTolerance, vpcCidr", _unreachable(address, cfg.vpc_cidr)))
    if mode is not GcsFaultTolerance.EXTERNAL_REDIS and cfg.gcs_redis_address:
        errors.append(("gcsRedisAddress", f"only used with gcsFaultTolerance external-redis (not {mode.value})"))
    managed = mode is GcsFaultTolerance.MANAGED
    if not managed and "gcs_redis" in cfg.model_fields_set:
        errors.append(("gcsRedis", f"only used with gcsFaultTolerance managed (not {mode.value})"))
    if managed and cfg.environment is Environment.PROD and not cfg.gcs_redis.failover:
        errors.append(
            ("gcsRedis.replicas", "0 leaves the prod GCS on one Redis node with no failover; keep at least 1 replica")
        )
    return errors
