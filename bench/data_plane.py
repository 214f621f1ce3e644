"""`make bench-data-plane`: Serve's three data planes under the same load, one local stack each.

What flows through here: for each round (`--rounds`) and each data plane
(`serving.ingress.dataPlane`, serving.spec.base DataPlane: ray-proxy, grpc, haproxy; the
order rotates from round to round) -> the local stack with that plane
(`python -m local --mode both --data-plane <plane>`, local/background.py) ->
`make bench`'s workload (bench/serving_bench.py `load_for`: vLLM's benchmark client, random
prompts) through its disaggregated and aggregated apps at each level
(serving_bench.run_level), with bench/cpu.py's sampler around every batch -> per plane,
round, app and level: TTFT p50/p99, TPOT p50, output tok/s and CPU-ms per request per hop ->
build/bench/data-plane.json, and a summary (`summary`): per hop, app and plane the median over
rounds, and its ratio to the ray-proxy run of the same round; the same for TTFT p50, TPOT p50
and output tok/s per level.

Ray reads the data plane's switches from every process's environment when it starts
(DataPlane.ray_env), so each plane is its own Ray cluster, started and stopped in turn;
alternating them round by round spreads the machine's drift over all three. Serve's request
tracing stays off (`make bench` traces at a prod stack's rate, and every request in its
--traced-pass): its cost would land on every hop. A benchmark prints figures beside its ray-proxy baseline; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from bench import BENCH_DIR, cpu, vllm_load
from bench.observe import stack_apps
from bench.serving_bench import (
    FIXED_LAYOUT,
    INPUT_LEN,
    OUTPUT_LEN,
    _say,
    cpu_counts,
    load_for,
    machine_info,
    parse_levels,
    run_level,
    sender,
    warm_up,
)
from bench.stats import aligned, summarize
from serving.spec.base import DataPlane

DEFAULT_OUT = BENCH_DIR / "data-plane.json"
BASELINE = DataPlane.RAY_PROXY.value
DATA_PLANES = (BASELINE, DataPlane.GRPC.value, DataPlane.HAPROXY.value)
TARGETS = ("disaggregated", "aggregated")
LEVELS = {1: 24, 16: 64}  # concurrency -> requests per app, per plane and round
ROUNDS = 2
# The summary's latency rows (keys of bench.stats.summarize).
LATENCY = (("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("output_tok_s", "output tok/s"))

Run = Mapping[str, Any]  # one entry of the JSON's "runs"
Get = Callable[[Run], float | None]


# --- the runs ------------------------------------------------------------------------------
def stack_options(plane: str) -> dict[str, Any]:
    """background_stack's arguments: both apps on `plane`, one engine per role as in make bench
    (serving_bench.FIXED_LAYOUT; tests/bench/test_data_plane.py builds what each plane deploys,
    without Ray)."""
    return {"mode": "both", "api_key": "sk-bench", "extra_args": ["--data-plane", plane, *FIXED_LAYOUT]}


def one_stack(
    plane: str, rnd: int, args: argparse.Namespace, model_dir: str, log: TextIO, say: Callable[[str], None]
) -> dict[str, Any]:
    """One data plane's stack, once: warm-up, then every level through both apps. Returns the
    run's "apps" (app -> level -> bench.stats.summarize's figures and bench.cpu's "cpu"; level
    "all": the CPU, levels pooled), "errors_sample" (app -> a few failed requests' errors) and
    "ready" (the stack's start time, from its READY line)."""
    from local.background import background_stack
    from local.config import MODEL_ID

    logs = args.out.parent
    with background_stack(**stack_options(plane), log_path=logs / f"serve-{plane}-r{rnd}.log") as stack:
        ready = stack.ready_line.split(":", 1)[0].strip()  # "READY in <s>s" (the rest names URLs and key)
        say(f"round {rnd + 1}: {plane} stack {ready}; warming up")
        send = sender(stack.urls, {t: stack.api_key for t in TARGETS}, MODEL_ID, model_dir, log)
        warm_up(send, TARGETS, args.seed - 1)
        apps, _, layout = stack_apps(stack)
        meter = cpu.Meter({"stack": stack.proc.pid}, layout)
        # One round per level inside the stack (the rounds are the stacks); same prompts for
        # every plane of a round.
        levels = {
            conc: run_level(
                send, TARGETS, conc, n, rounds=1, seed=args.seed + rnd, meter=meter, apps=apps, shift=li + rnd, say=say
            )
            for li, (conc, n) in enumerate(args.levels.items())
        }
    stats = {t: {c: summarize(lv.results[t], lv.duration_s[t]) for c, lv in levels.items()} for t in TARGETS}
    figures = cpu.run_figures(meter.tallies, cpu_counts(stats))
    apps_out = {
        t: {
            **{str(c): {**s, "cpu": figures[t][str(c)]} for c, s in stats[t].items()},
            "all": {"cpu": figures[t]["all"]},
        }
        for t in TARGETS
    }
    errors = {t: [r.error for lv in levels.values() for r in lv.results[t] if not r.ok][:3] for t in TARGETS}
    return {"apps": apps_out, "errors_sample": errors, "ready": ready}


def plan(planes: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, plane) in run order: every plane once a round, the order rotating by one each round."""
    out = []
    for r in range(rounds):
        k = r % len(planes)
        out += [(r, p) for p in [*planes[k:], *planes[:k]]]
    return out


# --- the summary -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """The median of some values and their range (min, max): with 2 rounds, both values."""

    median: float | None
    lo: float | None
    hi: float | None

    @classmethod
    def of(cls, xs: Iterable[float]) -> Spread:
        v = list(xs)
        return cls(statistics.median(v), min(v), max(v)) if v else cls(None, None, None)

    def text(self, digits: int = 1) -> str:
        if self.median is None or self.lo is None or self.hi is None:
            return "-"
        m, lo, hi = (f"{x:,.{digits}f}" for x in (self.median, self.lo, self.hi))
        return m if lo == hi else f"{m} ({lo}–{hi})"


def paired(runs: Iterable[Run], plane: str, get: Get) -> tuple[Spread, Spread]:
    """A figure of `plane` over the rounds, and its ratio to the baseline (ray-proxy) run of the
    same round, round by round. Runs that failed, or lack the figure, are left out."""
    done = [r for r in runs if "apps" in r]
    base = {r["round"]: get(r) for r in done if r["data_plane"] == BASELINE}
    values, ratios = [], []
    for r in done:
        if r["data_plane"] != plane or (v := get(r)) is None:
            continue
        values.append(v)
        b = base.get(r["round"])
        if b:
            ratios.append(v / b)
    return Spread.of(values), Spread.of(ratios)


def cpu_getter(app: str, key: str, level: str = "all") -> Get:
    """CPU-ms per request of one hop class (or a total: front_door, non_engine, engine)."""

    def get(run: Run) -> float | None:
        fig = (((run.get("apps") or {}).get(app) or {}).get(level) or {}).get("cpu") or {}
        part = (fig.get("classes") or {}).get(key) if key in cpu.CLASSES else fig.get(key)
        return (part or {}).get("cpu_ms_per_request")

    return get


def latency_getter(app: str, level: str, key: str) -> Get:
    def get(run: Run) -> float | None:
        return (((run.get("apps") or {}).get(app) or {}).get(level) or {}).get(key)

    return get


def summary(rep: Mapping[str, Any]) -> dict[str, Any]:
    """{"cpu": app -> hop -> plane -> (median, ratio), "latency": app -> level -> metric ->
    plane -> (median, ratio)}: Spreads, all levels pooled for CPU."""
    runs = rep.get("runs") or []
    planes = list(rep.get("data_planes") or DATA_PLANES)
    levels = [str(c) for c in (rep.get("workload") or {}).get("levels") or LEVELS]
    out: dict[str, Any] = {"planes": planes, "cpu": {}, "latency": {}}
    for app in TARGETS:
        hops = [k for k in cpu.CLASSES if any(cpu_getter(app, k)(r) is not None for r in runs)]
        hops += [k for k, _ in cpu.TOTALS]
        out["cpu"][app] = {k: {p: paired(runs, p, cpu_getter(app, k)) for p in planes} for k in hops}
        out["latency"][app] = {
            lv: {m: {p: paired(runs, p, latency_getter(app, lv, m)) for p in planes} for m, _ in LATENCY}
            for lv in levels
        }
    return out


def _header(first: str, planes: Sequence[str]) -> list[str]:
    cols = [first]
    for p in planes:
        cols += [p] if p == BASELINE else [p, f"÷ {BASELINE}"]
    return cols


def _cells(by_plane: Mapping[str, tuple[Spread, Spread]], planes: Sequence[str], digits: int) -> list[str]:
    cells = []
    for p in planes:
        value, ratio = by_plane[p]
        cells += [value.text(digits)] if p == BASELINE else [value.text(digits), ratio.text(2)]
    return cells


def cpu_rows(summ: Mapping[str, Any], app: str) -> list[list[str]]:
    """Rows (header first): per hop of `app`, the median CPU-ms per request over rounds (range)
    per plane, and the median of its round-by-round ratios to ray-proxy (range)."""
    labels = {**cpu.CLASSES, **dict(cpu.TOTALS)}
    rows = [_header(f"{app}: CPU-ms per request", summ["planes"])]
    for key, by_plane in summ["cpu"][app].items():
        rows.append([labels[key], *_cells(by_plane, summ["planes"], 1)])
    return rows


def latency_rows(summ: Mapping[str, Any]) -> list[list[str]]:
    """Rows (header first): per app, level and metric, the median over rounds (range) per
    plane, and the median of its round-by-round ratios to ray-proxy (range)."""
    names = dict(LATENCY)
    rows = [_header("app, concurrency, figure", summ["planes"])]
    for app, by_level in summ["latency"].items():
        for lv, by_metric in by_level.items():
            for m, by_plane in by_metric.items():
                rows.append([f"{app} c{lv} {names[m]}", *_cells(by_plane, summ["planes"], 1)])
    return rows


def format_text(rep: Mapping[str, Any]) -> str:
    summ = summary(rep)
    parts = [aligned(latency_rows(summ)), *(aligned(cpu_rows(summ, app)) for app in TARGETS)]
    return "\n\n".join(parts)


# --- the command -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.data_plane", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=20261202)
    p.add_argument(
        "--levels",
        type=parse_levels,
        default=LEVELS,
        help="concurrency:requests per app, comma-separated (default "
        + ",".join(f"{c}:{n}" for c, n in LEVELS.items())
        + ")",
    )
    p.add_argument("--rounds", type=int, default=ROUNDS, help="stacks per data plane, alternated (default %(default)s)")
    p.add_argument(
        "--data-planes",
        type=lambda s: [DataPlane(x).value for x in s.split(",")],
        default=list(DATA_PLANES),
        help=f"comma-separated (default {','.join(DATA_PLANES)}); ratios need {BASELINE}",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def record(args: argparse.Namespace, runs: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """The JSON: the workload, the machine, each plane's Ray switches, every run."""
    from local.config import MODEL_ID

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "data_planes": list(args.data_planes),
        "baseline": BASELINE,
        "ray_env": {p: DataPlane(p).ray_env for p in args.data_planes},
        "workload": {
            "seed": args.seed,
            "apps": list(TARGETS),
            "client_args_example": vllm_load.cli_args(
                load_for("http://HOST:PORT/v1", None, MODEL_ID, "<model dir>", 8, 1, args.seed)
            ),
            "prompt_tokens": f"uniform {INPUT_LEN[0]}..{INPUT_LEN[1]} (vLLM random dataset)",
            "output_tokens": f"uniform {OUTPUT_LEN[0]}..{OUTPUT_LEN[1]}",
            "levels": {str(c): n for c, n in args.levels.items()},
            "rounds": args.rounds,
        },
        "machine": machine_info(),
        "model": {"id": MODEL_ID, "dtype": "float32"},
        "cpu_classes": dict(cpu.CLASSES),
        "conditions": [
            "One local stack at a time (mode both: the disaggregated and the aggregated app), "
            "started with the plane's Ray switches and stopped before the next.",
            "Serve request tracing off; each level is one batch per app inside a stack.",
        ],
        "runs": runs,
        "wall_s": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    from local import tiny_model

    args = parse_args(argv)
    t0 = time.monotonic()
    say = lambda m: _say(t0, m)  # noqa: E731
    model_dir = str(tiny_model.ensure_tiny_model())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with open(args.out.parent / "data-plane-client.log", "w") as log:
        for position, (rnd, plane) in enumerate(plan(args.data_planes, args.rounds)):
            run: dict[str, Any] = {"round": rnd, "data_plane": plane, "position": position}
            start = time.monotonic()
            try:
                run.update(one_stack(plane, rnd, args, model_dir, log, say))
            except Exception as exc:  # one plane failing to start leaves the others' figures
                run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                say(f"round {rnd + 1}: {plane} failed: {run['error'][:200]}")
            run["wall_s"] = time.monotonic() - start
            runs.append(run)
            # Written after every stack: a run cut short keeps what it measured.
            args.out.write_text(json.dumps(record(args, runs, t0), indent=2))
    rep = record(args, runs, t0)
    args.out.write_text(json.dumps(rep, indent=2))
    print()
    print(f"Medians over {args.rounds} rounds (range); ÷ {BASELINE}: the median of each round's ratio to")
    print(f"the {BASELINE} run of the same round (range). CPU: all levels pooled, user + system CPU per process.")
    print()
    print(format_text(rep))
    print()
    failed = [f"{r['data_plane']} round {r['round'] + 1}" for r in runs if "error" in r]
    if failed:
        print(f"Failed runs (left out): {', '.join(failed)}")
    print(f"JSON: {args.out}  wall {rep['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
