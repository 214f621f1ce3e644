"""The EKS control plane: who can reach its API, how it keeps Secrets, what it logs.

What flows through here: pulumi-eks's `Cluster` (its camelCase inputs) or an `aws.eks.Cluster`
-> the API endpoint's public flag and allow-list (with each provider's default), the KMS key
for Secrets, the enabled log types -> `eks-endpoint-allow-list`, `eks-secrets-encryption`,
`eks-control-plane-logging` (mandatory) and `eks-endpoint-private` (advisory).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .inputs import AWS_EKS_CLUSTER, EKS_CLUSTER, Context, as_list, dig, known
from .network import open_cidr

# The EKS control-plane logs that must be on: who called the API, what they did, how they authenticated.
REQUIRED_LOG_TYPES = ("api", "audit", "authenticator")


def _endpoint(type_: str, props: dict[str, Any]) -> tuple[Any, Any] | None:
    """(public?, allow-list) of a cluster's API endpoint, with the providers' defaults applied."""
    if type_ == EKS_CLUSTER:
        public = props.get("endpointPublicAccess", True)  # pulumi-eks default: public
        cidrs = props.get("publicAccessCidrs")
    elif type_ == AWS_EKS_CLUSTER:
        public = dig(props, "vpcConfig", "endpointPublicAccess", default=True)  # EKS default: public
        cidrs = dig(props, "vpcConfig", "publicAccessCidrs")
    else:
        return None
    return public, cidrs


def check_endpoint_allow_list(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    endpoint = _endpoint(type_, props)
    if endpoint is None:
        return
    public, cidrs = endpoint
    if public is not True or not known(cidrs):
        return
    if not cidrs:
        yield (
            "the EKS API endpoint is public with no CIDR allow-list (the default is 0.0.0.0/0): keep it private "
            "(stack key endpointAccess: private) or list your networks in publicAccessCidrs"
        )
        return
    for c in as_list(cidrs):
        if open_cidr(c):
            yield (
                f"the EKS API endpoint's allow-list contains {c!r}, which is (nearly) the whole internet: "
                "list your own networks in publicAccessCidrs"
            )


def check_public_endpoint(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    endpoint = _endpoint(type_, props)
    if endpoint is None:
        return
    public, cidrs = endpoint
    if public is True:
        listed = ", ".join(str(c) for c in as_list(cidrs)) or "0.0.0.0/0"
        yield (
            f"the EKS API endpoint is reachable from the internet (allowed: {listed}): prefer endpointAccess: "
            "private and reach the API from inside the VPC (VPN, SSM, CI runners in the VPC)"
        )


def check_secrets_encryption(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    fix = "give the cluster a KMS key (pulumi-eks encryptionConfigKeyArn) so Secrets are envelope-encrypted in etcd"
    if type_ == EKS_CLUSTER:
        if not props.get("encryptionConfigKeyArn"):
            yield f"Kubernetes Secrets are not envelope-encrypted: {fix}"
    elif type_ == AWS_EKS_CLUSTER:
        config = props.get("encryptionConfig")
        if not known(config):
            return
        key = dig(config, "provider", "keyArn")
        resources = dig(config, "resources", default=[])
        if not key or (known(resources) and "secrets" not in as_list(resources)):
            yield f"Kubernetes Secrets are not envelope-encrypted (encryptionConfig resources ['secrets']): {fix}"


def check_control_plane_logging(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (EKS_CLUSTER, AWS_EKS_CLUSTER):
        return
    types = props.get("enabledClusterLogTypes")
    if not known(types):
        return
    missing = [t for t in REQUIRED_LOG_TYPES if t not in as_list(types)]
    if missing:
        yield (
            f"control-plane logging is missing {missing}: set enabledClusterLogTypes to include "
            f"{list(REQUIRED_LOG_TYPES)} (infra/components/cluster.py LOG_TYPES)"
        )
