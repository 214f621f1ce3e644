"""bench/goodput_figures.py: latency as the client sees it, goodput, the crossing and what binds,
worked by hand (no server, no Ray)."""

from __future__ import annotations

import pytest

from bench import cpu
from bench import goodput_figures as gf
from bench.goodput_figures import Request, chunk_intervals, group_chunks, token_gaps
from bench.goodput_load import PROMPT, STREAM


def test_a_chunk_of_three_tokens_after_50_ms_is_one_50_ms_gap_then_two_zero_gaps():
    chunks = [(0.200, 1), (0.250, 3)]
    assert token_gaps(chunks) == pytest.approx([0.050, 0.0, 0.0])
    assert chunk_intervals(chunks) == pytest.approx([0.050])
    # A first chunk of two tokens: its second token came with it.
    assert token_gaps([(0.2, 2)]) == [0.0] and chunk_intervals([(0.2, 2)]) == []


def test_events_of_one_read_are_one_chunk():
    # Ray Serve LLM sends a 50 ms batch of events in one write: the client parses them within
    # microseconds of each other.
    events = [(0.1000, 1), (0.1003, 1), (0.1005, 1), (0.1500, 1), (0.2000, 2)]
    assert group_chunks(events) == [(0.1000, 3), (0.1500, 1), (0.2000, 2)]


def _req(kind: str, chunks, ok: bool = True) -> Request:
    return Request(kind, 0.0, ok, tuple(chunks))


def test_goodput_counts_the_requests_that_met_both_thresholds_over_the_window():
    a = _req(STREAM, [(0.30, 1), (0.35, 1), (0.40, 1)])  # TTFT 0.3, gaps 50 ms
    b = _req(PROMPT, [(0.60, 1), (0.65, 1)])  # TTFT 0.6
    c = _req(STREAM, [(0.20, 1), (0.45, 1)])  # one 250 ms gap
    d = _req(STREAM, [(0.10, 1)], ok=False)  # failed
    e = _req(PROMPT, [(0.10, 1)])  # one token: no gap to hold
    reqs = [a, b, c, d, e]
    # TTFT <= 0.5 s and ITL <= 0.1 s: a and e, over a 10 s window.
    assert gf.goodput(reqs, 0.5, 0.1, 10.0) == {"req_s": pytest.approx(0.2), STREAM: 1, PROMPT: 1}
    # TTFT <= 1 s and ITL <= 0.3 s: all but the failed one.
    assert gf.goodput(reqs, 1.0, 0.3, 10.0) == {"req_s": pytest.approx(0.4), STREAM: 2, PROMPT: 2}


def test_a_request_is_held_to_its_per_token_p99_not_its_mean():
    # 0.2 s to a burst of four tokens: mean gap 50 ms, but the client waited 200 ms once.
    r = _req(STREAM, [(0.1, 1), (0.3, 4)])
    assert r.tpot_s == pytest.approx(0.2 / 4)
    # p99 of [0, 0, 0, 0.2] (numpy's linear interpolation): 0.2 x 0.97.
    assert r.itl_s == pytest.approx(0.194)
    assert not gf.meets(r, 1.0, 0.1) and gf.meets(r, 1.0, 0.2)


def test_the_summary_reports_per_token_itl_beside_chunk_intervals():
    # Bursts of three tokens every 50 ms: most per-token gaps are 0, every chunk 50 ms apart.
    s = _req(STREAM, [(0.10, 1), (0.15, 3), (0.20, 3)])
    p = _req(PROMPT, [(0.40, 2)])
    out = gf.summary([s, p], 10.0, [(0.5, 0.1)])
    assert out["itl_p50_ms"] == pytest.approx(0.0) and out["chunk_interval_p50_ms"] == pytest.approx(50.0)
    assert out["itl_p99_ms"] == pytest.approx(50.0) and out["tokens_per_chunk"] == pytest.approx(7 / 3)
    assert out["ttft_p50_ms"] == pytest.approx(250.0) and out["prompt_ttft_p50_ms"] == pytest.approx(400.0)
    assert out["completed_by_kind"] == {STREAM: 1, PROMPT: 1} and out["output_tokens"] == 9
    assert out["goodput"]["0.5/0.1"]["req_s"] == pytest.approx(0.2)


def _at(gp: dict[str, float], itl_p99: float = 80.0) -> dict:
    return {"goodput": {k: {"req_s": v} for k, v in gp.items()}, "itl_p99_ms": itl_p99}


def test_the_crossing_is_the_lowest_rate_where_pd_serves_more():
    agg = {"1": _at({"0.5/0.1": 2.0, "2/0.2": 3.0}, 120.0), "3": _at({"0.5/0.1": 1.0, "2/0.2": 3.0}, 300.0)}
    pd = {"1": _at({"0.5/0.1": 1.5, "2/0.2": 2.5}, 90.0), "3": _at({"0.5/0.1": 1.5, "2/0.2": 2.0}, 95.0)}
    c = gf.crossing(pd, agg)
    assert c["pairs"]["0.5/0.1"] == {"passes_at": "3", "ratio": {"1": 0.75, "3": 1.5}}
    assert c["pairs"]["2/0.2"]["passes_at"] is None
    assert c["best"] == {
        "rate": "3",
        "pair": "0.5/0.1",
        "ratio": 1.5,
        "met": True,  # >= 1.3
        "itl_p99_ms": {"disaggregated": 95.0, "aggregated": 300.0},
    }


def test_a_threshold_neither_app_meets_is_no_best_ratio_and_one_only_pd_meets_is():
    """make bench-goodput, 2026-12-07 15:01: at ITL <= 0.05 s both apps' bursts miss, 0.58 and
    0.08 req/s, a ratio of 7x between two failures; at the reference pair 6.13 against 4.12."""
    agg = {"1": _at({"0.25/0.05": 0.08, "0.5/0.1": 4.12}, 60.0)}
    pd = {"1": _at({"0.25/0.05": 0.58, "0.5/0.1": 6.13}, 55.0)}
    best = gf.crossing(pd, agg)["best"]
    assert best["pair"] == "0.5/0.1" and best["ratio"] == pytest.approx(6.13 / 4.12) and best["met"]
    # P/D meeting a tight threshold the aggregated app fails (DistServe's case) is the best ratio
    pd_meets = {"1": _at({"0.25/0.05": 5.9, "0.5/0.1": 6.13}, 40.0)}
    assert gf.crossing(pd_meets, agg)["best"]["pair"] == "0.25/0.05"


def test_the_binding_resource_is_a_saturated_engine_else_the_machine():
    binds = {"prefill": "0", "decode": "1", "aggregated": "0-1"}
    decode_bound = cpu.Tally(cpu_s={"engine_decode": 9.5, "engine_prefill": 3.0, "ingress": 2.0}, wall_s=10.0)
    b = gf.binding(decode_bound, 1.0, binds, 2)
    assert b["engine_share_of_cores"] == pytest.approx({"engine_decode": 0.95, "engine_prefill": 0.3})
    assert b["outside_engines_cores"] == pytest.approx(0.2) and b["client_cores"] == pytest.approx(0.1)
    assert b["machine_share"] == pytest.approx((9.5 + 3.0 + 2.0 + 1.0) / 10 / 2)
    assert b["binds"].startswith(cpu.CLASSES["engine_decode"]) and "95% of its 1 core(s)" in b["binds"]
    # The aggregated engine at 80% of its two cores, the rest of the machine busy: the machine binds.
    shared = cpu.Tally(cpu_s={"engine_aggregated": 16.0, "ingress": 1.5, "serve_proxy": 1.0}, wall_s=10.0)
    m = gf.binding(shared, 0.5, binds, 2)
    assert m["engine_share_of_cores"] == pytest.approx({"engine_aggregated": 0.8})
    assert m["binds"] == "the machine's 2 cores, shared by the engines, Ray and the client: 95%"
    idle = gf.binding(cpu.Tally(cpu_s={"engine_aggregated": 2.0}, wall_s=10.0), 0.0, binds, 2)
    assert idle["binds"] is None


def test_our_pd_against_rays_reads_itl_as_time_per_token_where_bursts_make_p50_zero():
    ours = {"1": {"ttft_p50_ms": 110.0, "itl_p50_ms": 0.0, "tpot_mean_ms": 12.0, "chunk_interval_p50_ms": 50.0}}
    ray = {"1": {"ttft_p50_ms": 100.0, "itl_p50_ms": 0.0, "tpot_mean_ms": 10.0, "chunk_interval_p50_ms": 50.0}}
    per_token = {
        "disaggregated": {
            "hops": {"ingress": {"net_ms_per_1k_tokens": 300.0}, "engine_decode": {"net_ms_per_1k_tokens": 9e3}}
        },
        "ray-pd": {
            "hops": {"ingress": {"net_ms_per_1k_tokens": 200.0}, "engine_decode": {"net_ms_per_1k_tokens": 8e3}}
        },
    }
    v = gf.versus_ray({"disaggregated": ours, "ray-pd": ray}, per_token)
    assert v["rates"]["1"] == {
        "ttft_p50": pytest.approx(1.1),
        "itl_p50": pytest.approx(1.2),
        "itl_from": "tpot_mean_ms",
        "chunk_interval_p50": 1.0,
    }
    # Outside the engines only: the ingress, 300 over 200.
    assert v["cpu_ms_per_1k_tokens"]["total"] == {"ours": 300.0, "ray": 200.0, "ratio": 1.5}
    assert v["met"] == {"ttft_p50": True, "itl_p50": False, "cpu": False}
