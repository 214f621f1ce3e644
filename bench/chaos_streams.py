"""`make chaos` stream scenarios: long answers through a decode death and a scale-in.

What flows through here: the chaos stack (1 prefill + 2 decode replicas, bench/chaos.py) ->
STREAMS streamed chat clients, one long answer each (a fixed prompt, temperature 0,
ignore_eos, TOKENS tokens) -> a reference round without a fault, then a round with the
fault FAULT_AT_S in, once the engines' exported gauges show the streams running: SIGKILL
of the decode replica whose engine runs the most of them (`migrate-decode`: the cut streams
must be continued on the other replica), or, once both decode engines run some, a Serve
config update that takes decode from 2 replicas to 1 (`scale-in`: Serve stops one replica,
whose streams must drain or be continued) -> per round: streams complete / cut / failed,
token counts, how many answers equal the reference text, stream latency, migrations counted
by outcome (ray_pd_stream_migrations_total), and what the fault hit (the killed or removed
replica and the streams its engine ran) -> a dict for build/chaos/<scenario>.json. The
stack is left with 2 decode replicas.

Texts are compared, not promised equal: with temperature 0 a continuation reproduces the
answer when the engine computes the same logits for the same tokens, which batch shapes
(how many sequences share a step, a prefill of prompt + answer instead of step-by-step
decoding) can change in the last bits; the figure says how often they matched here.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import httpx

from bench import hops, replicas
from bench.sse import Streamed, stream_request
from bench.stats import percentile

NAMES = ("migrate-decode", "scale-in")
STREAMS = 8
TOKENS = 600
FAULT_AT_S = 1.5
PROMPT = "Tell me a long story about a robot that learns to paint."
MIGRATIONS = "ray_pd_stream_migrations_total"
# The decode deployment (in its replicas' process titles) and the replicas the chaos stack runs.
DECODE = ":Decode:"
DECODE_REPLICAS = 2
# How long the fault waits for the engines' gauges (exported every few seconds) to show the
# streams running before it strikes anyway; and, after the round, how long they may take to
# read idle again (a reading left over from the round before would pick a victim blindly).
BUSY_WITHIN_S = 20.0
IDLE_WITHIN_S = 20.0
# How long Serve may take to mark the replica it stops on scale-in.
REMOVED_WITHIN_S = 30.0
# How long the round's migrations may take to show in the exported counter.
MIGRATIONS_WITHIN_S = 20.0


async def _round(ctx: Any, fault: Any = None) -> list[Streamed]:
    body = {
        "model": ctx.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {ctx.api_key}"} if ctx.api_key else {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=STREAMS * 2)) as c:
        tasks = [
            asyncio.create_task(
                stream_request(c, ctx.url, body, headers=headers, timeout=httpx.Timeout(180, connect=5))
            )
            for _ in range(STREAMS)
        ]
        if fault is not None:
            await asyncio.sleep(FAULT_AT_S)
            await fault()
        return list(await asyncio.gather(*tasks))


def migrations(urls: list[str]) -> dict[str, float]:
    """{outcome: streams} of ray_pd_stream_migrations_total, summed over the nodes."""
    return hops.scrape_by_label(urls, MIGRATIONS, "outcome")


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


async def _until_idle(ctx: Any) -> None:
    """Until no decode engine reads running requests (at most IDLE_WITHIN_S); a replica gone
    since (its series may linger in Ray's exporter) does not count."""
    until = time.monotonic() + IDLE_WITHIN_S
    while time.monotonic() < until:
        try:
            reps = await asyncio.to_thread(replicas.running_replicas, ctx.dashboard_url, DECODE)
        except httpx.HTTPError:  # a busy dashboard: ask again
            reps = None
        running = await asyncio.to_thread(replicas.engine_running, ctx.metrics_urls)
        if reps is not None and not replicas.busy(reps, running):
            return
        await asyncio.sleep(1)


def _summary(got: list[Streamed], reference: str | None) -> dict[str, Any]:
    complete = [r for r in got if r.ok and (r.usage or {}).get("completion_tokens") == TOKENS]
    lat = [r.end - r.start for r in got if r.ok]
    return {
        "streams": len(got),
        "complete": len(complete),
        "cut": sum(1 for r in got if r.status == 200 and not r.ok),
        "failed": sum(1 for r in got if r.status != 200),
        "short": sum(1 for r in got if r.ok and (r.usage or {}).get("completion_tokens") != TOKENS),
        "same_text_as_reference": sum(1 for r in got if reference is not None and r.text == reference),
        "errors": [r.error_event or r.error for r in got if not r.ok][:3],
        "p99_s": percentile(lat, 99),
        "max_s": max(lat, default=None),
    }


async def _counted_round(ctx: Any, fault: Any) -> dict[str, Any]:
    reference_round = await _round(ctx)
    texts = Counter(r.text for r in reference_round if r.ok)
    reference = texts.most_common(1)[0][0] if texts else None
    await _until_idle(ctx)
    before = await asyncio.to_thread(migrations, ctx.metrics_urls)
    faulted = await _round(ctx, fault)
    # Ray exports counters every few seconds: wait for the round's migrations to show (a
    # scale-in that drains counts none: then the whole wait).
    until = time.monotonic() + MIGRATIONS_WITHIN_S
    await asyncio.sleep(6)
    after = await asyncio.to_thread(migrations, ctx.metrics_urls)
    while not any(delta(before, after).values()) and time.monotonic() < until:
        await asyncio.sleep(2)
        after = await asyncio.to_thread(migrations, ctx.metrics_urls)
    ref, got = _summary(reference_round, reference), _summary(faulted, reference)
    return {
        "streams": STREAMS,
        "tokens": TOKENS,
        "fault_at_s": FAULT_AT_S,
        "reference": ref,
        "reference_texts_distinct": len(texts),
        "faulted": got,
        "latency_vs_before": {
            "faulted": {
                "p99": got["p99_s"] / ref["p99_s"] if got["p99_s"] and ref["p99_s"] else None,
                "max": got["max_s"] / ref["max_s"] if got["max_s"] and ref["max_s"] else None,
            }
        },
        "migrations": delta(before, after),
    }


async def _busy_decode(ctx: Any, want_busy: int) -> tuple[Any, list[dict[str, Any]], dict[str, float]]:
    return await replicas.busiest_replica(
        ctx.dashboard_url, ctx.metrics_urls, ctx.root_pid, DECODE, within_s=BUSY_WITHIN_S, want_busy=want_busy
    )


async def migrate_decode_scenario(ctx: Any) -> dict[str, Any]:
    """SIGKILL the decode replica running the most of STREAMS long streams."""
    fault: dict[str, Any] = {}

    async def kill() -> None:
        t = time.monotonic()
        victim, _, running = await _busy_decode(ctx, want_busy=1)
        if victim is None:
            raise RuntimeError(f"no decode replica under pid {ctx.root_pid}")
        at = FAULT_AT_S + time.monotonic() - t  # seconds into the round
        ctx.say(
            f"SIGKILL decode replica {victim.replica_id} (pid {victim.pid}, engine running {victim.running}; "
            f"engines: {running}), {at:.1f}s into {STREAMS} streams"
        )
        os.kill(victim.pid, signal.SIGKILL)
        fault.update(replica_id=victim.replica_id, pid=victim.pid, running=victim.running, at_s=at)

    res = await _counted_round(ctx, kill)
    res["fault"], res["fault_at_s"] = fault, fault.get("at_s")
    t = time.monotonic()
    await replicas.wait_healthy(
        ctx.dashboard_url, DECODE, DECODE_REPLICAS, ctx.recover_timeout_s, dead_pid=fault["pid"]
    )
    ctx.say(f"decode back to {DECODE_REPLICAS} replicas {time.monotonic() - t:.0f}s after the round")
    return res


def _with_decode_replicas(config: dict[str, Any], n: int) -> dict[str, Any]:
    """The stack's Serve config with decode at n replicas (fixed count or autoscaling range)."""
    out = copy.deepcopy(config)
    for app in out["applications"]:
        decode = (app.get("args") or {}).get("decode_config")
        if not decode:
            continue
        dep = decode.setdefault("deployment_config", {})
        if "autoscaling_config" in dep:
            dep["autoscaling_config"].update(min_replicas=n, max_replicas=n, initial_replicas=n)
        else:
            dep["num_replicas"] = n
    return out


async def scale_in_scenario(ctx: Any, config: dict[str, Any]) -> dict[str, Any]:
    """A Serve config update takes decode from 2 replicas to 1 under STREAMS long streams."""
    from local.cluster import deploy
    from local.decode_autoscale import decode_replicas

    fault: dict[str, Any] = {}

    async def scale_in() -> None:
        # Both engines running streams, so whichever replica Serve stops had some to keep.
        t = time.monotonic()
        _, reps, running = await _busy_decode(ctx, want_busy=DECODE_REPLICAS)
        fault["at_s"] = FAULT_AT_S + time.monotonic() - t  # seconds into the round
        ctx.say(f"Serve config update: decode 2 -> 1 replica, {STREAMS} streams running (engines: {running})")
        await asyncio.to_thread(deploy, ctx.dashboard_url, _with_decode_replicas(config, 1))
        # Which one Serve stops is Serve's choice: the first no longer RUNNING.
        until = time.monotonic() + REMOVED_WITHIN_S
        gone = None
        while gone is None and time.monotonic() < until:
            await asyncio.sleep(0.5)
            try:
                now = await asyncio.to_thread(replicas.deployment_replicas, ctx.dashboard_url, DECODE)
            except httpx.HTTPError:  # a busy dashboard: ask again
                continue
            gone = replicas.removed_replica([r["replica_id"] for r in reps], now)
        pid = next((r["pid"] for r in reps if r["replica_id"] == gone), None)
        fault.update(replica_id=gone, pid=pid, running=running.get(gone) if gone else None)
        ctx.say(f"Serve stops decode replica {gone} (engine running {fault['running']} at the update)")

    res = await _counted_round(ctx, scale_in)
    res["fault"], res["fault_at_s"] = fault, fault.get("at_s")
    t = time.monotonic()
    while time.monotonic() - t < ctx.recover_timeout_s:
        if await asyncio.to_thread(decode_replicas, ctx.dashboard_url) == (1, 1):
            break
        await asyncio.sleep(1)
    res["scaled_in_after_round_s"] = time.monotonic() - t
    await asyncio.to_thread(deploy, ctx.dashboard_url, config)
    await replicas.wait_healthy(ctx.dashboard_url, DECODE, DECODE_REPLICAS, ctx.recover_timeout_s)
    ctx.say(f"decode back to {DECODE_REPLICAS} replicas")
    return res


def verdicts(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("migrate-decode", "scale-in"):
        r = results.get(name)
        if r:
            f = r["faulted"]
            out[f"{name}: 0 streams cut or failed, every stream {TOKENS} tokens"] = (
                f["complete"] == f["streams"] and f["cut"] == 0 and f["failed"] == 0
            )
    return out


def line(name: str, res: Mapping[str, Any]) -> str:
    f, ref = res["faulted"], res["reference"]
    return (
        f"{name}: {f['complete']}/{f['streams']} streams complete ({TOKENS} tokens), {f['cut']} cut, "
        f"{f['failed']} failed, {f['short']} short; same text as the no-fault round: "
        f"{f['same_text_as_reference']}/{f['streams']} (no-fault round: {ref['same_text_as_reference']}/"
        f"{ref['streams']}); migrations {res['migrations']}"
    )
