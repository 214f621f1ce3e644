"""bench/cold_start.py dry: the scale-to-zero stack with a fallback, and the config its cluster
path deploys without the fallback, both built without Ray (tests/bench/dry_run.py)."""

from __future__ import annotations

from bench import cold_start
from serving.spec import APP_NAME, INGRESS_DEPLOYMENT
from tests.bench import dry_run

PROVIDER = "http://127.0.0.1:9/v1"


def _ingress_user_config(config: dict) -> dict:
    (app,) = [a for a in config["applications"] if a["name"] == APP_NAME]
    (dep,) = [d for d in app["deployments"] if d["name"] == INGRESS_DEPLOYMENT]
    return dep["user_config"]


def test_decode_starts_at_one_and_may_go_to_zero_with_the_provider_as_fallback():
    stack = dry_run.plan(cold_start.stack_options(PROVIDER))
    built = dry_run.build(stack.config)
    assert built[APP_NAME]["Decode:tiny-llama"] == dry_run.Replicas(0, 2, 1)
    assert _ingress_user_config(stack.config)["fallback"]["base_url"] == PROVIDER


def test_the_cluster_path_deploys_the_same_config_without_the_fallback():
    config = dry_run.plan(cold_start.stack_options(PROVIDER)).config
    without = cold_start.fallback_config(config, keep=False)
    assert "fallback" not in _ingress_user_config(without)
    assert cold_start.fallback_config(config, keep=True) == config
    assert dry_run.build(without) == dry_run.build(config)
