"""A key's budget for real: the shared local stack's limits ledger counts each answered request's
cost, a key reads its own spend at GET /v1/usage, and the first request after its day's spend
reached the budget is refused with 429 `budget_exceeded` and a Retry-After at UTC midnight.

The budget is set from what the key has spent so far (other tests use the stack), through a
lightweight user_config update, and the original config is put back at the end.
"""

from __future__ import annotations

import copy
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from serving.spec import key_id
from tests.conftest import E2E_KEY, E2E_RPM_KEY
from tests.serving.ingress.test_routing_e2e import base_user_config, set_user_config

pytestmark = pytest.mark.e2e
KEY = E2E_RPM_KEY
SETTLE_LIMIT_S = 30.0


@pytest.fixture
def restore(stack):
    yield
    set_user_config(stack, base_user_config(stack))


def _usage(stack, key: str = KEY) -> dict:
    r = httpx.get(f"{stack.urls['disaggregated']}/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _send(stack) -> httpx.Response:
    return httpx.post(
        f"{stack.urls['disaggregated']}/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": stack.model, "prompt": "Budget check", "max_tokens": 8, "ignore_eos": True, "temperature": 0},
        timeout=120,
    )


def _settled(stack, requests: int) -> dict:
    """The key's usage once the ledger counted `requests` requests today (settles are sent after
    the answer, fire and forget)."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while True:
        usage = _usage(stack)
        if usage["day"]["requests"] >= requests or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def test_a_key_reads_its_own_spend_and_is_refused_on_its_first_request_past_its_daily_budget(stack, restore):
    start = _usage(stack)
    assert start["key"] == key_id(KEY) and start["object"] == "usage"
    assert _send(stack).status_code == 200
    one = _settled(stack, start["day"]["requests"] + 1)
    per_request = one["day"]["spend_usd"] - start["day"]["spend_usd"]
    assert per_request > 0  # the local stack prices its tokens (local/config.py LOCAL_TOKEN_PRICES)
    # Room for half a request: the next is admitted (the spend is below the budget when it
    # comes), its cost takes the spend past the budget, and the one after it is refused.
    budget = one["day"]["spend_usd"] + 0.5 * per_request
    cfg = copy.deepcopy(base_user_config(stack))
    cfg["limits"] = {**cfg["limits"], "keys": {key_id(KEY): {"budget": {"usd": budget, "period": "day"}}}}
    set_user_config(stack, cfg)

    assert _send(stack).status_code == 200  # still under the budget
    two = _settled(stack, one["day"]["requests"] + 1)
    assert two["day"]["spend_usd"] >= budget
    refused = _send(stack)
    assert refused.status_code == 429, refused.text
    err = refused.json()["error"]
    assert err["code"] == "budget_exceeded" and "daily budget" in err["message"]
    now = datetime.now(UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert abs(int(refused.headers["retry-after"]) - (midnight - now).total_seconds()) < 60
    over = _usage(stack)
    assert over["day"]["requests"] == two["day"]["requests"]  # the refused request cost nothing
    assert over["budget"]["remaining_usd"] == 0 and over["budget"]["resets_at"] == midnight.strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    # Another key reads its own spend, never this key's, and is not refused.
    other = _usage(stack, E2E_KEY)
    assert other["key"] == key_id(E2E_KEY) and other["budget"] is None
