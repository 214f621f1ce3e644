"""`make bench-goodput`'s figures as tables: on screen, and as docs/performance.md's goodput section.

What flows through here: build/bench/goodput.json (bench/goodput.py `record`) -> rows of cells
(header first) for each table: per target and rate the latency as the client saw it (TTFT,
per-token ITL, chunk intervals) and goodput at the reference SLO; goodput per threshold pair;
where P/D's goodput passes aggregated's, or what bound each app (`verdict`); our P/D against
Ray's stock P/D app; the plan's verdict beside the measured one; the issue's targets; the cores
each engine was seen on -> `text()` (aligned, for the terminal) and `section()` (Markdown, for
bench/report.py). Pure: reads the JSON's dict only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench import cpu
from bench.goodput_figures import CPU_OURS_OVER_RAY, OURS_OVER_RAY, PD_OVER_AGGREGATED
from bench.stats import aligned, markdown

JSON_NAME = "goodput.json"  # under build/bench/: bench/goodput.py writes it, bench/report.py reads it
Rows = list[list[str]]
ROLE_OF = {"engine_prefill": "prefill", "engine_decode": "decode", "engine_aggregated": "aggregated"}
ROLE_OF["vllm_engine"] = "aggregated"
ITL_FROM = {"itl_p50_ms": "per-token gaps", "tpot_mean_ms": "time per output token (bursts: both p50s 0)"}
NO_PROFILE = "(no profile run: the plan's verdicts need the aggregated and disaggregated targets without --no-profile)"


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _x(v: Any) -> str:
    return "-" if v is None else ("∞" if v == float("inf") else f"{v:.2f}x")


def _pair(key: str) -> str:
    t, i = key.split("/")
    return f"TTFT <= {t} s, ITL <= {i} s"


def latency_rows(rep: Mapping[str, Any]) -> Rows:
    ref = rep["thresholds"]["reference"]
    rows = [
        [
            "target",
            "prompts/s",
            "requests",
            "errors",
            "TTFT p50",
            "TTFT p99",
            "long-prompt TTFT p99",
            "ITL p50",
            "ITL p99",
            "ITL p99.9",
            "chunk interval p50",
            "chunk interval p99",
            "tokens per chunk",
            "time per output token",
            f"goodput req/s ({_pair(ref)})",
        ]
    ]
    for t, by in rep["targets"].items():
        for r, s in by.items():
            rows.append(
                [t, r, str(s["requests"]), str(s["errors_total"])]
                + [
                    _f(s.get(k))
                    for k in (
                        "ttft_p50_ms",
                        "ttft_p99_ms",
                        "prompt_ttft_p99_ms",
                        "itl_p50_ms",
                        "itl_p99_ms",
                        "itl_p999_ms",
                        "chunk_interval_p50_ms",
                        "chunk_interval_p99_ms",
                    )
                ]
                + [_f(s.get("tokens_per_chunk"), 2), _f(s.get("tpot_mean_ms")), _f(s["goodput"][ref]["req_s"], 2)]
            )
    return rows


def goodput_rows(rep: Mapping[str, Any]) -> Rows:
    pairs = list(next(iter(next(iter(rep["targets"].values())).values()))["goodput"]) if rep["targets"] else []
    rows = [["target", "prompts/s", *(f"TTFT {p.split('/')[0]} s, ITL {p.split('/')[1]} s" for p in pairs)]]
    for t, by in rep["targets"].items():
        for r, s in by.items():
            rows.append([t, r, *(_f(s["goodput"][p]["req_s"], 2) for p in pairs)])
    return rows


def _binding_text(rep: Mapping[str, Any], target: str, rate: str) -> str:
    b = (rep.get("binding") or {}).get(target, {}).get(rate) or {}
    if "machine_share" not in b:
        return f"{target}: not measured"
    shares = ", ".join(f"{ROLE_OF.get(k, k)} engine {v:.0%}" for k, v in b["engine_share_of_cores"].items())
    what = b["binds"] or "no core saturated"
    return (
        f"{target} at {rate} prompts/s: {what} ({f'of their cores: {shares}; ' if shares else ''}outside the engines "
        f"{b['outside_engines_cores']:.2f} cores, the client {b['client_cores']:.2f}, the machine {b['machine_share']:.0%})"
    )


def verdict(rep: Mapping[str, Any]) -> list[str]:
    """Where P/D's goodput passes aggregated's (rate and thresholds), the best ratio, and what
    bound each app at the highest rate; the rate from which the plan picks P/D on GPUs."""
    c = rep.get("crossing") or {}
    pairs = c.get("pairs") or {}
    passes = {p: v["passes_at"] for p, v in pairs.items() if v["passes_at"] is not None}
    out = []
    if passes:
        out.append(
            "P/D's goodput passes aggregated's: "
            + "; ".join(f"from {r} prompts/s at {_pair(p)}" for p, r in passes.items())
            + "."
        )
    elif pairs:
        out.append("P/D's goodput does not pass aggregated's at any measured rate and threshold pair.")
    best = c.get("best")
    if best:
        itl = best["itl_p99_ms"]
        out.append(
            f"Best ratio: {_x(best['ratio'])} at {best['rate']} prompts/s, {_pair(best['pair'])} (target >= "
            f"{PD_OVER_AGGREGATED}x: {'met' if best['met'] else 'not met'}); ITL p99 disaggregated "
            f"{_f(itl['disaggregated'])} ms, aggregated {_f(itl['aggregated'])} ms."
        )
    rates = sorted({r for by in (rep.get("binding") or {}).values() for r in by}, key=float)
    if rates:
        out += [f"What bound: {_binding_text(rep, t, rates[-1])}." for t in rep["binding"]]
    g = rep.get("gpu_crossing")
    if g:
        shape = (
            f"{g['prompt_tokens']} prompt + {g['output_tokens']} output tokens on {g['stack']}'s GPUs ({g['model']})"
        )
        out.append(
            f"On a GPU, `make plan` picks P/D for {shape} from {g['rate']:g} req/s."
            if g.get("rate") is not None
            else f"On a GPU, `make plan` never picks P/D for {shape}: {g.get('why')}."
        )
    return out


def ray_rows(rep: Mapping[str, Any]) -> tuple[Rows, Rows]:
    """Our P/D over Ray's stock P/D app: latency per rate; CPU per 1,000 output tokens per hop."""
    v = rep.get("ours_vs_ray") or {}
    lat = [["prompts/s", "TTFT p50 ÷ Ray's", "ITL p50 ÷ Ray's", "ITL from", "chunk interval p50 ÷ Ray's"]]
    for r, x in (v.get("rates") or {}).items():
        itl_from = ITL_FROM.get(x["itl_from"], x["itl_from"])
        lat.append([r, _x(x["ttft_p50"]), _x(x["itl_p50"]), itl_from, _x(x["chunk_interval_p50"])])
    per = [["hop (outside the engines)", "ours, CPU-ms per 1k tokens", "Ray's", "ours ÷ Ray's"]]
    labels = {**cpu.CLASSES, "total": "total outside the engines"}
    for k, x in sorted((v.get("cpu_ms_per_1k_tokens") or {}).items(), key=lambda kv: kv[0] == "total"):
        per.append([labels.get(k, k), _f(x["ours"]), _f(x["ray"]), _x(x["ratio"])])
    return lat, per


def plan_rows(rep: Mapping[str, Any]) -> Rows:
    rows = [["prompts/s", "mix: prompt, output tokens", "req/s", "plan", "measured", "agree"]]
    for r, v in (rep.get("plan") or {}).items():
        w = v.get("workload") or {}
        agree = "-" if v["agree"] is None else ("yes" if v["agree"] else "no")
        mix = f"{w['prompt_tokens']:.0f}, {w['output_tokens']:.0f}" if w else "-"
        rows.append([r, mix, _f(w.get("req_s"), 2), str(v["plan"] or "-"), str(v["measured"] or "-"), agree])
    return rows


def _met(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def met_rows(rep: Mapping[str, Any]) -> Rows:
    best = (rep.get("crossing") or {}).get("best") or {}
    v = rep.get("ours_vs_ray") or {}
    worst, met = v.get("worst") or {}, v.get("met") or {}
    return [
        ["target", "measured", "met"],
        [
            f"our P/D's goodput ÷ our aggregated app's >= {PD_OVER_AGGREGATED} at an ITL threshold",
            f"{_x(best.get('ratio'))} ({best['rate']}/s, {_pair(best['pair'])})" if best else "-",
            _met(best.get("met")),
        ],
        [
            f"our P/D's TTFT p50 ÷ Ray's P/D app's <= {OURS_OVER_RAY}, worst rate",
            _x(worst.get("ttft_p50")),
            _met(met.get("ttft_p50")),
        ],
        [
            f"our P/D's ITL p50 ÷ Ray's P/D app's <= {OURS_OVER_RAY}, worst rate",
            _x(worst.get("itl_p50")),
            _met(met.get("itl_p50")),
        ],
        [
            f"our P/D's CPU per 1,000 output tokens outside the engines ÷ Ray's <= {CPU_OURS_OVER_RAY}",
            _x(worst.get("cpu")),
            _met(met.get("cpu")),
        ],
    ]


def pinning_rows(rep: Mapping[str, Any]) -> Rows:
    """Each vLLM process: the cores its main thread may run on, against its role's binding."""
    binds = rep.get("engine_cpus") or {}
    rows = [["target", "process", "main thread's cores", "bound to", "as bound", "threads by cores"]]
    for t, st in (rep.get("stacks") or {}).items():
        for p in st.get("pinning") or []:
            want = binds.get(ROLE_OF.get(p["class"], "")) if "Worker" in p["title"] else None
            ok = "-" if want is None else ("yes" if p["main_thread_cores"] == want else "no")
            threads = ", ".join(f"{c}: {n}" for c, n in p["threads_by_cores"].items())
            rows.append([t, p["title"].split(" ")[0], p["main_thread_cores"], want or "-", ok, threads])
    return rows


def _parts(rep: Mapping[str, Any], table: Callable[[Sequence[Sequence[str]]], str]) -> list[str]:
    w, m = rep["workload"], rep.get("machine") or {}
    failed = [f"{t} ({s['error'][:120]})" for t, s in (rep.get("stacks") or {}).items() if "error" in s]
    head = (
        f"Run of {rep['date']}: {m.get('cpus')} CPUs, load average at the end {m.get('load_average_at_end')}; "
        f"{w['streams']} decode streams ({w['stream_prompt_tokens']} prompt, {w['stream_output_tokens']} output "
        f"tokens, closed loop) while {w['prompt_tokens']}-token prompts ({w['prompt_output_tokens']} output tokens) "
        f"arrive at {', '.join(w['rates'])} per second (Poisson, seed {w['seed']}), {w['duration_s']:g} s per rate; "
        f"engines bound to cores {rep.get('engine_cpus')}; ITL per request: {w['request_itl']}; a chunk: "
        f"{w['chunk']}; {rep.get('wall_s', 0):.0f} s." + (f" Failed: {'; '.join(failed)}." if failed else "")
    )
    lat, per = ray_rows(rep)
    return [
        head,
        "Latency as the client saw it (ms):\n\n" + table(latency_rows(rep)),
        "Goodput (requests/s that met both thresholds) per threshold pair:\n\n" + table(goodput_rows(rep)),
        "\n".join(f"- {line}" for line in verdict(rep)),
        "Our P/D app against Ray Serve LLM's own P/D app on the same engines:\n\n" + table(lat),
        "CPU per 1,000 output tokens outside the engines, net of idle:\n\n" + table(per),
        "`make plan`'s recommendation (from this run's profile) beside the measured winner at the "
        f"reference thresholds:\n\n{table(plan_rows(rep)) if rep.get('plan') else NO_PROFILE}",
        "The issue's targets:\n\n" + table(met_rows(rep)),
        "Cores each vLLM process was seen on after the warm-up:\n\n" + table(pinning_rows(rep)),
    ]


def text(rep: Mapping[str, Any]) -> str:
    return "\n\n".join(_parts(rep, aligned))


def section(rep: Mapping[str, Any]) -> str:
    return "\n\n".join(_parts(rep, markdown))
