"""The Ray image tag and the GPU driver it needs.

Upstream rules encoded here:
- ray-project/ray `docker/ray-llm/Dockerfile`: ray-llm images are built for Python 3.12 with
  CUDA 13.0 only ("ray-llm supports Python 3.12 only", CUDA_CODE=cu130);
  `ci/ray_ci/automation/image_tags_lib.py`: tags are `<version>[-extra]-py<XY>-cu<MAJOR><MINOR>`
  (format_python_tag: 3.12 -> -py312; format_platform_tag: cu13.0.x -> -cu130).
- NVIDIA "CUDA Compatibility" (minor-version compatibility table): CUDA 13.x needs a driver
  of the 580 branch or later.
- awslabs/amazon-eks-ami CHANGELOG.md: the AL2023_x86_64_NVIDIA AMI of each release ships
  `kmod-nvidia-latest-dkms` (e.g. release v20260714: 580.159.03 for Kubernetes 1.30-1.36).
"""

from __future__ import annotations

import re

import yaml

from infra import paths, versions
from tests.conftest import STACKS


def _ray_llm_tag(version: str, python: str, cuda: str) -> str:
    major, minor = cuda.split(".")[:2]
    return f"{version}-py{python.replace('.', '')}-cu{major}{minor}"


def test_default_image_is_a_tag_ray_publishes() -> None:
    repo, tag = versions.RAY_IMAGE.split(":", 1)
    assert repo == "rayproject/ray-llm"
    # The only Python/CUDA pair ray-llm is built for.
    assert tag == _ray_llm_tag(versions.RAY_VERSION, "3.12", versions.RAY_IMAGE_CUDA)
    assert versions.RAY_IMAGE_CUDA == "13.0"
    assert "py311" not in versions.RAY_IMAGE and "cu128" not in versions.RAY_IMAGE


def test_recorded_ami_drivers_run_cuda_13() -> None:
    for release, driver in versions.EKS_AMI_NVIDIA_DRIVER.items():
        assert re.fullmatch(r"\d{8}", release)
        assert int(driver.split(".")[0]) >= versions.CUDA13_MIN_DRIVER_MAJOR, f"{release}: {driver}"


def _pinned_ami_releases() -> dict[str, str]:
    out = {}
    for stack in STACKS:
        doc = yaml.safe_load((paths.STACKS_DIR / f"Pulumi.{stack}.yaml").read_text()) or {}
        value = (doc.get("config") or {}).get("pd-inference:amiReleaseVersion")
        if value:
            out[stack] = str(value)
    return out


def test_every_pinned_ami_release_ships_a_cuda_13_driver() -> None:
    """Each stack's amiReleaseVersion (<k8s>-<date>) must be a release whose driver we recorded, >= 580."""
    for stack, release in _pinned_ami_releases().items():
        assert versions.ami_driver_problem(release) is None, stack


def test_the_driver_check_refuses_old_or_unknown_releases(monkeypatch) -> None:
    """570 was the AL2023 NVIDIA AMIs' branch before the 580 rollout (amazon-eks-ami #2470)."""
    monkeypatch.setitem(versions.EKS_AMI_NVIDIA_DRIVER, "20250901", "570.172.08")
    assert "needs >= 580" in (versions.ami_driver_problem("1.33.4-20250901") or "")
    assert "no recorded NVIDIA driver" in (versions.ami_driver_problem("1.35.6-20990101") or "")
    assert versions.ami_driver_problem("1.35.6-20260714") is None
