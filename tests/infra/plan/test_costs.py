"""infra/plan/costs.py: what a token costs per model and phase, against hand-computed prices."""

from __future__ import annotations

import copy

import pytest

from infra.catalog import lookup
from infra.config import load
from infra.plan.costs import DECODE, MEASURED, PREFILL, ROOFLINE, phase_prices, token_prices
from tools.stackfile import read_as_deployed as read


def _prod(**edits):
    """The prod stack (P/D Llama 3.3 70B, TP 8 on p5.48xlarge: one replica = one 8-GPU node)."""
    values, secrets, _ = read("prod")
    values = copy.deepcopy(values)
    for path, value in edits.items():
        node = values
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return load(values, secret_keys=secrets, source="stacks/Pulumi.prod.yaml")


def test_measured_speeds_at_the_pools_own_prices_by_hand():
    cfg = _prod(
        **{
            "nodePools.prefill.usdPerHour": 36.0,
            "nodePools.decode.usdPerHour": 40.0,
            "serving.model.throughput": {"prefillTokensPerS": 20000, "decodeTokensPerS": 1200},
        }
    )
    prices = token_prices(cfg)["llama-3.3-70b-instruct"]
    # A prompt token: $36/h / 3600 s / 20,000 tokens/s; an output token: $40/h / 3600 / 1,200.
    assert prices[PREFILL] == pytest.approx(5e-7)
    assert prices[DECODE] == pytest.approx(40 / 3600 / 1200)
    assert {p.basis for p in phase_prices(cfg, cfg.serving.served[0]).values()} == {MEASURED}


def test_a_replica_on_half_a_node_pays_half_the_node():
    cfg = _prod(
        **{
            "nodePools.decode.usdPerHour": 40.0,
            "serving.decode.tensorParallelSize": 4,
            "serving.model.throughput": {"decodeTokensPerS": 1000},
        }
    )
    decode = phase_prices(cfg, cfg.serving.served[0])[DECODE]
    assert decode.usd_per_hour == 20.0  # 4 of the node's 8 GPUs
    assert decode.usd_per_token == pytest.approx(20 / 3600 / 1000)


def test_without_a_price_or_a_measurement_the_catalogs_on_demand_price_and_the_roofline():
    cfg = _prod()
    prices = phase_prices(cfg, cfg.serving.served[0])
    assert prices[PREFILL].usd_per_hour == lookup("p5.48xlarge").usd_per_hour
    assert {p.basis for p in prices.values()} == {ROOFLINE}
    # The roofline is an upper bound on speed: a measured, slower replica costs more per token.
    slower = _prod(**{"serving.model.throughput": {"decodeTokensPerS": prices[DECODE].tokens_per_s / 2}})
    assert token_prices(slower)["llama-3.3-70b-instruct"][DECODE] == pytest.approx(2 * prices[DECODE].usd_per_token)
