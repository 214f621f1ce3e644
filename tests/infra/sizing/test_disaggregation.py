"""Aggregated or disaggregated: each mode's goodput worked by hand, what a mode needs for a rate,
the property that more prefill interference lowers aggregation's rate, and the module's purity
(the local benchmark imports it with CPU figures, no Pulumi)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from infra.sizing import disaggregation as dis

# One replica = one GPU, four GPUs a node at $4/h. Round figures so that every rate below is
# worked by hand:
# aggregated: prompts at F = 1,000 tok/s, a 10 ms step (weights) whatever the batch;
# prefill: 1,000 tok/s, nothing else per step, steps of 1,000 tokens;
# decode: 10 ms + 0.1 ms per running sequence.
AGG = dis.ReplicaProfile(
    prefill_tokens_per_s=1000.0,
    step_s=0.010,
    step_s_per_seq=0.0,
    max_batch=1000,
    max_batched_tokens=1_000_000,
    gpus=1,
    gpus_per_node=4,
    usd_per_node_hour=4.0,
)
PRE = dataclasses.replace(AGG, step_s=0.0, max_batched_tokens=1000)
DEC = dataclasses.replace(AGG, step_s_per_seq=0.0001)
PROFILE = dis.Profile(aggregated=AGG, prefill=PRE, decode=DEC, kv_transfer_s=0.05)
SLO = dis.Slo(ttft_s=1.0, itl_s=0.05)
PROMPT, OUTPUT = 100, 11


def test_aggregated_rate_by_hand():
    # A step may carry (ITL 0.05 - step 0.01) x 1,000 = 40 prompt tokens: a chunk step takes
    # 0.01 + 0.04 = 0.05 s, so prompts go through at 40 / 0.05 = 800 tok/s and a 100-token
    # prompt takes s = 0.125 s. TTFT = s + rho s / (2 (1 - rho)) <= 1 s: rho <= 2 x 0.875 /
    # (0.125 + 1.75) = 0.9333, so rate = 0.9333 / 0.125 = 7.467 req/s. At that rate the prompts
    # take 7.467 x 100 / 1,000 = 74.7% of the time: mean step 0.01 / 0.2533 = 39.5 ms, and
    # batch = 7.467 x 10 decode steps x 0.0395 = 2.947 sequences.
    rate, batch, chunk = dis.aggregated_rate(AGG, PROMPT, OUTPUT, SLO)
    assert rate == pytest.approx(7.4667, rel=1e-3)
    assert batch == pytest.approx(2.947, rel=1e-3)
    assert chunk == pytest.approx(40.0)


def test_disaggregated_rates_by_hand():
    # decode: the largest batch within ITL 0.05 s is (0.05 - 0.01) / 0.0001 = 400 (the KV cache
    # holds 1,000); 400 sequences x one token per 0.05 s, 11 tokens each: 400 / 0.55 = 727.3 req/s.
    # prefill: 1,000 tok/s, s = 0.1 s; TTFT also waits for the KV (0.05 s) and decode's first
    # step (0.05 s): budget 0.9 s, rho <= 2 x 0.8 / (0.1 + 1.6) = 0.9412, 9.412 req/s.
    r = dis.rates(PROFILE, PROMPT, OUTPUT, SLO)
    assert r.decode == pytest.approx(727.27, rel=1e-3) and r.decode_batch == pytest.approx(400.0)
    assert r.prefill == pytest.approx(9.4118, rel=1e-3)
    assert r.aggregated == pytest.approx(7.4667, rel=1e-3)


def test_what_each_mode_needs_for_a_rate_and_serves_on_eight_gpus():
    v = dis.recommend(
        lambda _: PROFILE,
        prompt_tokens=PROMPT,
        output_tokens=OUTPUT,
        rate=20.0,
        slo=SLO,
        gpus=8,
        mode=dis.DISAGGREGATED,
        longest_output=64,
    )
    # 20 req/s: aggregated ceil(20 / 7.467) = 3 replicas, 3 GPUs on one 4-GPU node: $4/h.
    # Disaggregated ceil(20 / 9.412) = 3 prefill + ceil(20 / 727.3) = 1 decode: 4 GPUs, one node
    # per pool: $8/h. So aggregation wins, and the stack (disaggregated) loses.
    assert v.aggregated.replicas == (3,) and v.aggregated.gpus == 3 and v.aggregated.usd_per_hour == 4.0
    assert v.disaggregated.replicas == (3, 1) and v.disaggregated.gpus == 4
    assert v.disaggregated.usd_per_hour == 8.0
    assert v.aggregated.goodput_per_gpu == pytest.approx(20 / 3)
    assert v.winner == dis.AGGREGATED and v.mode_loses
    # On 8 GPUs: aggregated 8 x 7.467 = 59.7 req/s; disaggregated 7 prefill + 1 decode:
    # min(7 x 9.412, 727.3) = 65.9 req/s, the best split.
    assert v.aggregated.max_rate == pytest.approx(59.73, rel=1e-3) and v.aggregated.split == (8,)
    assert v.disaggregated.max_rate == pytest.approx(65.88, rel=1e-3) and v.disaggregated.split == (7, 1)


def test_at_equal_cost_the_mode_that_serves_more_on_the_gpus_wins():
    # 5 req/s: aggregated 1 replica ($4/h, one node), disaggregated 1 + 1 on two pools ($8/h) -
    # unless both pools are the same whole node price: give decode no price of its own.
    free_decode = dataclasses.replace(PROFILE, decode=dataclasses.replace(DEC, usd_per_node_hour=0.0))
    v = dis.recommend(
        lambda _: free_decode,
        prompt_tokens=PROMPT,
        output_tokens=OUTPUT,
        rate=5.0,
        slo=SLO,
        gpus=8,
        mode=dis.AGGREGATED,
        longest_output=64,
    )
    assert v.aggregated.usd_per_hour == v.disaggregated.usd_per_hour == 4.0
    # 65.9 (7 + 1) against 59.7 req/s on 8 GPUs: disaggregation, and the aggregated stack loses.
    assert v.winner == dis.DISAGGREGATED and v.mode_loses


def test_a_mode_that_cannot_meet_the_slo_needs_no_replicas_count_and_loses():
    # A TTFT target below one prompt's 0.1 s prefill: no prefill replica can meet it, and the
    # aggregated replica (0.125 s per prompt) cannot either: neither mode wins.
    v = dis.recommend(
        lambda _: PROFILE,
        prompt_tokens=PROMPT,
        output_tokens=OUTPUT,
        rate=1.0,
        slo=dis.Slo(ttft_s=0.09, itl_s=0.05),
        gpus=8,
        mode=dis.AGGREGATED,
        longest_output=8,
    )
    assert v.aggregated.replicas is None and v.disaggregated.replicas is None and v.winner is None
    assert not v.mode_loses
    # An ITL target below the decode step (10 ms) rules out both decoding modes too.
    assert dis.rates(PROFILE, PROMPT, OUTPUT, dis.Slo(ttft_s=1.0, itl_s=0.01)).decode == 0.0


def test_more_prefill_interference_lowers_aggregations_rate():
    # Longer prompts or slower prompt processing take more of each aggregated step: its most
    # requests/s within the SLO falls (strictly, while it meets the SLO at all).
    last = None
    for prompt in (50, 100, 200, 400, 800):
        rate, _, _ = dis.aggregated_rate(AGG, prompt, OUTPUT, dis.Slo(ttft_s=5.0, itl_s=0.05))
        assert last is None or rate < last
        last = rate
    last = None
    for f in (4000.0, 2000.0, 1000.0, 500.0):
        slow = dataclasses.replace(AGG, prefill_tokens_per_s=f, step_s_per_seq=0.0001)
        rate, _, _ = dis.aggregated_rate(slow, PROMPT, OUTPUT, SLO)
        assert last is None or rate < last
        last = rate


def test_disaggregation_is_ahead_from_the_shortest_outputs_when_the_step_eats_the_itl():
    # On 8 one-GPU replicas, disaggregation needs a decode replica: 7 of 8 prefill, and with
    # short outputs decode has room to spare. An aggregated step leaves (ITL - step) / ITL of the
    # replica for prompts. With a 10 ms step that is 0.75 at ITL 40 ms (7/8 = 0.875 is more:
    # P/D ahead at 2 output tokens) and 0.9 at ITL 100 ms (aggregation ahead there).
    def ahead_at_two(itl: float) -> bool:
        r = dis.rates(PROFILE, PROMPT, 2, dis.Slo(ttft_s=5.0, itl_s=itl))
        agg, pd = dis.max_rates(PROFILE, r, 8)
        return pd > agg

    assert ahead_at_two(0.04) and not ahead_at_two(0.1)
    slo = dis.Slo(ttft_s=5.0, itl_s=0.04)
    assert dis.crossover_output_tokens(lambda _: PROFILE, PROMPT, slo, 8, 1000) == 2  # 1 token: no decode


def test_crossover_is_the_first_output_length_from_which_disaggregation_serves_more():
    # Both decodes slow with the output (the KV read grows with the context), so the two modes'
    # rates on 8 GPUs cross. The search's answer is the first switch: aggregation at least as
    # good at every shorter output (checked one by one), disaggregation ahead there.
    def at(output: int) -> dis.Profile:
        agg = dataclasses.replace(AGG, step_s_per_seq=0.00002 * output)
        return dataclasses.replace(
            PROFILE, aggregated=agg, decode=dataclasses.replace(DEC, step_s_per_seq=0.00002 * output)
        )

    slo = dis.Slo(ttft_s=5.0, itl_s=0.1)

    def ahead(output: int) -> bool:
        agg, pd = dis.max_rates(at(output), dis.rates(at(output), PROMPT, output, slo), 8)
        return pd > agg

    o = dis.crossover_output_tokens(at, PROMPT, slo, 8, 5000)
    assert o is not None and ahead(o)
    assert not any(ahead(shorter) for shorter in range(1, o))


def test_the_module_imports_nothing_but_the_standard_library_and_the_node_arithmetic():
    # bench/ calls it with CPU figures: no Pulumi, pydantic, Ray or vLLM may come with it.
    tree = ast.parse(Path(dis.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "dataclasses", "functools", "math", "collections.abc", "infra.sizing.nodes"}
