"""`make chaos`: the local P/D stack under streamed load while processes die or load triples.

What flows through here: one local stack (`python -m local`, disaggregated app,
1 prefill + 2 decode replicas) -> per scenario, C streamed chat clients in a loop; a fault
at a known time (SIGKILL of the Serve replica whose engine runs the most requests, found
through Serve's REST API and the engines' metrics and checked to be in the stack's own
process tree, or a burst of 3x the admission bound) -> every request's outcome (status,
error event, hung), time to first byte and end-to-end latency, by phase (before / during /
after the fault; "during" lasts until Serve reports the deployment healthy again), p99 and
max latency as ratios to before, and what the fault hit (replica, requests in flight, its
replacement, migrations, local prefills) -> a table and a "hit" line per scenario on screen
and build/chaos/<scenario>.json, plus build/chaos/summary.json.

Scenarios: kill-prefill, kill-decode, kill-ingress, overload, and the long-stream ones in
bench/chaos_streams.py, migrate-decode and scale-in (default run), soak (SOAK=1: 10 minutes
at concurrency 16 with the engines' RSS sampled).
A benchmark prints figures; the acceptance checks (bench/chaos_faults.py) are figures too
(printed and written), not a test, but a check whose scenario's fault missed its target reads
INCONCLUSIVE, and then the command exits non-zero: such a run proves nothing. Only 127.0.0.1
is targeted; only processes that descend from the stack this command started are signalled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import chaos_faults as cf
from bench import chaos_streams, replicas
from bench.prefill_mode import ModeSampler, path_delta
from bench.sse import stream_request
from bench.stats import percentile
from infra.paths import BUILD_DIR
from serving.core.metrics import PrefillPath

DEFAULT_OUT = BUILD_DIR / "chaos"
# Overload first (nothing to recover), the kill of prefill (slowest to restart) last.
SCENARIOS = ("overload", "kill-ingress", "migrate-decode", "scale-in", "kill-decode", "kill-prefill")
SOAK = "soak"
# The kill scenarios: the deployment marker (in the replica's process title) and how many
# replicas it runs, which Serve must be back to.
KILLS = {"kill-prefill": (":Prefill:", 1), "kill-decode": (":Decode:", 2), "kill-ingress": ("Ingress", 1)}

# The workload: short streamed chats, so each client sends many requests per phase.
MAX_TOKENS = 48
PROMPT = "Tell me a story about a robot that learns to paint."
CONCURRENCY = 8
SOAK_CONCURRENCY = 16
# The seconds after a fault whose new requests are reported on their own ("switch"): the
# circuit needs failures_to_open failed calls, and Serve's controller a health check, to notice.
SWITCH_S = 10.0
# The first seconds of a scenario's load are not its no-fault baseline: the first requests a
# fresh stack serves take several times longer (seen: p99 9.9 s against 3.1 s once warm).
WARMUP_S = 5.0
# After recovery, load goes on until the remote prefill share is back at the target, at most
# this long past the "after" window; a stack that stays aggregated fails its verdict.
BACK_MAX_S = 90.0
# A request with no byte for this long counts as hung (the client then gives up on it).
HUNG_AFTER_S = 60.0
# How long a kill waits for an engine reading that shows the victim busy (Ray exports the
# engines' gauges every few seconds); then it kills the busiest replica as last read.
VICTIM_WITHIN_S = 15.0


# --- one request ---------------------------------------------------------------------------
@dataclass
class Outcome:
    start: float  # seconds since the scenario's t0
    end: float
    status: int  # HTTP status; 0: no response (connection error or hung)
    ok: bool  # 200 and a complete stream ([DONE], no error event)
    began_streaming: bool  # at least one content byte reached the client
    ttfb_s: float | None
    kind: str  # ok | http_<status> | stream_error | hung | conn_error
    retry_after: str | None = None

    @property
    def latency_s(self) -> float:
        return self.end - self.start


async def one_request(
    client: httpx.AsyncClient, url: str, headers: dict, t0: float, *, model: str, max_tokens: int = MAX_TOKENS
) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    got = await stream_request(client, url, body, headers=headers, timeout=httpx.Timeout(HUNG_AFTER_S, connect=5))
    return Outcome(
        start=got.start - t0,
        end=got.end - t0,
        status=got.status,
        ok=got.ok,
        began_streaming=got.first_event_at is not None,
        ttfb_s=got.ttfb_s,
        kind=got.kind,
        retry_after=got.retry_after,
    )


class Load:
    """C clients, each sending one request after another until stopped."""

    def __init__(self, url: str, api_key: str | None, concurrency: int, t0: float, *, model: str):
        self.url = url
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.t0 = t0
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            out = await one_request(client, self.url, self.headers, self.t0, model=self.model)
            self.outcomes.append(out)
            if not out.ok:
                await asyncio.sleep(0.2)  # a refused client backs off a little, as SDKs do

    async def __aenter__(self) -> Load:
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        self._http = httpx.AsyncClient(limits=limits)
        self._tasks = [asyncio.create_task(self._client(self._http)) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()


# --- figures ---------------------------------------------------------------------------------
def phase_stats(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    outs = list(outcomes)
    lat = [o.latency_s for o in outs if o.ok]
    ttfb = [o.ttfb_s for o in outs if o.ok and o.ttfb_s is not None]
    kinds: dict[str, int] = {}
    for o in outs:
        if not o.ok:
            kinds[o.kind] = kinds.get(o.kind, 0) + 1
    return {
        "requests": len(outs),
        "ok": sum(o.ok for o in outs),
        "failed": sum(not o.ok for o in outs),
        "failures": kinds,
        "hung": kinds.get("hung", 0),
        "failed_before_streaming": sum(not o.ok and not o.began_streaming for o in outs),
        "failed_after_streaming": sum(not o.ok and o.began_streaming for o in outs),
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "max_s": max(lat, default=None),
        "ttfb_p50_s": percentile(ttfb, 50),
        "ttfb_p99_s": percentile(ttfb, 99),
    }


def by_phase(outcomes: list[Outcome], fault_at: float, healthy_at: float) -> dict[str, Any]:
    """before: ended before the fault (untouched by it), started after the first WARMUP_S of
    load (a scenario that meets a cold stack first times its warm-up otherwise); hit: open at the fault; switch: started
    within SWITCH_S after it (the requests that meet the stack while it notices); during: started
    before the replica was healthy again; after: the rest. hit and switch are where a fault's
    tail shows: inside a 90-second "during" it is diluted, and counted in "before" it flatters
    the ratio the bar reads."""
    return {
        "before": phase_stats(o for o in outcomes if o.start >= WARMUP_S and o.end <= fault_at),
        "hit": phase_stats(o for o in outcomes if o.start < fault_at < o.end),
        "switch": phase_stats(o for o in outcomes if fault_at <= o.start < min(fault_at + SWITCH_S, healthy_at)),
        "during": phase_stats(o for o in outcomes if fault_at <= o.start < healthy_at),
        "after": phase_stats(o for o in outcomes if o.start >= healthy_at),
    }


# --- scenarios ----------------------------------------------------------------------------------
@dataclass
class Ctx:
    url: str
    model: str  # the served model id (the stack's, as its state file says)
    api_key: str | None
    dashboard_url: str
    root_pid: int
    before_s: float
    after_s: float
    during_max_s: float
    recover_timeout_s: float
    capacity: int
    metrics_urls: list[str] = field(default_factory=list)
    say: Callable[[str], None] = print
    notes: dict[str, Any] = field(default_factory=dict)


async def _victim(ctx: Ctx, marker: str) -> tuple[Any, list[dict[str, Any]]]:
    """The replica to kill: of an engine deployment, the one whose engine runs the most
    requests (waiting a little for a reading); the ingress has no engine: its one replica."""
    engine = marker != KILLS["kill-ingress"][0]
    victim, reps, _ = await replicas.busiest_replica(
        ctx.dashboard_url, ctx.metrics_urls, ctx.root_pid, marker, within_s=VICTIM_WITHIN_S if engine else 0
    )
    if victim is None:
        raise RuntimeError(f"no Serve replica matching {marker!r} under pid {ctx.root_pid}")
    return victim, reps


async def _listed(ctx: Ctx, marker: str, tries: int = 5) -> list[dict[str, Any]]:
    """The deployment's RUNNING replicas ([] if the dashboard does not answer in `tries`)."""
    for _ in range(tries):
        try:
            return await asyncio.to_thread(replicas.running_replicas, ctx.dashboard_url, marker)
        except httpx.HTTPError:  # a busy dashboard: ask again
            await asyncio.sleep(1)
    return []


async def kill_scenario(ctx: Ctx, marker: str, want: int, concurrency: int = CONCURRENCY) -> dict:
    """Load; SIGKILL the busiest replica of the deployment named like `marker`; load until Serve
    has `want` healthy replicas again (at most during_max_s), then after_s more."""
    t0 = time.monotonic()
    recovered: float | None = None
    async with (
        ModeSampler(ctx.metrics_urls, t0) as modes,
        Load(ctx.url, ctx.api_key, concurrency, t0, model=ctx.model) as load,
    ):
        await asyncio.sleep(ctx.before_s)
        migrations = await asyncio.to_thread(chaos_streams.migrations, ctx.metrics_urls)
        victim, reps = await _victim(ctx, marker)
        fault_at = time.monotonic() - t0
        ctx.say(
            f"SIGKILL pid {victim.pid} (replica {victim.replica_id}, engine running {victim.running}) at {fault_at:.1f}s"
        )
        os.kill(victim.pid, signal.SIGKILL)
        try:
            recovered = await replicas.wait_healthy(
                ctx.dashboard_url, marker, want, ctx.during_max_s, dead_pid=victim.pid
            )
            ctx.say(f"{marker.strip(':')} healthy again {recovered:.1f}s after the kill")
        except TimeoutError:
            ctx.say(f"{marker.strip(':')} still restarting {ctx.during_max_s:.0f}s after the kill")
        healthy_at = time.monotonic() - t0
        back_from = healthy_at
        if recovered is None:
            # Still restarting: the load goes on (not measured as "during") until it is back,
            # so the serving mode after the restart is measured too.
            settle = await replicas.wait_healthy(
                ctx.dashboard_url, marker, want, ctx.recover_timeout_s, dead_pid=victim.pid
            )
            ctx.say(f"{marker.strip(':')} healthy again {settle + ctx.during_max_s:.0f}s after the kill")
            back_from = time.monotonic() - t0
        now = await _listed(ctx, marker)
        await asyncio.sleep(ctx.after_s)
        # Keep the load on until the serving mode is back (Ray exports counters every few
        # seconds, so a fixed window can end before the counts show it), at most BACK_MAX_S.
        until = time.monotonic() + BACK_MAX_S
        while modes.back_to_remote_after(back_from) is None and time.monotonic() < until:
            await asyncio.sleep(2)
        end = time.monotonic() - t0
    after = await asyncio.to_thread(chaos_streams.migrations, ctx.metrics_urls)
    phases = by_phase(load.outcomes, fault_at, healthy_at)
    if recovered is None:  # "after" starts when the replica was really back
        phases["after"] = phase_stats(o for o in load.outcomes if o.start >= back_from)
    # The designed mode: the share of requests prefilled remotely, per phase, and how long
    # after the killed replica was back that share reached the target again.
    shares = {
        "before": modes.share_between(0, fault_at)[0],
        "during": modes.share_between(fault_at, healthy_at)[0],
        "after": modes.share_between(back_from, end)[0],
    }
    back = modes.back_to_remote_after(back_from)
    # What the kill hit: the victim's engine load, the requests open at the kill, its
    # replacement (a replica id Serve did not list before), local prefills counted after it.
    base = [c for t, c in modes.samples if t <= fault_at][-1:] or [{}]
    last = modes.samples[-1][1] if modes.samples else base[0]
    paths = path_delta(base[0], last)
    local = f"{PrefillPath.LOCAL.value}/"
    known = {r["replica_id"] for r in reps}
    fault = {
        "replica_id": victim.replica_id,
        "pid": victim.pid,
        "running": victim.running,
        "open_requests": cf.open_at(((o.start, o.end) for o in load.outcomes), fault_at),
        "replaced_by": sorted(r["replica_id"] for r in now if r["replica_id"] not in known),
        "local_prefills": paths.get(PrefillPath.LOCAL.value, 0.0),
        # Why they prefilled locally (no_replica, circuit_open, overloaded: the queue bound...).
        "local_reasons": {
            k: v for k, v in path_delta(base[0], last, by_reason=True).items() if k.startswith(local) and v
        },
    }
    return {
        "concurrency": concurrency,
        "fault_at_s": fault_at,
        "healthy_at_s": healthy_at,
        "recovered_after_s": recovered,
        "fault": fault,
        "migrations": chaos_streams.delta(migrations, after),
        "phases": phases,
        "latency_vs_before": cf.latency_ratios(phases),
        "remote_prefill_share": shares,
        "back_to_remote_prefill_s": back,
    }


async def overload_scenario(ctx: Ctx) -> dict:
    """Steady load, then a burst of 3x the admission bound, all at once."""
    t0 = time.monotonic()
    burst_n = 3 * ctx.capacity
    async with Load(ctx.url, ctx.api_key, CONCURRENCY, t0, model=ctx.model) as load:
        await asyncio.sleep(ctx.before_s)
        fault_at = time.monotonic() - t0
        ctx.say(f"burst of {burst_n} concurrent requests (3 x admission bound {ctx.capacity})")
        headers = {"Authorization": f"Bearer {ctx.api_key}"} if ctx.api_key else {}
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=burst_n + 8)) as c:
            burst_task = asyncio.gather(
                *(one_request(c, ctx.url, headers, t0, model=ctx.model) for _ in range(burst_n))
            )
            # While the burst holds every slot: single requests, one after another. Their
            # answer time is what a client sees when the bound is reached.
            await asyncio.sleep(2)
            probes = []
            async with httpx.AsyncClient() as pc:
                for _ in range(10):
                    probes.append(await one_request(pc, ctx.url, headers, t0, model=ctx.model))
            burst = await burst_task
        healthy_at = time.monotonic() - t0
        await asyncio.sleep(ctx.after_s)
    phases = by_phase(load.outcomes, fault_at, healthy_at)
    statuses: dict[str, int] = {}
    for o in burst:
        statuses[o.kind] = statuses.get(o.kind, 0) + 1
    refused = [o for o in burst if o.status in (429, 503)]
    phases["burst"] = phase_stats(burst)
    # The fault landed when the burst really met the bound (cf.landing_checks: some 429/503).
    return {
        "concurrency": CONCURRENCY,
        "burst": burst_n,
        "fault_at_s": fault_at,
        "healthy_at_s": healthy_at,
        "phases": phases,
        "latency_vs_before": cf.latency_ratios(phases),
        "burst_outcomes": statuses,
        "burst_refused_max_s": max((o.latency_s for o in refused), default=None),
        "burst_refused_with_retry_after": sum(1 for o in refused if o.retry_after),
        "burst_slowest_s": max((o.latency_s for o in burst), default=None),
        "burst_refused_p50_s": percentile([o.latency_s for o in refused], 50),
        "probes_while_full": {
            "outcomes": {k: sum(1 for o in probes if o.kind == k) for k in {o.kind for o in probes}},
            "refused_p50_s": percentile([o.latency_s for o in probes if o.status == 503], 50),
            "refused_max_s": max((o.latency_s for o in probes if o.status == 503), default=None),
        },
    }


async def soak_scenario(ctx: Ctx, duration_s: float, warmup_s: float = 60.0) -> dict:
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    async with Load(ctx.url, ctx.api_key, SOAK_CONCURRENCY, t0, model=ctx.model) as load:
        while time.monotonic() - t0 < duration_s:
            await asyncio.sleep(10)
            rss = replicas.engine_rss_mb(ctx.root_pid)
            samples.append({"t": time.monotonic() - t0, "total_mb": sum(rss.values()), "processes": rss})
            ctx.say(
                f"soak {time.monotonic() - t0:5.0f}s: {len(load.outcomes)} requests, "
                f"{sum(not o.ok for o in load.outcomes)} errors, engines RSS "
                f"{sum(rss.values()):.0f} MB"
            )
    warm = [s for s in samples if s["t"] >= warmup_s]
    base = warm[0]["total_mb"] if warm else None
    peak = max((s["total_mb"] for s in warm), default=None)
    end = warm[-1]["total_mb"] if warm else None
    phases = {"soak": phase_stats(load.outcomes)}
    return {
        "concurrency": SOAK_CONCURRENCY,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "phases": phases,
        "rss_mb_after_warmup": base,
        "rss_mb_peak": peak,
        "rss_mb_end": end,
        "rss_growth_pct": (100 * (end - base) / base) if base and end else None,
        "rss_peak_growth_pct": (100 * (peak - base) / base) if base and peak else None,
        "rss_samples": [{"t": s["t"], "total_mb": s["total_mb"]} for s in samples],
    }


# --- the command ------------------------------------------------------------------------------
# Ray exports metrics every second instead of every 10 s: the engines' running requests pick
# the victim 1.5 s into a round, and the counters that show a fault landed (migrations, local
# prefills) arrive before the scenario reads them.
CHAOS_ENV = {"RAY_metrics_report_interval_ms": "1000"}


def stack_options() -> dict[str, Any]:
    """background_stack's arguments: the disaggregated app, 1 prefill + 2 decode replicas (what
    every scenario expects; tests/bench/test_chaos.py builds what it deploys, without Ray)."""
    return {
        "mode": "disaggregated",
        "extra_args": ["--prefill-replicas", "1", "--decode-replicas", "2"],
        "extra_env": CHAOS_ENV,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {', '.join((*SCENARIOS, SOAK))}"
    )
    p.add_argument("--soak", action="store_true", help="add the 10-minute soak at concurrency 16")
    p.add_argument("--soak-seconds", type=float, default=600)
    p.add_argument("--before", type=float, default=20, help="seconds of load before each fault")
    p.add_argument("--after", type=float, default=15, help="seconds of load after recovery")
    p.add_argument(
        "--during-max",
        type=float,
        default=100,
        help="at most this many seconds of load after a kill while the replica restarts",
    )
    p.add_argument("--recover-timeout", type=float, default=600, help="seconds a killed replica may take to return")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, stack: Any, say: Callable[[str], None]) -> dict:
    from local.config import admission_bound

    names = [s for s in args.scenarios.split(",") if s]
    if args.soak and SOAK not in names:
        names.append(SOAK)
    ctx = Ctx(
        url=stack.urls["disaggregated"] + "/chat/completions",
        model=stack.model,
        api_key=stack.api_key,
        dashboard_url=stack.state["dashboard_url"],
        root_pid=stack.proc.pid,
        before_s=args.before,
        after_s=args.after,
        during_max_s=args.during_max,
        recover_timeout_s=args.recover_timeout,
        capacity=admission_bound(stack.state["config"]),
        metrics_urls=[n["metrics_url"] for n in stack.nodes],
        say=say,
    )
    results: dict[str, dict] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        say(f"scenario {name}")
        if name in KILLS:
            marker, want = KILLS[name]
            res = await kill_scenario(ctx, marker, want=want)
        elif name == "overload":
            res = await overload_scenario(ctx)
        elif name == "migrate-decode":
            res = await chaos_streams.migrate_decode_scenario(ctx)
        elif name == "scale-in":
            res = await chaos_streams.scale_in_scenario(ctx, stack.state["config"])
        elif name == SOAK:
            res = await soak_scenario(ctx, args.soak_seconds)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
        res["scenario"] = name
        results[name] = res
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=2))
        print(cf.report(name, res), flush=True)
    return results


def main(argv=None) -> int:
    from local.background import background_stack

    args = parse_args(argv)
    t_start = time.monotonic()
    say = lambda m: print(f"[{time.monotonic() - t_start:6.1f}s] {m}", flush=True)  # noqa: E731
    say("starting the local stack: 1 prefill + 2 decode replicas")
    log = args.out / "serve.log"
    args.out.mkdir(parents=True, exist_ok=True)
    with background_stack(**stack_options(), log_path=log) as stack:
        say(f"stack ready: {stack.urls['disaggregated']}")
        results = asyncio.run(run(args, stack, say))
    v = cf.judge(cf.acceptance(results), results)
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "scenarios": {k: {kk: vv for kk, vv in r.items() if kk != "rss_samples"} for k, r in results.items()},
        "verdicts": v,
        "fault_landed": {k: cf.landing_checks(k, r) for k, r in results.items()},
        "wall_s": time.monotonic() - t_start,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n== acceptance figures ==")
    for k, verdict in v.items():
        print(f"  {verdict:<12}  {k}")
    print("== what each fault hit ==")
    for name, res in results.items():
        print(f"  {cf.fault_line(name, res)}")
    code = cf.exit_code(v)
    if code == 1:
        say(f"an acceptance bar failed: its lines read FAIL (exit {code})")
    elif code:
        say(f"a fault missed its target: its lines are INCONCLUSIVE (exit {code})")
    say(f"done; figures in {args.out}/")
    return code


if __name__ == "__main__":
    sys.exit(main())
