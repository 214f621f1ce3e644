"""The stack config: one typed, validated model of a `stacks/Pulumi.<env>.yaml` file.

`infra/config/stack.py` composes one model per concern (cluster, network, pools, service, GCS,
serving, observability, secrets: a module each here) and `load()`s a stack file's values into
a `StackConfig`, or raises `ConfigError` naming the file and the key. Each part holds the keys
of one concern as a pydantic model (`*Keys`, the same flat keys a stack file has), the nested
models and enums of those keys, and the cross-field checks of the concern as functions of the
composed `StackConfig`. Other modules import from here; the parts never do (they import each
other by module).
"""

from infra.config.stack import (
    EMPTY_MEANS_UNSET,
    PROJECT,
    SECRET_KEYS,
    CapacityType,
    ConfigError,
    EndpointAccess,
    Environment,
    ExistingVpc,
    GcsFaultTolerance,
    GcsRedis,
    ImageBuild,
    LocalStorage,
    MetricsStack,
    NatGateways,
    NodePool,
    NodePools,
    Observability,
    ServiceExposure,
    StackConfig,
    SystemNodes,
    Tracing,
    UpgradeStrategy,
    instance_type_format,
    load,
    missing_secret,
)

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
