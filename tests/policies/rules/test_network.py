"""Which CIDRs count as the whole internet (or nearly).

What flows through here: a CIDR string -> `open_cidr` -> whether `no-open-ingress` and
`eks-endpoint-allow-list` refuse it.
"""

from __future__ import annotations

import pytest

from policies.rules.network import open_cidr


@pytest.mark.parametrize(
    ("cidr", "is_open"),
    [
        ("0.0.0.0/0", True),
        ("::/0", True),
        ("128.0.0.0/1", True),
        ("2000::/3", True),
        ("10.0.0.0/8", False),
        ("203.0.113.0/24", False),
        ("2001:db8::/32", False),
        ("not-a-cidr", False),
    ],
)
def test_open_cidr(cidr: str, is_open: bool) -> None:
    assert open_cidr(cidr) is is_open
