"""`make bench-prefix` dry (bench/prefix_bench.py): the Serve config it deploys, built without
Ray (tests/bench/dry_run.py): two aggregated applications, two engine replicas each, that
differ only in decode's request router. (This render once failed on a ServingSpec validation
error, unnoticed until the bench ran.)"""

from __future__ import annotations

from pathlib import Path

from bench import prefix_bench
from tests.bench import dry_run


def test_two_apps_two_replicas_each_only_the_router_differs():
    config = prefix_bench.render(Path("/models/tiny"), port=8123)
    built = dry_run.build(config)
    assert list(built) == list(prefix_bench.ROUTERS)
    for deps in built.values():
        engines = {d: r for d, r in deps.items() if "Ingress" not in d}
        assert list(engines.values()) == [dry_run.Replicas(prefix_bench.REPLICAS, prefix_bench.REPLICAS)]
    p2c, affinity = (a["args"]["llm_configs"][0] for a in config["applications"])
    assert p2c != affinity
    differ = {k for k in p2c if p2c[k] != affinity[k]}
    assert differ == {"deployment_config"}
    p2c_dep, aff_dep = p2c["deployment_config"], affinity["deployment_config"]
    assert {k for k in p2c_dep.keys() | aff_dep.keys() if p2c_dep.get(k) != aff_dep.get(k)} == {"request_router_config"}
