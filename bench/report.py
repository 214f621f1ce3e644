"""docs/performance.md, generated from the benchmarks' JSON (build/bench/*.json).

What flows through here: build/bench/serving.json (`make bench`), build/bench/prefix.json
and prefix-multi-turn.json (`make bench-prefix`), build/bench/data-plane.json (`make bench-data-plane`) and
build/bench/goodput.json (`make bench-goodput`, bench/goodput_report.py), when present
-> the figures' tables (targets, ratios against the issue's bars, the per-hop breakdown, CPU
per hop and its bars, CPU per output token net of idle with its ceiling and targets, the
tracing ratio and tracing's own cost, the gaps between streamed chunks, start times, prefix routing, Serve's
data planes against ray-proxy) between the page's
hand-written explanations -> docs/performance.md. Figures are never typed by hand: rerun
the benchmarks, then `python -m bench.report`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench import BENCH_DIR, cpu, data_plane, gaps, goodput_report, observe, per_token, prefix_bench
from bench.hops import row_shown
from bench.stats import markdown
from infra.paths import ROOT

BUILD = BENCH_DIR
DOC = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
# The README's headline figures live between these markers and are rewritten from the JSON.
BEGIN, END = "<!-- perf-headline:begin -->", "<!-- perf-headline:end -->"

# The bars (ratio to plain vLLM at the same concurrency; "<=" for TTFT, ">=" for
# tok/s); they replace looser earlier ones.
BARS = (
    ("disaggregated", 1, "ttft_p50_ms", "<=", 2.5),
    ("disaggregated", 16, "ttft_p50_ms", "<=", 3.0),
    ("disaggregated", 16, "output_tok_s", ">=", 0.8),
    ("aggregated", 1, "ttft_p50_ms", "<=", 1.5),
    ("aggregated", 16, "ttft_p50_ms", "<=", 1.5),
    ("aggregated", 16, "output_tok_s", ">=", 0.95),
)
WARM_START_BAR_S = 45
# The bars on CPU: non-engine CPU-ms per request over plain vLLM's API server
# process's, all levels pooled.
CPU_BARS = (("aggregated", 2.0), ("disaggregated", 3.0))
CPU_LEVELS = ("1", "16", "all")  # the CPU tables' columns per target
NOT_MEASURED = "(not measured in this run: the next `make bench` fills it)"
# The idle phase, the per-token figures and the tracing ratio came later than the CPU tables.
NOT_YET = "(a run from before the idle phase and prod-rate tracing: the next `make bench` fills it)"


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def targets_table(rep: dict[str, Any]) -> str:
    rows = [
        "| target | conc | requests | errors | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | out tok/s | req/s |"
        " TTFT p50 ÷ vLLM | tok/s ÷ vLLM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, by in rep["targets"].items():
        for c, s in by.items():
            r = rep.get("ratios_vs_vllm", {}).get(t, {}).get(c, {})
            rows.append(
                f"| {t} | {c} | {s['requests']} | {s['errors']} | {_f(s['ttft_p50_ms'])} | {_f(s['ttft_p99_ms'])} | "
                f"{_f(s['tpot_p50_ms'])} | {_f(s['itl_p50_ms'])} | {_f(s['output_tok_s'])} | {_f(s['req_s'], 2)} | "
                f"{_f(r.get('ttft_p50_ms'), 2)} | {_f(r.get('output_tok_s'), 2)} |"
            )
    return "\n".join(rows)


def bars_table(rep: dict[str, Any]) -> str:
    rows = ["| bar | measured | met |", "|---|---|---|"]
    for target, conc, key, op, bar in BARS:
        v = rep.get("ratios_vs_vllm", {}).get(target, {}).get(str(conc), {}).get(key)
        name = "TTFT p50" if key == "ttft_p50_ms" else "output tok/s"
        met = "-" if v is None else ("yes" if (v <= bar if op == "<=" else v >= bar) else "no")
        rows.append(f"| {target} {name} ÷ vLLM at conc {conc} {op} {bar} | {_f(v, 2)} | {met} |")
    warm = (rep.get("start_times") or {}).get("warm", {}).get("ready_s")
    met = "-" if warm is None else ("yes" if warm <= WARM_START_BAR_S else "no")
    rows.append(f"| warm `make serve` READY <= {WARM_START_BAR_S} s | {_f(warm, 0)} s | {met} |")
    return "\n".join(rows)


def hops_table(rep: dict[str, Any], levels: tuple[str, ...] = ("1", "16")) -> str:
    labels: dict[str, str] = rep.get("hop_rows") or {}
    hops: dict[str, dict[str, dict[str, Any]]] = rep.get("hops_ms") or {}
    cols = [(t, c) for t in hops for c in levels if c in hops[t]]
    head = "| mean ms per request | " + " | ".join(f"{t} c{c}" for t, c in cols) + " |"
    rows = [head, "|---|" + "---|" * len(cols)]
    approx_t = set(rep.get("hops_approx_targets") or ())
    approx_r = set(rep.get("hops_approx_rows") or ())
    for key, label in labels.items():
        vals = [hops[t][c].get(key) for t, c in cols]
        if not row_shown(key, [hops[t][c] for t, c in cols]):
            continue
        cells = [
            ("~" if t in approx_t and key in approx_r and v is not None else "") + _f(v)
            for (t, _), v in zip(cols, vals, strict=True)
        ]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if rep.get("hops_note") and approx_t:
        rows.append("\n" + rep["hops_note"])
    return "\n".join(rows)


def starts_table(rep: dict[str, Any]) -> str:
    starts = rep.get("start_times") or {}
    if not starts:
        return "(not measured in this run)"
    when = f"Measured {starts['date']}, load average {starts.get('load_average')}.\n\n" if "date" in starts else ""
    rows = [when + "| start | READY after | steps (seconds since start) |", "|---|---|---|"]
    for kind, st in starts.items():
        if not isinstance(st, dict):
            continue
        steps = "; ".join(f"{s['at_s']:.0f}: {s['step'][:60]}" for s in st.get("steps", []))
        rows.append(f"| {kind} | {_f(st.get('ready_s'), 0)} s | {steps} |")
    return "\n".join(rows)


def prefix_table(pre: dict[str, Any]) -> str:
    """One row per prefill router; TTFT and computed prefill tokens also as ratios to power-of-two."""
    by = {a["router"]: a for a in pre["apps"].values()}
    base = by.get("power-of-two", {})

    def ratio(a: dict[str, Any], key: str) -> str:
        v, b = a.get(key), base.get(key)
        return "" if v is None or not b else f" ({v / b:.2f}x)"

    rows = [
        "| prefill router | requests | errors | TTFT p50 | TTFT p99 | prefix-cache hit rate (prefill) "
        "| prefill tokens computed | requests per prefill replica |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in pre["apps"].values():
        hit = a.get("prefix_cache_hit_rate")
        per = sorted(int(v) for v in (a.get("requests_per_prefill_replica") or {}).values())
        computed = a.get("prefill_tokens_computed")
        rows.append(
            f"| {a['router']} | {a['requests']} | {a['errors']} | {_f(a['ttft_p50_ms'])}{ratio(a, 'ttft_p50_ms')} | "
            f"{_f(a['ttft_p99_ms'])}{ratio(a, 'ttft_p99_ms')} | {'-' if hit is None else f'{hit:.1%}'} | "
            f"{'-' if computed is None else f'{computed:,.0f}'}{ratio(a, 'prefill_tokens_computed')} | {per} |"
        )
    return "\n".join(rows)


def prefix_section(pre: dict[str, Any]) -> str:
    """One make bench-prefix run: its date and workload, the table, the verdict."""
    return (
        f"Run of {pre['date']}; workload {json.dumps(pre['workload'])}.\n\n"
        + prefix_table(pre)
        + "\n\n"
        + prefix_verdict(pre)
    ).rstrip()


def prefix_verdict(pre: dict[str, Any]) -> str:
    """What each router bought in this run against power-of-two: hit rate and TTFT p50, and
    whether KV-aware routing did at least as well as prefix affinity (issue 39's bar)."""
    by = {a["router"]: a for a in pre["apps"].values()}
    p2c = by.get("power-of-two")
    if not p2c or p2c.get("prefix_cache_hit_rate") is None:
        return ""
    out = []
    for router, label in (("prefix-cache-affinity", "The affinity router"), ("kv-aware", "KV-aware routing")):
        a = by.get(router)
        if not a or a.get("prefix_cache_hit_rate") is None:
            continue
        hits = f"{p2c['prefix_cache_hit_rate']:.1%} to {a['prefix_cache_hit_rate']:.1%}"
        t0, t1 = p2c["ttft_p50_ms"], a["ttft_p50_ms"]
        moved = "raised" if a["prefix_cache_hit_rate"] > p2c["prefix_cache_hit_rate"] else "did not raise"
        ttft = (
            f"cut TTFT p50 from {t0:.1f} to {t1:.1f} ms"
            if t1 < t0
            else f"TTFT p50 did not fall ({t0:.1f} -> {t1:.1f} ms)"
        )
        out.append(f"{label} {moved} the prefill tier's prefix-cache hit rate from {hits}; {ttft}.")
    aff, kv = by.get("prefix-cache-affinity"), by.get("kv-aware")
    if aff and kv and aff.get("prefix_cache_hit_rate") is not None and kv.get("prefix_cache_hit_rate") is not None:
        verdict = "at least as high as" if kv["prefix_cache_hit_rate"] >= aff["prefix_cache_hit_rate"] else "below"
        out.append(f"KV-aware routing's hit rate is {verdict} prefix affinity's in this run.")
    wait = prefix_bench.scorer_wait_ms(kv) if kv else None
    if wait is not None:
        out.append(
            f"Each KV-routed request waited {wait:.1f} ms on the scorer (the mean of decode's "
            "pd_kv_route_wait_seconds) before its prefill call, which prefix affinity decides in decode's own process."
        )
    if any("did not fall" in line for line in out):
        out.append(
            "What a hit saves is the prefill of the cached tokens, and for this tiny random-weight model on "
            "two CPU cores that prefill is a small part of the time to first token, below the Serve hops in "
            "front of every request and the spread between rounds on a shared machine (compare the p99s). "
            "The saving grows with the prefill's cost: long shared system prompts on a large model."
        )
    return " ".join(out)


def serving_mode_text(serving: dict[str, Any] | None) -> str:
    """How the P/D requests were prefilled, per level (a run before the bench read it: nothing)."""
    if not serving or "serving_mode" not in serving:
        return ""
    return observe.serving_mode_line(serving["serving_mode"]) + "."


def _idle(serving: dict[str, Any] | None, target: str, process: str | None = None) -> str:
    """Idle CPU (% of one core) of a target's processes, or of one process name, as sampled."""
    per = ((serving or {}).get("idle_cpu_percent") or {}).get(target) or {}
    if not per:
        return "(not sampled)"
    return f"{sum(v for k, v in per.items() if process is None or k == process):.0f}%"


def floor_text(rep: dict[str, Any]) -> str:
    """The TTFT floor at concurrency 1: plain vLLM's TTFT p50 plus the hops Serve adds before
    the engine sees the request (Serve's spans), as a ratio to plain vLLM, per Ray target."""
    hops: dict[str, dict[str, dict[str, Any]]] = rep.get("hops_ms") or {}
    # The bars compare TTFT p50s; the hops are means over the same requests.
    base = ((rep.get("targets") or {}).get("vllm") or {}).get("1", {}).get("ttft_p50_ms")
    if not base:
        return "(no concurrency-1 breakdown in this run)"
    parts = []
    for target, hop_keys in (
        ("aggregated", ("proxy_to_ingress", "ingress_to_engine")),
        ("disaggregated", ("proxy_to_ingress", "ingress_to_engine", "decode_to_prefill", "prefill_leg")),
    ):
        row = (hops.get(target) or {}).get("1") or {}
        # No proxy span in Serve's HAProxy mode: HAProxy's time is in the rest, not here.
        untraced = row.get("ingress_to_engine") is not None and row.get("proxy_to_ingress") is None
        keys = [k for k in hop_keys if not (untraced and k == "proxy_to_ingress")]
        if any(row.get(k) is None for k in keys):
            continue
        vals = [float(row[k]) for k in keys]
        added = sum(vals)
        parts.append(
            f"- **{target}**: the Serve hops before the engine sees the request "
            f"({' + '.join(f'{v:.1f}' for v in vals)} = {added:.1f} ms at concurrency 1, from Serve's "
            f"spans, means{'; HAProxy to the ingress not traced' if untraced else ''}) on top of plain "
            f"vLLM's TTFT p50 of {base:.1f} ms put the floor at {(base + added) / base:.2f}x, before any "
            "stream delivery."
        )
    head = (
        "At concurrency 1 the time to first token is plain vLLM's plus the hops Ray Serve adds. "
        "Those hops are Python on the same two cores: the proxy's actor call to the ingress (gone in "
        "HAProxy mode, the default: HAProxy hands the request to the ingress replica's own HTTP server), the "
        "ingress's auth, parsing and routing (our API keys, limits, fallback and deadlines live "
        "there), and in P/D the decode replica's call to prefill and the prefill itself:"
    )
    tail = (
        "Removing the remaining ingress hop needs Ray's direct streaming (`RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING` "
        "on top of HAProxy mode), which moves the request into vLLM's own app and so would move "
        "this project's ingress logic into ASGI middleware there (the switches table); the P/D "
        "prefill leg is the design's own cost, smaller on a GPU where prefill is fast."
    )
    return "\n".join([head, "", *parts, "", tail])


def cpu_section(rep: dict[str, Any]) -> str:
    """The CPU per hop (per request, per 1,000 output tokens) and the issue's CPU bars."""
    by: dict[str, dict[str, Any]] = rep.get("cpu") or {}
    if not by:
        return NOT_MEASURED
    cols = {t: {lv: f for lv, f in levels.items() if lv in CPU_LEVELS} for t, levels in by.items()}
    rows = ["| bar | measured | met |", "|---|---|---|"]
    for target, bar in CPU_BARS:
        v = ((by.get(target) or {}).get("all") or {}).get("non_engine_vs_vllm_api_server")
        met = "-" if v is None else ("yes" if v <= bar else "no")
        rows.append(f"| {target} non-engine CPU per request ÷ plain vLLM API server <= {bar} | {_f(v, 2)} | {met} |")
    ended = sum(f.get("processes_ended", 0) for levels in by.values() for f in levels.values() if f is not None)
    return "\n\n".join(
        [
            "CPU-ms per request:\n\n" + cpu.format_markdown(cols),
            "CPU-ms per 1,000 output tokens:\n\n" + cpu.format_markdown(cols, "cpu_ms_per_1k_tokens"),
            "The issue's CPU bars (all levels pooled):\n\n" + "\n".join(rows),
            f"Processes that ended during a batch (their CPU after its start is not counted): {ended}.",
        ]
    )


def per_token_section(rep: dict[str, Any]) -> str:
    """Per output token, net of idle, with each hop's ceiling and the issue's per-token targets."""
    fig = rep.get("per_token")
    if not fig:
        return NOT_YET
    idle_s = (rep.get("idle_phase") or {}).get("seconds")
    head = f"Idle phase: {_f(idle_s, 0)} s with no traffic, after the warm-up and before the load."
    return head + "\n\n" + per_token.format_markdown(fig)


def tracing_section(rep: dict[str, Any]) -> str:
    """The sampling ratio the run traced at, where the hop breakdown's spans came from, and
    (with --traced-pass) tracing's own CPU cost per hop."""
    tracing = rep.get("tracing")
    if not tracing:
        return NOT_YET
    parts = [
        f"Serve's tracing sampled {tracing['sample_rate']:g} of requests ({tracing['source']}); the hop "
        f"breakdown's spans come from {rep.get('hops_from', '-')}."
    ]
    cost = rep.get("tracing_cost")
    if cost:
        parts.append(
            "Tracing's own cost, the pass tracing every request minus the prod-rate pass (two stacks, one "
            "after the other: plain vLLM's row is the drift between them):\n\n" + markdown(per_token.tracing_rows(cost))
        )
    else:
        parts.append("(no pass with every request traced in this run: `make bench BENCH_TRACED=1`)")
    return "\n\n".join(parts)


def data_plane_section(rep: dict[str, Any]) -> str:
    """`make bench-data-plane`: the run, then latency and CPU per hop per data plane, each
    beside its ratio to the ray-proxy run of the same round (bench/data_plane.py summary)."""
    summ = data_plane.summary(rep)
    work, machine = rep.get("workload") or {}, rep.get("machine") or {}
    failed = [f"{r['data_plane']} round {r['round'] + 1}" for r in rep.get("runs") or [] if "error" in r]
    head = (
        f"Run of {rep['date']}: data planes {', '.join(summ['planes'])}, {work.get('rounds')} rounds "
        f"(a stack each), requests per app and round at concurrency "
        f"{', '.join(f'{c}: {n}' for c, n in (work.get('levels') or {}).items())}; "
        f"{machine.get('cpus')} CPUs, load average at the end {machine.get('load_average_at_end')}; "
        f"{rep.get('wall_s', 0):.0f} s." + (f" Failed, left out: {', '.join(failed)}." if failed else "")
    )
    return "\n\n".join(
        [
            head,
            "Latency and throughput:\n\n" + markdown(data_plane.latency_rows(summ)),
            *(
                f"CPU-ms per request per hop, {app}, all levels pooled:\n\n" + markdown(data_plane.cpu_rows(summ, app))
                for app in data_plane.TARGETS
            ),
        ]
    )


def gaps_section(rep: dict[str, Any]) -> str:
    by = rep.get("chunk_gaps") or {}
    return gaps.format_markdown(by) if by else NOT_MEASURED


def kept(previous: str | None, template: str, name: str) -> str | None:
    """What the placeholder {{name}} held in the page `previous` rendered from `template`: the
    text between the template's literal lines around it (None when they are not found). A
    benchmark that was not rerun keeps its last figures, with their run's date, instead of
    losing them to "(run ...)"."""
    if not previous:
        return None
    head, _, tail = template.partition("{{" + name + "}}")
    # The nearest lines around it, each literal (one with a placeholder of its own is no anchor).
    before = next((ln for ln in reversed(head.splitlines()) if ln.strip()), "{{")
    after = next((ln for ln in tail.splitlines() if ln.strip()), "{{")
    if "{{" in before or "{{" in after or before not in previous:
        return None
    rest = previous.split(before, 1)[1]
    if after not in rest:
        return None
    return rest.split(after, 1)[0].strip("\n")


def render(
    serving: dict[str, Any] | None,
    prefix: dict[str, Any] | None,
    template: str,
    data_planes: dict[str, Any] | None = None,
    previous: str | None = None,
    goodput: dict[str, Any] | None = None,
    multi_turn: dict[str, Any] | None = None,
) -> str:
    """The page; a section whose benchmark has no JSON here keeps what `previous` (the page as
    it was) showed for it, if anything."""
    parts = {
        "SERVING_DATE": serving["date"] if serving else "(no run)",
        "SERVING_CONDITIONS": (
            f"{serving['machine']['cpus']} CPUs, load average at the end {serving['machine'].get('load_average_at_end')}; "
            f"{serving['workload']['requests_total']} requests in {serving['wall_s']:.0f} s"
            if serving
            else ""
        ),
        "TARGETS": targets_table(serving) if serving else "(run `make bench`)",
        "BARS": bars_table(serving) if serving else "",
        "HOPS": hops_table(serving) if serving else "",
        "STARTS": starts_table(serving) if serving else "",
        "KV": (
            f"{_f(serving['kv_transfer'].get('bytes_per_request'), 0)} bytes and "
            f"{_f(serving['kv_transfer'].get('kv_tokens_per_request'))} prompt tokens per request, "
            f"{_f(serving['kv_transfer'].get('xfer_ms_per_transfer'), 2)} ms per NIXL transfer"
            if serving
            else ""
        ),
        "SERVING_MODE": serving_mode_text(serving),
        "FLOOR": floor_text(serving) if serving else "(run `make bench`)",
        "CPU": cpu_section(serving) if serving else "(run `make bench`)",
        "GAPS": gaps_section(serving) if serving else "(run `make bench`)",
        "PER_TOKEN": per_token_section(serving) if serving else "(run `make bench`)",
        "TRACING": tracing_section(serving) if serving else "(run `make bench`)",
        "IDLE_WORKERS": _idle(serving, "stack", "VLLM::Worker"),
        "IDLE_VLLM": _idle(serving, "vllm"),
        # The run's date inside the block: a page rendered without prefix.json keeps it whole.
        "PREFIX": prefix_section(prefix)
        if prefix
        else kept(previous, template, "PREFIX") or "(run `make bench-prefix`)",
        "PREFIX_MULTI_TURN": prefix_section(multi_turn)
        if multi_turn
        else kept(previous, template, "PREFIX_MULTI_TURN") or "(run `make bench-prefix PREFIX_WORKLOAD=multi-turn`)",
        "DATA_PLANE": data_plane_section(data_planes)
        if data_planes
        else kept(previous, template, "DATA_PLANE") or "(run `make bench-data-plane`)",
        "GOODPUT": goodput_report.section(goodput)
        if goodput
        else kept(previous, template, "GOODPUT") or "(run `make bench-goodput`)",
    }
    out = template
    for k, v in parts.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def headline(serving: dict[str, Any] | None) -> str:
    """A few lines for the README: the run's date and the issue's bars."""
    if not serving:
        return "No `make bench` run recorded yet."
    machine = serving.get("machine") or {}
    load = (machine.get("load_average_at_end") or [None])[0]
    return (
        f"Latest `make bench` ({serving['date']}, {machine.get('cpus')}-core CPU machine, "
        f"1-minute load average at the end {_f(load)}; "
        "ratios to plain vLLM in the same interleaved run; details in docs/performance.md):\n\n" + bars_table(serving)
    )


def replace_block(text: str, block: str) -> str:
    """`text` with the part between the headline markers replaced by `block`."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DOC)
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args(argv)
    load = lambda name: json.loads((BUILD / name).read_text()) if (BUILD / name).is_file() else None  # noqa: E731
    template = (Path(__file__).parent / "performance.md.in").read_text()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    serving = load("serving.json")
    previous = DOC.read_text() if DOC.is_file() else None
    args.out.write_text(
        render(
            serving,
            load("prefix.json"),
            template,
            load(data_plane.DEFAULT_OUT.name),
            previous,
            load(goodput_report.JSON_NAME),
            load(prefix_bench.WORKLOADS["multi-turn"].name),
        )
    )
    print(f"wrote {args.out}")
    if args.readme.is_file() and BEGIN in args.readme.read_text():
        args.readme.write_text(replace_block(args.readme.read_text(), headline(serving)))
        print(f"updated the headline in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
