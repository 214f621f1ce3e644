"""The nodes: their metadata service, GPU taint, EFA placement and capacity type.

What flows through here: pulumi-eks's `ManagedNodeGroup`/`NodeGroupV2`, `aws.eks.NodeGroup`
and EC2 launch templates -> the IMDS options (or the lack of a template), the GPU signs
(instance types, AMI, `gpu`) and taints, the EFA interfaces, subnets and placement, the
capacity type -> `nodes-imdsv2-required`, `gpu-nodes-tainted`, `efa-single-zone` (mandatory)
and `no-spot-in-prod` (advisory, prod stacks only).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from .inputs import (
    AWS_NODE_GROUP,
    EKS_MNG,
    EKS_NODE_GROUP_V2,
    LAUNCH_TEMPLATE,
    Context,
    as_list,
    dig,
    known,
)

GPU_TAINT_KEY = "nvidia.com/gpu"


# IMDSv2's PUT response hop limit that keeps pod-network containers away from the instance
# metadata service, and so from the node role (AWS EKS best practices, "Restrict access to the
# instance profile assigned to the worker node"; infra/components/launch_templates.py).
IMDS_HOP_LIMIT = 1
_TEMPLATE_FIX = (
    f"give the node group a launch template with metadataOptions.httpTokens 'required' and "
    f"httpPutResponseHopLimit {IMDS_HOP_LIMIT}"
)


def check_imdsv2(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ in (EKS_MNG, EKS_NODE_GROUP_V2):
        if props.get("launchTemplate"):
            return  # the template carries the metadata options; it is checked itself
        if props.get("enableIMDSv2") is not True:
            yield (
                f"nodes accept IMDSv1 (pods could read the node role's credentials with a plain GET): {_TEMPLATE_FIX}"
            )
        else:
            # pulumi-eks's template for enableIMDSv2 hard-codes httpPutResponseHopLimit 2
            # (nodejs/eks/nodes/nodegroup.ts createMNGCustomLaunchTemplate).
            yield f"enableIMDSv2 gives the nodes a hop limit of 2 (pods reach IMDS and the node role): {_TEMPLATE_FIX}"
    elif type_ == AWS_NODE_GROUP:
        if not props.get("launchTemplate"):
            yield f"an EKS node group without a launch template gets IMDSv1: {_TEMPLATE_FIX}"
    elif type_ == LAUNCH_TEMPLATE:
        meta = props.get("metadataOptions")
        if not known(meta):
            return
        if dig(meta, "httpEndpoint") == "disabled":
            return  # no metadata service at all
        tokens = dig(meta, "httpTokens")
        if known(tokens) and tokens != "required":
            yield (
                f"launch template metadataOptions.httpTokens is {tokens!r}: set it to 'required' (IMDSv2) with "
                f"httpPutResponseHopLimit {IMDS_HOP_LIMIT}"
            )
        hops = dig(meta, "httpPutResponseHopLimit")
        if known(hops) and (hops is None or int(hops) > IMDS_HOP_LIMIT):
            what = "unset (an AMI with IMDSv2 support v2.0, as AL2023's, then gives 2)" if hops is None else hops
            yield (
                f"launch template metadataOptions.httpPutResponseHopLimit is {what}: set it to {IMDS_HOP_LIMIT} so "
                "pods cannot reach IMDS and the node role (give pods their own role through EKS Pod Identity)"
            )


_GPU_INSTANCE = re.compile(r"^(p\d|g\d)[a-z0-9-]*\.", re.IGNORECASE)


def _is_gpu_group(props: Mapping[str, Any]) -> bool:
    if props.get("gpu") is True:
        return True
    ami = props.get("amiType")
    if isinstance(ami, str) and ("NVIDIA" in ami.upper() or "GPU" in ami.upper()):
        return True
    return any(isinstance(t, str) and _GPU_INSTANCE.match(t) for t in as_list(props.get("instanceTypes")))


def check_gpu_taint(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (EKS_MNG, AWS_NODE_GROUP) or not _is_gpu_group(props):
        return
    taints = props.get("taints")
    if not known(taints):
        return
    for t in as_list(taints):
        if dig(t, "key") == GPU_TAINT_KEY and dig(t, "effect") in ("NO_SCHEDULE", "NoSchedule"):
            return
    yield (
        f"GPU nodes are not tainted: add the taint {GPU_TAINT_KEY}=true:NoSchedule (effect NO_SCHEDULE) so only "
        "pods that tolerate it (the Ray GPU workers, the device plugins) land on these expensive nodes"
    )


def _efa_interfaces(props: Mapping[str, Any]) -> list[Any]:
    return [ni for ni in as_list(props.get("networkInterfaces")) if dig(ni, "interfaceType") in ("efa", "efa-only")]


def _offers_efa(props: Mapping[str, Any]) -> bool:
    """A node group whose own launch template carries the EFA interfaces: the group says so in
    the Cluster Autoscaler's node-template tag for the EFA resource (the program sets it)."""
    tags = props.get("tags")
    return isinstance(tags, Mapping) and any(str(k).endswith("/vpc.amazonaws.com/efa") for k in tags)


def check_efa_single_zone(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ == EKS_MNG:
        subnets = props.get("subnetIds")
        one_subnet = not known(subnets) or (isinstance(subnets, list) and len(subnets) == 1)
        if props.get("enableEfaSupport") is True:
            if not props.get("placementGroupAvailabilityZone"):
                yield (
                    "an EFA node group needs a cluster placement group: set placementGroupAvailabilityZone "
                    "(the stack's efaZone)"
                )
            if not one_subnet:
                yield (
                    f"an EFA node group spans {len(as_list(subnets))} subnets: give it exactly one subnet, the "
                    "private subnet in the placement group's zone (EFA traffic does not cross zones)"
                )
        elif props.get("launchTemplate") and props.get("capacityType") == "CAPACITY_BLOCK" and not one_subnet:
            yield (
                f"a capacity-block node group spans {len(as_list(subnets))} subnets: a Capacity Block lives in one "
                "zone; give the node group exactly one subnet, in that zone"
            )
        elif props.get("launchTemplate") and _offers_efa(props) and not one_subnet:
            yield (
                f"an EFA node group spans {len(as_list(subnets))} subnets: give it exactly one subnet, the private "
                "subnet in the placement group's zone (EFA traffic does not cross zones)"
            )
    elif type_ == LAUNCH_TEMPLATE:
        efa = _efa_interfaces(props)
        if not efa:
            return
        placed = dig(props, "placement", "groupName") or dig(props, "placement", "availabilityZone")
        reserved = dig(props, "instanceMarketOptions", "marketType") == "capacity-block" or dig(
            props, "capacityReservationSpecification", "capacityReservationTarget", "capacityReservationId"
        )
        if not placed and not reserved:
            yield (
                "a launch template with EFA interfaces has no placement: set placement.groupName to a cluster "
                "placement group, or target a capacity block/reservation (which carries its placement)"
            )
        subnets = {dig(ni, "subnetId") for ni in efa} - {None}
        if len(subnets) > 1:
            yield f"the EFA interfaces of one launch template are in {len(subnets)} subnets: use one subnet (one zone)"


def check_spot_in_prod(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in (EKS_MNG, AWS_NODE_GROUP) or props.get("capacityType") != "SPOT":
        return
    if ctx.is_prod(props):
        yield (
            f"stack {ctx.stack!r} runs a node group on spot capacity: GPU spot nodes are reclaimed on two "
            "minutes' notice and can be unavailable for hours; use on-demand or a capacity block in prod"
        )
