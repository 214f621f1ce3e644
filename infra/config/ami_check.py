"""Refuse an AMI release whose NVIDIA driver is older than the worker image needs.

What flows through here: a stack's `amiReleaseVersion` and its GPU pools -> `(key, message)`
pairs for the config model's cross-field checks (one line each, naming `amiReleaseVersion`).
The rule itself (which AMI release ships which driver, what CUDA 13 needs) lives in
`infra.versions.ami_driver_problem`; this module only decides where it applies: every
pool with GPUs boots the AL2023 NVIDIA AMI of that release, so the first GPU pool found
reports it (one release, one message).
"""

from __future__ import annotations

from collections.abc import Mapping

from infra import catalog, versions


def ami_driver_errors(ami_release_version: str, pools: Mapping[str, catalog.InstanceType]) -> list[tuple[str, str]]:
    """[("amiReleaseVersion", why)] when a GPU pool would boot a driver the image cannot use, else []."""
    gpu_pools = [role for role, inst in pools.items() if inst.gpus > 0]
    if not gpu_pools:
        return []
    problem = versions.ami_driver_problem(ami_release_version)
    if problem is None:
        return []
    return [
        ("amiReleaseVersion", f"{problem} (the {', '.join(gpu_pools)} pool(s) boot the NVIDIA AMI of this release)")
    ]
