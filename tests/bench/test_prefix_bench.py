"""`make bench-prefix` dry (bench/prefix_bench.py): the Serve config it deploys, built without
Ray (tests/bench/dry_run.py): three P/D applications, two prefill replicas and one decode
replica each, that differ only in prefill's request router (and, for kv-aware, the scorer it
brings and the engines' KV-event ports). (This render once failed on a ServingSpec validation
error, unnoticed until the bench ran.)"""

from __future__ import annotations

from pathlib import Path

from bench import prefix_bench
from serving.spec.base import KV_SCORER_DEPLOYMENT
from tests.bench import dry_run


def test_three_apps_that_differ_only_in_prefills_router():
    config = prefix_bench.render(Path("/models/tiny"), port=8123)
    built = dry_run.build(config)
    assert list(built) == list(prefix_bench.ROUTERS)
    for name, deps in built.items():
        prefill = next(r for d, r in deps.items() if d.startswith("Prefill"))
        decode = next(r for d, r in deps.items() if d.startswith("Decode"))
        assert prefill == dry_run.Replicas(prefix_bench.REPLICAS, prefix_bench.REPLICAS)
        assert decode == dry_run.Replicas(1, 1)
        assert (KV_SCORER_DEPLOYMENT in deps) == (prefix_bench.ROUTERS[name] == "kv-aware")
    args = [a["args"] for a in config["applications"]]
    assert all(a["decode_config"] == args[0]["decode_config"] for a in args)
    prefills = [a["prefill_config"] for a in args]
    routers = [p["deployment_config"].get("request_router_config", {}).get("request_router_class") for p in prefills]
    assert len(set(routers)) == 3
    for p in prefills[1:]:
        assert {k for k in p if p[k] != prefills[0][k]} <= {"deployment_config", "experimental_configs"}
        dep, dep0 = p["deployment_config"], prefills[0]["deployment_config"]
        assert {k for k in dep.keys() | dep0.keys() if dep.get(k) != dep0.get(k)} == {"request_router_config"}
        extra = {
            k
            for k in p["experimental_configs"]
            if p["experimental_configs"][k] != prefills[0]["experimental_configs"].get(k)
        }
        assert extra <= {"KV_EVENTS_PORT_BASE", "KV_TOKEN_PORT_BASE"}


def test_the_table_shows_each_figure_against_power_of_two():
    apps = {
        name: {
            "router": router,
            "requests": 10,
            "errors": 0,
            "ttft_p50_ms": 100.0 / (i + 1),
            "ttft_p99_ms": 200.0,
            "prefix_cache_hit_rate": 0.3 * (i + 1),
            "prefill_tokens_computed": 1000.0 / (i + 1),
            "requests_per_prefill_replica": {"a": 5, "b": 5},
        }
        for i, (name, router) in enumerate(prefix_bench.ROUTERS.items())
    }
    apps["kv"]["routed"] = {"scored": 8.0, "timeout": 2.0, "skipped": 6.0}
    apps["kv"]["scorer_wait_s"] = {"tiny": 0.6}
    apps["kv"]["prefill_path"] = {"remote": 9.0, "local": 1.0}
    apps["kv"]["scored_tokens"] = {"prompt": 400.0, "cached": 100.0}
    text = prefix_bench.table(apps)
    assert "(0.33x)" in text and "(1.00x)" in text
    assert (
        "kv-aware: prefilled {'remote': 9.0, 'local': 1.0}, locally because {}, routed {'scored': 8.0, 'timeout': 2.0, 'skipped': 6.0}"
        in text
    )
    # what the scorer believed cached, beside the engines' hit rate: 100 of 400 prompt tokens
    assert "the scorer found 25.0% cached" in text
    # 0.6 s over the 10 requests that asked the scorer (the skipped ones did not wait)
    assert "decode waited 60.0 ms on the scorer per request that asked it" in text
    assert "waited" not in text.split("\n")[-2]  # affinity: no scorer


def test_with_auth_every_app_serves_the_benchs_key_from_the_clusters_environment():
    """--auth: the applications as a stack serves them, API keys on (and so each key's prefix
    cache salted: limits.cacheIsolation defaults to "key"); the ingress reads the keys from the
    environment variable the bench sets on the cluster. Without it no key, no salt."""
    from serving.spec import API_KEYS_ENV

    keyed = [a["args"]["auth"] for a in prefix_bench.render(Path("/m"), 8123, auth=True)["applications"]]
    plain = [a["args"]["auth"] for a in prefix_bench.render(Path("/m"), 8123)["applications"]]
    assert keyed == [{"mode": "api-key", "api_keys_env": API_KEYS_ENV}] * 3
    assert all(a["mode"] == "disabled" for a in plain)
