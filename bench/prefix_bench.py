"""`make bench-prefix`: prefix-cache affinity routing vs Serve's default router, two replicas each.

What flows through here: two aggregated applications rendered by the spec, identical but
for `decode.router` (`power-of-two`, Serve's default, vs `prefix-cache-affinity`, Ray Serve
LLM's PrefixCacheAffinityRouter), each with two engine replicas, on one local Ray cluster ->
vLLM's benchmark client sending its `prefix_repetition` workload (many requests sharing a
few long "system prompt" prefixes) to both, interleaved round by round with the same seeds
-> TTFT p50/p99 per application, vLLM's prefix-cache hit rate and the requests each replica
served (Ray's re-export of the engines' metrics, by ReplicaId) -> a table and
build/bench/prefix.json.

A benchmark prints figures; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench import BENCH_DIR, hops, vllm_load
from bench.observe import roles, serve_apps, settled
from bench.stats import RequestResult, summarize

DEFAULT_OUT = BENCH_DIR / "prefix.json"
ROUTERS = {"p2c": "power-of-two", "affinity": "prefix-cache-affinity"}
REPLICAS = 2
# The shared-prefix workload (vLLM's prefix_repetition dataset).
PREFIX_LEN = 512
SUFFIX_LEN = 32
NUM_PREFIXES = 16
OUTPUT_LEN = 16
CONCURRENCY = 4
ROUNDS = 4
PER_ROUND = 48


def render(model_dir: Path, port: int) -> dict[str, Any]:
    """Both applications in one Serve config, from the spec (only the router differs)."""
    from local.config import HOST, local_spec, local_target
    from serving.spec import Mode, RoleSpec

    apps = []
    config: dict[str, Any] = {}
    for name, router in ROUTERS.items():
        base = local_spec(Mode.AGGREGATED, model_dir, auth=False)
        decode = RoleSpec.model_validate({"minReplicas": REPLICAS, "maxReplicas": REPLICAS, "router": router})
        spec = base.model_validate(
            {**base.model_dump(by_alias=True, exclude={"models"}), "decode": decode.model_dump(by_alias=True)}
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_bench", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=20261130)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--per-round", type=int, default=PER_ROUND, help="requests per application per round")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()

    def say(m: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {m}", flush=True)

    from local.cluster import LocalCluster, deploy, smoke_request, wait_dashboard, wait_running
    from local.config import HOST, MODEL_ID, cluster_env
    from local.procs import free_port
    from local.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model()
    port = free_port()
    config = render(model_dir, port)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    client_log = open(args.out.parent / "prefix-client.log", "w")  # noqa: SIM115 - closed below
    # Two engines per application, two logical CPUs each.
    cluster = LocalCluster(decode_cpus=2 * REPLICAS * len(ROUTERS))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    results: dict[str, list[RequestResult]] = {n: [] for n in ROUTERS}
    durations = dict.fromkeys(ROUTERS, 0.0)
    try:
        say(f"starting a local Ray cluster; two applications x {REPLICAS} engine replicas")
        cluster.start(cluster_env())
        wait_dashboard(cluster.dashboard_url)
        deploy(cluster.dashboard_url, config)
        wait_running(cluster.dashboard_url, list(ROUTERS), timeout=900, progress=say)
        urls = {n: f"http://{HOST}:{port}/{n}" for n in ROUTERS}
        for url in urls.values():
            smoke_request(f"{url}/v1", None, MODEL_ID)
        decode_url = next(n["metrics_url"] for n in cluster.nodes() if n["label"] == "decode")
        served = serve_apps(cluster.dashboard_url)
        before = settled([decode_url])[decode_url]
        for r in range(args.rounds):
            order = list(ROUTERS)[r % 2 :] + list(ROUTERS)[: r % 2]
            for name in order:
                load = vllm_load.Load(
                    base_url=urls[name],
                    model=MODEL_ID,
                    tokenizer=str(model_dir),
                    num_prompts=args.per_round,
                    concurrency=CONCURRENCY,
                    # Same seed for both applications in a round: the same prompts.
                    seed=args.seed + r,
                    dataset="prefix_repetition",
                    prefix_len=PREFIX_LEN,
                    suffix_len=SUFFIX_LEN,
                    num_prefixes=NUM_PREFIXES,
                    output_len=OUTPUT_LEN,
                )
                res, dur = vllm_load.run(load, log=client_log)
                results[name].extend(res)
                durations[name] += dur
            say(f"round {r + 1}/{args.rounds} done ({' -> '.join(order)})")
        after = settled([decode_url])[decode_url]
    except KeyboardInterrupt:
        say("interrupted")
        return 1
    finally:
        client_log.close()
        cluster.shutdown()

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": {
            "client": "vllm.benchmarks.serve, dataset prefix_repetition, streamed /v1/completions",
            "prefix_tokens": PREFIX_LEN,
            "suffix_tokens": SUFFIX_LEN,
            "prefixes_per_round": NUM_PREFIXES,
            "output_tokens": OUTPUT_LEN,
            "concurrency": CONCURRENCY,
            "rounds": args.rounds,
            "requests_per_app": args.rounds * args.per_round,
            "replicas_per_app": REPLICAS,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": list(os.getloadavg()),
        },
        "apps": {},
    }
    print(f"{'router':<24}{'reqs':>6}{'err':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'hit rate':>10}  requests per replica")
    for name, router in ROUTERS.items():
        s = summarize(results[name], durations[name])
        _, engine, _ = roles(served[name])
        engine_ids = served[name]["replicas"][engine]
        delta = hops.engine_delta(before, after, via_ray=True, replica_ids=engine_ids)
        per_replica = {rid: _served_by(before, after, rid) for rid in engine_ids}
        report["apps"][name] = {
            "router": router,
            **s,
            "prefix_cache_hit_rate": delta.prefix_hit_rate,
            "requests_per_replica": per_replica,
        }
        hit = "-" if delta.prefix_hit_rate is None else f"{delta.prefix_hit_rate:.1%}"
        print(
            f"{router:<24}{s['requests']:>6}{s['errors']:>5}{s['ttft_p50_ms'] or 0:>10.1f}{s['ttft_p99_ms'] or 0:>10.1f}"
            f"{hit:>10}  {sorted(int(v) for v in per_replica.values())}"
        )
    report["wall_s"] = time.monotonic() - t0
    args.out.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.out}  wall {report['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
