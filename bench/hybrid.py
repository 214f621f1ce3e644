"""`make bench`, hybrid scenario: how much a burst overflows to the external fallback, and
what each path's time to first token is.

What flows through here: a local external provider (local.provider, behind its
recording proxy: by default the paced backend, which answers at a remote provider's pace
without using our CPU; with `--provider vllm`, vLLM's own OpenAI server with the tiny model,
niced, on the same cores) and the disaggregated local stack started the way `make serve`
is, with the fallback configured by the environment (PD_FALLBACK_BASE_URL,
PD_FALLBACK_MODEL, PD_FALLBACK_API_KEY, PD_FALLBACK_OVERFLOW_AT) -> rounds of an unloaded
phase (requests one at a time: the cluster's own TTFT) and a burst phase (many concurrent
streamed requests, above the overflow threshold), interleaved on the same stack and pooled,
so a p99 rests on more than a few dozen samples and both phases see the same machine -> per
request: the path that served it (`x-served-by`), TTFT, latency, tokens -> the share served
by the fallback, TTFT p50/p99 per path, and the cluster's burst p99 TTFT against its
unloaded p99, on screen and in build/bench/hybrid.json.

The issue's question is whether overflow keeps the cluster's own TTFT near its unloaded value;
a real provider does not run on our GPUs, so the paced backend is the default, and the vLLM
provider shows what a second engine on the same two cores costs. The ingress that relays
the fallback streams does share the cores in both. A benchmark prints figures; it does not
pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import BENCH_DIR
from bench.sse import stream_request
from bench.stats import RequestResult, percentile, summarize
from local.provider import Backend, Pace

DEFAULT_OUT = BENCH_DIR / "hybrid.json"
OVERFLOW_AT = 2
PROMPT = "Tell me a long story about a cat who learned to fly over the sea"


async def one(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[str, RequestResult]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    got = await stream_request(client, f"{url}/completions", body)
    usage = got.usage or {}
    times = got.token_times
    res = RequestResult(
        ok=got.status == 200 and got.error is None and bool(times),
        ttft_s=got.ttft_s or 0.0,
        latency_s=got.latency_s,
        itl_s=[b - a for a, b in itertools.pairwise(times)],
        prompt_tokens=usage.get("prompt_tokens", 0),
        output_tokens=usage.get("completion_tokens", 0),
        error=(f"HTTP {got.status}: " if got.status not in (0, 200) else "") + (got.error or ""),
    )
    return got.served_by or "?", res


async def phase(url: str, key: str, model: str, n: int, concurrency: int, max_tokens: int):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=300, limits=limits) as c:

        async def guarded():
            async with sem:
                return await one(c, url, model, max_tokens)

        t0 = time.perf_counter()
        out = await asyncio.gather(*(guarded() for _ in range(n)))
        return out, time.perf_counter() - t0


def by_path(results: list[tuple[str, RequestResult]], duration: float) -> dict[str, Any]:
    paths = sorted({s for s, _ in results})
    return {p: summarize([r for s, r in results if s == p], duration) for p in paths}


def stack_options(provider_url: str, overflow_at: int) -> dict[str, Any]:
    """background_stack's arguments: the disaggregated app, the provider at `provider_url` its
    fallback past `overflow_at` (tests/bench/test_hybrid.py builds what it deploys, without Ray)."""
    from local.provider import EXTERNAL_MODEL, PROVIDER_KEY

    env = {
        "PD_FALLBACK_BASE_URL": provider_url,
        "PD_FALLBACK_MODEL": EXTERNAL_MODEL,
        "PD_FALLBACK_API_KEY": PROVIDER_KEY,
        "PD_FALLBACK_OVERFLOW_AT": str(overflow_at),
    }
    return {"mode": "disaggregated", "api_key": "sk-bench-hybrid", "extra_env": env}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid", description=__doc__.split("\n")[0])
    p.add_argument("--unloaded", type=int, default=24, help="requests sent one at a time (default %(default)s)")
    p.add_argument("--burst", type=int, default=96, help="requests in the burst (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="burst concurrency (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="unloaded + burst rounds, pooled (default %(default)s)")
    p.add_argument(
        "--overflow-at",
        type=int,
        default=OVERFLOW_AT,
        help="fallback.overflowAt: ongoing requests per decode replica (default %(default)s)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--provider",
        choices=[b.value for b in Backend],
        default=Backend.PACED.value,
        help="the stand-in provider's backend (default %(default)s)",
    )
    p.add_argument("--provider-ttft-ms", type=float, default=Pace().ttft_s * 1000, help="paced: time to first token")
    p.add_argument("--provider-tokens-per-s", type=float, default=Pace().tokens_per_s, help="paced: tokens per second")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", flush=True)

    from local.background import background_stack
    from local.config import local_target
    from local.provider import running_provider
    from local.tiny_model import ensure_tiny_model

    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent
    model_dir = str(ensure_tiny_model())
    backend = Backend(args.provider)
    pace = Pace(ttft_s=args.provider_ttft_ms / 1000, tokens_per_s=args.provider_tokens_per_s)
    say(f"starting the external provider ({backend.value} backend) and the local stack with a fallback")
    with (
        running_provider(
            model_dir, logs / "hybrid-provider.log", dict(local_target().engine_env), backend=backend, pace=pace
        ) as provider,
        background_stack(**stack_options(provider.url, args.overflow_at), log_path=logs / "hybrid-serve.log") as stack,
    ):
        url, key, model = stack.urls["disaggregated"], stack.api_key, stack.model
        assert key is not None  # given to background_stack above
        say("warming up")
        asyncio.run(phase(url, key, model, 2, 1, args.max_tokens))
        unloaded: list[tuple[str, RequestResult]] = []
        burst: list[tuple[str, RequestResult]] = []
        d_unloaded = d_burst = 0.0
        for i in range(args.rounds):
            say(f"round {i + 1}/{args.rounds}: {args.unloaded} requests one at a time")
            got, took = asyncio.run(phase(url, key, model, args.unloaded, 1, args.max_tokens))
            unloaded, d_unloaded = unloaded + got, d_unloaded + took
            say(f"round {i + 1}/{args.rounds}: burst of {args.burst} at concurrency {args.concurrency}")
            got, took = asyncio.run(phase(url, key, model, args.burst, args.concurrency, args.max_tokens))
            burst, d_burst = burst + got, d_burst + took
        leaked = [r for r in provider.records if key in repr(r.headers) + repr(r.body)]

    u = by_path(unloaded, d_unloaded)
    b = by_path(burst, d_burst)
    n_fb = b.get("fallback", {}).get("requests", 0)
    cl_unloaded = [r.ttft_s for s, r in unloaded if s == "cluster" and r.ok]
    cl_burst = [r.ttft_s for s, r in burst if s == "cluster" and r.ok]
    p99_u, p99_b = percentile(cl_unloaded, 99), percentile(cl_burst, 99)
    share = n_fb / len(burst) if burst else 0.0
    ratio = p99_b / p99_u if p99_u and p99_b else None
    report: dict[str, Any] = {
        "workload": {
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "unloaded": args.unloaded,
            "burst": args.burst,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "overflow_at": args.overflow_at,
        },
        "provider": {"backend": backend.value}
        | ({"ttft_ms": pace.ttft_s * 1000, "tokens_per_s": pace.tokens_per_s} if backend is Backend.PACED else {}),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "unloaded": u,
        "burst": b,
        "fallback_share": share,
        "cluster_ttft_p99_unloaded_ms": None if p99_u is None else p99_u * 1000,
        "cluster_ttft_p99_burst_ms": None if p99_b is None else p99_b * 1000,
        "cluster_ttft_p99_ratio": ratio,
        "client_key_seen_by_provider": bool(leaked),
        "errors_sample": [r.error for _, r in burst if not r.ok][:5],
        "wall_s": time.monotonic() - t_start,
    }
    args.out.write_text(json.dumps(report, indent=2))

    print()
    print(f"{'phase':10} {'path':9} {'requests':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'errors':>7}")
    for name, summary in (("unloaded", u), ("burst", b)):
        for path, s in summary.items():
            print(
                f"{name:10} {path:9} {s['requests']:>8} {_f(s.get('ttft_p50_ms')):>12} "
                f"{_f(s.get('ttft_p99_ms')):>12} {s.get('errors', 0):>7}"
            )
    print(f"\nprovider: {report['provider']}")
    print(f"fallback share in the burst: {n_fb}/{len(burst)} = {100 * share:.0f}%")
    if ratio is not None and p99_u is not None and p99_b is not None:
        print(f"cluster TTFT p99: burst {p99_b * 1000:.0f} ms vs unloaded {p99_u * 1000:.0f} ms = {ratio:.2f}x")
    print(f"client key seen by the provider: {'YES' if leaked else 'no'}")
    print(f"JSON: {args.out}  wall {report['wall_s']:.0f}s")
    return 0


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:,.0f}"


if __name__ == "__main__":
    sys.exit(main())
