"""Tenants' prefix caches kept apart: the `cache_salt` every request of a key carries.

What flows through here: an admitted request's key id, the limits' `cache_isolation` and cache
groups (serving/ingress/limits.py `LimitsConfig`) and the client's own `cache_salt`, if it sent
one -> the salt the cluster's copy of the request carries (serving/ingress/pipeline.py
`_cluster_fields`): vLLM hashes a prompt's first KV block with it (vllm/v1/core/kv_cache_utils.py
`generate_block_hash_extra_keys`, 0.29 and 0.32), and every later block chains to the first, so
a prompt another salt cached gives no prefix-cache hit (the timing attack on shared prefix
caches; vLLM's reason for `cache_salt`). One copy of the request goes to prefill and decode
alike (Ray's `prepare_prefill_request` and `prepare_decode_request` deep-copy it), to a
continuation of a cut stream (a carried field), and to the KV scorer, which scores with it
(serving/engines/kv_router.py).

The salt of a key is HMAC-SHA256 keyed by a secret derived from the API key itself, so only the
ingress, which holds the keys, can compute it; a key id (in metrics and stack files) gives
nothing away. A cache group's is keyed by its members' secrets together: every key of the group
gets one salt, and a change of membership starts the group on a new cache. A client's own
`cache_salt` narrows its key's: the salt sent is HMAC(key salt, client salt), a cache of its
own inside the key's, never another key's. With `cache_isolation: shared`, or with auth off
(one anonymous tenant), a client's salt is passed on as it came and requests carry none else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

from serving.spec import key_id, parse_api_keys

# Marks the secrets and salts this module derives (never used for anything else).
_DOMAIN = b"pd-inference cache salt v1"


def _secret(api_key: str) -> bytes:
    return hashlib.sha256(_DOMAIN + b"\0" + api_key.encode()).digest()


def narrowed(salt: str, client: str) -> str:
    """A salt inside `salt` that only `client`'s value reaches."""
    return hmac.new(bytes.fromhex(salt), client.encode(), hashlib.sha256).hexdigest()


class CacheSalts:
    """The salts of the ingress's API keys (one per replica, from the keys' environment)."""

    def __init__(self, api_keys: Iterable[str]):
        self._secrets = {key_id(k): _secret(k) for k in api_keys}
        self._groups: dict[tuple[str, frozenset[str]], str] = {}

    @classmethod
    def from_env(cls, env: str) -> CacheSalts:
        return cls(parse_api_keys(os.environ.get(env)))

    def key_salt(self, kid: str, groups: Mapping[str, str]) -> str | None:
        """The salt of key `kid` (of its cache group's, when `groups` gives it one); None for a
        key this replica does not hold (auth off: the anonymous key)."""
        group = groups.get(kid)
        if group is None:
            secret = self._secrets.get(kid)
            return None if secret is None else hmac.new(secret, b"key", hashlib.sha256).hexdigest()
        members = frozenset(k for k, g in groups.items() if g == group and k in self._secrets)
        if kid not in members:
            return None
        cached = self._groups.get((group, members))
        if cached is None:
            secret = hashlib.sha256(b"".join(self._secrets[k] for k in sorted(members))).digest()
            cached = hmac.new(secret, b"group:" + group.encode(), hashlib.sha256).hexdigest()
            self._groups[(group, members)] = cached
        return cached

    def salt(self, kid: str, isolated: bool, groups: Mapping[str, str], client: str | None) -> str | None:
        """The `cache_salt` the cluster gets for a request of key `kid` with the client's own
        salt `client` (None: it sent none); None: the request carries no salt."""
        own = self.key_salt(kid, groups) if isolated else None
        if own is None:
            return client
        return own if client is None else narrowed(own, client)
