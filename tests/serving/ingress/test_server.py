"""serving/ingress/server.py's usage endpoint: a key reads its own spend and budget, and nothing of
any other key's."""

from __future__ import annotations

import json

from serving.ingress.limits import LimitsConfig
from serving.ingress.server import EXTRA_ENDPOINTS, USAGE_PATH, usage_report
from serving.spec import key_id
from tests.serving.fakes import LocalLedger
from tests.serving.test_app import KEY, error_of, make_ingress, make_request, run

OTHER = "sk-unit-2"


def _usage(ingress, key):
    return run(ingress.usage(make_request(key=key, path=USAGE_PATH, method="GET")))


def test_a_key_reads_its_own_spend_and_budget_and_nothing_of_another_keys(monkeypatch):
    ingress, _ = make_ingress(monkeypatch, keys=f"{KEY},{OTHER}")
    ledger = LocalLedger()
    limiter = ingress._door.limiter
    limiter._factory = lambda: ledger
    mine, theirs = key_id(KEY), key_id(OTHER)
    limiter.config = LimitsConfig.from_user_config({"keys": {mine: {"budget": {"usd": 2.0, "period": "day"}}}})
    ledger.actor.record([[mine, 0.5, 2, 30, 7, 10], [theirs, 9.0, 1, 1, 1, 0]])
    resp = _usage(ingress, KEY)
    body = json.loads(resp.body)
    assert resp.status_code == 200 and body["key"] == mine and body["object"] == "usage"
    day = body["day"]
    assert (day["spend_usd"], day["requests"], day["prompt_tokens"], day["completion_tokens"]) == (0.5, 2, 30, 7)
    assert day["cached_tokens"] == 10 and body["month"]["spend_usd"] == 0.5
    assert body["budget"]["usd"] == 2.0 and body["budget"]["remaining_usd"] == 1.5
    assert body["budget"]["resets_at"] == day["end"]
    assert "9.0" not in resp.body.decode() and theirs not in resp.body.decode()
    # The other key sees its own, with no budget; nothing a request sends picks another key.
    other = json.loads(_usage(ingress, OTHER).body)
    assert other["key"] == theirs and other["month"]["spend_usd"] == 9.0 and other["budget"] is None
    assert [c for c in ledger.calls if c[0] == "spend"] == [("spend", mine), ("spend", theirs)]


def test_the_usage_endpoint_needs_a_key_and_says_when_it_cannot_answer(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    status, error = error_of(_usage(ingress, None))
    assert status == 401
    ingress._door.limiter._factory = lambda: (_ for _ in ()).throw(RuntimeError("no GCS"))
    resp = _usage(ingress, KEY)
    status, error = error_of(resp)
    assert status == 503 and error["code"] == "limits_unavailable" and resp.headers["retry-after"]


def test_the_usage_route_is_a_get_of_the_ingress():
    assert "usage" in EXTRA_ENDPOINTS and USAGE_PATH == "/v1/usage"


def test_a_key_without_a_budget_has_no_remaining():
    periods = {
        p: {"start": "s", "end": "e", "usd": 1.0, "requests": 1, "prompt": 1, "completion": 1, "cached": 0}
        for p in ("day", "month")
    }
    report = usage_report("k-000000000000", periods, LimitsConfig.from_user_config(None))
    assert report["budget"] is None and report["day"]["spend_usd"] == 1.0
