"""API-key auth at the front door: the request's `Authorization` header, read once.

What flows through here: the raw request's `Authorization: Bearer <key>` -> the key id
(`k-` + 12 hex of the key's SHA-256, serving.spec.key_id: what limits, access and usage
metrics name; the key itself never leaves this module) or the 401 to send. Keys come from the
environment variable the spec names (a Kubernetes Secret in the cloud); with auth on and no
key configured, every request is refused rather than served open.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from starlette.responses import JSONResponse

from serving.ingress.errors import error_response
from serving.spec import AuthMode, key_id, parse_api_keys

logger = logging.getLogger("ray.serve")

ANONYMOUS = "anonymous"  # the key id when auth is disabled


def auth_mode(mode: str, where: str = "auth mode") -> AuthMode:
    """The one check of an auth mode (the spec's AuthMode values)."""
    try:
        return AuthMode(mode)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in AuthMode)
        raise ValueError(f"{where} {mode!r} is not one of {allowed}") from None


class ApiKeyAuth:
    """Checks `Authorization: Bearer <key>` against a fixed set of keys."""

    def __init__(self, mode: str, keys: tuple[str, ...]):
        self.enabled = auth_mode(mode) is not AuthMode.DISABLED
        self._keys = tuple(k.encode() for k in keys)

    @classmethod
    def from_env(cls, mode: str, env: str) -> ApiKeyAuth:
        keys = parse_api_keys(os.environ.get(env))
        auth = cls(mode, keys)
        if auth.enabled and not keys:
            logger.warning("auth is %r but %s holds no keys: every request will get 401", mode, env)
        return auth

    def key_id(self, request: Any) -> str | JSONResponse:
        """The request's key id, or the 401 to send (ANONYMOUS when auth is disabled)."""
        if not self.enabled:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode()
        if scheme.lower() != "bearer" or not presented:
            return error_response(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                headers={"WWW-Authenticate": "Bearer"},
            )
        # Compare against every key, constant-time, so timing says nothing about which.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        if not ok:
            return error_response(401, "Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"})
        return key_id(token.strip())

    def check(self, request: Any) -> JSONResponse | None:
        """None when the request may pass, else the 401 response to send."""
        kid = self.key_id(request)
        return kid if isinstance(kid, JSONResponse) else None
