"""Which image references count as pinned: a release tag or a well-formed digest.

What flows through here: an image reference -> `image_problem` -> None when it is pinned,
else the reason the `images-pinned` rule reports.
"""

from __future__ import annotations

import pytest

from policies.rules.workloads import image_problem


@pytest.mark.parametrize(
    ("image", "pinned"),
    [
        ("rayproject/ray-llm:2.60.0-py311-cu128", True),
        ("quay.io/kuberay/operator:v1.7.0", True),
        ("localhost:5000/ray@sha256:" + "a" * 64, True),
        ("localhost:5000/ray", False),
        ("ray", False),
        ("rayproject/ray:latest", False),
        ("rayproject/ray:nightly-extra", False),
        ("rayproject/ray@sha256:abc", False),
    ],
)
def test_image_problem(image: str, pinned: bool) -> None:
    assert (image_problem(image) is None) is pinned
