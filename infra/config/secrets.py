"""The stack's secrets: which keys must be Pulumi secrets, and which ones the config needs."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from infra.config.cluster import Environment
from infra.config.errors import missing_secret
from infra.config.gcs import GcsFaultTolerance
from serving.spec import AuthMode

if TYPE_CHECKING:
    from infra.config import StackConfig

# Config keys that must be Pulumi secrets (`pulumi config set --secret`).
SECRET_KEYS = ("hfToken", "apiKeys", "gcsRedisPassword", "fallbackApiKey")


def secret_errors(cfg: StackConfig, secrets_present: Collection[str]) -> list[tuple[str, str]]:
    """The secrets the config needs (and one it must not have); auth and the fallback's transport."""
    errors = []
    if cfg.serving.auth is AuthMode.API_KEY and "apiKeys" not in secrets_present:
        errors.append(missing_secret("apiKeys", "serving.auth is api-key", "<key1,key2>"))
    if cfg.gcs_fault_tolerance is GcsFaultTolerance.EXTERNAL_REDIS and "gcsRedisPassword" not in secrets_present:
        # Without AUTH, any client that reaches the Redis may rewrite Ray's control state.
        errors.append(
            missing_secret("gcsRedisPassword", "gcsFaultTolerance is external-redis", "<the Redis AUTH token>")
        )
    if cfg.gcs_fault_tolerance is GcsFaultTolerance.MANAGED and "gcsRedisPassword" in secrets_present:
        # The stack generates the managed group's AUTH token itself (random.RandomPassword).
        errors.append(
            (
                "gcsRedisPassword",
                "only used with gcsFaultTolerance external-redis: managed generates its own AUTH token "
                "(pulumi config rm gcsRedisPassword)",
            )
        )
    if cfg.serving.auth is AuthMode.DISABLED and cfg.environment is not Environment.DEV:
        errors.append(("serving.auth", "API-key authentication can only be disabled in dev"))
    fallback = cfg.serving.fallback
    if fallback is not None and "fallbackApiKey" not in secrets_present:
        errors.append(
            (
                "fallbackApiKey",
                "serving.fallback is set but no fallbackApiKey secret is set "
                "(pulumi config set --secret fallbackApiKey <the provider's key>)",
            )
        )
    if fallback is not None and fallback.plain_http and cfg.environment is not Environment.DEV:
        errors.append(
            (
                "serving.fallback.baseUrl",
                f"{fallback.base_url!r} is plain http: requests and the provider key would cross the "
                "internet unencrypted; use https:// (http is allowed only in dev)",
            )
        )
    return errors
