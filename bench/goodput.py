"""`make bench-goodput`: goodput under a mixed load, four targets on the same cores, one at a time.

What flows through here: the targets (`vllm`: vLLM's own server; `aggregated` and
`disaggregated`: our apps, `python -m local --mode <it>`; `ray-pd`: Ray Serve LLM's own P/D app on
our P/D app's engine configs, `--mode ray-pd`, local/ray_pd.py), each engine's compute threads
bound to its cores (`--engine-cpus`, local/engine_cpus.py: one core per P/D engine, both for the
aggregated engine and plain vLLM) -> per target, its stack started alone (`stack_up`), warmed
up; the bound cores its engine threads were seen on (`pinning_seen`); an idle phase (bench/cpu.py
per hop, netted off later); for our two apps a profile run (bench/goodput_plan.py); then per
rate a window of bench/goodput_load.py's workload (decode streams closed-loop, long prompts
arriving open-loop at the rate, seeded: the same requests for every target), every process's
CPU metered around it -> stopped -> per target and rate bench/goodput_figures.py's summary
(TTFT, per-token ITL beside chunk intervals, goodput per threshold pair), CPU per hop per 1,000
output tokens net of idle (bench/per_token.py), what bound; across targets where P/D's goodput
passes aggregated's, our P/D against Ray's, and the plan's verdict beside the measured one ->
build/bench/goodput.json and the tables (bench/goodput_report.py; `python -m bench.report`
puts them in docs/performance.md).

One stack at a time: the cores are the resource measured. A benchmark prints figures; it
does not pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import BENCH_DIR, cpu, goodput_report, per_token
from bench import goodput_figures as gf
from bench import goodput_plan as gplan
from bench.goodput_load import DRAIN_S, Workload, body, run_window, sequential
from bench.serving_bench import FIXED_LAYOUT, _say, machine_info
from local.config import LOCAL_SLO
from local.engine_cpus import ENGINE_CPUS_ENV, OMP_BIND_ENV, cores
from local.engine_cpus import parse as parse_engine_cpus
from local.ray_pd import RAY_PD_MODE

DEFAULT_OUT = BENCH_DIR / goodput_report.JSON_NAME
TARGETS = ("vllm", "aggregated", "disaggregated", RAY_PD_MODE)
PROFILED = ("aggregated", "disaggregated")  # the plan compares our two modes
RATES = (1.0, 3.0, 6.0)  # long prompts per second
DURATION_S = 100.0  # per rate
IDLE_S = 15.0
ENGINE_CPUS = "prefill=0,decode=1,aggregated=0-1"
# Thresholds swept (seconds); the reference pair is the local stack's SLO (local/config.py).
TTFT_THRESHOLDS = (0.25, 0.5, 1.0, 2.0)
ITL_THRESHOLDS = (0.05, 0.1, 0.2)
REFERENCE = (LOCAL_SLO["ttftSeconds"], LOCAL_SLO["itlSeconds"])
API_KEY = "sk-bench"
WARMUP_REQUESTS = 2


# --- the stacks (tests/bench/test_goodput.py builds what they deploy, without Ray) --------------
def stack_options(target: str, engine_cpus: str = ENGINE_CPUS) -> dict[str, Any]:
    """background_stack's arguments for a Ray target: its mode alone, one engine per role
    (serving_bench.FIXED_LAYOUT), its engines bound to their cores; Ray's own app has no keys."""
    return {
        "mode": target,
        "api_key": None if target == RAY_PD_MODE else API_KEY,
        "extra_env": {ENGINE_CPUS_ENV: engine_cpus},
        "extra_args": FIXED_LAYOUT,
    }


def plain_vllm_env(engine_cpus: str = ENGINE_CPUS) -> dict[str, str]:
    """Plain vLLM's engine environment: the local engines' (local_target), bound as the aggregated engine."""
    from local.config import local_target

    return {**local_target().engine_env, OMP_BIND_ENV: parse_engine_cpus(engine_cpus)["aggregated"]}


@dataclass
class Up:
    """A target ready for load."""

    url: str  # its OpenAI base, ending in /v1
    headers: dict[str, str]
    meter: cpu.Meter
    app: str | None  # its Serve app (None: plain vLLM)
    ready: str
    kv_seconds: Callable[[], tuple[float, float]] | None = None  # decode's NIXL (seconds, transfers)


@contextlib.contextmanager
def stack_up(target: str, args: argparse.Namespace, model_dir: str, say: Callable[[str], None]) -> Iterator[Up]:
    """Start one target's stack, yield it ready, stop it after."""
    from bench.observe import kv_totals, settled, stack_apps
    from bench.plain_vllm import vllm_server, wait_healthy
    from local.background import background_stack
    from local.config import HOST, MODEL_ID
    from local.procs import free_port

    logs = args.out.parent
    if target == "vllm":
        port = free_port()
        with vllm_server(model_dir, MODEL_ID, port, plain_vllm_env(args.engine_cpus), logs / "goodput-vllm.log") as p:
            t0 = time.monotonic()
            wait_healthy(f"http://{HOST}:{port}", p)
            meter = cpu.Meter({cpu.PLAIN: p.pid}, {})
            yield Up(f"http://{HOST}:{port}/v1", {}, meter, None, f"healthy in {time.monotonic() - t0:.0f}s")
        return
    with background_stack(**stack_options(target, args.engine_cpus), log_path=logs / f"goodput-{target}.log") as st:
        apps, _, layout = stack_apps(st)
        decode = next(n["metrics_url"] for n in st.nodes if n["label"] == "decode")

        def kv_seconds() -> tuple[float, float]:
            kv = kv_totals(settled([decode])[decode])
            return kv["nixl_xfer_s"], kv["nixl_transfers"]

        yield Up(
            st.urls[target],
            {"Authorization": f"Bearer {st.api_key}"} if st.api_key else {},
            cpu.Meter({"stack": st.proc.pid}, layout),
            apps[target],
            st.ready_line.split(":", 1)[0].strip(),
            kv_seconds if target != "aggregated" else None,
        )


def _cores_text(ids: set[int]) -> str:
    """{0, 1, 3} -> "0-1,3"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def pinning_seen(meter: cpu.Meter) -> list[dict[str, Any]]:
    """Each vLLM process of the target: the cores its main thread (a worker's runs the model)
    and its other threads may run on, as the kernel has them now."""
    import psutil

    snap = meter.take()
    out = []
    for p in snap.values():
        cls, _ = cpu.classify(p, snap, meter.layout)
        if cls not in cpu.ENGINE_CLASSES or not p.title.startswith(cpu.VLLM_PREFIX):
            continue
        try:
            threads = Counter(_cores_text(os.sched_getaffinity(t.id)) for t in psutil.Process(p.pid).threads())
            main = _cores_text(os.sched_getaffinity(p.pid))
        except (psutil.Error, OSError):
            continue
        out.append({"class": cls, "title": p.title[:60], "main_thread_cores": main, "threads_by_cores": dict(threads)})
    return out


# --- one target -------------------------------------------------------------------------------
def _client_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def warm_up(up: Up, model: str, wl: Workload) -> None:
    """A few requests of each kind; the first failure stops the run."""
    import random

    rng = random.Random("warm-up")
    bodies = [body(rng, model, wl.prompt_tokens, 4, wl.vocab), body(rng, model, wl.stream_prompt_tokens, 16, wl.vocab)]
    got = asyncio.run(sequential(up.url, up.headers, bodies * WARMUP_REQUESTS))
    bad = [g.error or g.kind for g in got if not g.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def one_target(
    target: str, args: argparse.Namespace, wl: Workload, model_dir: str, say: Callable[[str], None]
) -> dict[str, Any]:
    """One target's stack, alone: warm-up, pinning, idle phase, profile run, every rate."""
    from local.config import MODEL_ID

    out: dict[str, Any] = {"rates": {}, "binding": {}}
    with stack_up(target, args, model_dir, say) as up:
        say(f"{target}: {up.ready}; warming up")
        warm_up(up, MODEL_ID, wl)
        out["ready"], out["pinning"] = up.ready, pinning_seen(up.meter)
        idle_s, wall = up.meter.idle(args.idle_s, {target: cpu.target_scopes(up.app)})
        out["idle_cores"] = per_token.idle_cores(idle_s[target], wall)
        if target in PROFILED and not args.no_profile:
            say(f"{target}: profile run (decode step at two batches, prompt tokens/s, KV transfer)")
            out["profile"] = gplan.measure(up.url, up.headers, MODEL_ID, wl, str(args.seed), up.kv_seconds)
        for k, rate in enumerate(args.rates):
            key = f"{rate:g}"
            c0 = _client_cpu_s()
            with up.meter.batch(target, key, up.app):
                sent = asyncio.run(
                    run_window(
                        up.url, up.headers, MODEL_ID, wl, rate, args.duration_s, f"{args.seed}:{k}", args.drain_s
                    )
                )
            reqs = [gf.from_sent(s) for s in sent]
            out["rates"][key] = gf.summary(reqs, args.duration_s, args.pairs)
            tally = up.meter.tallies[target][key]
            out["binding"][key] = gf.binding(tally, _client_cpu_s() - c0, args.binds, os.cpu_count() or 1)
            s = out["rates"][key]
            say(
                f"{target} at {key} prompts/s: {s['completed']}/{s['requests']} ok, TTFT p50 {s['ttft_p50_ms'] or 0:.0f} ms, "
                f"ITL p99 {s['itl_p99_ms'] or 0:.0f} ms, goodput {s['goodput'][gf.pair_key(*REFERENCE)]['req_s']:.2f}/s"
            )
        out["tallies"] = up.meter.tallies.get(target, {})
    return out


# --- the run ---------------------------------------------------------------------------------
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=20261207)
    p.add_argument("--targets", type=lambda s: s.split(","), default=list(TARGETS), help=f"of {','.join(TARGETS)}")
    p.add_argument("--rates", type=_floats, default=RATES, help="long prompts per second (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=DURATION_S, help="window per rate (default %(default)s)")
    p.add_argument("--drain-s", type=float, default=DRAIN_S, help="after a window, for its last requests")
    p.add_argument("--idle-s", type=float, default=IDLE_S, help="idle phase per target (default %(default)s)")
    p.add_argument("--streams", type=int, default=Workload().streams, help="decode streams (default %(default)s)")
    p.add_argument("--ttft-s", type=_floats, default=TTFT_THRESHOLDS, help="TTFT thresholds swept")
    p.add_argument("--itl-s", type=_floats, default=ITL_THRESHOLDS, help="ITL thresholds swept")
    p.add_argument("--engine-cpus", default=ENGINE_CPUS, help="cores per engine role (default %(default)s)")
    p.add_argument("--no-profile", action="store_true", help="skip the profile runs (no plan verdicts)")
    p.add_argument("--dry-run", action="store_true", help="print what each target would deploy and the schedule")
    args = p.parse_args(argv)
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"--targets: {', '.join(unknown)} not among {', '.join(TARGETS)}")
    try:
        args.binds = parse_engine_cpus(args.engine_cpus)
    except ValueError as exc:
        p.error(f"--engine-cpus: {exc}")
    args.pairs = sorted({(t, i) for t in args.ttft_s for i in args.itl_s} | {REFERENCE})
    return args


# The schedule's estimate, per target (seconds): a stack's start to READY (make serve took 50-140 s
# on this machine), its warm-up and stop, a profile run (P/D's waits out decode's metrics twice),
# and what a window's last requests take after it.
START_S, WARM_AND_STOP_S, PROFILE_S, TAIL_S = 120.0, 30.0, 75.0, 10.0


def estimate_s(args: argparse.Namespace) -> float:
    """About how long the run takes."""
    per_target = START_S + WARM_AND_STOP_S + args.idle_s + len(args.rates) * (args.duration_s + TAIL_S)
    profiled = 0 if args.no_profile else sum(1 for t in args.targets if t in PROFILED)
    return len(args.targets) * per_target + profiled * PROFILE_S


def dry_run(args: argparse.Namespace) -> str:
    """What each target would deploy (nothing is started), and the schedule."""
    from local.background import plan_stack
    from local.config import MODEL_ID
    from local.plain_vllm import plain_vllm_argv

    lines = []
    for t in args.targets:
        if t == "vllm":
            cmd = " ".join(plain_vllm_argv("<tiny model>", MODEL_ID, 0)[1:3])
            lines.append(f"{t}: {cmd}, {OMP_BIND_ENV}={plain_vllm_env(args.engine_cpus)[OMP_BIND_ENV]}")
            continue
        plan = plan_stack(**stack_options(t, args.engine_cpus))
        for app in plan.config["applications"]:
            a = app["args"]
            engines = {k: a[k] for k in ("prefill_config", "decode_config") if k in a}
            engines.update({f"llm_configs[{i}]": c for i, c in enumerate(a.get("llm_configs") or [])})
            binds = ", ".join(f"{k} {c['runtime_env']['env_vars'].get(OMP_BIND_ENV)}" for k, c in engines.items())
            lines.append(f"{t}: {' '.join(plan.argv[3:])} -> {app['import_path']}; {OMP_BIND_ENV}: {binds}")
    lines.append(
        f"rates {', '.join(f'{r:g}' for r in args.rates)} long prompts/s, {args.duration_s:g} s each, "
        f"{len(args.pairs)} threshold pairs; about {estimate_s(args) / 60:.0f} minutes"
    )
    return "\n".join(lines)


def role_cores(binds: Mapping[str, str], cpus: int) -> dict[str, int]:
    """Engine role -> the cores it was bound to (unbound: the machine's)."""
    return {r: len(cores(binds[r])) if r in binds else cpus for r in ("prefill", "decode", "aggregated")}


def record(args: argparse.Namespace, wl: Workload, runs: dict[str, dict[str, Any]], t0: float) -> dict[str, Any]:
    """The JSON (module doc), from what the targets gave."""
    from local.config import MODEL_ID

    ok = {t: r for t, r in runs.items() if "rates" in r}
    figs = {t: r["rates"] for t, r in ok.items()}
    tallies = {t: r["tallies"] for t, r in ok.items()}
    counts = {t: {k: (s["completed"], s["output_tokens"]) for k, s in figs[t].items()} for t in ok}
    ref = gf.pair_key(*REFERENCE)
    cpus = os.cpu_count() or 1
    profiles = {t: r["profile"] for t, r in ok.items() if r.get("profile")}
    slo = gplan.dis.Slo(ttft_s=REFERENCE[0], itl_s=REFERENCE[1])
    rep: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
        "model": {"id": MODEL_ID, "dtype": "float32"},
        "workload": {
            "seed": args.seed,
            **dataclasses.asdict(wl),
            "rates": [f"{r:g}" for r in args.rates],
            "duration_s": args.duration_s,
            "drain_s": args.drain_s,
            "arrivals": "long prompts open-loop, Poisson at the rate (seeded); decode streams closed-loop",
            "request_itl": f"p{gf.REQUEST_ITL_PERCENTILE:g} of the request's per-token gaps as the client computes them",
            "chunk": f"events within {gf.BURST_S * 1000:g} ms of the one before (one network read)",
        },
        "thresholds": {"ttft_s": list(args.ttft_s), "itl_s": list(args.itl_s), "reference": ref},
        "engine_cpus": args.binds,
        "targets": figs,
        "stacks": {
            t: {k: r[k] for k in ("ready", "pinning", "idle_cores", "error") if k in r} for t, r in runs.items()
        },
        "binding": {t: r["binding"] for t, r in ok.items()},
        "cpu": cpu.run_figures(tallies, counts),
        "per_token": per_token.run(tallies, counts, {t: r["idle_cores"] for t, r in ok.items()}),
        "crossing": gf.crossing(figs.get("disaggregated") or {}, figs.get("aggregated") or {}),
        "profile": profiles,
        "plan": gplan.verdicts(profiles, figs, role_cores(args.binds, cpus), wl, slo, ref) if profiles else {},
        "wall_s": time.monotonic() - t0,
    }
    # The heaviest measured mix (the highest rate on the aggregated app) on a shipped stack's GPUs.
    heaviest = (figs.get("aggregated") or {}).get(f"{max(args.rates):g}")
    m = gplan.mix(heaviest, wl) if heaviest else None
    rep["gpu_crossing"] = gplan.gpu_crossing(round(m[0]), max(1, round(m[1]))) if m else None
    rep["ours_vs_ray"] = gf.versus_ray(figs, rep["per_token"])
    return rep


def main(argv: list[str] | None = None) -> int:
    from local import tiny_model

    args = parse_args(argv)
    if args.dry_run:
        print(dry_run(args))
        return 0
    t0 = time.monotonic()
    say = lambda m: _say(t0, m)  # noqa: E731
    wl = Workload(streams=args.streams)
    model_dir = str(tiny_model.ensure_tiny_model())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    for target in args.targets:
        try:
            runs[target] = one_target(target, args, wl, model_dir, say)
        except Exception as exc:  # one target failing leaves the others' figures
            runs[target] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            say(f"{target} failed: {runs[target]['error'][:300]}")
        # Written after every target: a run cut short keeps what it measured.
        args.out.write_text(json.dumps(record(args, wl, runs, t0), indent=2, default=str))
    rep = record(args, wl, runs, t0)
    args.out.write_text(json.dumps(rep, indent=2, default=str))
    print()
    print(goodput_report.text(rep))
    print(f"JSON: {args.out}  wall {rep['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
