"""In the stack file: scale to zero (dev and staging only), per-role signals and the
weights path, each refused with one line naming file and key; the plan's time to serve for the
first request after idle.

Upstream: Ray 2.60 ray/serve/config.py AutoscalingConfig (`min_replicas` may be 0) and
ray/serve/autoscaling_policy.py `_get_cold_start_scale_up_replicas` (0 replicas and a waiting
request -> one replica at once, without the upscale delay).
"""

from __future__ import annotations

import copy

import pytest

from infra import config
from infra.plan import planning
from tools import stackfile


def _values(stack: str, mutate) -> tuple[dict, frozenset]:
    values, secrets, _ = stackfile.read_as_deployed(stack)
    values = copy.deepcopy(values)
    mutate(values)
    return values, secrets


def _error(stack: str, mutate) -> str:
    values, secrets = _values(stack, mutate)
    with pytest.raises(config.ConfigError) as e:
        config.load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _load(stack: str, mutate) -> config.StackConfig:
    values, secrets = _values(stack, mutate)
    return config.load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")


def _zero(role: str):
    def mutate(v):
        v["serving"][role]["minReplicas"] = 0

    return mutate


def test_prod_refuses_scale_to_zero_in_one_line():
    msg = _error("prod", _zero("decode"))
    assert msg.startswith(
        "stacks/Pulumi.prod.yaml: serving.decode.minReplicas: 0 (scale to zero) is for dev and staging only"
    )


@pytest.mark.parametrize("stack", ["dev", "staging"])
def test_dev_and_staging_may_scale_either_role_to_zero(stack):
    def both(v):
        _zero("prefill")(v)
        _zero("decode")(v)

    cfg = _load(stack, both)
    assert cfg.serving.prefill.min_replicas == 0 and cfg.serving.decode.min_replicas == 0


def test_a_fallback_that_cannot_bridge_the_cold_start_is_refused():
    def mutate(v):
        _zero("decode")(v)
        v["serving"]["fallback"] = {"baseUrl": "https://api.example.com/v1", "model": "x", "when": ["overloaded"]}

    msg = _error("staging", mutate)
    assert "serving.fallback.when: must list 'unavailable' while serving.decode.minReplicas is 0" in msg


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda v: v["serving"]["decode"].update(signals={"queueTimeS": 1.0}),
            "serving: decode.signals: queueTimeS is not a decode signal",
        ),
        (
            lambda v: v["serving"]["prefill"].update(signals={"kvCacheUsage": 2}),
            "serving.prefill.signals.kvCacheUsage",
        ),
        (
            lambda v: v["serving"]["model"].update(loading={"weights": "streamer"}),
            "serving: model.loading: weights: streamer reads s3:// or a local path",
        ),
    ],
)
def test_signal_and_loading_mistakes_are_one_line(mutate, expected):
    msg = _error("staging", mutate)
    assert msg.startswith(f"stacks/Pulumi.staging.yaml: {expected}"), msg


def test_the_plan_prints_the_first_request_after_idle():
    """A role at zero waits for a warm node's time to serve, or a new node's when its pool may
    empty too (nodePools.<role>.minSize 0); roles that keep a replica print none."""

    def mutate(v):
        _zero("decode")(v)
        v["nodePools"]["decode"]["minSize"] = 0
        v["nodePools"]["decode"]["desiredSize"] = 0

    p = planning.plan(_load("staging", mutate))
    decode = next(r for r in p.roles if r.role == "decode")
    assert decode.startup is not None and decode.startup.new_node_s is not None
    text = planning.format_plan(p)
    line = next(x for x in text.splitlines() if x.startswith("First request after idle"))
    assert f"{decode.startup.new_node_s / 60:.1f} min (new node)" in line
    assert "- (minReplicas > 0)" in line  # prefill keeps its replica


def test_a_role_at_zero_renders_for_serve_and_kuberay_alike():
    """Serve min_replicas 0 with one starting replica; KubeRay's worker group may go to 0 pods
    and starts with the pods of that one replica (the KubeRay autoscaler removes idle pods)."""
    import yaml

    from infra import catalog
    from infra.k8s.rayservice import RayServiceInputs, rayservice_manifest

    def mutate(v):
        _zero("decode")(v)

    cfg = _load("staging", mutate)
    inp = RayServiceInputs(
        name="llm",
        namespace=cfg.namespace,
        image=cfg.ray_image,
        serving=cfg.serving,
        instances={r: catalog.lookup(getattr(cfg.node_pools, r).instance_type) for r in cfg.serving.engine_roles()},
        working_dir="s3://code/serving/x.zip",
        head_service_account="h",
        worker_service_account="w",
        api_keys=None,
    )
    rs = rayservice_manifest(inp)
    group = next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "decode")
    assert group["minReplicas"] == 0 and group["replicas"] >= 1
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["decode_config"]
    auto = serve["deployment_config"]["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"]) == (0, 1)
