"""The LLM service: its namespace, the Ray image, how it is reached and how it is upgraded."""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from infra import versions
from infra.config.formats import allow_list
from infra.config.pools import engine_pools
from infra.k8s import labels
from serving.spec import SpecModel

if TYPE_CHECKING:
    from infra.config import StackConfig

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# registry/name:tag, registry/name@sha256:<digest>, or both (the tag documents, the digest pins).
_IMAGE = re.compile(
    r"^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+((:[A-Za-z0-9._-]{1,128})?@sha256:[0-9a-f]{64}|:[A-Za-z0-9._-]{1,128})$"
)


class ServiceExposure(str, Enum):
    CLUSTER_IP = "cluster-ip"
    INTERNAL_NLB = "internal-nlb"


class UpgradeStrategy(str, Enum):
    # KubeRay RayService spec.upgradeStrategy.type
    NEW_CLUSTER = "NewCluster"
    NONE = "None"


class ImageBuild(str, Enum):
    """What the Ray pods run. AUTO: the worker image (images/ray-llm-efa, FROM rayImage,
    built and pushed by the stack) when the engine pools have EFA or a model's weights are
    streamed from S3 (it adds the EFA userspace and the Run:ai model streamer, neither of
    which the stock image carries), rayImage as is otherwise. EFA_USERSPACE: always build it.
    NONE: run rayImage as is (a prebuilt image that already carries what the stack needs,
    e.g. an AWS Deep Learning Container)."""

    AUTO = "auto"
    EFA_USERSPACE = "efa-userspace"
    NONE = "none"


class ServiceKeys(SpecModel):
    namespace: str = "llm"
    ray_image: str = versions.RAY_IMAGE
    image_build: ImageBuild = ImageBuild.AUTO
    service_exposure: ServiceExposure = ServiceExposure.CLUSTER_IP
    service_allowed_cidrs: list[str] = Field(default_factory=list)
    upgrade_strategy: UpgradeStrategy = UpgradeStrategy.NEW_CLUSTER

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str) -> str:
        # kuberay-system and nvidia-device-plugin are created by the stack's add-ons themselves.
        if not _DNS_LABEL.match(v) or v.startswith("kube-") or v in labels.RESERVED_NAMESPACES:
            raise ValueError(
                f"{v!r} is not a usable namespace name (a DNS label, not default, kube-* or an add-on's namespace)"
            )
        return v

    @field_validator("ray_image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not _IMAGE.match(v):
            raise ValueError(f"{v!r} is not a pinned image reference (registry/name:tag or @sha256:...)")
        if "@" in v:
            return v  # a digest pins the content whatever the tag says
        tag = v.rsplit(":", 1)[-1]
        if tag in {"latest", "nightly"} or tag.startswith("nightly"):
            raise ValueError(f"{v!r} uses a floating tag; pin a release tag or a digest")
        return v

    @field_validator("service_allowed_cidrs")
    @classmethod
    def _allowed_cidrs(cls, v: list[str]) -> list[str]:
        return allow_list(v)


def exposure_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    if cfg.service_exposure is ServiceExposure.INTERNAL_NLB and not cfg.service_allowed_cidrs:
        return [("serviceAllowedCidrs", "an internal NLB needs the client CIDRs allowed to reach it")]
    return []


def streamed_models(cfg: StackConfig) -> list[str]:
    """The ids of the models whose engines stream their weights (vLLM's `runai_streamer`
    load format: an s3:// source with loading.weights auto, or weights: streamer)."""
    return [m.model.id for m in cfg.serving.served if m.model.loading.streamed(m.model.source)]


def kv_routed_models(cfg: StackConfig) -> list[str]:
    """The ids of the models whose prefill tier routes by KV state (prefill.router kv-aware:
    its scorer imports Dynamo's selection core, ai-dynamo-runtime)."""
    return [m.model.id for m in cfg.serving.served if m.kv_routed]


def builds_worker_image(cfg: StackConfig) -> bool:
    """Whether the stack builds the worker image (images/ray-llm-efa) FROM rayImage.

    AUTO builds it whenever the stock image would lack something the stack uses: the EFA
    userspace (EFA pools), the Run:ai model streamer (streamed weights) or Dynamo's selection
    core (KV-aware prefill routing). For streamed weights
    the stack builds rather than refuses: the stack file asked for S3 weights and the stack
    already knows how to build that image, so the unsurprising outcome is that they load."""
    if cfg.image_build is ImageBuild.AUTO:
        return (
            any(pool.instance.efa for pool in engine_pools(cfg).values())
            or bool(streamed_models(cfg))
            or bool(kv_routed_models(cfg))
        )
    return cfg.image_build is ImageBuild.EFA_USERSPACE


def image_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """The stock image run as is (imageBuild none) lacks the EFA userspace that EFA pools need,
    the Run:ai model streamer that streamed weights need and the Dynamo selection core that
    KV-aware prefill routing needs."""
    stock = cfg.ray_image.split("@")[0].rsplit(":", 1)[0] == versions.RAY_IMAGE.rsplit(":", 1)[0]
    if cfg.image_build is not ImageBuild.NONE or not stock:
        return []
    errors = []
    if any(pool.instance.efa for pool in engine_pools(cfg).values()):
        errors.append(
            (
                "imageBuild",
                f"none runs {cfg.ray_image} as is, which has no EFA userspace: NIXL's LIBFABRIC plugin "
                "cannot load libfabric.so.1 (leave imageBuild auto, or set rayImage to an image with the "
                "AWS EFA installer, e.g. a Deep Learning Container)",
            )
        )
    streamed = streamed_models(cfg)
    if streamed:
        errors.append(
            (
                "imageBuild",
                f"none runs {cfg.ray_image} as is, which has no Run:ai model streamer, but the weights of "
                f"{', '.join(streamed)} are streamed from S3 (vLLM load_format runai_streamer cannot import "
                "it): leave imageBuild auto (the stack builds images/ray-llm-efa, which installs it), set "
                "the model's loading.weights: download, or set rayImage to an image that carries "
                "runai-model-streamer[s3]",
            )
        )
    routed = kv_routed_models(cfg)
    if routed:
        errors.append(
            (
                "imageBuild",
                f"none runs {cfg.ray_image} as is, which has no ai-dynamo-runtime, but the prefill tier of "
                f"{', '.join(routed)} routes by KV state (prefill.router kv-aware: its scorer cannot score "
                "without it): leave imageBuild auto (the stack builds images/ray-llm-efa, which installs it), "
                "set prefill.router to prefix-cache-affinity, or set rayImage to an image that carries "
                f"ai-dynamo-runtime=={versions.DYNAMO_RUNTIME_VERSION}",
            )
        )
    return errors
