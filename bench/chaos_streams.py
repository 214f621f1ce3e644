"""`make chaos` stream scenarios: long answers through a decode death and a scale-in.

What flows through here: the chaos stack (1 prefill + 2 decode replicas, bench/chaos.py) ->
STREAMS streamed chat clients, one long answer each (a fixed prompt, temperature 0,
ignore_eos, TOKENS tokens) -> a reference round without a fault, then a round with the
fault FAULT_AT_S in: SIGKILL of one decode replica (`migrate-decode`: the cut streams must
be continued on the other replica), or a Serve config update that takes decode from 2
replicas to 1 (`scale-in`: Serve stops one replica, whose streams must drain or be
continued) -> per round: streams complete / cut / failed, token counts, how many answers
equal the reference text, migrations counted by outcome (ray_pd_stream_migrations_total)
-> a dict for build/chaos/<scenario>.json. The stack is left with 2 decode replicas.

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
from typing import Any

import httpx

from bench import hops
from bench.replicas import replica_processes, wait_healthy
from bench.sse import Streamed, stream_request

NAMES = ("migrate-decode", "scale-in")
STREAMS = 8
TOKENS = 600
FAULT_AT_S = 1.5
PROMPT = "Tell me a long story about a robot that learns to paint."
MIGRATIONS = "ray_pd_stream_migrations_total"
# The decode deployment (in its replicas' process titles) and the replicas the chaos stack runs.
DECODE = ":Decode:"
DECODE_REPLICAS = 2


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


def _migrations(urls: list[str]) -> dict[str, float]:
    return hops.scrape_by_label(urls, MIGRATIONS, "outcome")


def _summary(got: list[Streamed], reference: str | None) -> dict[str, Any]:
    complete = [r for r in got if r.ok and (r.usage or {}).get("completion_tokens") == TOKENS]
    return {
        "streams": len(got),
        "complete": len(complete),
        "cut": sum(1 for r in got if r.status == 200 and not r.ok),
        "failed": sum(1 for r in got if r.status != 200),
        "short": sum(1 for r in got if r.ok and (r.usage or {}).get("completion_tokens") != TOKENS),
        "same_text_as_reference": sum(1 for r in got if reference is not None and r.text == reference),
        "errors": [r.error_event or r.error for r in got if not r.ok][:3],
    }


async def _counted_round(ctx: Any, fault: Any) -> dict[str, Any]:
    reference_round = await _round(ctx)
    texts = Counter(r.text for r in reference_round if r.ok)
    reference = texts.most_common(1)[0][0] if texts else None
    before = await asyncio.to_thread(_migrations, ctx.metrics_urls)
    faulted = await _round(ctx, fault)
    await asyncio.sleep(6)  # Ray exports counters every few seconds
    after = await asyncio.to_thread(_migrations, ctx.metrics_urls)
    return {
        "streams": STREAMS,
        "tokens": TOKENS,
        "fault_at_s": FAULT_AT_S,
        "reference": _summary(reference_round, reference),
        "reference_texts_distinct": len(texts),
        "faulted": _summary(faulted, reference),
        "migrations": {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)},
    }


async def migrate_decode_scenario(ctx: Any) -> dict[str, Any]:
    """SIGKILL one decode replica under STREAMS long streams."""

    killed: list[int] = []

    async def kill() -> None:
        victim = replica_processes(ctx.root_pid, DECODE)[0]
        ctx.say(f"SIGKILL decode replica pid {victim.pid}, {FAULT_AT_S}s into {STREAMS} streams")
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(victim.pid)

    res = await _counted_round(ctx, kill)
    t = time.monotonic()
    await wait_healthy(ctx.dashboard_url, DECODE, DECODE_REPLICAS, ctx.recover_timeout_s, dead_pid=killed[0])
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

    async def scale_in() -> None:
        ctx.say(f"Serve config update: decode 2 -> 1 replica, {FAULT_AT_S}s into {STREAMS} streams")
        await asyncio.to_thread(deploy, ctx.dashboard_url, _with_decode_replicas(config, 1))

    res = await _counted_round(ctx, scale_in)
    t = time.monotonic()
    while time.monotonic() - t < ctx.recover_timeout_s:
        if await asyncio.to_thread(decode_replicas, ctx.dashboard_url) == (1, 1):
            break
        await asyncio.sleep(1)
    res["scaled_in_after_round_s"] = time.monotonic() - t
    await asyncio.to_thread(deploy, ctx.dashboard_url, config)
    await wait_healthy(ctx.dashboard_url, DECODE, DECODE_REPLICAS, ctx.recover_timeout_s)
    ctx.say(f"decode back to {DECODE_REPLICAS} replicas")
    return res


def verdicts(results: dict[str, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("migrate-decode", "scale-in"):
        r = results.get(name)
        if r:
            f = r["faulted"]
            out[f"{name}: 0 streams cut or failed, every stream {TOKENS} tokens"] = (
                f["complete"] == f["streams"] and f["cut"] == 0 and f["failed"] == 0
            )
    return out


def line(name: str, res: dict[str, Any]) -> str:
    f, ref = res["faulted"], res["reference"]
    return (
        f"{name}: {f['complete']}/{f['streams']} streams complete ({TOKENS} tokens), {f['cut']} cut, "
        f"{f['failed']} failed, {f['short']} short; same text as the no-fault round: "
        f"{f['same_text_as_reference']}/{f['streams']} (no-fault round: {ref['same_text_as_reference']}/"
        f"{ref['streams']}); migrations {res['migrations']}"
    )
