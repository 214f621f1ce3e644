"""`make bench-prefix`: the prefill tier's three routers side by side, two prefill replicas each.

What flows through here: three P/D applications rendered by the spec, identical but for
`prefill.router` (`power-of-two`, Serve's default; `prefix-cache-affinity`, Ray Serve LLM's
PrefixCacheAffinityRouter, which routes by request text; `kv-aware`, serving/engines/
kv_router.py, which routes by the engines' own KV-cache events), each with two prefill
replicas and one decode replica, on one local Ray cluster -> vLLM's benchmark client sending
its `prefix_repetition` workload (many requests sharing a few long "system prompt" prefixes)
to each, one application after another (three side by side exhaust this machine's memory)
with the same seeds -> per application: TTFT p50/p99, the
prefill engines' prefix-cache hit rate and the prompt tokens they computed (vLLM's
prefix-cache counters, by ReplicaId), the requests each prefill replica served, and for
kv-aware how each request was routed (pd_kv_routes) -> a table with each figure as a ratio to
power-of-two in the same run, and build/bench/prefix.json.

`--workload multi-turn` (`make bench-prefix PREFIX_WORKLOAD=multi-turn`) sends chat sessions
instead, each turn resending the conversation so far (bench/multi_turn.py): the prefix a
request shares is its own session's, grown by every turn, not a system prompt shared by
unrelated requests; its figures land in build/bench/prefix-multi-turn.json.

`--auth` serves the applications as a stack does, with API keys on: every request carries its
key's prefix-cache salt (serving/ingress/tenancy.py), so the figures are one key's, salted;
without it no request is salted.

A benchmark prints figures; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench import BENCH_DIR, hops, multi_turn, vllm_load
from bench.observe import roles, serve_apps, settled
from bench.stats import RequestResult, summarize
from serving.core.metrics import KV_ROUTE_TOKENS, KV_ROUTE_WAIT, KV_ROUTES, LOCAL_PREFILLS, PREFILL_PATH, KvRoute
from serving.spec import API_KEYS_ENV

DEFAULT_OUT = BENCH_DIR / "prefix.json"
WORKLOADS = {"prefix-repetition": DEFAULT_OUT, "multi-turn": BENCH_DIR / "prefix-multi-turn.json"}
ROUTERS = {"p2c": "power-of-two", "affinity": "prefix-cache-affinity", "kv": "kv-aware"}
BASELINE = "p2c"
REPLICAS = 2  # prefill replicas per application (one decode replica each)
# The shared-prefix workload (vLLM's prefix_repetition dataset).
PREFIX_LEN = 512
SUFFIX_LEN = 32
NUM_PREFIXES = 16
OUTPUT_LEN = 16
CONCURRENCY = 4
ROUNDS = 4
PER_ROUND = 48
# The multi-turn workload (bench/multi_turn.py): 16 sessions of 4 turns per round, 4 at once.
MULTI_TURN = multi_turn.Sessions()


# The one key of an --auth run (the ingress reads it from the cluster's environment).
BENCH_KEY = "sk-bench-prefix"


def render(model_dir: Path, port: int, auth: bool = False) -> dict[str, Any]:
    """The three applications in one Serve config, from the spec (only prefill's router differs)."""
    from local.config import HOST, LOCAL_ROLE_LIMITS, local_spec, local_target
    from serving.spec import Mode, RoleSpec

    apps = []
    config: dict[str, Any] = {}
    for name, router in ROUTERS.items():
        base = local_spec(Mode.DISAGGREGATED, model_dir, auth=auth)
        prefill = RoleSpec.model_validate(
            {"minReplicas": REPLICAS, "maxReplicas": REPLICAS, "router": router, **LOCAL_ROLE_LIMITS}
        )
        decode = RoleSpec.model_validate({"minReplicas": 1, "maxReplicas": 1, **LOCAL_ROLE_LIMITS})
        spec = base.model_validate(
            {
                **base.model_dump(by_alias=True, exclude={"models"}),
                "prefill": prefill.model_dump(by_alias=True),
                "decode": decode.model_dump(by_alias=True),
            }
        )
        config = spec.serve_config(local_target(), port=port)
        app = config["applications"][0]
        app["name"], app["route_prefix"] = name, f"/{name}"
        apps.append(app)
    config["applications"] = apps
    config["http_options"]["host"] = HOST
    return config


def _served_by(before: list[hops.Sample], after: list[hops.Sample], replica_id: str) -> float:
    """Requests one engine replica finished between two scrapes (vLLM's request_success counter)."""

    def mine(labels: dict[str, str]) -> bool:
        return labels.get("ReplicaId") == replica_id

    name = "ray_vllm_request_success_total"
    return hops.metric_total(after, name, mine) - hops.metric_total(before, name, mine)


def _counts(metrics_urls: list[str]) -> dict[str, dict[str, float]]:
    """Decode's counters so far: how prefill calls were routed (pd_kv_routes by outcome, kv-aware
    only), how requests were prefilled (pd_prefill_path by path) and why locally (by reason), and
    for kv-aware the prompt tokens scored and those the scorer found cached on the replica it
    chose (pd_kv_route_tokens: what the index believed, beside the engines' own hit rate), and
    the seconds decode waited on the scorer (pd_kv_route_wait_seconds: its round trip)."""
    return {
        "routed": hops.scrape_by_label(metrics_urls, KV_ROUTES.prometheus, "outcome"),
        "scorer_wait_s": hops.scrape_by_label(metrics_urls, KV_ROUTE_WAIT.prometheus, "model"),
        "scored_tokens": hops.scrape_by_label(metrics_urls, KV_ROUTE_TOKENS.prometheus, "kind"),
        "prefill_path": hops.scrape_by_label(metrics_urls, PREFILL_PATH.prometheus, "path"),
        "local_prefill_reasons": hops.scrape_by_label(metrics_urls, LOCAL_PREFILLS.prometheus, "reason"),
    }


def scorer_wait_ms(app: dict[str, Any]) -> float | None:
    """Decode's mean wait on the scorer per request that asked it, ms (None: none asked)."""
    asked = sum(n for outcome, n in (app.get("routed") or {}).items() if outcome != KvRoute.SKIPPED.value)
    waited = sum((app.get("scorer_wait_s") or {}).values())
    return waited / asked * 1e3 if asked else None


def _scorer_wait(app: dict[str, Any]) -> str:
    wait = scorer_wait_ms(app)
    return "" if wait is None else f", decode waited {wait:.1f} ms on the scorer per request that asked it"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def table(apps: dict[str, dict[str, Any]]) -> str:
    """One line per router: each figure, and its ratio to power-of-two's in the same run."""
    base = apps.get(BASELINE) or next(iter(apps.values()))
    lines = [
        f"{'router':<24}{'reqs':>6}{'err':>5}{'TTFT p50':>18}{'TTFT p99':>18}{'hit rate':>10}"
        f"{'prefill tokens computed':>30}  requests per prefill replica"
    ]
    for app in apps.values():
        hit = app["prefix_cache_hit_rate"]
        computed = app["prefill_tokens_computed"]
        p50, p99 = app["ttft_p50_ms"], app["ttft_p99_ms"]
        lines.append(
            f"{app['router']:<24}{app['requests']:>6}{app['errors']:>5}"
            f"{p50 or 0:>9.1f} ({_ratio(p50, base['ttft_p50_ms'])})"
            f"{p99 or 0:>9.1f} ({_ratio(p99, base['ttft_p99_ms'])})"
            f"{'-' if hit is None else f'{hit:.1%}':>10}"
            f"{computed:>20,.0f} ({_ratio(computed, base['prefill_tokens_computed'])})"
            f"  {sorted(int(v) for v in app['requests_per_prefill_replica'].values())}"
        )
    for app in apps.values():
        scored = app.get("scored_tokens") or {}
        believed = (
            f", the scorer found {scored['cached'] / scored['prompt']:.1%} cached" if scored.get("prompt") else ""
        )
        lines.append(
            f"{app['router']}: prefilled {app.get('prefill_path') or {}}, locally because "
            f"{app.get('local_prefill_reasons') or {}}, routed {app.get('routed') or {}}{believed}"
            f"{_scorer_wait(app)}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_bench", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=20261130)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--per-round", type=int, default=PER_ROUND, help="requests per application per round")
    p.add_argument("--workload", choices=list(WORKLOADS), default="prefix-repetition")
    p.add_argument("--out", type=Path, help="default: build/bench/prefix.json, or prefix-multi-turn.json")
    p.add_argument("--only", choices=list(ROUTERS), action="append", help="run these applications only")
    p.add_argument("--auth", action="store_true", help="API keys on: one key's requests, salted (module doc)")
    args = p.parse_args(argv)
    args.out = args.out or WORKLOADS[args.workload]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()

    def say(m: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {m}", flush=True)

    from local.cluster import LocalCluster, deploy, wait_dashboard
    from local.config import cluster_env
    from local.procs import free_port
    from local.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model()
    port = free_port()
    config = render(model_dir, port, auth=args.auth)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Two logical CPUs per engine: REPLICAS prefill engines and one decode engine.
    cluster = LocalCluster(decode_cpus=2)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    apps: dict[str, dict[str, Any]] = {}
    with open(args.out.parent / "prefix-client.log", "w") as client_log:
        try:
            say(f"starting a local Ray cluster; {len(ROUTERS)} P/D applications, one at a time")
            env = {**cluster_env(), **({API_KEYS_ENV: BENCH_KEY} if args.auth else {})}
            cluster.start(env, extra_prefill=REPLICAS - 1)
            wait_dashboard(cluster.dashboard_url)
            for name in args.only or ROUTERS:
                # One application at a time: three side by side (nine engines) run this
                # machine out of memory (Ray's memory monitor kills replicas).
                deploy(cluster.dashboard_url, {**config, "applications": []})
                _wait_gone(cluster.dashboard_url)
                deploy(cluster.dashboard_url, {**config, "applications": [_app(config, name)]})
                apps[name] = _measure(name, cluster, model_dir, port, args, client_log, say)
        except KeyboardInterrupt:
            say("interrupted")
            return 1
        finally:
            cluster.shutdown()

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {
            **_workload(args),
            "rounds": args.rounds,
            "prefill_replicas_per_app": REPLICAS,
            "decode_replicas_per_app": 1,
            "order": "one application after another, the same seeds",
            "keys": "one API key, its prefix cache salted" if args.auth else "none (no request salted)",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": list(os.getloadavg()),
        },
        "apps": apps,
    }
    print(table(apps))
    report["wall_s"] = time.monotonic() - t0
    args.out.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.out}  wall {report['wall_s']:.0f}s")
    return 0


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    """What each application was sent, for the report."""
    if args.workload == "multi-turn":
        shape = MULTI_TURN
        return {
            "client": "bench/multi_turn.py: chat sessions, each turn resending the conversation, streamed /v1/chat/completions",
            "sessions_per_round": shape.sessions,
            "turns": shape.turns,
            "system_tokens": shape.system_tokens,
            "user_tokens_per_turn": shape.user_tokens,
            "output_tokens": shape.answer_tokens,
            "concurrency": shape.concurrency,
            "requests_per_app": args.rounds * shape.sessions * shape.turns,
        }
    return {
        "client": "vllm.benchmarks.serve, dataset prefix_repetition, streamed /v1/completions",
        "prefix_tokens": PREFIX_LEN,
        "suffix_tokens": SUFFIX_LEN,
        "prefixes_per_round": NUM_PREFIXES,
        "output_tokens": OUTPUT_LEN,
        "concurrency": CONCURRENCY,
        "requests_per_app": args.rounds * args.per_round,
    }


@functools.cache
def _sessions(model_dir: Path, seed: int) -> list[list[str]]:
    """The multi-turn sessions of one round's seed: made once, sent to every application."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return multi_turn.texts(MULTI_TURN, seed, tok.decode, tok.vocab_size)


def _round(
    url: str, model_dir: Path, args: argparse.Namespace, r: int, client_log: Any
) -> tuple[list[RequestResult], float]:
    """Round `r` of the workload against one application: its results and its wall time."""
    from local.config import MODEL_ID

    api_key = BENCH_KEY if args.auth else None
    if args.workload == "multi-turn":
        parts = _sessions(model_dir, args.seed + r)
        t = time.monotonic()
        results = asyncio.run(multi_turn.run(url, MODEL_ID, MULTI_TURN, parts, api_key))
        return results, time.monotonic() - t
    load = vllm_load.Load(
        base_url=url,
        model=MODEL_ID,
        tokenizer=str(model_dir),
        num_prompts=args.per_round,
        concurrency=CONCURRENCY,
        # The same seed per round for every application: the same prompts.
        seed=args.seed + r,
        dataset="prefix_repetition",
        prefix_len=PREFIX_LEN,
        suffix_len=SUFFIX_LEN,
        num_prefixes=NUM_PREFIXES,
        output_len=OUTPUT_LEN,
        api_key=api_key,
    )
    return vllm_load.run(load, log=client_log)


def _app(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in config["applications"] if a["name"] == name)


def _wait_gone(dashboard_url: str, timeout: float = 300) -> None:
    """Until Serve reports no application (the last one's engines stopped, their memory freed)."""
    deadline = time.monotonic() + timeout
    while serve_apps(dashboard_url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"Serve still runs {list(serve_apps(dashboard_url))} after {timeout:.0f}s")
        time.sleep(2)


def _measure(
    name: str, cluster: Any, model_dir: Path, port: int, args: argparse.Namespace, client_log: Any, say: Any
) -> dict[str, Any]:
    """One deployed application: the rounds, then its figures (read while its replicas live:
    an engine's series leave the scrape with it)."""
    from local.cluster import smoke_request, wait_running
    from local.config import HOST, MODEL_ID

    wait_running(cluster.dashboard_url, [name], timeout=900, progress=say)
    url = f"http://{HOST}:{port}/{name}"
    smoke_request(f"{url}/v1", BENCH_KEY if args.auth else None, MODEL_ID)
    metrics_urls = [n["metrics_url"] for n in cluster.nodes()]
    prefill_url = next(n["metrics_url"] for n in cluster.nodes() if n["label"] == "prefill")
    served = serve_apps(cluster.dashboard_url)[name]
    # Every node's series quiet (decode's counters live on the decode node).
    before = settled(metrics_urls)[prefill_url]
    counts_before = _counts(metrics_urls)
    results: list[RequestResult] = []
    duration = 0.0
    for r in range(args.rounds):
        res, dur = _round(url, model_dir, args, r, client_log)
        results.extend(res)
        duration += dur
        say(f"{name}: round {r + 1}/{args.rounds} done")
    after = settled(metrics_urls)[prefill_url]
    counts_after = _counts(metrics_urls)
    _, _, prefill = roles(served)
    assert prefill is not None
    prefill_ids = served["replicas"][prefill]
    delta = hops.engine_delta(before, after, via_ray=True, replica_ids=prefill_ids)
    out = {
        "router": ROUTERS[name],
        **summarize(results, duration),
        "prefix_cache_hit_rate": delta.prefix_hit_rate,
        # Prompt tokens the prefill engines computed (queried, less those found cached).
        "prefill_tokens_computed": delta.prefix_queries - delta.prefix_hits,
        "requests_per_prefill_replica": {rid: _served_by(before, after, rid) for rid in prefill_ids},
    }
    for key, after_counts in counts_after.items():
        was = counts_before[key]
        out[key] = {k: v - was.get(k, 0.0) for k, v in after_counts.items() if v != was.get(k, 0.0)}
    return out


if __name__ == "__main__":
    sys.exit(main())
