"""Prefix caches kept apart by key, for real: the shared local stack (P/D app with the KV-aware
prefill router, and the aggregated app), two API keys, one prompt.

What a client sees of the engines' prefix cache is `usage.prompt_tokens_details.cached_tokens`
(the engines report it: serving/spec/render.py `enable_prompt_tokens_details`; in P/D, the
prefill engine's own hits, which vLLM >= 0.31 hands to decode). A prompt cached by one key
must give the other key 0 cached tokens (its salt differs, so no block hash matches), and the
same key must still hit; a client's own `cache_salt` narrows its key's cache, so the same
prompt with a new client salt misses too.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.conftest import E2E_KEY, E2E_KEY_2

pytestmark = pytest.mark.e2e
APPS = ("disaggregated", "aggregated")


def _prompt() -> str:
    """A prompt no earlier request sent (so nothing of it is cached yet), some 400 tokens long:
    several KV blocks of the CPU engine's block size."""
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(120))
    return f"Tenant isolation check {uuid.uuid4().hex}: {words}"


def _cached(stack, app: str, key: str, prompt: str, **extra) -> int:
    """The cached prompt tokens of one completion of `prompt` sent with `key` to `app`."""
    r = httpx.post(
        f"{stack.urls[app]}/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": stack.model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 64, usage  # long enough to span full blocks
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("app", APPS)
def test_a_prefix_one_key_cached_gives_another_key_no_hit_and_still_hits_for_the_same_key(stack, app):
    prompt = _prompt()
    assert _cached(stack, app, E2E_KEY, prompt) == 0  # a prompt nobody sent
    assert _cached(stack, app, E2E_KEY, prompt) > 0  # the same key: its own blocks
    assert _cached(stack, app, E2E_KEY_2, prompt) == 0  # another key: none of them
    assert _cached(stack, app, E2E_KEY_2, prompt) > 0  # which now has blocks of its own
    assert _cached(stack, app, E2E_KEY, prompt) > 0  # and the first key's are still there


@pytest.mark.parametrize("app", APPS)
def test_a_clients_own_cache_salt_narrows_its_keys_cache_and_never_reaches_another_keys(stack, app):
    prompt = _prompt()
    assert _cached(stack, app, E2E_KEY, prompt, cache_salt="team-a") == 0
    assert _cached(stack, app, E2E_KEY, prompt, cache_salt="team-a") > 0  # the same key and salt
    assert _cached(stack, app, E2E_KEY, prompt) == 0  # the key without that salt: another cache
    # Another key sending the same client salt is still in its own key's cache.
    assert _cached(stack, app, E2E_KEY_2, prompt, cache_salt="team-a") == 0
