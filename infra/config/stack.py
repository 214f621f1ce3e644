"""The stack config: one typed, validated model of a `stacks/Pulumi.<env>.yaml` file.

What flows through here: `__main__.py` (or `tools.render`, reading the same file) hands
`load()` the stack's raw config values (bare keys, project namespace stripped) and the set of
keys that are Pulumi secrets; `load()` returns a `StackConfig` or raises `ConfigError` with
one line naming the stack file and the key. Nothing is registered before this succeeds.

`StackConfig` composes one model per concern (`infra/model/stack/`: cluster, network, pools,
service, GCS, serving, observability) over the same flat keys a stack file has, and runs the
checks that span keys in one place, in a fixed order. Every name other modules use is
importable from here.

Defaults live in those models and nowhere else (Pulumi.yaml's declarations are checked
against them by the tests). Secret values never enter the model: it records only which
secrets are present; `__main__.py` passes the secret Outputs to the components.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import ValidationError, ValidationInfo, model_validator

from infra.config import cluster, gcs, kv_offload, network, pools, secrets, service
from infra.config import serving as served
from infra.config.ami_check import ami_driver_errors
from infra.config.cluster import AccessKeys, ClusterKeys, EndpointAccess, Environment
from infra.config.errors import ConfigError, cross_field, missing_secret, missing_secrets, one_line
from infra.config.formats import instance_type_format
from infra.config.gcs import GcsFaultTolerance, GcsKeys, GcsRedis
from infra.config.network import ExistingVpc, NatGateways, NetworkKeys
from infra.config.observability import MetricsStack, Observability, ObservabilityKeys, Tracing
from infra.config.pools import CapacityType, LocalStorage, NodePool, NodePools, PoolKeys, SystemNodes
from infra.config.secrets import SECRET_KEYS
from infra.config.service import ImageBuild, ServiceExposure, ServiceKeys, UpgradeStrategy
from infra.config.serving import ServingKeys

__all__ = [
    "EMPTY_MEANS_UNSET",
    "PROJECT",
    "SECRET_KEYS",
    "CapacityType",
    "ConfigError",
    "EndpointAccess",
    "Environment",
    "ExistingVpc",
    "GcsFaultTolerance",
    "GcsRedis",
    "ImageBuild",
    "LocalStorage",
    "MetricsStack",
    "NatGateways",
    "NodePool",
    "NodePools",
    "Observability",
    "ServiceExposure",
    "StackConfig",
    "SystemNodes",
    "Tracing",
    "UpgradeStrategy",
    "instance_type_format",
    "load",
    "missing_secret",
]

PROJECT = "pd-inference"

# Optional string keys that Pulumi.yaml declares with `default: ""` (Pulumi refuses a stack that
# lacks a declared key without a default): the empty string means "not set".
EMPTY_MEANS_UNSET = ("efaZone", "gcsRedisAddress", "modelBucket")


# pydantic orders the fields of several bases from the last base to the first: the bases are
# listed in reverse so that the keys keep the stack file's order (environment first,
# observability last), which is also the order in which per-key errors are found. pydantic
# also keys validators by their function's name: a part's validator that shares a name with
# another part's is silently dropped, so each has its own (tests/infra/config/test_parts.py).
class StackConfig(ObservabilityKeys, ServingKeys, GcsKeys, ServiceKeys, PoolKeys, AccessKeys, NetworkKeys, ClusterKeys):
    """Every key of a stack file's `pd-inference:` namespace."""

    @model_validator(mode="after")
    def _cross(self, info: ValidationInfo) -> StackConfig:
        """Checks that span several keys; every failing one is reported, the first one first."""
        ctx = info.context or {}
        # Every other check reads the pools the models name: an unknown one stops here.
        unknown = pools.pool_reference_errors(self)
        if unknown:
            raise cross_field(unknown)
        errors = [
            *network.zone_errors(self, ctx.get("region")),
            *cluster.ami_errors(self),
            *cluster.access_errors(self),
            *service.exposure_errors(self),
            *gcs.gcs_errors(self),
            # Which secrets the stack holds comes from load(), never from the file's values.
            *secrets.secret_errors(self, ctx.get("secrets_present", frozenset())),
            *served.model_source_errors(self),
            *served.scale_to_zero_problems(self),
            *pools.pool_errors(self),
            *kv_offload.kv_offload_errors(self, pools.placements(self)),
            *served.kv_transfer_errors(self),
            *served.vllm_option_errors(self),
            *service.image_errors(self),
            *ami_driver_errors(self.ami_release_version, {r: p.instance for r, p in self.node_pools}),
            # Does each model fit its pools' GPUs (weights, one maxModelLen sequence of KV cache)?
            *served.fit_problems(self),
        ]
        # The head's sizing reads the capacity plan: infra.plan.stack.load checks it after these.
        if errors:
            raise cross_field(errors)
        return self

    @property
    def builds_worker_image(self) -> bool:
        """Whether the stack builds the worker image (images/ray-llm-efa) FROM rayImage: EFA
        pools or streamed weights (infra/config/service.py)."""
        return service.builds_worker_image(self)


# --- loading ---------------------------------------------------------------------------
_JSON_KEYS = {
    "observability",
    "availabilityZones",
    "existingVpc",
    "publicAccessCidrs",
    "adminRoleArns",
    "viewRoleArns",
    "systemNodes",
    "nodePools",
    "serviceAllowedCidrs",
    "serving",
    "gcsRedis",
}


def _decode(key: str, raw: Any) -> Any:
    """Pulumi hands structured config to programs as JSON text; decode it."""
    if key in _JSON_KEYS and isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # let the model say what type it wanted
    return raw


def load(
    values: Mapping[str, Any],
    *,
    secret_keys: Collection[str] = (),
    source: str,
    region: str | None = None,
) -> StackConfig:
    """Validate a stack's config (bare keys) into a StackConfig, or raise a one-line ConfigError.

    `region` (the stack's `aws:region`, when known) lets the zones be checked against it.
    """
    secrets_present = set()
    data: dict[str, Any] = {}
    for key, raw in values.items():
        if key in SECRET_KEYS:
            if raw in (None, ""):
                continue  # absent; the checks below say whether the stack needs it
            if key not in secret_keys:
                raise ConfigError(f"{source}: {key}: must be stored as a secret (pulumi config set --secret {key} ...)")
            secrets_present.add(key)
            continue
        if key in EMPTY_MEANS_UNSET and raw == "":
            continue  # Pulumi.yaml's `default: ""`: not set
        data[key] = _decode(key, raw)
    try:
        return StackConfig.model_validate(
            data, context={"secrets_present": frozenset(secrets_present), "region": region}
        )
    except ValidationError as err:
        raise ConfigError(one_line(source, err, data), missing_secrets(err)) from None
