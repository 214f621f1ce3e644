"""The stack config: one typed, validated model of a `stacks/Pulumi.<env>.yaml` file.

What flows through here: `__main__.py` (or `tools.render`, reading the same file) hands
`load()` the stack's raw config values (bare keys, project namespace stripped) and the set of
keys that are Pulumi secrets; `load()` returns a `StackConfig` or raises `ConfigError` with
one line naming the stack file and the key. Nothing is registered before this succeeds.

Defaults live here and nowhere else (Pulumi.yaml's declarations are checked against them by
the tests). Secret values never enter the model: it records only which secrets are present;
`__main__.py` passes the secret Outputs to the components.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Collection, Mapping
from enum import Enum
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from infra.k8s import labels
from infra.model import catalog, sizing, versions, vllm_options
from infra.model.ami_check import ami_driver_errors
from infra.model.fit import fit_errors
from infra.model.scale_to_zero import scale_to_zero_errors
from serving.spec import AuthMode, KvBackend, Mode, ServingSpec, SpecModel, check_order

PROJECT = "pd-inference"

# Config keys that must be Pulumi secrets (`pulumi config set --secret`).
SECRET_KEYS = ("hfToken", "apiKeys", "gcsRedisPassword", "fallbackApiKey")

_ARN_ROLE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
_AZ = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
_VPC_ID = re.compile(r"^vpc-[0-9a-f]{8,17}$")
_SUBNET_ID = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{17}$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# registry/name:tag, registry/name@sha256:<digest>, or both (the tag documents, the digest pins).
_IMAGE = re.compile(
    r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+((:[A-Za-z0-9._-]{1,128})?@sha256:[0-9a-f]{64}|:[A-Za-z0-9._-]{1,128})$"
)
_HOST_PORT = re.compile(r"^[A-Za-z0-9.-]+:\d{1,5}$")
# Ray's GCS Redis address (ray/_private/services.py get_address): host:port, redis://host:port,
# or rediss://host:port for TLS (what ElastiCache in-transit encryption needs).
_REDIS_ADDRESS = re.compile(r"^(rediss?://)?[A-Za-z0-9.-]+:\d{1,5}$")
# An EC2 instance type: family letters, generation digit(s), optional attribute letters and
# "-suffix" (p6-b200, u7i-12tb), then a size (large, 48xlarge, metal, metal-48xl, ...).
_INSTANCE_TYPE = re.compile(
    r"^[a-z]+[0-9]+[a-z]*(-[a-z0-9]+)?\.(nano|micro|small|medium|large|[0-9]{0,3}xlarge|metal(-[0-9]+xl)?)$"
)
# An EKS-optimized AMI release version as EKS and awslabs/amazon-eks-ami name it: <k8s>.<patch>-<date>.
_AMI_RELEASE = re.compile(r"^(1\.\d{1,2})\.\d{1,3}-(\d{8})$")
# Documentation-only ranges (RFC 5737, RFC 3849): no real client ever comes from them.
_DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]

# Optional string keys that Pulumi.yaml declares with `default: ""` (Pulumi refuses a stack that
# lacks a declared key without a default): the empty string means "not set".
EMPTY_MEANS_UNSET = ("efaZone", "gcsRedisAddress", "modelBucket")


def instance_type_format(v: str) -> str:
    """Refuse what is not shaped like an EC2 instance type (p5.48xl, m7i.huge) before AWS does."""
    if not _INSTANCE_TYPE.match(v):
        raise ValueError(f"{v!r} is not an EC2 instance type (family+generation.size, e.g. m7i.2xlarge, p5.48xlarge)")
    return v


# Joins the cross-field errors inside one pydantic ValueError; `_one_line` splits them again.
_CROSS_SEP = " @@ "


class ConfigError(Exception):
    """A stack file is wrong; the message is one line naming the file and the key.

    `missing_secrets`: the secrets among the problems that the config needs and the file lacks
    (offline tools may stand in for them and check again).
    """

    def __init__(self, message: str, missing_secrets: tuple[str, ...] = ()):
        super().__init__(message)
        self.missing_secrets = missing_secrets


def missing_secret(key: str, why: str, example: str) -> tuple[str, str]:
    """The cross-field error for a secret the stack needs but does not hold: names the command."""
    return key, f"{why} but no {key} secret is set (pulumi config set --secret {key} {example})"


_MISSING_SECRET = re.compile(r"but no (\w+) secret is set \(pulumi config set --secret")


class Environment(str, Enum):
    DEV = "dev"
    STAGING = "staging"
    PROD = "prod"


class EndpointAccess(str, Enum):
    PRIVATE = "private"
    PUBLIC_AND_PRIVATE = "public-and-private"


class CapacityType(str, Enum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"
    CAPACITY_BLOCK = "capacity-block"


class LocalStorage(str, Enum):
    # The instance-store NVMe drives striped into one RAID0 volume (kubelet and container
    # storage, so the model cache and images land on NVMe), or left alone.
    RAID0 = "raid0"
    NONE = "none"


class NatGateways(str, Enum):
    SINGLE = "single"  # one NAT gateway for all zones: cheaper, one zone's outage cuts egress
    PER_ZONE = "per-zone"


class ServiceExposure(str, Enum):
    CLUSTER_IP = "cluster-ip"
    INTERNAL_NLB = "internal-nlb"


class UpgradeStrategy(str, Enum):
    # KubeRay RayService spec.upgradeStrategy.type
    NEW_CLUSTER = "NewCluster"
    NONE = "None"


class ImageBuild(str, Enum):
    """What the Ray pods run. AUTO: the EFA worker image (images/ray-llm-efa, FROM rayImage,
    built and pushed by the stack) when the engine pools have EFA, rayImage as is otherwise.
    EFA_USERSPACE: always build it. NONE: run rayImage as is (a prebuilt image that already
    carries the EFA userspace, e.g. an AWS Deep Learning Container)."""

    AUTO = "auto"
    EFA_USERSPACE = "efa-userspace"
    NONE = "none"


class GcsFaultTolerance(str, Enum):
    DISABLED = "disabled"
    EXTERNAL_REDIS = "external-redis"  # the stack's gcsRedisAddress (+ gcsRedisPassword secret)
    MANAGED = "managed"  # a stack-created ElastiCache (Valkey) group, TLS + AUTH (gcsRedis: its size)


# ElastiCache node types: cache.<family>.<size> (cache.t4g.medium, cache.m7g.large, ...).
_CACHE_NODE_TYPE = re.compile(r"^cache\.[a-z][a-z0-9-]*\.[0-9]*(micro|small|medium|large|xlarge)$")


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


class MetricsStack(str, Enum):
    # Prometheus Operator, Prometheus, Alertmanager and Grafana in the cluster (default).
    KUBE_PROMETHEUS_STACK = "kube-prometheus-stack"
    # The same in-cluster Prometheus (scrapes, rules, Alertmanager) remote-writing to an Amazon
    # Managed Service for Prometheus workspace; dashboards go to your Amazon Managed Grafana.
    AMAZON_MANAGED_PROMETHEUS = "amazon-managed-prometheus"


class Observability(SpecModel):
    """The metrics pipeline: where metrics go, how long they stay, how big the volume is."""

    stack: MetricsStack = MetricsStack.KUBE_PROMETHEUS_STACK
    retention_days: int = Field(default=15, ge=1, le=365)
    storage_gib: int = Field(default=100, ge=20, le=16384, alias="storageGiB")
    scrape_interval_seconds: int = Field(default=30, ge=5, le=300)
    pending_alert_minutes: int = Field(default=15, ge=1, le=240)

    @property
    def retention_size_gb(self) -> int:
        # Prometheus deletes the oldest blocks past this size; the rest of the volume holds
        # the WAL and compaction's scratch space (Prometheus storage docs).
        return int(self.storage_gib * 2**30 * 0.8 / 1e9)


def _cidr(v: str) -> str:
    try:
        net = ipaddress.ip_network(v, strict=True)
    except ValueError as e:
        raise ValueError(f"{v!r} is not a valid CIDR ({e})") from None
    return str(net)


class ExistingVpc(SpecModel):
    vpc_id: str
    private_subnet_ids: list[str] = Field(min_length=2)
    public_subnet_ids: list[str] = Field(default_factory=list)
    # The private subnet in efaZone that the EFA node groups use.
    efa_subnet_id: str

    @field_validator("vpc_id")
    @classmethod
    def _vpc(cls, v: str) -> str:
        if not _VPC_ID.match(v):
            raise ValueError(f"{v!r} is not a VPC id (vpc-...)")
        return v

    @field_validator("private_subnet_ids", "public_subnet_ids")
    @classmethod
    def _subnets(cls, v: list[str]) -> list[str]:
        for s in v:
            if not _SUBNET_ID.match(s):
                raise ValueError(f"{s!r} is not a subnet id (subnet-...)")
        return v

    @model_validator(mode="after")
    def _efa_subnet(self) -> ExistingVpc:
        if not _SUBNET_ID.match(self.efa_subnet_id):
            raise ValueError(f"efaSubnetId {self.efa_subnet_id!r} is not a subnet id (subnet-...)")
        if self.efa_subnet_id not in self.private_subnet_ids:
            raise ValueError("efaSubnetId must be one of privateSubnetIds")
        return self


class SystemNodes(SpecModel):
    """The CPU node group for the Ray head, the operators and other system pods."""

    instance_type: str = "m7i.2xlarge"
    min_size: int = Field(default=2, ge=1)
    desired_size: int = Field(default=2, ge=1)
    max_size: int = Field(default=4, ge=1)
    # The Ray head runs the ray-llm image (tens of GB unpacked) beside the operators and
    # Prometheus's images; EKS's default root volume is 20 GiB. Encrypted gp3 (cluster.py).
    root_volume_gib: int = Field(default=100, ge=40, le=16384, alias="rootVolumeGiB")

    @field_validator("instance_type")
    @classmethod
    def _cpu(cls, v: str) -> str:
        if v in catalog.CATALOG:
            raise ValueError(f"{v!r} is a GPU type; system nodes are CPU nodes")
        return instance_type_format(v)

    @model_validator(mode="after")
    def _sizes(self) -> SystemNodes:
        check_order(("minSize", self.min_size), ("desiredSize", self.desired_size), ("maxSize", self.max_size))
        return self


class NodePool(SpecModel):
    instance_type: str
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    capacity_reservation_id: str | None = None
    min_size: int = Field(default=1, ge=0)
    desired_size: int = Field(default=1, ge=0)
    # Room for the second Ray cluster of a NewCluster upgrade (one replica running, one starting).
    max_size: int = Field(default=2, ge=1)
    root_volume_gib: int = Field(default=200, ge=50, le=16384, alias="rootVolumeGiB")
    local_storage: LocalStorage = LocalStorage.RAID0

    @field_validator("instance_type")
    @classmethod
    def _known(cls, v: str) -> str:
        # The catalog's types are well-formed (a test checks them against the format).
        try:
            catalog.lookup(v)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        return v

    @model_validator(mode="after")
    def _check(self) -> NodePool:
        check_order(("minSize", self.min_size), ("desiredSize", self.desired_size), ("maxSize", self.max_size))
        if self.capacity_type is CapacityType.CAPACITY_BLOCK:
            if not self.capacity_reservation_id:
                raise ValueError("capacityType capacity-block needs capacityReservationId (cr-...)")
            if not _CAPACITY_RESERVATION.match(self.capacity_reservation_id):
                raise ValueError(
                    f"capacityReservationId {self.capacity_reservation_id!r} is not a reservation id (cr-...)"
                )
        elif self.capacity_reservation_id is not None:
            raise ValueError("capacityReservationId is only used with capacityType capacity-block")
        return self

    @property
    def instance(self) -> catalog.InstanceType:
        return catalog.lookup(self.instance_type)


class NodePools(SpecModel):
    prefill: NodePool
    decode: NodePool


class StackConfig(SpecModel):
    """Every key of a stack file's `pd-inference:` namespace."""

    environment: Environment
    kubernetes_version: str = versions.DEFAULT_KUBERNETES_VERSION
    # The EKS-optimized AMI release of every node group (e.g. "1.35.6-20260714"), pinned here
    # so that a new AMI release reaches the nodes only through a reviewed change of this key.
    ami_release_version: str
    # Network: a new VPC unless existingVpc is given.
    vpc_cidr: str = "10.0.0.0/16"
    availability_zones: list[str] = Field(min_length=2, max_length=6)
    efa_zone: str | None = None  # default: the first of availabilityZones
    existing_vpc: ExistingVpc | None = None
    nat_gateways: NatGateways = NatGateways.SINGLE
    # Cluster
    endpoint_access: EndpointAccess = EndpointAccess.PRIVATE
    public_access_cidrs: list[str] = Field(default_factory=list)
    admin_role_arns: list[str] = Field(default_factory=list)
    # Read-only cluster access (AmazonEKSViewPolicy), e.g. the CI preview role.
    view_role_arns: list[str] = Field(default_factory=list)
    system_nodes: SystemNodes = Field(default_factory=SystemNodes)
    node_pools: NodePools
    # The LLM service
    namespace: str = "llm"
    ray_image: str = versions.RAY_IMAGE
    image_build: ImageBuild = ImageBuild.AUTO
    service_exposure: ServiceExposure = ServiceExposure.CLUSTER_IP
    service_allowed_cidrs: list[str] = Field(default_factory=list)
    upgrade_strategy: UpgradeStrategy = UpgradeStrategy.NEW_CLUSTER
    gcs_fault_tolerance: GcsFaultTolerance = GcsFaultTolerance.DISABLED
    gcs_redis_address: str | None = None
    # The managed group's size (gcsFaultTolerance managed only).
    gcs_redis: GcsRedis = Field(default_factory=GcsRedis)
    model_bucket: str | None = None
    serving: ServingSpec
    # Metrics, dashboards and alerts
    observability: Observability = Field(default_factory=Observability)

    @field_validator("kubernetes_version")
    @classmethod
    def _k8s(cls, v: str) -> str:
        m = re.fullmatch(r"1\.(\d{1,2})", v)
        lo, hi = versions.MIN_KUBERNETES_VERSION, versions.MAX_KUBERNETES_VERSION
        if not m or not (lo <= (1, int(m.group(1))) <= hi):
            raise ValueError(
                f"{v!r} is not a supported Kubernetes version (1.{lo[1]} to 1.{hi[1]}, e.g. "
                f"{versions.DEFAULT_KUBERNETES_VERSION!r})"
            )
        return v

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_cidr(cls, v: str) -> str:
        v = _cidr(v)
        net = ipaddress.ip_network(v)
        if net.version != 4 or not net.is_private or not 16 <= net.prefixlen <= 20:
            raise ValueError(f"{v!r} must be a private IPv4 range from /16 to /20")
        return v

    @field_validator("public_access_cidrs", "service_allowed_cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        out = [_cidr(c) for c in v]
        for c in out:
            net = ipaddress.ip_network(c)
            if net.prefixlen == 0:
                raise ValueError(f"{c!r} opens the endpoint to the whole internet; list your networks")
            # Two halves (0.0.0.0/1 + 128.0.0.0/1) are the whole internet too: cap the width.
            widest = 8 if net.version == 4 else 32
            if net.prefixlen < widest:
                raise ValueError(f"{c!r} is wider than a /{widest}; list your networks")
            if any(net.version == d.version and net.subnet_of(d) for d in _DOC_NETS):  # type: ignore[arg-type]
                raise ValueError(f"{c!r} is a documentation-only range (RFC 5737/3849); list your real networks")
        return out

    @field_validator("availability_zones")
    @classmethod
    def _azs(cls, v: list[str]) -> list[str]:
        for z in v:
            if not _AZ.match(z):
                raise ValueError(f"{z!r} is not an availability zone name (e.g. us-east-2a)")
        if len(set(v)) != len(v):
            raise ValueError("availability zones must not repeat")
        return v

    @field_validator("admin_role_arns", "view_role_arns")
    @classmethod
    def _arns(cls, v: list[str]) -> list[str]:
        for a in v:
            if not _ARN_ROLE.match(a):
                raise ValueError(f"{a!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")
        return v

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str) -> str:
        # kuberay-system and nvidia-device-plugin are created by the stack's add-ons themselves.
        if not _DNS_LABEL.match(v) or v.startswith("kube-") or v in labels.RESERVED_NAMESPACES:
            raise ValueError(
                f"{v!r} is not a usable namespace name (a DNS label, not default, kube-* or an add-on's namespace)"
            )
        return v

    @field_validator("ray_image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not _IMAGE.match(v):
            raise ValueError(f"{v!r} is not a pinned image reference (registry/name:tag or @sha256:...)")
        if "@" in v:
            return v  # a digest pins the content whatever the tag says
        tag = v.rsplit(":", 1)[-1]
        if tag in {"latest", "nightly"} or tag.startswith("nightly"):
            raise ValueError(f"{v!r} uses a floating tag; pin a release tag or a digest")
        return v

    @field_validator("model_bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        if v is not None and not _BUCKET.match(v):
            raise ValueError(f"{v!r} is not an S3 bucket name")
        return v

    @field_validator("gcs_redis_address")
    @classmethod
    def _redis(cls, v: str | None) -> str | None:
        if v is not None and not _REDIS_ADDRESS.match(v):
            raise ValueError(f"{v!r} is not host:port, redis://host:port or rediss://host:port (TLS)")
        return v

    @field_validator("ami_release_version")
    @classmethod
    def _ami_release(cls, v: str) -> str:
        if not _AMI_RELEASE.match(v):
            raise ValueError(
                f"{v!r} is not an EKS AMI release version (<k8s>.<patch>-<YYYYMMDD>, e.g. "
                f"{versions.AMI_RELEASE_VERSION!r}; see awslabs/amazon-eks-ami releases)"
            )
        return v

    @model_validator(mode="after")
    def _cross(self, info: ValidationInfo) -> StackConfig:
        """Checks that span several keys; every failing one is reported, the first one first."""
        ctx = info.context or {}
        errors = [
            *self._zone_errors(ctx.get("region")),
            *self._access_errors(),
            # Which secrets the stack holds comes from load(), never from the file's values.
            *self._secret_errors(ctx.get("secrets_present", frozenset())),
            *self._model_source_errors(),
            *scale_to_zero_errors(self.environment.value, self.serving),
            *self._pool_errors(),
            *self._kv_transfer_errors(),
            *self._vllm_option_errors(),
            *self._image_errors(),
            *ami_driver_errors(self.ami_release_version, {r: p.instance for r, p in self.node_pools}),
            # Does the model fit its pools' GPUs (weights, one maxModelLen sequence of KV cache)?
            *fit_errors(self.serving, {role: pool.instance for role, pool in self._engine_pools().items()}),
        ]
        if errors:
            raise ValueError(_CROSS_SEP.join(f"@{key}@ {msg}" for key, msg in errors))
        return self

    def _engine_pools(self) -> dict[str, NodePool]:
        pools = {"prefill": self.node_pools.prefill, "decode": self.node_pools.decode}
        return {role: pools[role] for role in self.serving.engine_roles()}

    def _zone_errors(self, region: str | None) -> list[tuple[str, str]]:
        errors = []
        if region and any(not z.startswith(region) for z in self.availability_zones):
            errors.append(
                ("availabilityZones", f"{self.availability_zones} are not all zones of aws:region {region!r}")
            )
        zone = self.efa_zone or self.availability_zones[0]
        if zone not in self.availability_zones:
            errors.append(("efaZone", f"{zone!r} is not one of availabilityZones {self.availability_zones}"))
        m = _AMI_RELEASE.match(self.ami_release_version)
        if m and m.group(1) != self.kubernetes_version:
            errors.append(
                (
                    "amiReleaseVersion",
                    f"{self.ami_release_version!r} is an AMI release for Kubernetes {m.group(1)}, "
                    f"not kubernetesVersion {self.kubernetes_version!r}",
                )
            )
        return errors

    def _access_errors(self) -> list[tuple[str, str]]:
        errors = []
        if self.endpoint_access is EndpointAccess.PUBLIC_AND_PRIVATE and not self.public_access_cidrs:
            errors.append(("publicAccessCidrs", "a public endpoint needs a CIDR allow-list"))
        if self.environment is Environment.PROD and self.endpoint_access is not EndpointAccess.PRIVATE:
            errors.append(("endpointAccess", "prod clusters keep a private API endpoint"))
        if self.service_exposure is ServiceExposure.INTERNAL_NLB and not self.service_allowed_cidrs:
            errors.append(("serviceAllowedCidrs", "an internal NLB needs the client CIDRs allowed to reach it"))
        if self.gcs_fault_tolerance is GcsFaultTolerance.EXTERNAL_REDIS and not self.gcs_redis_address:
            errors.append(("gcsRedisAddress", "gcsFaultTolerance external-redis needs gcsRedisAddress"))
        if self.gcs_fault_tolerance is not GcsFaultTolerance.EXTERNAL_REDIS and self.gcs_redis_address:
            errors.append(
                (
                    "gcsRedisAddress",
                    f"only used with gcsFaultTolerance external-redis (not {self.gcs_fault_tolerance.value})",
                )
            )
        managed = self.gcs_fault_tolerance is GcsFaultTolerance.MANAGED
        if not managed and "gcs_redis" in self.model_fields_set:
            errors.append(
                ("gcsRedis", f"only used with gcsFaultTolerance managed (not {self.gcs_fault_tolerance.value})")
            )
        if managed and self.environment is Environment.PROD and not self.gcs_redis.failover:
            errors.append(
                (
                    "gcsRedis.replicas",
                    "0 leaves the prod GCS on one Redis node with no failover; keep at least 1 replica",
                )
            )
        return errors

    def _secret_errors(self, secrets_present: Collection[str]) -> list[tuple[str, str]]:
        errors = []
        if self.serving.auth is AuthMode.API_KEY and "apiKeys" not in secrets_present:
            errors.append(missing_secret("apiKeys", "serving.auth is api-key", "<key1,key2>"))
        if self.gcs_fault_tolerance is GcsFaultTolerance.MANAGED and "gcsRedisPassword" in secrets_present:
            # The stack generates the managed group's AUTH token itself (random.RandomPassword).
            errors.append(
                (
                    "gcsRedisPassword",
                    "only used with gcsFaultTolerance external-redis: managed generates its own AUTH token "
                    "(pulumi config rm gcsRedisPassword)",
                )
            )
        if self.serving.auth is AuthMode.DISABLED and self.environment is not Environment.DEV:
            errors.append(("serving.auth", "API-key authentication can only be disabled in dev"))
        fallback = self.serving.fallback
        if fallback is not None and "fallbackApiKey" not in secrets_present:
            errors.append(
                (
                    "fallbackApiKey",
                    "serving.fallback is set but no fallbackApiKey secret is set "
                    "(pulumi config set --secret fallbackApiKey <the provider's key>)",
                )
            )
        if fallback is not None and fallback.plain_http and self.environment is not Environment.DEV:
            errors.append(
                (
                    "serving.fallback.baseUrl",
                    f"{fallback.base_url!r} is plain http: requests and the provider key would cross the "
                    "internet unencrypted; use https:// (http is allowed only in dev)",
                )
            )
        return errors

    def _model_source_errors(self) -> list[tuple[str, str]]:
        errors = []
        src = self.serving.model.source
        if src.startswith("/"):
            errors.append(
                (
                    "serving.model.source",
                    f"{src!r} is a local path; a stack needs a Hugging Face repo id or s3:// prefix",
                )
            )
        if src.startswith("s3://") and self.model_bucket != src[5:].split("/", 1)[0]:
            errors.append(
                ("modelBucket", f"must name the bucket of serving.model.source ({src!r}) so the pods may read it")
            )
        return errors

    def _pool_errors(self) -> list[tuple[str, str]]:
        errors = []
        for role, pool in self._engine_pools().items():
            spec = self.serving.engine_roles()[role]
            inst = pool.instance
            need = spec.gpus_per_replica
            key = f"serving.{role}"
            if need > inst.gpus and need % inst.gpus:
                errors.append(
                    (
                        f"{key}.tensorParallelSize",
                        f"TP x PP = {need} GPUs neither fits one {inst.name} ({inst.gpus} GPUs) nor spans whole nodes",
                    )
                )
            elif need > inst.gpus and spec.tensor_parallel_size > inst.gpus:
                errors.append(
                    (
                        f"{key}.tensorParallelSize",
                        f"tensorParallelSize {spec.tensor_parallel_size} is larger than one {inst.name} "
                        f"({inst.gpus} GPUs); span nodes with pipelineParallelSize instead",
                    )
                )
            elif need < inst.gpus and inst.gpus % need:
                errors.append(
                    (
                        f"{key}.tensorParallelSize",
                        f"TP x PP = {need} does not divide the {inst.gpus} GPUs of {inst.name}",
                    )
                )
            if sizing.nodes_for(spec.max_replicas, need, inst.gpus) > pool.max_size:
                errors.append(
                    (
                        f"nodePools.{role}.maxSize",
                        f"{pool.max_size} nodes cannot hold serving.{role}.maxReplicas={spec.max_replicas} "
                        f"({sizing.nodes_per_replica(need, inst.gpus)} node(s) per replica on {inst.name})",
                    )
                )
            else:
                peak = sizing.upgrade_peak_nodes(
                    self.upgrade_strategy.value,
                    spec.min_replicas,
                    spec.max_replicas,
                    spec.initial_replicas,
                    need,
                    inst.gpus,
                )
                if peak > pool.max_size:
                    # kuberay#1476: a NewCluster upgrade without room stays Pending forever.
                    errors.append(
                        (
                            f"nodePools.{role}.maxSize",
                            f"{pool.max_size} nodes leave no room for a {self.upgrade_strategy.value} upgrade: the "
                            f"running cluster at serving.{role}.maxReplicas={spec.max_replicas} plus the new cluster's "
                            f"starting replicas need {peak} nodes (raise maxSize to {peak}, lower "
                            f"serving.{role}.maxReplicas, or set upgradeStrategy: None)",
                        )
                    )
        if self.serving.mode is Mode.DISAGGREGATED:
            p, d = self.node_pools.prefill.instance, self.node_pools.decode.instance
            if p.efa != d.efa:
                errors.append(
                    ("nodePools", "prefill and decode pools must both have EFA or neither (KV transfer path)")
                )
        return errors

    def _kv_transfer_errors(self) -> list[tuple[str, str]]:
        """The NIXL backend must be the one the pools' fabric calls for (the catalog's)."""
        if self.serving.mode is not Mode.DISAGGREGATED:
            return []
        kv = self.serving.kv_transfer
        asked = kv.requested_backend
        key = (
            "serving.kvTransfer.backend"
            if kv.backend is not KvBackend.AUTO
            else "serving.kvTransfer.extraConfig.backends"
        )
        errors = []
        for role, pool in self._engine_pools().items():
            inst = pool.instance
            if asked is None or asked is inst.nixl_backend:
                continue
            if inst.efa:
                why = (
                    f"{asked.value} on the EFA pool {role} ({inst.name}) gets no RDMA and falls back to TCP "
                    f"without a word (ai-dynamo/nixl#909); EFA pools use {inst.nixl_backend.value} (leave it auto)"
                )
            else:
                why = (
                    f"{asked.value} needs EFA, which the {role} pool ({inst.name}) does not have; "
                    f"use {inst.nixl_backend.value} (leave it auto)"
                )
            errors.append((key, why))
            break
        return errors

    def _image_errors(self) -> list[tuple[str, str]]:
        efa = any(pool.instance.efa for pool in self._engine_pools().values())
        stock = self.ray_image.split("@")[0].rsplit(":", 1)[0] == versions.RAY_IMAGE.rsplit(":", 1)[0]
        if efa and self.image_build is ImageBuild.NONE and stock:
            return [
                (
                    "imageBuild",
                    f"none runs {self.ray_image} as is, which has no EFA userspace: NIXL's LIBFABRIC plugin "
                    "cannot load libfabric.so.1 (leave imageBuild auto, or set rayImage to an image with the "
                    "AWS EFA installer, e.g. a Deep Learning Container)",
                )
            ]
        return []

    @property
    def builds_worker_image(self) -> bool:
        """Whether the stack builds the EFA worker image (images/ray-llm-efa) FROM rayImage."""
        if self.image_build is ImageBuild.AUTO:
            return any(pool.instance.efa for pool in self._engine_pools().values())
        return self.image_build is ImageBuild.EFA_USERSPACE

    def _vllm_option_errors(self) -> list[tuple[str, str]]:
        """engineKwargs must exist in the vLLM the Ray image carries (vllm_options.IMAGE_VLLM_VERSION)."""
        bad = vllm_options.engine_kwarg_problems(self.serving.engine_kwargs, vllm_options.IMAGE_VLLM_VERSION)
        return [("serving.engineKwargs", bad[0] + " (the version the Ray image carries)")] if bad else []

    @property
    def efa_zone_name(self) -> str:
        return self.efa_zone or self.availability_zones[0]


# --- loading ---------------------------------------------------------------------------
_JSON_KEYS = {
    "observability",
    "availabilityZones",
    "existingVpc",
    "publicAccessCidrs",
    "adminRoleArns",
    "viewRoleArns",
    "systemNodes",
    "nodePools",
    "serviceAllowedCidrs",
    "serving",
    "gcsRedis",
}


def _decode(key: str, raw: Any) -> Any:
    """Pulumi hands structured config to programs as JSON text; decode it."""
    if key in _JSON_KEYS and isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # let the model say what type it wanted
    return raw


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif parts:
            parts.append(f".{p}")
        else:
            parts.append(str(p))
    return "".join(parts)


def _one_line(source: str, err: ValidationError) -> str:
    e = err.errors(include_url=False)[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if msg.startswith("@"):  # cross-field checks name their own keys; all of them, on one line
        found = [re.match(r"^@([^@]+)@ (.*)$", part, flags=re.S) for part in msg.split(_CROSS_SEP)]
        first, *more = [(m.group(1), m.group(2)) for m in found if m]
        line = f"{source}: {first[0]}: {first[1]}"
        if more:
            line += f" (and {len(more)} more: " + "; ".join(f"{k}: {v}" for k, v in more) + ")"
        return line
    key = _loc(loc) or "(top level)"
    if e["type"] == "extra_forbidden":
        return f"{source}: {key}: unknown key (check the spelling against docs/configuration.md)"
    if e["type"] == "missing":
        return f"{source}: {key}: required key is missing"
    if e["type"] == "enum":
        return f"{source}: {key}: {e['input']!r} is not allowed ({msg.replace('Input should be ', 'expected ')})"
    if "input" in e and not isinstance(e["input"], (dict, list)) and repr(e["input"]) not in msg:
        return f"{source}: {key}: {e['input']!r}: {msg}"
    return f"{source}: {key}: {msg}"


def load(
    values: Mapping[str, Any],
    *,
    secret_keys: Collection[str] = (),
    source: str,
    region: str | None = None,
) -> StackConfig:
    """Validate a stack's config (bare keys) into a StackConfig, or raise a one-line ConfigError.

    `region` (the stack's `aws:region`, when known) lets the zones be checked against it.
    """
    secrets_present = set()
    data: dict[str, Any] = {}
    for key, raw in values.items():
        if key in SECRET_KEYS:
            if raw in (None, ""):
                continue  # absent; the checks below say whether the stack needs it
            if key not in secret_keys:
                raise ConfigError(f"{source}: {key}: must be stored as a secret (pulumi config set --secret {key} ...)")
            secrets_present.add(key)
            continue
        if key in EMPTY_MEANS_UNSET and raw == "":
            continue  # Pulumi.yaml's `default: ""`: not set
        data[key] = _decode(key, raw)
    try:
        return StackConfig.model_validate(
            data, context={"secrets_present": frozenset(secrets_present), "region": region}
        )
    except ValidationError as err:
        line = _one_line(source, err)
        parts = str(err.errors(include_url=False)[0]["msg"]).split(_CROSS_SEP)
        missing = tuple(m.group(1) for m in map(_MISSING_SECRET.search, parts) if m)
        raise ConfigError(line, missing) from None
