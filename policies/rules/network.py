"""The network edge: what may reach the serving endpoint, and where its requests may go.

What flows through here: Services (and the RayService's spec.serveService, which KubeRay turns
into one), NetworkPolicies and security groups with their rules -> every source CIDR, checked
against `open_cidr` (the whole internet, or nearly) -> `no-open-ingress`; the RayService's
serveConfigV2 -> the fallback's base URL -> `fallback-https-outside-dev`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator, Mapping
from typing import Any

from .inputs import (
    K8S_NETWORK_POLICY,
    K8S_SERVICE,
    RAY_TYPES,
    SECURITY_GROUP,
    SECURITY_GROUP_RULE,
    SG_INGRESS_RULE,
    Context,
    as_list,
    dig,
    known,
)
from .manifests import serve_doc


# --- CIDRs ----------------------------------------------------------------------------------
def open_cidr(cidr: Any) -> bool:
    """True for /0 and anything wider than an IPv4 /8 or IPv6 /32 (two /1s are the internet too)."""
    if not isinstance(cidr, str):
        return False
    try:
        net = ipaddress.ip_network(cidr.strip(), strict=False)
    except ValueError:
        return False
    return net.prefixlen < (8 if net.version == 4 else 32)


# --- ingress to the endpoint -------------------------------------------------------------------------------------
def _service_ingress(props: Any, where: str = "Service") -> Iterator[str]:
    spec = dig(props, "spec")
    if not isinstance(spec, Mapping):
        return
    ranges = spec.get("loadBalancerSourceRanges")
    annotation = dig(props, "metadata", "annotations", "service.beta.kubernetes.io/load-balancer-source-ranges")
    if isinstance(annotation, str):
        ranges = [*as_list(ranges), *[r for r in annotation.split(",") if r.strip()]]
    if not known(ranges):
        return
    if spec.get("type") == "LoadBalancer" and not ranges:
        yield (
            f"a LoadBalancer {where} without loadBalancerSourceRanges accepts 0.0.0.0/0: list the client CIDRs "
            "(stack key serviceAllowedCidrs)"
        )
    for c in as_list(ranges):
        if open_cidr(c):
            yield f"{where} loadBalancerSourceRanges contains {c!r} (the whole internet): list the client CIDRs"


def check_no_open_ingress(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ == K8S_SERVICE:
        yield from _service_ingress(props)
    elif type_.endswith(":RayService") and isinstance(dig(props, "spec", "serveService"), Mapping):
        # KubeRay creates this Service from the RayService (spec.serveService): same rule.
        yield from _service_ingress(dig(props, "spec", "serveService"), "RayService spec.serveService")
    elif type_ == K8S_NETWORK_POLICY:
        for i, rule in enumerate(as_list(dig(props, "spec", "ingress"))):
            if not known(rule):
                continue
            sources = dig(rule, "from")
            if known(sources) and not sources:
                yield (
                    f"NetworkPolicy ingress rule {i} has no 'from': it admits every source, 0.0.0.0/0 included; "
                    "list pod/namespace selectors or ipBlocks"
                )
            for s in as_list(sources):
                cidr = dig(s, "ipBlock", "cidr")
                if open_cidr(cidr):
                    yield f"NetworkPolicy ingress rule {i} admits ipBlock {cidr!r} (the whole internet): list the client CIDRs"
    elif type_ == SECURITY_GROUP:
        for i, rule in enumerate(as_list(props.get("ingress"))):
            for c in [*as_list(dig(rule, "cidrBlocks")), *as_list(dig(rule, "ipv6CidrBlocks"))]:
                if open_cidr(c):
                    yield f"security group ingress rule {i} admits {c!r}: allow only the networks that need it"
    elif type_ == SECURITY_GROUP_RULE:
        if props.get("type") == "ingress":
            for c in [*as_list(props.get("cidrBlocks")), *as_list(props.get("ipv6CidrBlocks"))]:
                if open_cidr(c):
                    yield f"security group ingress rule admits {c!r}: allow only the networks that need it"
    elif type_ == SG_INGRESS_RULE:
        for c in (props.get("cidrIpv4"), props.get("cidrIpv6")):
            if open_cidr(c):
                yield f"security group ingress rule admits {c!r}: allow only the networks that need it"


# --- the external fallback (hybrid routing) -------------------------------------------------------
def _fallback_urls(serve_config: Any) -> Iterator[tuple[str, str]]:
    """(application name, fallback base URL) in a serveConfigV2 document: the ingress
    deployment's user_config.fallback.base_url, as serving/spec/serving.py renders it."""
    doc = serve_doc(serve_config)
    for app in as_list(dig(doc, "applications")):
        for dep in as_list(dig(app, "deployments")):
            url = dig(dep, "user_config", "fallback", "base_url")
            if isinstance(url, str):
                yield str(dig(app, "name", default="?")), url


def check_fallback_https(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    if type_ not in RAY_TYPES or ctx.stack in (ctx.config.get("devStacks") or ["dev"]):
        return
    for app, url in _fallback_urls(dig(props, "spec", "serveConfigV2")):
        if url.lower().startswith("http://"):
            yield (
                f"application {app!r} sends requests and the fallback API key to {url!r} over plain http: "
                "use an https:// baseUrl outside dev (stack key serving.fallback.baseUrl)"
            )
