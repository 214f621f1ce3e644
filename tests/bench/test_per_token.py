"""CPU per output token, net of idle, its streaming ceiling and the issue's verdicts
(bench/per_token.py): every expected figure below is worked out by hand in the comments."""

from __future__ import annotations

import pytest

from bench import cpu, per_token


def test_the_ceiling_is_the_tokens_one_core_carries():
    # 500 CPU-ms per 1,000 tokens is 0.5 CPU-ms per token: 1,000 CPU-ms in a core-second -> 2,000 tokens/s.
    assert per_token.ceiling_tok_s_per_core(500.0) == pytest.approx(2000.0)
    # 4 CPU-ms per token -> 250 tokens/s.
    assert per_token.ceiling_tok_s_per_core(4000.0) == pytest.approx(250.0)
    assert per_token.ceiling_tok_s_per_core(None) is None


def test_idle_shares_and_the_net_of_idle():
    # 0.5 CPU-s over a 25 s window is 2% of a core.
    assert per_token.idle_cores({"raylet": 0.5}, 25.0) == pytest.approx({"raylet": 0.02})
    # 3 CPU-s over 10 s of batches, 0.05 of a core idle: 3 - 0.5 = 2.5; never below zero.
    net = per_token.net_of_idle({"raylet": 3.0, "gcs": 0.1}, {"raylet": 0.05, "gcs": 0.5}, 10.0)
    assert net == pytest.approx({"raylet": 2.5, "gcs": 0.0})


def _tallies() -> dict[str, dict[str, cpu.Tally]]:
    return {
        # Two levels; pooled: ingress 3.0, decode outside the engine 9.0, raylet 1.0, engine 20.0
        # CPU-s over 4 + 6 = 10 s of batches.
        "disaggregated": {
            # The decode replica's busiest thread (its event loop): 3.0 + 4.5 of its 9.0 CPU-s.
            "1": cpu.Tally(
                cpu_s={"ingress": 1.0, "pd_orchestration": 4.0, "raylet": 0.5, "engine_decode": 10.0},
                wall_s=4.0,
                busiest_s={"pd_orchestration": 3.0},
            ),
            "16": cpu.Tally(
                cpu_s={"ingress": 2.0, "pd_orchestration": 5.0, "raylet": 0.5, "engine_decode": 10.0},
                wall_s=6.0,
                busiest_s={"pd_orchestration": 4.5},
            ),
        },
        "vllm": {"1": cpu.Tally(cpu_s={"vllm_api_server": 8.0, "vllm_engine": 30.0}, wall_s=10.0)},
    }


COUNTS = {"disaggregated": {"1": (40, 4000), "16": (60, 6000)}, "vllm": {"1": (100, 10000)}}
IDLE = {
    "disaggregated": {"ingress": 0.01, "pd_orchestration": 0.02, "raylet": 0.05, "engine_decode": 0.03},
    "vllm": {"vllm_api_server": 0.0},
    "stack": {"ingress": 0.02, "aggregated_server": 0.01, "raylet": 0.05, "engine_decode": 0.03},
}


def test_per_hop_raw_net_ceiling_and_ratio_to_plain_vllm():
    fig = per_token.run(_tallies(), COUNTS, IDLE)
    pd = fig["disaggregated"]
    assert (pd["requests"], pd["output_tokens"], pd["wall_s"]) == (100, 10000, 10.0)
    dec = pd["hops"]["pd_orchestration"]
    # raw: 9.0 CPU-s x 1e6 / 10,000 tokens = 900; net: 9.0 - 0.02 x 10 = 8.8 -> 880.
    assert dec["raw_ms_per_1k_tokens"] == pytest.approx(900.0)
    assert dec["net_ms_per_1k_tokens"] == pytest.approx(880.0)
    assert dec["ceiling_tok_s_per_core"] == pytest.approx(1e6 / 880)  # about 1,136 tokens/s per core
    # plain vLLM's API server: 8.0 CPU-s, no idle, 10,000 tokens -> 800; 880 / 800 = 1.1.
    assert fig["vllm"]["hops"]["vllm_api_server"]["net_ms_per_1k_tokens"] == pytest.approx(800.0)
    assert dec["net_vs_vllm_api_server"] == pytest.approx(1.1)
    # Its event loop's share of its CPU at the top level (16 streams), raw: 4.5 / 5.0, not the
    # pooled 7.5 / 9.0; none where threads were not read.
    assert dec["busiest_thread_share"] == pytest.approx(0.9)
    assert pd["hops"]["raylet"]["busiest_thread_share"] is None
    # ingress: 3.0 - 0.01 x 10 = 2.9 -> 290; 290 / 800 = 0.3625.
    assert pd["hops"]["ingress"]["net_vs_vllm_api_server"] == pytest.approx(0.3625)
    # Non-engine per request: raw (3 + 9 + 1) CPU-s / 100 = 130 ms; net (2.9 + 8.8 + 0.5) / 100 = 122 ms;
    # plain vLLM's 8.0 / 100 = 80 ms -> 122 / 80 = 1.525.
    assert pd["non_engine_ms_per_request"] == pytest.approx({"raw": 130.0, "net": 122.0})
    assert pd["non_engine_net_vs_vllm_api_server"] == pytest.approx(1.525)
    # Idle outside the engines: 0.01 + 0.02 + 0.05 = 8% of a core; the whole stack 0.02 + 0.01 + 0.05.
    assert pd["idle_non_engine_cores"] == pytest.approx(0.08)
    assert fig["stack_idle_cores"] == pytest.approx(0.08)


def test_verdicts_name_each_target_with_its_ratio():
    rows = {name: (shown, met) for name, _, shown, met in per_token.verdicts(per_token.run(_tallies(), COUNTS, IDLE))}
    dec = "disaggregated P/D orchestration: decode replica outside the engine"
    assert rows[f"{dec}, CPU per 1,000 output tokens net of idle ÷ plain vLLM API server <= 1.5"] == ("1.10x", "yes")
    assert rows[
        "disaggregated ingress replicas, CPU per 1,000 output tokens net of idle ÷ plain vLLM API server <= 0.5"
    ] == ("0.36x", "yes")
    # 122 / 80 = 1.525 (shown to two places), within 3.0.
    assert rows["disaggregated non-engine CPU per request net of idle ÷ plain vLLM API server <= 3.0"][1] == "yes"
    assert rows["disaggregated app + Ray's shared processes idle, outside the engines <= 10% of a core"] == (
        "8.0%",
        "yes",
    )
    # No aggregated target in this run: its rows say so instead of passing.
    assert rows["aggregated non-engine CPU per request net of idle ÷ plain vLLM API server <= 2.0"] == ("-", "-")
    # Twice the decode hop's net CPU (18.0 - 0.2 = 17.8 CPU-s -> 1,780 per 1k) is 2.225x: not met.
    heavy = _tallies()
    heavy["disaggregated"]["16"].cpu_s["pd_orchestration"] = 14.0
    rows2 = {n: (s, m) for n, _, s, m in per_token.verdicts(per_token.run(heavy, COUNTS, IDLE))}
    assert rows2[f"{dec}, CPU per 1,000 output tokens net of idle ÷ plain vLLM API server <= 1.5"] == ("2.23x", "no")


def test_tracing_cost_is_the_traced_pass_minus_the_prod_rate_pass():
    prod = per_token.run(_tallies(), COUNTS, IDLE)
    traced_t = _tallies()
    # 1.2 CPU-s more in the decode replica over 10,000 tokens: +120 CPU-ms per 1,000 tokens, +12 ms per request.
    traced_t["disaggregated"]["16"].cpu_s["pd_orchestration"] += 1.2
    cost = per_token.tracing_cost(prod, per_token.run(traced_t, COUNTS, IDLE))
    assert cost["disaggregated"]["ms_per_1k_tokens"]["pd_orchestration"] == pytest.approx(120.0)
    assert cost["disaggregated"]["ms_per_1k_tokens"]["ingress"] == pytest.approx(0.0)
    assert cost["disaggregated"]["non_engine_ms_per_request"] == pytest.approx(12.0)
    assert cost["vllm"]["ms_per_1k_tokens"]["vllm_api_server"] == pytest.approx(0.0)  # the drift between passes
    assert "stack_idle_cores" not in cost


def test_tables_show_non_engine_hops_and_the_idle_line():
    fig = per_token.run(_tallies(), COUNTS, IDLE)
    table = per_token.format_markdown(fig)
    assert (
        "| disaggregated | P/D orchestration: decode replica outside the engine | 2.0 | 900.0 | 880.0 | 1,136 | 90.0 | 1.10 |"
        in table
    )
    assert "engine core and workers" not in table
    assert "disaggregated 8.0%" in per_token.idle_line(fig) and "whole local stack" in per_token.idle_line(fig)
    rows = per_token.tracing_rows(per_token.tracing_cost(fig, fig))
    assert ["disaggregated", "non-engine total, CPU-ms per request", "0.0"] in rows


def test_rays_own_floor_is_reported_beside_the_stack_and_is_no_target():
    """bench/idle_floor.py's figures (the bare cluster, no Serve app) under RAY_FLOOR: one number
    in the idle line, outside the engines like the rest, and not a target of the verdicts."""
    idle = {**IDLE, per_token.RAY_FLOOR: {"raylet": 0.03, "gcs": 0.01, "other_ray": 0.025, "engine_decode": 0.5}}
    fig = per_token.run(_tallies(), COUNTS, idle)
    assert fig["ray_floor_idle_cores"] == pytest.approx(0.065)
    assert per_token.RAY_FLOOR not in fig
    line = per_token.idle_line(fig)
    assert "Ray's own floor" in line and "6.5%" in line and "disaggregated 8.0%" in line
    assert per_token.verdicts(fig) == per_token.verdicts(per_token.run(_tallies(), COUNTS, IDLE))
    assert "Ray's own floor" not in per_token.idle_line(per_token.run(_tallies(), COUNTS, IDLE))
