"""Each role scales on its own load: `python -m bench.role_scaling`, part of `make bench`.

What flows through here: a local stack started with `--signals` (disaggregated; prefill and
decode each autoscaled 1..2 by their own policy, serving/engines/autoscaling.py, reading vLLM's
engine metrics from a local Prometheus, local/prometheus.py) -> two loads, one after
the other, each until its role has a second RUNNING replica (or the phase's time runs out):
  prompt-heavy   PROMPT_CLIENTS clients, completions of a PROMPT_TOKENS-token prompt of
                 random token ids (no prefix-cache hits) and 1 output token;
  output-heavy   OUTPUT_CLIENTS clients, a short prompt and OUTPUT_TOKENS streamed tokens;
-> per phase: seconds until the loaded role had 2 running replicas, the most replicas the
other role ran meanwhile, the signal the policy named (Serve's policy state), requests
failed -> build/bench/role-scaling.json and a line per phase. The verdicts: prompt-heavy
load scales prefill and not decode, output-heavy load scales decode and not prefill.
Between phases the stack goes back to one replica per role (idle for the down delay).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from infra.paths import BUILD_DIR

PROMPT_CLIENTS = 16
PROMPT_TOKENS = 900  # of the tiny model's 1024-token context
OUTPUT_CLIENTS = 24
OUTPUT_TOKENS = 256
PHASE_MAX_S = 240.0
SETTLE_MAX_S = 180.0


@dataclass
class Phase:
    name: str
    loaded_role: str
    scale_out_s: float | None = None
    other_role_max_running: int = 0
    loaded_role_max_running: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    errors: list[str] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (s, prefill, decode running)


def role_replicas(dashboard_url: str, app: str = "llm") -> dict[str, int]:
    """RUNNING replicas of the prefill and decode deployments of `app` (Serve's REST API)."""
    status = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()
    deployments = ((status.get("applications") or {}).get(app) or {}).get("deployments") or {}
    out = {"prefill": 0, "decode": 0}
    for name, dep in deployments.items():
        for role in out:
            if role in name.lower():
                out[role] = sum(1 for r in dep.get("replicas") or [] if r.get("state") == "RUNNING")
    return out


async def _prompt_heavy(base: str, headers: dict, model: str, stop: asyncio.Event, ph: Phase) -> None:
    rng = random.Random()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as c:
        while not stop.is_set():
            body = {"model": model, "prompt": [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)], "max_tokens": 1}
            await _count(c.post(f"{base}/completions", json=body, headers=headers), ph)


async def _output_heavy(base: str, headers: dict, model: str, stop: asyncio.Event, ph: Phase) -> None:
    body = {
        "model": model,
        "prompt": "Tell me a long story.",
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as c:
        while not stop.is_set():

            async def one() -> httpx.Response:
                async with c.stream("POST", f"{base}/completions", json=body, headers=headers) as r:
                    async for _ in r.aiter_bytes():
                        pass
                    return r

            await _count(one(), ph)


async def _count(call: Any, ph: Phase) -> None:
    try:
        r = await call
        if r.status_code == 200:
            ph.requests_ok += 1
        else:
            ph.requests_failed += 1
            ph.errors.append(f"HTTP {r.status_code}")
    except httpx.HTTPError as exc:
        ph.requests_failed += 1
        ph.errors.append(repr(exc)[:200])


async def run_phase(stack: Any, name: str, loaded_role: str, clients: int, say: Any) -> Phase:
    ph = Phase(name=name, loaded_role=loaded_role)
    other = "decode" if loaded_role == "prefill" else "prefill"
    headers = {"Authorization": f"Bearer {stack.api_key}"} if stack.api_key else {}
    base = stack.urls["disaggregated"]
    client = _prompt_heavy if loaded_role == "prefill" else _output_heavy
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client(base, headers, stack.model, stop, ph)) for _ in range(clients)]
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < PHASE_MAX_S:
            running = await asyncio.to_thread(role_replicas, stack.state["dashboard_url"])
            ph.timeline.append((round(time.monotonic() - t0, 1), running["prefill"], running["decode"]))
            ph.other_role_max_running = max(ph.other_role_max_running, running[other])
            ph.loaded_role_max_running = max(ph.loaded_role_max_running, running[loaded_role])
            if running[loaded_role] >= 2:
                ph.scale_out_s = time.monotonic() - t0
                # Keep the load a little longer: the other role must stay put under it too.
                await asyncio.sleep(10)
                running = await asyncio.to_thread(role_replicas, stack.state["dashboard_url"])
                ph.other_role_max_running = max(ph.other_role_max_running, running[other])
                break
            await asyncio.sleep(1)
    finally:
        stop.set()
        await asyncio.wait(tasks, timeout=150)
    say(
        f"{name}: {loaded_role} at 2 replicas after {ph.scale_out_s if ph.scale_out_s is None else round(ph.scale_out_s, 1)}s; "
        f"{other} ran at most {ph.other_role_max_running}; {ph.requests_ok} ok, {ph.requests_failed} failed"
    )
    return ph


async def settle(stack: Any, say: Any) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < SETTLE_MAX_S:
        if await asyncio.to_thread(role_replicas, stack.state["dashboard_url"]) == {"prefill": 1, "decode": 1}:
            return time.monotonic() - t0
        await asyncio.sleep(1)
    raise TimeoutError(f"the stack did not return to one replica per role within {SETTLE_MAX_S:.0f}s")


def verdicts(phases: list[Phase]) -> dict[str, bool]:
    by = {p.name: p for p in phases}
    out = {}
    if "prompt-heavy" in by:
        p = by["prompt-heavy"]
        out["prompt-heavy load scales prefill, decode stays at 1"] = (
            p.scale_out_s is not None and p.other_role_max_running == 1 and p.requests_failed == 0
        )
    if "output-heavy" in by:
        p = by["output-heavy"]
        out["output-heavy load scales decode, prefill stays at 1"] = (
            p.scale_out_s is not None and p.other_role_max_running == 1 and p.requests_failed == 0
        )
    return out


def stack_options() -> dict[str, Any]:
    """background_stack's arguments: the disaggregated app, each role autoscaled on its own
    signals (tests/bench/test_role_scaling.py builds what it deploys, without Ray)."""
    return {"mode": "disaggregated", "extra_args": ["--signals"]}


def main(argv: list[str] | None = None) -> int:
    from local.background import background_stack

    p = argparse.ArgumentParser(prog="python -m bench.role_scaling", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=BUILD_DIR / "bench" / "role-scaling.json")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    say = lambda m: print(f"[{time.monotonic() - t_start:6.1f}s] {m}", flush=True)  # noqa: E731
    args.out.parent.mkdir(parents=True, exist_ok=True)
    say("starting the local stack with per-role signals (local Prometheus)")
    with background_stack(**stack_options(), log_path=args.out.with_suffix(".log")) as stack:

        async def both() -> list[Phase]:
            phases = [await run_phase(stack, "prompt-heavy", "prefill", PROMPT_CLIENTS, say)]
            say(f"back to one replica per role after {await settle(stack, say):.0f}s idle")
            phases.append(await run_phase(stack, "output-heavy", "decode", OUTPUT_CLIENTS, say))
            return phases

        phases = asyncio.run(both())
    v = verdicts(phases)
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "phases": [asdict(ph) for ph in phases],
        "verdicts": v,
    }
    args.out.write_text(json.dumps(doc, indent=2))
    for k, ok in v.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
