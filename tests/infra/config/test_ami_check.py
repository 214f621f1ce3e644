"""The AMI release's NVIDIA driver is checked where stacks come in, not only by tests.

Upstream rules encoded here (the table itself: infra/versions.py):
- NVIDIA "CUDA Compatibility" (minor-version compatibility table): CUDA 13.x needs a driver of
  the 580 branch or later; the image (rayproject/ray-llm:2.60.0-py312-cu130) is CUDA 13.0.
- awslabs/amazon-eks-ami CHANGELOG.md: each release's AL2023_x86_64_NVIDIA AMI ships one
  `kmod-nvidia-latest-dkms`; the 570 branch preceded the 580 rollout (amazon-eks-ami #2470).

What flows through here: a shipped stack whose amiReleaseVersion names a release with a 570
driver -> the config model (`pulumi up` and `make render` both validate through it), the
program under mocks, and `make stack` (tools.newstack) with that release as its default: each
refuses with one line naming the stack file and `amiReleaseVersion`, and creates nothing.
"""

from __future__ import annotations

import pulumi
import pytest

from infra import versions
from infra.config import ConfigError, load
from tools import mock_runtime, newstack, render, stackfile

OLD = "1.33.4-20250901"  # a 570-branch release (the table entry is added by the fixture)


@pytest.fixture
def old_driver_release(monkeypatch):
    monkeypatch.setitem(versions.EKS_AMI_NVIDIA_DRIVER, "20250901", "570.172.08")
    return OLD


def _as_deployed(stack: str, **changes):
    values, secrets, others = stackfile.read_as_deployed(stack)
    values = {**values, **changes}
    return values, secrets, others


def _assert_one_line(message: str, stack: str) -> None:
    lines = message.strip().splitlines()
    assert len(lines) == 1, message
    assert lines[0].startswith(f"stacks/Pulumi.{stack}.yaml: amiReleaseVersion: "), lines[0]
    assert "570.172.08" in lines[0] and ">= 580" in lines[0], lines[0]


def test_config_refuses_a_release_with_a_570_driver(old_driver_release) -> None:
    values, secrets, _ = _as_deployed("prod", amiReleaseVersion=old_driver_release, kubernetesVersion="1.33")
    with pytest.raises(ConfigError) as info:
        load(values, secret_keys=secrets, source="stacks/Pulumi.prod.yaml")
    _assert_one_line(str(info.value), "prod")


def test_pulumi_up_path_refuses_before_registering_anything(old_driver_release) -> None:
    values, secrets, others = _as_deployed("prod", amiReleaseVersion=old_driver_release, kubernetesVersion="1.33")
    with pytest.raises(pulumi.RunError) as info:
        mock_runtime.run("prod", values, secrets, others)
    _assert_one_line(str(info.value), "prod")
    assert info.value.registered == []


def test_make_stack_refuses_when_the_default_release_is_too_old(old_driver_release, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(stackfile, "STACKS_DIR", tmp_path)
    monkeypatch.setattr(versions, "AMI_RELEASE_VERSION", old_driver_release)
    monkeypatch.setattr(versions, "DEFAULT_KUBERNETES_VERSION", "1.33")
    with pytest.raises(newstack.NewStackError) as info:
        newstack.create("team-x")
    _assert_one_line(str(info.value), "team-x")
    assert not (tmp_path / "Pulumi.team-x.yaml").exists()


def test_the_shipped_stacks_pass_the_check() -> None:
    # The check must not refuse what we ship (each names a release recorded with a 580 driver).
    for stack in stackfile.stacks():
        render.render(stack, stand_in_secrets=True)
