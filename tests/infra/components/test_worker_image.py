"""The EFA worker image: built from images/ray-llm-efa by the stack, pushed to its own ECR repo.

What the program must register (read under Pulumi's mocks, as `pulumi up` would send it):
- on EFA stacks, a KMS key, an ECR repository with immutable tags, scan on push and KMS
  encryption, an expiry policy, and a pulumi-docker-build Image pushed with one tag: the
  content hash of the build context and arguments; the Ray pods run exactly that reference;
- on non-EFA stacks (imageBuild auto), nothing is built and the pods run rayImage, unless a
  model's weights stream from S3: the stock image lacks the Run:ai model streamer that vLLM's
  `runai_streamer` load format imports (ray-project/ray 2.60.0 wheel METADATA: `ray[llm]`
  requires `vllm[audio]==0.29.0`, not vLLM's `runai` extra; the installed Ray's metadata is
  read), so the stack builds the image, whose Dockerfile installs it;
- the tag changes when, and only when, the build context or an argument changes (that is
  what makes a rebuild visible in the PR's rendered diff and in `pulumi preview`).
"""

from __future__ import annotations

import copy
import re
import shutil
from importlib.metadata import requires
from pathlib import Path

import pulumi
import pytest
import yaml

from infra import versions
from infra.components.worker_image import IMAGE_DIR, build_args, content_tag
from infra.config import service
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


def test_shipped_efa_or_streaming_stacks_build_and_the_others_do_not(rendered_stacks) -> None:
    built = {s for s in STACKS if rendered_stacks[s].result.of_type(IMAGE)}
    efa = {s for s in STACKS if rendered_stacks[s].config.node_pools.prefill.instance.efa}
    streaming = {s for s in STACKS if service.streamed_models(rendered_stacks[s].config)}
    assert built == efa | streaming and efa and set(STACKS) - efa - streaming


# --- weights streamed from S3 on a stack without EFA ----------------------------------------------
def test_the_stock_ray_llm_image_does_not_ask_for_the_streamer() -> None:
    """Why streamed weights need a built image: Ray's LLM extra pins vLLM without its `runai`
    extra (the installed ray's METADATA; Ray's docker/ray-llm image installs ray[llm])."""
    llm = [r for r in requires("ray") or [] if 'extra == "llm"' in r and r.startswith("vllm")]
    assert llm and all("runai" not in r.split(";")[0] for r in llm), llm
    dockerfile = (IMAGE_DIR / "Dockerfile").read_text()
    assert re.search(r'pip install [^\n]*"runai-model-streamer\[s3\]==\$\{RUNAI_STREAMER_VERSION\}"', dockerfile)


def _dev_streaming(**extra: str):
    values, secrets, others = stackfile.read_as_deployed("dev")
    values = copy.deepcopy(values)
    values["modelBucket"] = "dev-models"
    values["serving"]["model"]["source"] = "s3://dev-models/Qwen/Qwen2.5-1.5B-Instruct"
    values.update(extra)
    return values, secrets, others


def _engines_load_formats(result) -> set[str | None]:
    rs = next(r for r in result.resources if r.type == "kubernetes:ray.io/v1:RayService")
    return {
        (a["llm_configs"] if "llm_configs" in a else [a["prefill_config"], a["decode_config"]])[0]["engine_kwargs"].get(
            "load_format"
        )
        for app in yaml.safe_load(rs.inputs["spec"]["serveConfigV2"])["applications"]
        for a in [app["args"]]
    }


def test_s3_weights_on_a_non_efa_stack_build_the_image_with_the_streamer() -> None:
    values, secrets, others = _dev_streaming()
    result = mock_runtime.run("dev", values, secrets, others)
    assert _engines_load_formats(result) == {"runai_streamer"}
    (img,) = result.of_type(IMAGE)
    assert img.inputs["context"]["location"] == str(IMAGE_DIR)
    rs = next(r for r in result.resources if r.type == "kubernetes:ray.io/v1:RayService")
    (tag,) = img.inputs["tags"]
    assert rs.inputs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == tag


def test_downloaded_s3_weights_on_a_non_efa_stack_build_nothing() -> None:
    values, secrets, others = _dev_streaming()
    values["serving"]["model"]["loading"] = {"weights": "download"}
    result = mock_runtime.run("dev", values, secrets, others)
    assert _engines_load_formats(result) == {None} and result.of_type(IMAGE) == []


def test_imagebuild_none_with_the_stock_image_and_streamed_weights_is_refused() -> None:
    values, secrets, others = _dev_streaming(imageBuild="none")
    with pytest.raises(pulumi.RunError) as e:
        mock_runtime.run("dev", values, secrets, others)
    assert str(e.value).startswith(
        "stacks/Pulumi.dev.yaml: imageBuild: none runs rayproject/ray-llm:2.60.0-py312-cu130 as is, which has no "
        "Run:ai model streamer, but the weights of qwen2.5-1.5b-instruct are streamed from S3"
    )


def _dev_kv_routed(**extra: str):
    values, secrets, others = stackfile.read_as_deployed("dev")
    values = copy.deepcopy(values)
    values["serving"]["mode"] = "disaggregated"
    values["serving"]["prefill"] = {**values["serving"].get("prefill", {}), "router": "kv-aware"}
    values.update(extra)
    return values, secrets, others


def test_kv_aware_prefill_routing_on_a_non_efa_stack_builds_the_image_with_dynamo() -> None:
    """The KV scorer imports ai-dynamo-runtime, which the stock image lacks: auto builds it."""
    values, secrets, others = _dev_kv_routed()
    assert mock_runtime.run("dev", values, secrets, others).of_type(IMAGE)
    plain = stackfile.read_as_deployed("dev")
    assert mock_runtime.run("dev", *plain).of_type(IMAGE) == []


def test_imagebuild_none_with_the_stock_image_and_kv_aware_routing_is_refused() -> None:
    values, secrets, others = _dev_kv_routed(imageBuild="none")
    with pytest.raises(pulumi.RunError, match=r"imageBuild: none runs .* no ai-dynamo-runtime, but the prefill tier"):
        mock_runtime.run("dev", values, secrets, others)


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
