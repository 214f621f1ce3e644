"""The EKS cluster: environment, Kubernetes and AMI versions, and who reaches the API endpoint."""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from infra import versions
from infra.config.formats import allow_list
from serving.spec import SpecModel

if TYPE_CHECKING:
    from infra.config import StackConfig

_ARN_ROLE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
# An EKS-optimized AMI release version as EKS and awslabs/amazon-eks-ami name it: <k8s>.<patch>-<date>.
_AMI_RELEASE = re.compile(r"^(1\.\d{1,2})\.\d{1,3}-(\d{8})$")


class Environment(str, Enum):
    DEV = "dev"
    STAGING = "staging"
    PROD = "prod"


class EndpointAccess(str, Enum):
    PRIVATE = "private"
    PUBLIC_AND_PRIVATE = "public-and-private"


class ClusterKeys(SpecModel):
    """The environment and the versions every node runs."""

    environment: Environment
    kubernetes_version: str = versions.DEFAULT_KUBERNETES_VERSION
    # The EKS-optimized AMI release of every node group (e.g. "1.35.6-20260714"), pinned here
    # so that a new AMI release reaches the nodes only through a reviewed change of this key.
    ami_release_version: str

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

    @field_validator("ami_release_version")
    @classmethod
    def _ami_release(cls, v: str) -> str:
        if not _AMI_RELEASE.match(v):
            raise ValueError(
                f"{v!r} is not an EKS AMI release version (<k8s>.<patch>-<YYYYMMDD>, e.g. "
                f"{versions.AMI_RELEASE_VERSION!r}; see awslabs/amazon-eks-ami releases)"
            )
        return v


class AccessKeys(SpecModel):
    """The API endpoint and the IAM roles given access to the cluster."""

    endpoint_access: EndpointAccess = EndpointAccess.PRIVATE
    public_access_cidrs: list[str] = Field(default_factory=list)
    admin_role_arns: list[str] = Field(default_factory=list)
    # Read-only cluster access (AmazonEKSViewPolicy), e.g. the CI preview role.
    view_role_arns: list[str] = Field(default_factory=list)

    @field_validator("public_access_cidrs")
    @classmethod
    def _public_cidrs(cls, v: list[str]) -> list[str]:
        return allow_list(v)

    @field_validator("admin_role_arns", "view_role_arns")
    @classmethod
    def _arns(cls, v: list[str]) -> list[str]:
        for a in v:
            if not _ARN_ROLE.match(a):
                raise ValueError(f"{a!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")
        return v


def ami_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """The AMI release must be one for the cluster's Kubernetes version."""
    m = _AMI_RELEASE.match(cfg.ami_release_version)
    if m and m.group(1) != cfg.kubernetes_version:
        return [
            (
                "amiReleaseVersion",
                f"{cfg.ami_release_version!r} is an AMI release for Kubernetes {m.group(1)}, "
                f"not kubernetesVersion {cfg.kubernetes_version!r}",
            )
        ]
    return []


def access_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    errors = []
    if cfg.endpoint_access is EndpointAccess.PUBLIC_AND_PRIVATE and not cfg.public_access_cidrs:
        errors.append(("publicAccessCidrs", "a public endpoint needs a CIDR allow-list"))
    if cfg.environment is Environment.PROD and cfg.endpoint_access is not EndpointAccess.PRIVATE:
        errors.append(("endpointAccess", "prod clusters keep a private API endpoint"))
    return errors
