"""Small format checks that several concerns share (CIDRs, allow-lists, instance types)."""

from __future__ import annotations

import ipaddress
import re

# An EC2 instance type: family letters, generation digit(s), optional attribute letters and
# "-suffix" (p6-b200, u7i-12tb), then a size (large, 48xlarge, metal, metal-48xl, ...).
_INSTANCE_TYPE = re.compile(
    r"^[a-z]+[0-9]+[a-z]*(-[a-z0-9]+)?\.(nano|micro|small|medium|large|[0-9]{0,3}xlarge|metal(-[0-9]+xl)?)$"
)
# Documentation-only ranges (RFC 5737, RFC 3849): no real client ever comes from them.
_DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]


def instance_type_format(v: str) -> str:
    """Refuse what is not shaped like an EC2 instance type (p5.48xl, m7i.huge) before AWS does."""
    if not _INSTANCE_TYPE.match(v):
        raise ValueError(f"{v!r} is not an EC2 instance type (family+generation.size, e.g. m7i.2xlarge, p5.48xlarge)")
    return v


def cidr(v: str) -> str:
    try:
        net = ipaddress.ip_network(v, strict=True)
    except ValueError as e:
        raise ValueError(f"{v!r} is not a valid CIDR ({e})") from None
    return str(net)


def allow_list(v: list[str]) -> list[str]:
    """CIDRs allowed to reach an endpoint: real networks, none as wide as the internet."""
    out = [cidr(c) for c in v]
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
