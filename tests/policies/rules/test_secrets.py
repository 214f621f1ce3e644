"""Which environment variable names count as credentials.

What flows through here: a variable name -> `secret_like` -> whether `secrets-by-reference`
requires it to come from a Secret reference.
"""

from __future__ import annotations

import pytest

from policies.rules.secrets import secret_like


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("PD_API_KEYS", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("REDIS_PASSWORD", True),
        ("VLLM_NIXL_SIDE_CHANNEL_HOST", False),
        ("FI_EFA_FORK_SAFE", False),
        ("KEYCLOAK_URL", False),
        ("MONKEY", False),
    ],
)
def test_secret_like(name: str, secret: bool) -> None:
    assert secret_like(name) is secret
