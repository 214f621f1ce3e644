"""How long a KV offload tier takes to fill at a request rate: arithmetic only.

What flows through here: the bytes of one engine's share of its node's tier, the requests per
second its replica takes at the plan's rate, the tokens each request stores and the KV bytes
of one token on the replica -> the seconds until the tier is full.

Every block a request computes is stored to the tier (vLLM's OffloadingConnector stores each
full block once computed: v1/kv_offload), and every request is taken as new: no prefix of it is
in the tier yet, which fills it fastest. A full CPU tier stays within its bound: vLLM then
evicts its least recently used blocks (v1/kv_offload/cpu/policies/lru.py), so the time to fill
is how long a prefix stays findable at that rate. (vLLM's file-system tier has no such bound,
which is why the config refuses it: infra/config/kv_offload.py.)
"""

from __future__ import annotations


def fill_seconds(
    tier_bytes: int, requests_per_s: float, tokens_per_request: int, kv_bytes_per_token: int
) -> float | None:
    """Seconds until `tier_bytes` hold the KV of the requests since it was empty; None without
    a rate (or nothing stored)."""
    stored_per_s = requests_per_s * tokens_per_request * kv_bytes_per_token
    return tier_bytes / stored_per_s if stored_per_s > 0 else None
