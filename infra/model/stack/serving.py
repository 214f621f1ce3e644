"""What is served: the serving spec (model, roles, KV transfer), where the weights come from,
and whether it all fits the pools."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pydantic import field_validator

from infra.model import vllm_options
from infra.model.fit import fit_errors
from infra.model.stack.pools import engine_pools
from serving.spec import KvBackend, Mode, ServingSpec, SpecModel

if TYPE_CHECKING:
    from infra.model.config import StackConfig

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class ServingKeys(SpecModel):
    model_bucket: str | None = None
    serving: ServingSpec

    @field_validator("model_bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        if v is not None and not _BUCKET.match(v):
            raise ValueError(f"{v!r} is not an S3 bucket name")
        return v


def model_source_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    errors = []
    src = cfg.serving.model.source
    if src.startswith("/"):
        errors.append(
            ("serving.model.source", f"{src!r} is a local path; a stack needs a Hugging Face repo id or s3:// prefix")
        )
    if src.startswith("s3://") and cfg.model_bucket != src[5:].split("/", 1)[0]:
        errors.append(
            ("modelBucket", f"must name the bucket of serving.model.source ({src!r}) so the pods may read it")
        )
    return errors


def kv_transfer_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """The NIXL backend must be the one the pools' fabric calls for (the catalog's)."""
    if cfg.serving.mode is not Mode.DISAGGREGATED:
        return []
    kv = cfg.serving.kv_transfer
    asked = kv.requested_backend
    key = (
        "serving.kvTransfer.backend" if kv.backend is not KvBackend.AUTO else "serving.kvTransfer.extraConfig.backends"
    )
    for role, pool in engine_pools(cfg).items():
        inst = pool.instance
        if asked is None or asked is inst.nixl_backend:
            continue
        if inst.efa:
            why = (
                f"{asked.value} on the EFA pool {role} ({inst.name}) gets no RDMA and falls back to TCP "
                f"without a word (ai-dynamo/nixl#909); EFA pools use {inst.nixl_backend.value} (leave it auto)"
            )
        else:
            why = (
                f"{asked.value} needs EFA, which the {role} pool ({inst.name}) does not have; "
                f"use {inst.nixl_backend.value} (leave it auto)"
            )
        return [(key, why)]
    return []


def vllm_option_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """engineKwargs must exist in the vLLM the Ray image carries (vllm_options.IMAGE_VLLM_VERSION)."""
    bad = vllm_options.engine_kwarg_problems(cfg.serving.engine_kwargs, vllm_options.IMAGE_VLLM_VERSION)
    return [("serving.engineKwargs", bad[0] + " (the version the Ray image carries)")] if bad else []


def fit_problems(cfg: StackConfig) -> list[tuple[str, str]]:
    """Does the model fit its pools' GPUs (weights, one maxModelLen sequence of KV cache)?"""
    return fit_errors(cfg.serving, {role: pool.instance for role, pool in engine_pools(cfg).items()})
