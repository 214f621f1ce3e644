"""docs/performance.md is rendered from the benchmarks' JSON, not typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from bench import report
from tests.bench.test_data_plane import REP, RUNS

TEMPLATE = (Path(report.__file__).parent / "performance.md.in").read_text()


def _summary(ttft: float, tok_s: float) -> dict:
    return {
        "requests": 8,
        "errors": 0,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 2,
        "tpot_p50_ms": 5.0,
        "itl_p50_ms": 1.0,
        "output_tok_s": tok_s,
        "req_s": 2.0,
    }


SERVING = {
    "date": "2026-11-30 05:40 UTC",
    "machine": {"cpus": 2, "load_average_at_end": [3.0, 3.0, 3.0]},
    "workload": {"requests_total": 24},
    "wall_s": 300.0,
    "targets": {
        "disaggregated": {"1": _summary(50.0, 90.0), "16": _summary(200.0, 700.0)},
        "aggregated": {"1": _summary(40.0, 100.0), "16": _summary(150.0, 950.0)},
        "vllm": {"1": _summary(30.0, 100.0), "16": _summary(100.0, 1000.0)},
    },
    "ratios_vs_vllm": {
        "disaggregated": {
            "1": {"ttft_p50_ms": 50 / 30, "output_tok_s": 0.9},
            "16": {"ttft_p50_ms": 2.0, "output_tok_s": 0.7},
        },
        "aggregated": {
            "1": {"ttft_p50_ms": 40 / 30, "output_tok_s": 1.0},
            "16": {"ttft_p50_ms": 1.5, "output_tok_s": 0.95},
        },
    },
    "hop_rows": {"client_ttft": "client TTFT", "kv_transfer": "KV transfer"},
    "hops_ms": {
        "disaggregated": {
            "1": {"client_ttft": 50.0, "kv_transfer": 3.0},
            "16": {"client_ttft": 200.0, "kv_transfer": None},
        }
    },
    "kv_transfer": {"bytes_per_request": 1000.0, "kv_tokens_per_request": 200.0, "xfer_ms_per_transfer": 10.0},
    "start_times": {"warm": {"ready_s": 44.0, "steps": [{"at_s": 0.0, "step": "building"}]}},
}


def test_page_carries_the_run_and_marks_each_bar():
    page = report.render(SERVING, None, TEMPLATE)
    assert "{{" not in page
    assert "2026-11-30 05:40 UTC" in page
    assert "| disaggregated output tok/s ÷ vLLM at conc 16 >= 0.8 | 0.70 | no |" in page
    assert "| aggregated TTFT p50 ÷ vLLM at conc 1 <= 1.5 | 1.33 | yes |" in page
    # Issue 27's bars: concurrency 16's TTFT too, and its tighter throughput bar.
    assert "| aggregated TTFT p50 ÷ vLLM at conc 16 <= 1.5 | 1.50 | yes |" in page
    assert "| disaggregated TTFT p50 ÷ vLLM at conc 16 <= 3.0 | 2.00 | yes |" in page
    assert "| aggregated output tok/s ÷ vLLM at conc 16 >= 0.95 | 0.95 | yes |" in page
    assert "| warm `make serve` READY <= 45 s | 44 s | yes |" in page
    assert "| KV transfer | 3.0 | - |" in page
    assert "run `make bench-prefix`" in page


def test_page_says_how_the_pd_requests_were_prefilled_when_the_run_read_it():
    run = {**SERVING, "serving_mode": {"1": {"remote": 32}, "16": {"local:kv_timeout": 8, "remote": 120}}}
    page = report.render(run, None, TEMPLATE)
    assert "c1 100% of 32 remote; c16 94% of 128 remote (local:kv_timeout 8)." in page
    # A run from before the bench read the counter: the page says nothing rather than 0%.
    assert "prefilled by the prefill tier" not in report.render(SERVING, None, TEMPLATE)


def test_prefix_section():
    prefix = {
        "date": "d",
        "workload": {"prefix_tokens": 512},
        "apps": {
            "p2c": {
                "router": "power-of-two",
                "requests": 10,
                "errors": 0,
                "ttft_p50_ms": 20.0,
                "ttft_p99_ms": 40.0,
                "prefix_cache_hit_rate": 0.5,
                "prefill_tokens_computed": 1200.0,
                "requests_per_prefill_replica": {"a": 4, "b": 6},
            }
        },
    }
    page = report.render(None, prefix, TEMPLATE)
    assert "| power-of-two | 10 | 0 | 20.0 (1.00x) | 40.0 (1.00x) | 50.0% | 1,200 (1.00x) | [4, 6] |" in page
    assert 'Run of d; workload {"prefix_tokens": 512}.' in page
    # `make bench` on a machine without prefix.json keeps the section whole, its run's date too.
    again = report.render(SERVING, None, TEMPLATE, previous=page)
    assert 'Run of d; workload {"prefix_tokens": 512}.' in again
    assert "| power-of-two | 10 | 0 | 20.0 (1.00x) |" in again and "run `make bench-prefix`" not in again
    # The multi-turn run has its own section, under its heading, kept the same way.
    turns = {**prefix, "date": "mt", "workload": {"turns": 4}}
    both = report.render(None, prefix, TEMPLATE, multi_turn=turns)
    heading = both.index("### The same routers on a multi-turn workload")
    assert (
        both.index('Run of d; workload {"prefix_tokens": 512}.')
        < heading
        < both.index('Run of mt; workload {"turns": 4}.')
    )
    kept = report.render(SERVING, None, TEMPLATE, previous=both)
    assert 'Run of d; workload {"prefix_tokens": 512}.' in kept and 'Run of mt; workload {"turns": 4}.' in kept
    assert "PREFIX_WORKLOAD=multi-turn`)" not in kept


def test_readme_block_is_replaced_between_the_markers_only():
    text = f"intro\n{report.BEGIN}\nold figures\n{report.END}\noutro\n"
    out = report.replace_block(text, report.headline(SERVING))
    assert out.startswith("intro\n") and out.endswith(f"{report.END}\noutro\n")
    assert "old figures" not in out and "2026-11-30 05:40 UTC" in out


def test_floor_adds_the_serve_hops_to_plain_vllms_ttft_p50():
    from bench.report import floor_text

    rep = {
        "targets": {"vllm": {"1": {"ttft_p50_ms": 40.0}}},
        "hops_ms": {
            "aggregated": {"1": {"proxy_to_ingress": 10.0, "ingress_to_engine": 30.0}},
            "disaggregated": {
                "1": {
                    "proxy_to_ingress": 10.0,
                    "ingress_to_engine": 30.0,
                    "decode_to_prefill": 10.0,
                    "prefill_leg": 70.0,
                }
            },
        },
    }
    text = floor_text(rep)
    assert "floor at 2.00x" in text  # (40 + 40) / 40
    assert "floor at 4.00x" in text  # (40 + 120) / 40
    assert "no concurrency-1 breakdown" in floor_text({"hops_ms": {}})


def test_prefix_verdict_says_what_each_router_bought_against_power_of_two():
    from bench.report import prefix_table, prefix_verdict

    def pre(aff_ttft, kv_hit):
        return {
            "apps": {
                "p2c": {"router": "power-of-two", "prefix_cache_hit_rate": 0.4, "ttft_p50_ms": 100.0},
                "affinity": {"router": "prefix-cache-affinity", "prefix_cache_hit_rate": 0.6, "ttft_p50_ms": aff_ttft},
                "kv": {"router": "kv-aware", "prefix_cache_hit_rate": kv_hit, "ttft_p50_ms": 90.0},
            }
        }

    text = prefix_verdict(pre(80.0, 0.7))
    assert "The affinity router raised the prefill tier's prefix-cache hit rate from 40.0% to 60.0%" in text
    assert "cut TTFT p50 from 100.0 to 80.0 ms" in text
    assert "at least as high as prefix affinity's" in text
    assert "waited" not in text  # no scorer counts: nothing said of its wait
    text = prefix_verdict(pre(110.0, 0.5))
    assert "did not fall" in text and "below prefix affinity's" in text
    waited = pre(80.0, 0.7)
    waited["apps"]["kv"].update(routed={"scored": 90.0, "timeout": 10.0, "skipped": 50.0}, scorer_wait_s={"m": 2.5})
    assert "Each KV-routed request waited 25.0 ms on the scorer" in prefix_verdict(waited)
    both = pre(80.0, 0.7)
    for a, (computed, per) in zip(
        both["apps"].values(), [(1000.0, [30, 30]), (500.0, [40, 20]), (250.0, [35, 25])], strict=False
    ):
        a.update(
            requests=60,
            errors=0,
            ttft_p99_ms=200.0,
            prefill_tokens_computed=computed,
            requests_per_prefill_replica=dict(enumerate(per)),
        )
    table = prefix_table(both)
    assert "| kv-aware | 60 | 0 | 90.0 (0.90x) |" in table and "250 (0.25x)" in table


def test_cpu_and_gap_sections_from_the_run():
    from bench import cpu

    def fig(non_engine_ms: float, ratio: float | None) -> dict:
        tally = cpu.Tally(cpu_s={"ingress": non_engine_ms / 1000 * 10, "engine_decode": 1.0})
        out = cpu.figures(tally, requests=10, output_tokens=500)
        if ratio is not None:
            out["non_engine_vs_vllm_api_server"] = ratio
        return out

    rep = {
        **SERVING,
        "cpu": {
            "aggregated": {"1": fig(12.0, 1.5), "all": fig(12.0, 1.5)},
            "disaggregated": {"1": fig(40.0, 4.0), "all": fig(40.0, 3.5)},
        },
        "chunk_gaps": {
            "aggregated": {
                "1": {"streams": 8, "chunks": 400, "gap_p50_ms": 0.1, "gap_p99_ms": 52.0, "tail_share": 0.12}
            }
        },
    }
    page = report.render(rep, None, TEMPLATE)
    assert "| ingress replicas | 12.0 | 12.0 | 40.0 | 40.0 |" in page
    assert "| aggregated non-engine CPU per request ÷ plain vLLM API server <= 2.0 | 1.50 | yes |" in page
    assert "| disaggregated non-engine CPU per request ÷ plain vLLM API server <= 3.0 | 3.50 | no |" in page
    assert "| aggregated | 1 | 8 | 400 | 0.1 | 52.0 | 12% |" in page
    # A run from before the sampler says so instead of showing empty tables.
    old = report.render(SERVING, None, TEMPLATE)
    assert old.count(report.NOT_MEASURED) == 2


def test_haproxy_mode_reads_dash_for_the_untraced_proxy_hop_and_floors_without_it():
    from bench import hops
    from bench.report import floor_text, hops_table

    rep = {
        "targets": {"vllm": {"1": {"ttft_p50_ms": 40.0}}},
        "hop_rows": dict(hops.HOP_ROWS),
        "hops_ms": {
            # Serve's HAProxy mode: the ingress's span is the root, no proxy span.
            "aggregated": {"1": {"proxy_to_ingress": None, "ingress_to_engine": 20.0}},
            "vllm": {"1": {"client_ttft": 30.0}},
        },
    }
    table = hops_table(rep)
    assert "| proxy -> ingress replica (Serve tracing; HAProxy: not traced, -) | - | - |" in table
    text = floor_text(rep)
    assert "(20.0 = 20.0 ms" in text and "HAProxy to the ingress not traced" in text
    assert "floor at 1.50x" in text  # (40 + 20) / 40


# --- make bench-data-plane's section (bench/data_plane.py summary, on its tests' synthetic run) ---
def test_the_page_renders_the_data_plane_section_from_the_json():
    page = report.render(None, None, TEMPLATE, json.loads(json.dumps(REP)))
    assert "{{" not in page
    assert "Run of 2026-12-02 01:00 UTC: data planes ray-proxy, grpc, haproxy, 2 rounds" in page
    assert "concurrency 1: 24, 16: 64" in page
    assert "| aggregated c1 TTFT p50 ms | 90.0 (80.0–100.0) | 71.0 (70.0–72.0) | 0.80 (0.70–0.90) |" in page
    assert "| HAProxy (Serve's HTTP front in haproxy mode) | - | - | - | 1.2 (1.0–1.4) | - |" in page
    failed = {**REP, "runs": [*RUNS, {"round": 2, "data_plane": "grpc", "error": "x"}]}
    assert "Failed, left out: grpc round 3." in report.render(None, None, TEMPLATE, failed)
    # No run yet: the section says how to get one, as the prefix section does.
    assert "(run `make bench-data-plane`)" in report.render(None, None, TEMPLATE)


def test_a_section_whose_benchmark_was_not_rerun_keeps_its_last_run():
    """`make bench` rewrites the page; the data-plane figures of an earlier `make
    bench-data-plane` (its JSON not here) stay, with their own run's date."""
    earlier = report.render(None, None, TEMPLATE, json.loads(json.dumps(REP)))
    page = report.render(None, None, TEMPLATE, None, previous=earlier)
    assert "Run of 2026-12-02 01:00 UTC: data planes ray-proxy, grpc, haproxy, 2 rounds" in page
    assert page == earlier
    assert "(run `make bench-data-plane`)" in report.render(None, None, TEMPLATE, None, previous="another page")


def test_the_switches_table_names_the_data_plane_and_why_direct_streaming_is_not_used():
    page = report.render(None, None, TEMPLATE)
    row = next(line for line in page.splitlines() if line.startswith("| `RAY_SERVE_ENABLE_HA_PROXY`"))
    assert "`serving.ingress.dataPlane`" in row and "`haproxy` (default)" in row and "make bench-data-plane" in row
    ds = next(line for line in page.splitlines() if line.startswith("| `RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`"))
    assert "one model per application" in ds and "ASGI middleware" in ds and "Not used" in ds


def test_the_per_token_and_tracing_sections_from_the_run():
    from bench import cpu, per_token

    tallies = {
        "disaggregated": {
            "1": cpu.Tally(
                cpu_s={"pd_orchestration": 0.11, "ingress": 0.03}, wall_s=1.0, busiest_s={"pd_orchestration": 0.099}
            )
        },
        "vllm": {"1": cpu.Tally(cpu_s={"vllm_api_server": 0.1}, wall_s=1.0)},
    }
    counts = {"disaggregated": {"1": (2, 100)}, "vllm": {"1": (2, 100)}}
    fig = per_token.run(tallies, counts, {"disaggregated": {"pd_orchestration": 0.01}})
    rep = {
        **SERVING,
        "per_token": fig,
        "idle_phase": {"seconds": 25.0},
        "tracing": {"sample_rate": 0.01, "source": "the prod stack's default"},
        "hops_from": "the prod-rate pass",
    }
    page = report.render(rep, None, TEMPLATE)
    assert "Idle phase: 25 s with no traffic" in page
    # (0.11 - 0.01) CPU-s over 100 tokens = 1,000 CPU-ms per 1,000 tokens: 1,000 tokens/s per core, 1.0x vLLM's;
    # its busiest thread 0.099 of its 0.11 CPU-s.
    assert (
        "| disaggregated | P/D orchestration: decode replica outside the engine | 1.0 | 1,100.0 | 1,000.0 | 1,000 | 90.0 | 1.00 |"
        in page
    )
    assert (
        "decode replica outside the engine, CPU per 1,000 output tokens net of idle ÷ plain vLLM API server <= 1.5 | 1.00x | yes |"
        in page
    )
    assert "Serve's tracing sampled 0.01 of requests" in page and "BENCH_TRACED=1" in page
    traced = {**rep, "tracing_cost": per_token.tracing_cost(fig, fig)}
    assert "| disaggregated | non-engine total, CPU-ms per request | 0.0 |" in report.render(traced, None, TEMPLATE)
    # A run from before the idle phase says so.
    assert report.render(SERVING, None, TEMPLATE).count(report.NOT_YET) == 2
