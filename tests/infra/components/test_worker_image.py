"""The EFA worker image: built from images/ray-llm-efa by the stack, pushed to its own ECR repo.

What the program must register (read under Pulumi's mocks, as `pulumi up` would send it):
- on EFA stacks, a KMS key, an ECR repository with immutable tags, scan on push and KMS
  encryption, an expiry policy, and a pulumi-docker-build Image pushed with one tag: the
  content hash of the build context and arguments; the Ray pods run exactly that reference;
- on non-EFA stacks (imageBuild auto), nothing is built and the pods run rayImage;
- the tag changes when, and only when, the build context or an argument changes (that is
  what makes a rebuild visible in the PR's rendered diff and in `pulumi preview`).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pulumi
import pytest

from infra import versions
from infra.components.worker_image import IMAGE_DIR, build_args, content_tag
from tests.conftest import STACKS
from tools import mock_runtime, stackfile

ECR = "aws:ecr/repository:Repository"
IMAGE = "docker-build:index:Image"


def _pods_images(rendered) -> set[str]:
    rs = next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}


@pytest.mark.parametrize("stack", STACKS)
def test_efa_stacks_build_and_run_the_efa_image(stack, rendered_stacks) -> None:
    r = rendered_stacks[stack]
    images = r.result.of_type(IMAGE)
    if not r.config.builds_worker_image:
        assert images == [] and r.result.of_type(ECR) == []
        assert _pods_images(r) == {r.config.ray_image}
        return
    (img,) = images
    (repo,) = r.result.of_type(ECR)
    assert repo.inputs["imageTagMutability"] == "IMMUTABLE"
    assert repo.inputs["imageScanningConfiguration"] == {"scanOnPush": True}
    (enc,) = repo.inputs["encryptionConfigurations"]
    assert enc["encryptionType"] == "KMS"
    assert r.result.of_type("aws:ecr/lifecyclePolicy:LifecyclePolicy")
    assert img.inputs["push"] is True and img.inputs["platforms"] == ["linux/amd64"]
    assert img.inputs["buildArgs"] == build_args(r.config.ray_image)
    assert img.inputs["buildArgs"]["BASE_IMAGE"] == versions.RAY_IMAGE
    (tag,) = img.inputs["tags"]
    url = f"{mock_runtime.FAKE_ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/{repo.inputs['name']}"
    assert tag == f"{url}:{content_tag(IMAGE_DIR, build_args(r.config.ray_image))}"
    assert img.inputs["registries"][0]["address"] == url
    assert _pods_images(r) == {tag}


def test_shipped_efa_stacks_build_and_non_efa_do_not(rendered_stacks) -> None:
    built = {s for s in STACKS if rendered_stacks[s].result.of_type(IMAGE)}
    efa = {s for s in STACKS if rendered_stacks[s].config.node_pools.prefill.instance.efa}
    assert built == efa and efa and set(STACKS) - efa


def test_content_tag_follows_the_build_context(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    shutil.copytree(IMAGE_DIR, ctx)
    args = build_args(versions.RAY_IMAGE)
    tag = content_tag(ctx, args)
    assert tag == content_tag(IMAGE_DIR, args) and tag.startswith(f"{versions.RAY_VERSION}-efa-")
    (ctx / "Dockerfile").write_text((ctx / "Dockerfile").read_text() + "\n# a change\n")
    assert content_tag(ctx, args) != tag
    other = dict(args, EFA_INSTALLER_VERSION="1.50.0")
    assert content_tag(IMAGE_DIR, other) != tag


def test_imagebuild_none_runs_a_prebuilt_image() -> None:
    values, secrets, others = stackfile.read_as_deployed("prod")
    values = copy.deepcopy(values)
    dlc = "763104351884.dkr.ecr.us-east-1.amazonaws.com/vllm:0.29.0-gpu-py312-cu130-ubuntu22.04-ec2"
    values.update(imageBuild="none", rayImage=dlc)
    result = mock_runtime.run("prod", values, secrets, others)
    assert result.of_type(IMAGE) == [] and result.of_type(ECR) == []
    rs = next(r for r in result.resources if r.type == "kubernetes:ray.io/v1:RayService")
    assert rs.inputs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == dlc


def test_imagebuild_none_with_the_stock_ray_image_on_efa_is_refused() -> None:
    values, secrets, others = stackfile.read_as_deployed("prod")
    values = dict(values, imageBuild="none")
    with pytest.raises(pulumi.RunError, match=r"imageBuild: none runs rayproject/ray-llm:.*no EFA userspace"):
        mock_runtime.run("prod", values, secrets, others)
