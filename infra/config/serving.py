"""What is served: the serving spec (one model, or `serving.models`), where each model's weights
and adapters come from, and whether each fits its pools.

Every check runs once per model (`ServingSpec.served`); in the many-model form its keys and
messages name the model's entry (`serving.models[i] (id).key`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import field_validator

from infra import vllm_options
from infra.config.pools import engine_pools, model_key, rekey
from infra.sizing.fit import fit_errors
from infra.sizing.scale_to_zero import scale_to_zero_errors
from serving.spec import KvBackend, Mode, ServingSpec, SpecModel

if TYPE_CHECKING:
    from infra.config import StackConfig

# `serving.<per-model key>` in a message; the shared keys (fallback, limits, ...) stay.
_SHARED_KEY = re.compile(r"serving\.(?!fallback|limits|ingress|auth|resilience|streaming|placement)")
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


def _source_errors(spec: ServingSpec, bucket: str | None) -> list[tuple[str, str]]:
    errors = []
    src = spec.model.source
    if src.startswith("/"):
        errors.append(
            ("serving.model.source", f"{src!r} is a local path; a stack needs a Hugging Face repo id or s3:// prefix")
        )
    if src.startswith("s3://") and bucket != src[5:].split("/", 1)[0]:
        errors.append(
            ("modelBucket", f"must name the bucket of serving.model.source ({src!r}) so the pods may read it")
        )
    if spec.lora is not None and bucket != spec.lora.bucket:
        errors.append(
            (
                "modelBucket",
                f"must name the bucket of serving.lora.adaptersPath ({spec.lora.adapters_path!r}) so the pods may "
                "read the adapters (only under that prefix)",
            )
        )
    return errors


def model_source_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """Every model's weights and adapters come from a repo id or the stack's modelBucket."""
    return _per_model(cfg, lambda spec: _source_errors(spec, cfg.model_bucket))


def _per_model(cfg: StackConfig, check: Callable[[ServingSpec], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """`check` on every model; its `serving.` keys rewritten to the model's entry, and a
    message naming a model key in the many-model form names the entry too."""
    errors: list[tuple[str, str]] = []
    for i, spec in enumerate(cfg.serving.served):
        found = check(spec)
        if cfg.serving.many:
            where = model_key(cfg, i)
            found = [(k, _SHARED_KEY.sub(where + ".", m)) for k, m in found]
        errors += rekey(cfg, i, found)
    return errors


def _kv_errors(cfg: StackConfig, spec: ServingSpec) -> list[tuple[str, str]]:
    if spec.mode is not Mode.DISAGGREGATED:
        return []
    kv = spec.kv_transfer
    asked = kv.requested_backend
    key = (
        "serving.kvTransfer.backend" if kv.backend is not KvBackend.AUTO else "serving.kvTransfer.extraConfig.backends"
    )
    for role, pool in engine_pools(cfg, spec).items():
        inst = pool.instance
        name = spec.pool_of(role)
        if asked is None or asked is inst.nixl_backend:
            continue
        if inst.efa:
            why = (
                f"{asked.value} on the EFA pool {name} ({inst.name}) gets no RDMA and falls back to TCP "
                f"without a word (ai-dynamo/nixl#909); EFA pools use {inst.nixl_backend.value} (leave it auto)"
            )
        else:
            why = (
                f"{asked.value} needs EFA, which the {name} pool ({inst.name}) does not have; "
                f"use {inst.nixl_backend.value} (leave it auto)"
            )
        return [(key, why)]
    return []


def kv_transfer_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """The NIXL backend must be the one the pools' fabric calls for (the catalog's)."""
    return _per_model(cfg, lambda spec: _kv_errors(cfg, spec))


def vllm_option_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """engineKwargs must exist in the vLLM the Ray image carries (vllm_options.IMAGE_VLLM_VERSION),
    and tool and reasoning parsers in both vLLMs."""

    def check(spec: ServingSpec) -> list[tuple[str, str]]:
        bad = vllm_options.engine_kwarg_problems(spec.engine_kwargs, vllm_options.IMAGE_VLLM_VERSION)
        found = [("serving.engineKwargs", bad[0] + " (the version the Ray image carries)")] if bad else []
        return found + _parser_errors(spec)

    return _per_model(cfg, check)


def _parser_errors(spec: ServingSpec) -> list[tuple[str, str]]:
    """Tool and reasoning parsers must be ones both vLLMs register (the image's and the
    local run's); engineKwargs may not name them (RESERVED_ENGINE_KWARGS)."""
    m = spec.model
    asked = [
        ("tool", "serving.model.tools.parser", m.tools.parser if m.tools else None),
        ("reasoning", "serving.model.reasoning.parser", m.reasoning.parser if m.reasoning else None),
    ]
    found = []
    for kind, key, name in asked:
        problem = vllm_options.parser_problem(kind, name) if name is not None else None
        if problem:
            found.append((key, problem))
    return found


def fit_problems(cfg: StackConfig) -> list[tuple[str, str]]:
    """Does each model fit its pools' GPUs (weights, one maxModelLen sequence of KV cache)?
    In the many-model form each message ends with the pool it was checked against."""

    def check(spec: ServingSpec) -> list[tuple[str, str]]:
        pools = {role: pool.instance for role, pool in engine_pools(cfg, spec).items()}
        found = fit_errors(spec, pools)
        if not cfg.serving.many:
            return found
        return [(k, f"{m} (pool {_pool_in_key(spec, k)})") for k, m in found]

    return _per_model(cfg, check)


def _pool_in_key(spec: ServingSpec, key: str) -> str:
    """The pool of the role a fit error's key names (serving.<role>.x), else every pool."""
    for role in spec.engine_roles():
        if key.startswith(f"serving.{role}."):
            return spec.pool_of(role)
    return ", ".join(dict.fromkeys(spec.pool_of(r) for r in spec.engine_roles()))


def scale_to_zero_problems(cfg: StackConfig) -> list[tuple[str, str]]:
    """infra.sizing.scale_to_zero's rules, for every model."""
    return _per_model(cfg, lambda spec: scale_to_zero_errors(cfg.environment.value, spec))
