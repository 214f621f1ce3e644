"""From zero decode replicas to a first token, per path: `python -m bench.cold_start`.

What flows through here: the stand-in provider (local.provider: plain vLLM serving the
tiny model under another name) and a local stack started with `--scale-to-zero` (decode
autoscaled 0..2, starting with one) whose fallback is that provider for `unavailable` ->
decode idles down to zero replicas -> two paths, each timed from the moment decode is at zero:
  fallback   a streamed request right away: answered by the provider (x-served-by:
             fallback) while the ingress wakes decode (serving/app.py `_wake`); then one
             request every POLL_S until the cluster answers one again;
  cluster    the fallback taken out of the ingress's user_config (a lightweight Serve update),
             decode at zero again, one streamed request that waits for Serve's cold start
             (or is refused 503 + Retry-After past firstTokenTimeoutS);
-> per path: status, who served, time to first token, and (fallback path) when the cluster
served again -> build/bench/cold-start.json and a line per path. Verdict: during scale from
zero, every request of the fallback path is answered without a 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.sse import stream_request
from infra.paths import BUILD_DIR

POLL_S = 2.0
ZERO_WITHIN_S = 180.0
BACK_WITHIN_S = 300.0


def decode_state(dashboard_url: str) -> tuple[int, int]:
    from local.decode_autoscale import decode_replicas

    return decode_replicas(dashboard_url)


async def at_zero(stack: Any) -> None:
    t = time.monotonic()
    while time.monotonic() - t < ZERO_WITHIN_S:
        if await asyncio.to_thread(decode_state, stack.state["dashboard_url"]) == (0, 0):
            return
        await asyncio.sleep(1)
    raise TimeoutError(f"decode did not scale to zero within {ZERO_WITHIN_S:.0f}s")


async def one(stack: Any, client: httpx.AsyncClient) -> dict[str, Any]:
    body = {"model": stack.model, "prompt": "Hello", "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {stack.api_key}"} if stack.api_key else {}
    r = await stream_request(
        client, stack.urls["disaggregated"] + "/completions", body, headers=headers, timeout=httpx.Timeout(180)
    )
    return {
        "status": r.status,
        "served_by": r.served_by,
        "ok": r.ok,
        "ttft_s": r.ttfb_s,
        "retry_after": r.retry_after,
        "sent_at": r.start,
    }


async def fallback_path(stack: Any) -> dict[str, Any]:
    await at_zero(stack)
    t0 = time.monotonic()
    out: dict[str, Any] = {"requests": []}
    async with httpx.AsyncClient() as c:
        while time.monotonic() - t0 < BACK_WITHIN_S:
            got = await one(stack, c)
            got["sent_at_s"] = round(got.pop("sent_at") - t0, 2)
            out["requests"].append(got)
            if got["served_by"] == "cluster" and got["ok"]:
                out["cluster_again_s"] = got["sent_at_s"] + (got["ttft_s"] or 0)
                break
            await asyncio.sleep(POLL_S)
    first = out["requests"][0]
    out["first"] = {k: first[k] for k in ("status", "served_by", "ttft_s")}
    out["no_5xx"] = all(r["status"] < 500 and r["ok"] for r in out["requests"])
    return out


def fallback_config(config: dict[str, Any], keep: bool) -> dict[str, Any]:
    """The stack's Serve config with or without the ingress's fallback (its user_config)."""
    from serving.spec import APP_NAME, INGRESS_DEPLOYMENT

    config = copy.deepcopy(config)
    for app in config["applications"]:
        if app["name"] != APP_NAME:
            continue
        for dep in app.get("deployments", []):
            if dep["name"] == INGRESS_DEPLOYMENT and not keep:
                dep["user_config"] = {k: v for k, v in dep["user_config"].items() if k != "fallback"}
    return config


def set_fallback(stack: Any, keep: bool) -> None:
    """PUT the stack's own config with or without the ingress's fallback; wait until applied."""
    config = fallback_config(stack.state["config"], keep)
    url = f"{stack.state['dashboard_url']}/api/serve/applications/"
    r = httpx.put(url, json=config, timeout=60)
    r.raise_for_status()
    time.sleep(5)  # the ingress's reconfigure runs in place (no restart)


async def cluster_path(stack: Any) -> dict[str, Any]:
    await asyncio.to_thread(set_fallback, stack, False)
    await at_zero(stack)
    async with httpx.AsyncClient() as c:
        got = await one(stack, c)
    got.pop("sent_at")
    return got


def stack_options(provider_url: str) -> dict[str, Any]:
    """background_stack's arguments: decode scales to zero, the provider at `provider_url` its
    fallback (tests/bench/test_cold_start.py builds what it deploys, without Ray)."""
    from local.provider import EXTERNAL_MODEL, PROVIDER_KEY
    from serving.spec import FALLBACK_API_KEY_ENV

    env = {
        "PD_FALLBACK_BASE_URL": provider_url,
        "PD_FALLBACK_MODEL": EXTERNAL_MODEL,
        FALLBACK_API_KEY_ENV: PROVIDER_KEY,
    }
    return {"mode": "disaggregated", "extra_env": env, "extra_args": ["--scale-to-zero"]}


def main(argv: list[str] | None = None) -> int:
    from local.background import background_stack
    from local.config import local_target
    from local.provider import running_provider
    from local.tiny_model import ensure_tiny_model

    p = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=BUILD_DIR / "bench" / "cold-start.json")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    say = lambda m: print(f"[{time.monotonic() - t_start:6.1f}s] {m}", flush=True)  # noqa: E731
    say("starting the stand-in provider and a stack whose decode scales to zero")
    log = args.out.with_suffix(".log")
    with (
        running_provider(
            str(ensure_tiny_model()), args.out.with_suffix(".provider.log"), dict(local_target().engine_env)
        ) as provider,
        background_stack(**stack_options(provider.url), log_path=log) as stack,
    ):
        fb = asyncio.run(fallback_path(stack))
        say(
            f"fallback path: first request {fb['first']}; the cluster served again "
            f"{fb.get('cluster_again_s')}s after decode was at zero; no 5xx: {fb['no_5xx']}"
        )
        cl = asyncio.run(cluster_path(stack))
        say(f"cluster path (no fallback): {cl}")
    verdicts = {
        "scale from zero: the first request is answered by the fallback": fb["first"]["served_by"] == "fallback"
        and fb["first"]["status"] == 200,
        "scale from zero: no 5xx while decode starts": fb["no_5xx"],
        "the woken decode serves again": fb.get("cluster_again_s") is not None,
    }
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fallback_path": fb,
        "cluster_path": cl,
        "verdicts": verdicts,
    }
    args.out.write_text(json.dumps(doc, indent=2))
    for k, ok in verdicts.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
