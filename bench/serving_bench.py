"""`make bench`: the disaggregated app vs the aggregated app vs vLLM's own server, on CPU.

What flows through here: a seeded workload (vLLM's `random` dataset: prompt and output
lengths uniform in the ranges below, random token ids of the tiny model) -> vLLM's own
benchmark client (`vllm.benchmarks.serve`, bench/vllm_load.py) sending streamed
/v1/completions requests at several concurrency levels to three targets in the same run:
  (a) disaggregated  the P/D app `make serve` runs (Ray Serve LLM, prefill -> NIXL -> decode)
  (b) aggregated     the single-engine app with the same model, in the same Ray cluster
  (c) vllm           `python -m vllm.entrypoints.openai.api_server`, same model, no Ray Serve
-> per-request timings -> bench.stats figures per target and concurrency, ratios a/c and
b/c; every chunk's arrival -> the gaps between chunks and the share held to a stream's end
(bench/gaps.py); the CPU time of every process of each target around each batch, and over an
idle phase before the load -> CPU-ms per request and per 1,000 output tokens per hop, net of
idle, and each hop's streaming ceiling (bench/cpu.py, bench/per_token.py); Ray Serve's spans
(traced at a prod stack's ratio; --traced-pass: a second pass tracing every request, whose
CPU difference is tracing's own cost) and the engines' vLLM metrics around each level -> the
per-hop breakdown of the time to first token (bench/hops.py); decode's NIXL counters per
request; the cold and warm start of `make serve` (bench/start_times.py) -> tables on screen
and build/bench/serving.json. `main` reads as that pipeline: parse the options -> time `make
serve` -> start the targets and run the levels (run_targets) -> the figures (analyse,
build_report) -> the JSON, the plot and the tables. What the targets are read with beside
the load (metrics, Serve's apps, spans, idle CPU) is bench/observe.py.

Each concurrency level runs in rounds; each round sends the same requests to every target,
and the order of targets rotates from round to round, so drift in the machine (thermal,
background work, other jobs) hits all three alike. All three share this machine's cores.
A benchmark prints figures; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from bench import BENCH_DIR, cpu, gaps, hops, idle_floor, observe, per_token, plots, vllm_load
from bench.observe import KV_KEYS, idle_cpu, kv_totals, read_spans, roles, settled, stack_apps
from bench.plain_vllm import vllm_server, wait_healthy
from bench.start_times import save_start_times, start_times
from bench.stats import (
    RequestResult,
    aligned,
    format_table,
    kv_backends,
    kv_transfer_per_request,
    ratios,
    samples,
    summarize,
)
from infra.config.observability import Tracing

DEFAULT_OUT = BENCH_DIR / "serving.json"
TARGETS = ("disaggregated", "aggregated", "vllm")
BASELINE = "vllm"

# The workload: stated here so the report can quote it.
INPUT_LEN = (32, 384)  # prompt tokens, uniform
OUTPUT_LEN = (16, 96)  # output tokens, uniform (ignore_eos: exactly this many)
LEVELS = {1: 32, 4: 64, 16: 128}  # concurrency -> requests per target
HOP_LEVELS = (1, 16)  # the breakdown's columns
ROUNDS = 4
WARMUP = 4
# One engine per role in every bench stack (make bench-data-plane's too): a decode replica Serve
# started and stopped within a level was counted as streaming cost; make bench-scaling scales.
FIXED_LAYOUT = ["--fixed-replicas"]

# Serve's request tracing: Ray's own file exporter (ray/serve/_private/constants.py
# DEFAULT_TRACING_EXPORTER_IMPORT_PATH) at the ratio a prod stack renders (its environment's
# default, infra/config/observability.py: one source of truth with the stacks), so the Ray
# targets pay what they pay in prod; --traced-pass adds a pass with every request traced (the
# hop breakdown's spans, and tracing's own CPU cost). Nothing else: Ray exports metrics every
# 10 s as in a prod pod (`observe.settled` waits that out); a 1 s export here made every Ray
# process push ten times as often, 8-9 points of a core of the idle stack's 25 (2026-12-06).
PROD_TRACE_SAMPLE_RATE = Tracing().rate_for("prod")
EVERY_REQUEST = 1.0
IDLE_S = 25.0  # the idle phase: no traffic, after the warm-up, before the load


def bench_env(sample_rate: float) -> dict[str, str]:
    """The Ray stack's extra environment for the bench, tracing at `sample_rate`."""
    return {
        "RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH": "ray.serve._private.tracing_utils:default_tracing_exporter",
        "RAY_SERVE_TRACING_SAMPLING_RATIO": repr(sample_rate),
    }


BENCH_ENV = bench_env(PROD_TRACE_SAMPLE_RATE)


def length_shape(lo: int, hi: int) -> tuple[int, float]:
    """vLLM's random dataset draws lengths uniformly in len * (1 - r) .. len * (1 + r)."""
    center = (lo + hi) / 2
    return round(center), (hi - lo) / (hi + lo)


def load_for(url: str, key: str | None, model: str, tokenizer: str, n: int, conc: int, seed: int) -> vllm_load.Load:
    """One batch of the main workload against one target (url: its OpenAI base, ending in /v1)."""
    in_len, in_r = length_shape(*INPUT_LEN)
    out_len, out_r = length_shape(*OUTPUT_LEN)
    return vllm_load.Load(
        base_url=url.removesuffix("/v1"),
        model=model,
        tokenizer=tokenizer,
        num_prompts=n,
        concurrency=conc,
        seed=seed,
        input_len=in_len,
        output_len=out_len,
        input_range_ratio=in_r,
        output_range_ratio=out_r,
        api_key=key,
    )


# --- the load, level by level -------------------------------------------------------------------
# One batch against one target: (target, requests, concurrency, seed) -> results, duration (s).
Send = Callable[[str, int, int, int], tuple[list[RequestResult], float]]


def sender(
    urls: Mapping[str, str], keys: Mapping[str, str | None], model: str, tokenizer: str, log: TextIO | None
) -> Send:
    """Batches of the main workload through vLLM's client, to the target's URL with its key."""

    def send(t: str, n: int, conc: int, seed: int) -> tuple[list[RequestResult], float]:
        return vllm_load.run(load_for(urls[t], keys[t], model, tokenizer, n, conc, seed), log=log)

    return send


def warm_up(send: Send, targets: Sequence[str], seed: int) -> None:
    """A few requests to each target; the first failure stops the run."""
    for t in targets:
        res, _ = send(t, WARMUP, 2, seed)
        bad = [r.error for r in res if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up against {t} failed: {bad[0]}")


@dataclass
class Level:
    """What one concurrency level gave each target, its rounds pooled."""

    results: dict[str, list[RequestResult]]
    duration_s: dict[str, float]
    window: tuple[float, float]  # epoch seconds: the level's start and end


def run_level(
    send: Send,
    targets: Sequence[str],
    conc: int,
    n: int,
    *,
    rounds: int,
    seed: int,
    meter: cpu.Meter,
    apps: Mapping[str, str],
    shift: int = 0,
    say: Callable[[str], None] | None = None,
) -> Level:
    """`n` requests per target at concurrency `conc`, split over `rounds`. Each round sends
    the same prompts (one seed) to every target, in an order that rotates from round to round
    (starting `shift` along); the meter counts each batch's CPU for its target (`apps`:
    target -> Serve app name; a target not in it is plain vLLM)."""
    start = time.time()
    out = Level(results={t: [] for t in targets}, duration_s={t: 0.0 for t in targets}, window=(start, start))
    for r in range(rounds):
        k = (r + shift) % len(targets)
        order = [*targets[k:], *targets[:k]]
        per_round = n // rounds + (1 if r < n % rounds else 0)
        for t in order:
            with meter.batch(t, str(conc), apps.get(t)):
                res, dur = send(t, per_round, conc, seed + 1000 * conc + r)
            out.results[t].extend(res)
            out.duration_s[t] += dur
        if say is not None:
            say(f"concurrency {conc}: round {r + 1}/{rounds} done ({' -> '.join(order)})")
    out.window = (start, time.time())
    return out


def parse_levels(text: str) -> dict[int, int]:
    """ "1:32,16:128" -> {concurrency: requests per target}."""
    return {int(c): int(n) for c, n in (x.split(":") for x in text.split(","))}


def machine_info() -> dict[str, Any]:
    """The machine the run took, for the JSON: cores, platform, Python, the load at the end."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_end": list(os.getloadavg()),
    }


def cpu_counts(summaries: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, dict[str, tuple[int, int]]]:
    """target -> level -> (completed requests, output tokens): what bench.cpu divides by."""
    return {
        t: {str(c): (int(s["completed"] or 0), int(s["output_tokens"] or 0)) for c, s in by.items()}
        for t, by in summaries.items()
    }


# --- the stacks (tests/bench/test_serving_bench.py builds what they deploy, without Ray) ---------
def stack_options(sample_rate: float = PROD_TRACE_SAMPLE_RATE) -> dict[str, Any]:
    """background_stack's arguments for targets a and b: both apps, FIXED_LAYOUT, tracing at `sample_rate`."""
    return {"mode": "both", "api_key": "sk-bench", "extra_env": bench_env(sample_rate), "extra_args": FIXED_LAYOUT}


# --- the run ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving_bench", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=20260101)
    p.add_argument(
        "--levels",
        default=",".join(f"{c}:{n}" for c, n in LEVELS.items()),
        help="concurrency:requests per target, comma-separated (default %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-start-times", action="store_true", help="skip timing a cold and a warm `make serve`")
    p.add_argument(
        "--start-times-only",
        action="store_true",
        help="only time a cold and a warm `make serve`, and add the figures to an existing --out file",
    )
    p.add_argument(
        "--traced-pass",
        action="store_true",
        help="run the levels again on a stack that traces every request: the hop breakdown's spans, and "
        "tracing's own CPU cost (that pass - the prod-rate one)",
    )
    p.add_argument("--idle-s", type=float, default=IDLE_S, help="the idle phase's window (default %(default)s s)")
    return p.parse_args(argv)


def _say(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)


@dataclass
class Measured:
    """What the three targets gave, level by level, and what was read around them."""

    results: dict[str, dict[int, list[RequestResult]]]
    durations: dict[str, dict[int, float]]
    windows: dict[int, tuple[float, float]]  # concurrency -> the level's epoch start and end
    snaps: list[dict[str, list[hops.Sample]]]  # metric URL -> scrape: before the first level, after each
    metric_urls: list[str]  # decode node, prefill node, vLLM's server
    spans: list[hops.Span]
    apps: dict[str, str]  # target -> Serve app name
    served: dict[str, dict[str, Any]]  # Serve's view of each app (serve_apps)
    idle: dict[str, dict[str, float]]
    tallies: dict[str, dict[str, cpu.Tally]]  # cpu.Meter.tallies: target -> level -> CPU
    backend: str  # the NIXL backend of the deployed config
    sample_rate: float = PROD_TRACE_SAMPLE_RATE  # Serve's tracing ratio of this pass
    # The idle phase: name (a target, or "stack": both apps) -> hop -> share of a core.
    idle_hops: dict[str, dict[str, float]] = field(default_factory=dict)


def run_targets(
    args: argparse.Namespace,
    levels: dict[int, int],
    model_dir: str,
    logs: Path,
    client_log: TextIO,
    say: Callable[[str], None],
    sample_rate: float = PROD_TRACE_SAMPLE_RATE,
) -> Measured:
    """Targets a and b (the local Ray stack, Serve tracing at `sample_rate`) and c (vLLM's
    server) up; warm-up, idle CPU, the idle phase (`--idle-s` with no traffic, every process's
    CPU per hop), then every level in rounds, the engines' metrics settled around each; all
    stopped after."""
    from local.background import background_stack
    from local.config import HOST, MODEL_ID, local_target
    from local.procs import free_port

    vport = free_port()
    vroot = f"http://{HOST}:{vport}"
    say(
        f"starting vLLM's OpenAI server (target c) on {vroot} and the local Ray stack (targets a, b), "
        f"tracing {sample_rate:g} of requests"
    )
    spans_since = time.time()
    tag = "" if sample_rate == PROD_TRACE_SAMPLE_RATE else f"-traced-{sample_rate:g}"
    # The Ray stack first: its nodes time out at start when vLLM's server imports alongside them.
    with (
        background_stack(**stack_options(sample_rate), log_path=logs / f"serve{tag}.log") as stack,
        vllm_server(
            model_dir, MODEL_ID, vport, dict(local_target().engine_env), logs / f"vllm-server{tag}.log"
        ) as vproc,
    ):
        wait_healthy(vroot, vproc)
        urls = {
            "disaggregated": stack.urls["disaggregated"],
            "aggregated": stack.urls["aggregated"],
            "vllm": f"{vroot}/v1",
        }
        keys = {"disaggregated": stack.api_key, "aggregated": stack.api_key, "vllm": None}
        # The NIXL backend of the deployed config labels the KV figures (UCX on this machine).
        backend = "+".join(kv_backends(stack.state.get("config") or {})) or "none"
        node_metrics = {n["label"]: n["metrics_url"] for n in stack.nodes}
        metric_urls = [node_metrics["decode"], node_metrics["prefill"], f"{vroot}/metrics"]
        send = sender(urls, keys, MODEL_ID, model_dir, client_log)

        say("all three targets up; warming up")
        warm_up(send, TARGETS, args.seed - 1)

        apps, served, layout = stack_apps(stack)
        idle = {"stack": idle_cpu(stack.proc.pid), "vllm": idle_cpu(vproc.pid)}
        # CPU per hop: every process of the target whose batch runs, snapshot around the batch.
        meter = cpu.Meter({"stack": stack.proc.pid, cpu.PLAIN: vproc.pid}, layout)
        say(f"idle CPU (% of a core) of the Ray stack's processes: {idle['stack']}")
        m = Measured(
            results={t: {} for t in TARGETS},
            durations={t: {} for t in TARGETS},
            windows={},
            snaps=[settled(metric_urls)],
            metric_urls=metric_urls,
            spans=[],
            apps=apps,
            served=served,
            idle=idle,
            tallies=meter.tallies,
            backend=backend,
            sample_rate=sample_rate,
        )
        # The idle phase: what each hop spends with no traffic, subtracted from its load-phase CPU.
        scopes = {t: cpu.target_scopes(apps.get(t)) for t in TARGETS}
        idle_cpu_s, idle_wall = meter.idle(args.idle_s, {**scopes, "stack": (cpu.RAY_SCOPE, *apps.values())})
        m.idle_hops = {name: per_token.idle_cores(per, idle_wall) for name, per in idle_cpu_s.items()}
        say(
            f"idle phase ({idle_wall:.0f} s), share of a core outside the engines: "
            + ", ".join(f"{name} {cpu.non_engine(c):.1%}" for name, c in m.idle_hops.items())
        )
        for li, (conc, n) in enumerate(levels.items()):
            lv = run_level(
                send, TARGETS, conc, n, rounds=args.rounds, seed=args.seed, meter=meter, apps=apps, shift=li, say=say
            )
            for t in TARGETS:
                m.results[t][conc], m.durations[t][conc] = lv.results[t], lv.duration_s[t]
            m.windows[conc] = lv.window
            m.snaps.append(settled(metric_urls))
        m.spans = read_spans(spans_since)
    return m


@dataclass
class Figures:
    """Per target and level: bench.stats figures, the hop breakdown of the time to first token
    and the prefix-cache hit rate; the analysis's errors (a target left out of a level)."""

    summaries: dict[str, dict[int, dict[str, Any]]]
    breakdown: dict[str, dict[int, dict[str, float | None]]]
    prefix_hits: dict[str, dict[int, float | None]]
    analysis_errors: list[str]


def analyse(m: Measured, levels: Mapping[int, int]) -> Figures:
    """The measured requests, metrics and spans -> Figures."""
    summaries = {t: {c: summarize(m.results[t][c], m.durations[t][c]) for c in levels} for t in TARGETS}
    breakdown: dict[str, dict[int, dict[str, float | None]]] = {t: {} for t in TARGETS}
    prefix_hits: dict[str, dict[int, float | None]] = {t: {} for t in TARGETS}
    analysis_errors: list[str] = []
    decode_url, prefill_url, vllm_url = m.metric_urls
    for li, conc in enumerate(levels):
        before, after = m.snaps[li], m.snaps[li + 1]
        for t in TARGETS:
            ok = [r for r in m.results[t][conc] if r.ok]
            ttft = sum(r.ttft_s for r in ok) * 1000 / len(ok) if ok else None
            try:
                if t == BASELINE:
                    eng = hops.engine_delta(before[vllm_url], after[vllm_url], via_ray=False)
                    row = hops.breakdown(ttft, eng, requests=len(ok))
                else:
                    app = m.apps[t]
                    ing, engine_dep, prefill_dep = roles(m.served[app])
                    ids = m.served[app]["replicas"]
                    eng = hops.engine_delta(
                        before[decode_url], after[decode_url], via_ray=True, replica_ids=ids[engine_dep]
                    )
                    pre = (
                        hops.engine_delta(
                            before[prefill_url], after[prefill_url], via_ray=True, replica_ids=ids[prefill_dep]
                        )
                        if prefill_dep
                        else None
                    )
                    sh = hops.span_hops(
                        m.spans, app=app, ingress=ing, engine=engine_dep, prefill=prefill_dep, window=m.windows[conc]
                    )
                    row = hops.breakdown(ttft, eng, requests=len(ok), hops=sh if sh.requests else None, prefill=pre)
            except Exception as exc:
                analysis_errors.append(f"{t} conc {conc}: {type(exc).__name__}: {exc}")
                continue
            breakdown[t][conc] = row
            prefix_hits[t][conc] = eng.prefix_hit_rate
    return Figures(summaries, breakdown, prefix_hits, analysis_errors)


def per_token_report(m: Measured, traced: Measured | None, idle_s: float) -> dict[str, Any]:
    """The JSON's tracing, idle-phase and per-token parts (bench/per_token.py): the prod-rate
    pass's, and with --traced-pass that pass's CPU and tracing's own cost (its - the prod-rate's)."""

    def figures(p: Measured) -> dict[str, Any]:
        counts = cpu_counts(
            {t: {c: summarize(p.results[t][c], p.durations[t][c]) for c in p.results[t]} for t in TARGETS}
        )
        return per_token.run(p.tallies, counts, p.idle_hops)

    main_fig = figures(m)
    out: dict[str, Any] = {
        "tracing": {
            "sample_rate": m.sample_rate,
            "source": "the prod stack's default (infra/config/observability.py DEFAULT_TRACE_SAMPLE_RATES)",
            "traced_pass_rate": None if traced is None else traced.sample_rate,
        },
        "idle_phase": {"seconds": idle_s, "cores": m.idle_hops},
        "per_token": main_fig,
    }
    if traced is not None:
        traced_fig = figures(traced)
        out["traced_pass"] = {"sample_rate": traced.sample_rate, "per_token": traced_fig}
        out["tracing_cost"] = per_token.tracing_cost(main_fig, traced_fig)
    return out


def build_report(
    args: argparse.Namespace,
    levels: dict[int, int],
    m: Measured,
    f: Figures,
    starts: dict[str, Any],
    model_dir: str,
    t0: float,
    traced: Measured | None = None,
) -> dict[str, Any]:
    """The JSON: the workload, the machine, every figure per target and level, the samples."""
    from local.config import MODEL_ID

    summaries = f.summaries
    decode_url = m.metric_urls[0]
    kv_delta = {k: kv_totals(m.snaps[-1][decode_url])[k] - kv_totals(m.snaps[0][decode_url])[k] for k in KV_KEYS}
    n_pd = sum(int(s["completed"] or 0) for s in summaries["disaggregated"].values())
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {
            "seed": args.seed,
            "client": "vllm.benchmarks.serve (vLLM's `vllm bench serve`), backend openai, streamed",
            "client_args_example": vllm_load.cli_args(
                load_for("http://HOST:PORT/v1", None, MODEL_ID, "<model dir>", 8, 1, args.seed)
            ),
            "endpoint": "/v1/completions (streamed, temperature 0, ignore_eos)",
            "prompt_tokens": f"uniform {INPUT_LEN[0]}..{INPUT_LEN[1]} (vLLM random dataset)",
            "output_tokens": f"uniform {OUTPUT_LEN[0]}..{OUTPUT_LEN[1]}",
            "levels": {str(c): n for c, n in levels.items()},
            "rounds": args.rounds,
            "requests_total": sum(levels.values()) * len(TARGETS),
        },
        "machine": machine_info(),
        "model": {"id": MODEL_ID, "dir": Path(model_dir).name, "dtype": "float32"},
        "targets": {t: {str(c): s for c, s in by.items()} for t, by in summaries.items()},
        "ratios_vs_vllm": {
            t: {str(c): ratios(summaries[t][c], summaries[BASELINE][c]) for c in levels}
            for t in TARGETS
            if t != BASELINE
        },
        "hops_ms": {t: {str(c): row for c, row in by.items()} for t, by in f.breakdown.items()},
        "hop_rows": dict(hops.HOP_ROWS),
        # Engine metrics of these targets came through Ray (bucket-midpoint sums: hops.RAY_HISTOGRAM_NOTE).
        "hops_approx_targets": [t for t in TARGETS if t != BASELINE],
        "hops_approx_rows": sorted(hops.ENGINE_HISTOGRAM_ROWS),
        "hops_note": hops.RAY_HISTOGRAM_NOTE,
        "prefix_cache_hit_rate": {t: {str(c): v for c, v in by.items()} for t, by in f.prefix_hits.items()},
        "kv_transfer": {
            "backend": m.backend,
            "decode_counters_delta": kv_delta,
            **kv_transfer_per_request(kv_delta, n_pd),
        },
        # level -> P/D requests per prefill path (remote, remote_retry, local:<reason>).
        "serving_mode": {
            str(c): observe.serving_mode(m.snaps[i][decode_url], m.snaps[i + 1][decode_url])
            for i, c in enumerate(levels)
        },
        "start_times": starts,
        "idle_cpu_percent": m.idle,
        # target -> level (and "all") -> CPU-ms per request and per 1,000 output tokens per hop.
        "cpu": cpu.run_figures(m.tallies, cpu_counts(summaries)),
        "cpu_classes": dict(cpu.CLASSES),
        **per_token_report(m, traced, args.idle_s),
        "hops_from": "the pass with every request traced"
        if traced is not None
        else f"the prod-rate pass ({m.sample_rate:g} of requests traced: few spans)",
        "chunk_gaps": {t: {str(c): gaps.summary(m.results[t][c]) for c in levels} for t in TARGETS},
        "analysis_errors": f.analysis_errors,
        "conditions": [
            f"Serve request tracing on for the Ray targets at a prod stack's ratio ({m.sample_rate:g}, Ray's "
            "file exporter); tracing's own cost is the traced pass's difference (--traced-pass).",
            "All three targets share this machine's cores with each other and with other jobs "
            "on the machine (load average above).",
        ],
        "errors_sample": {t: [r.error for c in levels for r in m.results[t][c] if not r.ok][:5] for t in TARGETS},
        # Per-request figures for the distribution plots (bench/plots.py).
        "samples": {t: {str(c): samples(m.results[t][c]) for c in levels} for t in TARGETS},
        "wall_s": time.monotonic() - t0,
    }


def print_report(report: dict[str, Any], f: Figures, out: Path, png: Path) -> None:
    """The tables on screen."""
    summaries, breakdown = f.summaries, f.breakdown
    cpu_figures, chunk_gaps, kv = report["cpu"], report["chunk_gaps"], report["kv_transfer"]
    print()
    print(format_table(summaries, BASELINE))
    print()
    print("Where the time to first token goes (mean ms per request; Serve spans, vLLM and NIXL metrics):")
    print(
        hops.format_breakdown(
            {t: {c: breakdown[t][c] for c in HOP_LEVELS if c in breakdown[t]} for t in TARGETS},
            approx_targets=[t for t in TARGETS if t != BASELINE],
        )
    )
    print()
    print("CPU-ms per request, per hop (user + system CPU of each process during the target's batches):")
    print(cpu.format_text(cpu_figures))
    print()
    print("CPU-ms per 1,000 output tokens, per hop:")
    print(cpu.format_text(cpu_figures, "cpu_ms_per_1k_tokens"))
    print()
    print(cpu.front_door_line(cpu_figures))
    print()
    print("Per output token, net of idle (the idle phase's rate x the batches' wall time taken off):")
    print(aligned(per_token.hop_rows(report["per_token"])))
    print(per_token.idle_line(report["per_token"]))
    print(aligned(per_token.verdict_rows(report["per_token"])))
    if "tracing_cost" in report:
        print("Tracing's own cost (the pass with every request traced - the prod-rate pass):")
        print(aligned(per_token.tracing_rows(report["tracing_cost"])))
    print()
    print("Client-seen gaps between streamed chunks (vLLM's client stamps each event as it parses it):")
    print(gaps.format_text(chunk_gaps))
    print()
    print(observe.kv_line(kv))
    print(observe.serving_mode_line(report["serving_mode"]))
    for kind, st in report["start_times"].items():
        print(f"{kind} `make serve` (disaggregated): READY in {st['ready_s']}s")
    print("Ratios are target / vllm (TTFT, TPOT: lower is better; tok/s, req/s: higher is better).")
    print(f"JSON: {out}  PNG: {png}  wall {report['wall_s']:.0f}s")


def main(argv: list[str] | None = None) -> int:
    """parse the options -> time `make serve` -> start the three targets and run the levels ->
    the report, its figures and tables."""
    args = parse_args(argv)
    levels = parse_levels(args.levels)
    t0 = time.monotonic()
    say = lambda m: _say(t0, m)  # noqa: E731

    from local import tiny_model

    model_dir = str(tiny_model.ensure_tiny_model())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent
    with open(logs / "vllm-bench-client.log", "w") as client_log:
        starts = start_times(args, logs, say)
        if args.start_times_only:
            save_start_times(args.out, starts)
            return 0
        floor = idle_floor.measured(args.idle_s, say)  # first, on a quiet machine
        measured = run_targets(args, levels, model_dir, logs, client_log, say)
        measured.idle_hops[per_token.RAY_FLOOR] = floor
        traced = (
            run_targets(args, levels, model_dir, logs, client_log, say, sample_rate=EVERY_REQUEST)
            if args.traced_pass
            else None
        )
    figures = analyse(measured, levels)
    if traced is not None:
        # The hop breakdown reads Serve's spans: the pass that traced every request has them all.
        hop_figures = analyse(traced, levels)
        figures.breakdown = hop_figures.breakdown
        figures.analysis_errors += [f"traced pass: {e}" for e in hop_figures.analysis_errors]
    report = build_report(args, levels, measured, figures, starts, model_dir, t0, traced)
    args.out.write_text(json.dumps(report, indent=2))
    png = plots.serving_png(report, args.out.with_suffix(".png"))
    print_report(report, figures, args.out, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
