"""IAM policy documents the components share.

What flows through here: an AWS service principal (and the actions it needs) -> the JSON
trust policy of a role that only that service may assume.
"""

from __future__ import annotations

import json


def trusted_by(service: str, actions: tuple[str, ...] = ("sts:AssumeRole",)) -> str:
    """Trust policy: only `service` (e.g. "ec2.amazonaws.com") may assume the role."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": list(actions)}],
        }
    )
