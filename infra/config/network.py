"""The network: a new VPC (CIDR, zones, NAT) or an existing one, and the EFA pools' zone."""

from __future__ import annotations

import ipaddress
import re
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import Field, field_validator, model_validator

from infra.config.formats import cidr
from serving.spec import SpecModel

if TYPE_CHECKING:
    from infra.config import StackConfig

_AZ = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
_VPC_ID = re.compile(r"^vpc-[0-9a-f]{8,17}$")
_SUBNET_ID = re.compile(r"^subnet-[0-9a-f]{8,17}$")


class NatGateways(str, Enum):
    SINGLE = "single"  # one NAT gateway for all zones: cheaper, one zone's outage cuts egress
    PER_ZONE = "per-zone"


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


class NetworkKeys(SpecModel):
    """A new VPC unless existingVpc is given."""

    vpc_cidr: str = "10.0.0.0/16"
    availability_zones: list[str] = Field(min_length=2, max_length=6)
    efa_zone: str | None = None  # default: the first of availabilityZones
    existing_vpc: ExistingVpc | None = None
    nat_gateways: NatGateways = NatGateways.SINGLE

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_cidr(cls, v: str) -> str:
        v = cidr(v)
        net = ipaddress.ip_network(v)
        if net.version != 4 or not net.is_private or not 16 <= net.prefixlen <= 20:
            raise ValueError(f"{v!r} must be a private IPv4 range from /16 to /20")
        return v

    @field_validator("availability_zones")
    @classmethod
    def _azs(cls, v: list[str]) -> list[str]:
        for z in v:
            if not _AZ.match(z):
                raise ValueError(f"{z!r} is not an availability zone name (e.g. us-east-2a)")
        if len(set(v)) != len(v):
            raise ValueError("availability zones must not repeat")
        return v

    @property
    def efa_zone_name(self) -> str:
        return self.efa_zone or self.availability_zones[0]


def zone_errors(cfg: StackConfig, region: str | None) -> list[tuple[str, str]]:
    """The zones must be the stack region's, and the EFA zone one of them."""
    errors = []
    if region and any(not z.startswith(region) for z in cfg.availability_zones):
        errors.append(("availabilityZones", f"{cfg.availability_zones} are not all zones of aws:region {region!r}"))
    zone = cfg.efa_zone or cfg.availability_zones[0]
    if zone not in cfg.availability_zones:
        errors.append(("efaZone", f"{zone!r} is not one of availabilityZones {cfg.availability_zones}"))
    return errors
