"""serving/ingress/costs.py: what one request costs, worked by hand from its usage and the prices."""

from __future__ import annotations

import pytest

from serving.ingress.costs import PREFILL_HITS_SINCE, Costs, reports_prefill_hits
from serving.ingress.sse import cached_tokens

# The rendered user_config's `costs` and `fallback.prices` (serving/spec/render.py): USD per token.
COSTS = {
    "pd": {"prefill_usd_per_token": 2e-7, "decode_usd_per_token": 5e-6, "disaggregated": True},
    "agg": {"prefill_usd_per_token": 1e-7, "decode_usd_per_token": 3e-6, "disaggregated": False},
}
FALLBACK = {"prices": {"pd": {"prompt": 1e-6, "completion": 4e-6, "cached_prompt": 2.5e-7}}}


def test_a_pd_request_pays_prefill_for_the_prompt_tokens_computed_and_decode_per_output_token():
    costs = Costs.from_user_config(COSTS, FALLBACK, vllm="0.32.0")
    # 1000 prompt tokens of which prefill's cache served 256: 744 computed at $0.20 per million,
    # 50 output tokens at $5 per million.
    cost = costs.of("pd", "cluster", prompt=1000, completion=50, cached=256)
    assert cost is not None
    assert cost.prefill == pytest.approx(744 * 0.2 / 1e6)  # $0.0001488
    assert cost.decode == pytest.approx(50 * 5 / 1e6)  # $0.00025
    assert cost.total == pytest.approx(0.0001488 + 0.00025)


def test_where_decode_reports_the_transferred_kv_as_cached_every_prompt_token_counts_as_computed():
    """vLLM before 0.31 (the image's 0.29) reports a P/D request's KV from prefill as cached: its
    cached count says nothing of prefill's cache, so a P/D prompt is costed whole; an aggregated
    engine's hits are its own in every version."""
    old = Costs.from_user_config(COSTS, None, vllm="0.29.0")
    assert old.of("pd", "cluster", 1000, 0, cached=999).prefill == pytest.approx(1000 * 2e-7)
    assert old.of("agg", "cluster", 1000, 0, cached=512).prefill == pytest.approx(488 * 1e-7)
    assert reports_prefill_hits("0.31.0") and not reports_prefill_hits("0.30.2")
    assert PREFILL_HITS_SINCE == (0, 31)


def test_an_adapter_costs_as_its_base_model_and_an_unpriced_model_costs_nothing_known():
    costs = Costs.from_user_config(COSTS, FALLBACK, vllm="0.32.0")
    assert costs.of("agg:tenant-a", "cluster", 10, 10, 0) == costs.of("agg", "cluster", 10, 10, 0)
    assert costs.of("other", "cluster", 10, 10, 0) is None
    assert costs.of("agg", "fallback", 10, 10, 0) is None  # no provider price for agg


def test_a_fallback_request_pays_the_providers_prices_its_cached_prompt_at_the_cached_price():
    costs = Costs.from_user_config(COSTS, FALLBACK, vllm="0.32.0")
    cost = costs.of("pd", "fallback", prompt=2000, completion=100, cached=1024)
    # 976 prompt tokens at $1/M, 1024 cached at $0.25/M, 100 completion at $4/M.
    assert cost.prefill == pytest.approx((976 * 1 + 1024 * 0.25) / 1e6)
    assert cost.decode == pytest.approx(100 * 4 / 1e6)


def test_a_cached_count_past_the_prompt_is_held_to_the_prompt():
    costs = Costs.from_user_config(COSTS, FALLBACK, vllm="0.32.0")
    assert costs.of("pd", "cluster", 10, 1, cached=50).prefill == 0.0
    assert costs.of("pd", "cluster", 10, 1, cached=-5).prefill == pytest.approx(10 * 2e-7)


@pytest.mark.parametrize(
    "usage,expected",
    [
        ({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}, 4),
        ({"prompt_tokens": 9, "prompt_tokens_details": None}, 0),
        ({"prompt_tokens": 9}, 0),
        ({"prompt_tokens_details": {"cached_tokens": True}}, 0),
        ({"prompt_tokens_details": {"cached_tokens": "4"}}, 0),
        (None, 0),
    ],
)
def test_cached_tokens_are_read_from_openais_usage_shape(usage, expected):
    assert cached_tokens(usage) == expected
