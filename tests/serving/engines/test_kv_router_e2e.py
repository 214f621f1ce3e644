"""KV-aware prefill routing on the shared local stack (`make serve`'s P/D application, whose
prefill tier is `router: kv-aware`; serving/engines/kv_router.py).

What it shows, from outside the stack: each P/D request is scored by the prefill tier's scorer
(`pd_kv_routes{outcome="scored"}`, decode's counter), and the scorer's index, built from the
prefill engine's own vLLM KV-cache events through Dynamo's selection core, knows that a prompt
repeating an earlier prompt's prefix is already cached on the replica it chose
(`pd_kv_route_tokens{kind="cached"}`), while a first prompt is not; and once the requests are
done, every load the scorer booked has been freed by the engine's lifecycle reports
(`pd_kv_bookings`: the state the scorer must return to). The fault side (a prefill
replica killed: routing by load meanwhile, scored again once it is back) is in
tests/serving/test_resilience_e2e.py.
"""

from __future__ import annotations

import time

import httpx
import pytest

from bench import hops
from serving.core.metrics import KV_BOOKINGS, KV_ROUTE_TOKENS, KV_ROUTES

pytestmark = pytest.mark.e2e

# About 490 tokens of the tiny model's tokenizer (three of vLLM's 128-token CPU KV blocks and
# more), under the local engines' 1,024-token context: a prefix the index counts in blocks.
SYSTEM = " ".join(f"Rule {i}: answer briefly, plainly and only about the question asked." for i in range(15))


def _read(stack) -> tuple[dict[str, float], dict[str, float]]:
    urls = [n["metrics_url"] for n in stack.nodes]
    return (
        hops.scrape_by_label(urls, KV_ROUTES.prometheus, "outcome"),
        hops.scrape_by_label(urls, KV_ROUTE_TOKENS.prometheus, "kind"),
    )


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _ask(stack, system: str, question: str) -> None:
    body = {
        "model": stack.model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    r = httpx.post(
        stack.urls["disaggregated"] + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {stack.api_key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def _settled_delta(stack, before, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """The counters' change once `n` routing outcomes have been exported (Ray exports every
    few seconds)."""
    deadline = time.monotonic() + 45
    while True:
        routes, tokens = _read(stack)
        routes_d, tokens_d = _delta(routes, before[0]), _delta(tokens, before[1])
        if sum(routes_d.values()) >= n or time.monotonic() > deadline:
            return routes_d, tokens_d
        time.sleep(2)


def test_prefill_is_routed_by_where_the_prompts_kv_cache_is(stack):
    # A fresh prefix (never sent before in this session): nothing of it is cached anywhere.
    fresh = f"{SYSTEM} Session {time.time_ns()}."
    # What earlier requests left (the stack's own test request, other tests) still arriving.
    before = hops.settled(lambda: _read(stack))
    _ask(stack, fresh, "What is two plus two?")
    routes, tokens = _settled_delta(stack, before, 1)
    assert routes == {"scored": 1}, f"the first request was not scored: {routes}"
    assert tokens.get("prompt", 0) > 256 and tokens.get("cached", 0) == 0, tokens

    # The same system prompt again, other questions: the index has the prefill engine's stored
    # blocks of the first request, so the chosen replica holds the shared prefix.
    before = _read(stack)
    for q in ("Name a colour.", "Name a fruit.", "Name a planet."):
        _ask(stack, fresh, q)
    routes, tokens = _settled_delta(stack, before, 3)
    assert routes == {"scored": 3}, f"requests routed by load instead: {routes}"
    # At least two whole 128-token blocks of the shared prefix per request.
    assert tokens.get("cached", 0) >= 3 * 256, f"the index did not see the cached prefix: {tokens}"
    assert tokens["cached"] < tokens["prompt"], tokens

    # Every booking freed: the prefill engine's lifecycle reports reached the scorer under the
    # request ids it booked them by (else those replicas would look ever busier).
    urls = [n["metrics_url"] for n in stack.nodes]
    deadline = time.monotonic() + 45
    while True:
        bookings = hops.scrape_by_label(urls, KV_BOOKINGS.prometheus, "event")
        done = bookings.get("booked", 0) >= 4 and bookings.get("freed", 0) == bookings.get("booked")
        if done or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert bookings.get("booked", 0) >= 4 and bookings.get("freed") == bookings["booked"], bookings
