"""Graceful drain in the Serve config: each deployment may take as long to stop as its longest request.

Upstream behaviour encoded (Ray 2.60, python/ray/serve/_private/): a stopping replica waits
for its ongoing requests, polling every `graceful_shutdown_wait_loop_s` (replica.py
`_drain_ongoing_requests`), and the controller kills it `graceful_shutdown_timeout_s` after the
stop (deployment_state.py `DeploymentReplica.stop` / `check_stopped`); the defaults are 20 s and
2 s (constants.py). A stream that outlives the timeout is cut at scale-in or at a restarting
update. None of these tests start Ray.
"""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from serving.spec import Mode, ServingSpec, Target
from serving.spec.drain import (
    DRAIN_POLL_S,
    NODE_DRAIN_ENV,
    RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    RAY_DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
)

GPU = Target(accelerator_type="H100")


def make_spec(**overrides) -> ServingSpec:
    data = {"model": {"id": "llama-3-8b", "source": "meta-llama/Meta-Llama-3-8B-Instruct"}, **overrides}
    return ServingSpec.model_validate(data)


def deployments(spec: ServingSpec) -> dict[str, dict]:
    """Each Serve deployment's options as rendered: ingress, and the engine(s)."""
    args = spec.app_args(GPU)
    found = {"ingress": args["ingress_deployment_config"]}
    if spec.mode is Mode.AGGREGATED:
        found["engine"] = args["llm_configs"][0]["deployment_config"]
    else:
        found["prefill"] = args["prefill_config"]["deployment_config"]
        found["engine"] = args["decode_config"]["deployment_config"]
    return found


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_each_deployment_outlasts_its_longest_request(mode):
    spec = make_spec(mode=mode)
    r = spec.resilience
    proxy_timeout = spec.serve_config(GPU)["http_options"]["request_timeout_s"]
    opts = deployments(spec)
    # The ingress holds a request until Serve's proxy gives up on it; the engine stream ends at the
    # ingress's total deadline; a prefill call ends when decode stops waiting for it. The last
    # request may end just after a poll, so one poll more.
    longest = {
        "ingress": proxy_timeout,
        "engine": r.total_timeout_s,
        "prefill": r.prefill_queue_timeout_s + r.prefill_timeout_s,
    }
    for part, o in opts.items():
        assert o["graceful_shutdown_timeout_s"] >= longest[part] + o["graceful_shutdown_wait_loop_s"], part
    # Ray's 20 s default would cut any stream longer than that at a scale-in.
    assert opts["ingress"]["graceful_shutdown_timeout_s"] > RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
    assert opts["engine"]["graceful_shutdown_timeout_s"] > RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S


def test_the_drain_follows_total_timeout():
    short, long = (make_spec(resilience={"totalTimeoutS": t}) for t in (300, 1800))
    a, b = deployments(short), deployments(long)
    for part in ("ingress", "engine"):
        assert b[part]["graceful_shutdown_timeout_s"] - a[part]["graceful_shutdown_timeout_s"] == 1500
    # Prefill's bound is its own deadlines, not the stream's.
    assert a["prefill"]["graceful_shutdown_timeout_s"] == b["prefill"]["graceful_shutdown_timeout_s"]
    slower_prefill = deployments(make_spec(resilience={"prefillTimeoutS": 7, "firstTokenTimeoutS": 60}))["prefill"]
    assert slower_prefill["graceful_shutdown_timeout_s"] - a["prefill"]["graceful_shutdown_timeout_s"] == 2


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_rendered_drain_is_what_ray_serve_would_run(mode):
    """Ray's own models parse the options into the values the controller and replicas read."""
    from ray.serve._private.config import DeploymentConfig
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import DeploymentSchema, ServeDeploySchema

    spec = make_spec(mode=mode)
    ServeDeploySchema.model_validate(spec.serve_config(GPU))
    args = spec.app_args(GPU)
    ingress = DeploymentSchema.model_validate({"name": "ingress", **args["ingress_deployment_config"]})
    rendered = deployments(spec)
    assert ingress.graceful_shutdown_timeout_s == rendered["ingress"]["graceful_shutdown_timeout_s"]
    engines = args.get("llm_configs") or [args["prefill_config"], args["decode_config"]]
    for raw in engines:
        llm = LLMConfig.model_validate(copy.deepcopy(raw))  # validates deployment_config as a DeploymentConfig
        cfg = DeploymentConfig(**{k: v for k, v in llm.deployment_config.items() if k in DeploymentConfig.model_fields})
        assert cfg.graceful_shutdown_timeout_s == raw["deployment_config"]["graceful_shutdown_timeout_s"]
        assert cfg.graceful_shutdown_wait_loop_s == DRAIN_POLL_S


def test_ray_schema_is_not_a_rubber_stamp():
    from ray.serve.schema import DeploymentSchema

    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s"):
        DeploymentSchema.model_validate({"name": "ingress", "graceful_shutdown_timeout_s": -1})


def test_the_local_stack_drains_its_streams_too():
    """`make serve` renders through the same spec: a local decode scale-in waits for the local total deadline."""
    from local import config as local_config
    from local.config import LOCAL_RESILIENCE

    rendered = local_config.render_local_config("both", "/models/tiny", port=8000)
    for app in rendered["applications"]:
        args = app["args"]
        engines = args.get("llm_configs") or [args["decode_config"]]
        for raw in engines:
            assert raw["deployment_config"]["graceful_shutdown_timeout_s"] >= LOCAL_RESILIENCE["totalTimeoutS"]


def test_mirror_of_rays_defaults_matches_the_installed_ray():
    """Sanity test of a mirror: the defaults and the variable named in serving/spec/drain.py are Ray 2.60's."""
    import inspect

    from ray._private import ray_constants
    from ray.serve._private import constants

    assert constants.DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S == RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
    assert constants.DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S == RAY_DEFAULT_GRACEFUL_SHUTDOWN_WAIT_LOOP_S
    assert f'"{NODE_DRAIN_ENV}"' in inspect.getsource(ray_constants)


@pytest.mark.parametrize("total", [300, 1800])
def test_an_haproxy_reload_does_not_stop_the_old_process_before_its_longest_stream(total):
    """In HAProxy mode Serve reloads HAProxy whenever the ingress replicas change, and Ray 2.60
    stops the replaced process RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S later (default 120 s,
    ray/serve/_private/constants.py; haproxy_templates.py `hard-stop-after`), cutting what it
    still streams (tests/infra/k8s/test_haproxy_contract.py shows the cut). The spec gives every
    Ray process a hard stop no shorter than the longest request the proxy holds."""
    import inspect

    from ray.serve._private import constants

    from serving.spec import HAPROXY_HARD_STOP_ENV, PROXY_TIMEOUT_MARGIN_S

    assert f'"{HAPROXY_HARD_STOP_ENV}"' in inspect.getsource(constants)
    spec = make_spec(resilience={"totalTimeoutS": total})
    env = spec.ray_env()
    hard_stop = int(env[HAPROXY_HARD_STOP_ENV])
    assert hard_stop >= total + PROXY_TIMEOUT_MARGIN_S
    assert hard_stop > constants.RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S or total + PROXY_TIMEOUT_MARGIN_S <= 120
    # Serve's own proxy needs no such bound: without HAProxy the variable is not set.
    assert HAPROXY_HARD_STOP_ENV not in make_spec(ingress={"dataPlane": "ray-proxy"}).ray_env()
