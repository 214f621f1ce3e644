"""What the PR preview says about a RayService change: KubeRay 1.7's own rule.

ray-operator/controllers/ray/rayservice_controller.go (v1.7.0) `shouldPrepareNewCluster` and
`isClusterSpecHashEqual`, utils/util.go `GenerateHashWithoutReplicasAndWorkersToDelete`:
replicas, minReplicas, maxReplicas, workersToDelete, tolerations and scheduling gates are left
out of the cluster hash; appending worker groups updates the cluster; any other change to
rayClusterConfig prepares a new cluster when the strategy is NewCluster (not with None);
serveConfigV2 alone goes to the running cluster's Serve.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from infra import catalog
from infra.k8s.upgrades import classify


@pytest.fixture
def prod_rs(rendered_stacks):
    return next(o for o in rendered_stacks["prod"].manifests().values() if o.get("kind") == "RayService")


def _worker(rs, role):
    return next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == role)


def test_serve_config_only_is_in_place(prod_rs):
    after = copy.deepcopy(prod_rs)
    after["spec"]["serveConfigV2"] += "\n# changed\n"
    v = classify(prod_rs, after)
    assert v.kind == "serve-in-place" and v.extra_gpu_nodes == 0
    assert "in-place Serve update" in v.line("llm")


def test_replica_bounds_are_not_a_new_cluster(prod_rs):
    after = copy.deepcopy(prod_rs)
    _worker(after, "decode")["maxReplicas"] += 1
    assert classify(prod_rs, after).kind == "cluster-in-place"


def test_an_image_change_builds_a_new_cluster_and_says_what_it_costs(rendered_stacks, prod_rs):
    after = copy.deepcopy(prod_rs)
    for g in after["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        g["template"]["spec"]["containers"][0]["image"] = "example.com/ray:next"
    v = classify(prod_rs, after)
    cfg = rendered_stacks["prod"].config
    p5 = catalog.lookup("p5.48xlarge").usd_per_hour
    # The new cluster starts at each group's replicas: prod 1 prefill + 2 decode nodes.
    assert (v.kind, v.extra_gpu_nodes) == ("new-cluster", 3)
    assert v.extra_usd_per_hour == pytest.approx(3 * p5)
    assert cfg.node_pools.decode.instance_type == "p5.48xlarge"
    assert "+3 GPU nodes" in v.line("llm")


def test_with_upgrade_strategy_none_the_change_is_not_applied(prod_rs):
    after = copy.deepcopy(prod_rs)
    after["spec"]["upgradeStrategy"] = {"type": "None"}
    after["spec"]["rayClusterConfig"]["rayVersion"] = "9.9.9"
    v = classify(prod_rs, after)
    assert v.kind == "new-cluster" and "will NOT apply" in v.line("llm")


def test_the_diff_report_carries_the_rollout_line(prod_rs):
    from tools import diff
    from tools.mock_runtime import Registered

    after = copy.deepcopy(prod_rs)
    serve = yaml.safe_load(after["spec"]["serveConfigV2"])
    serve["applications"][0]["args"]["ingress_deployment_config"]["autoscaling_config"]["max_replicas"] += 1
    after["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    t = "kubernetes:ray.io/v1:RayService"
    a = diff.Side("a", "prod", None, [Registered(t, "llm-rayservice", None, prod_rs)])
    b = diff.Side("b", "prod", None, [Registered(t, "llm-rayservice", None, after)])
    report = diff.compare(a, b)
    assert any("in-place Serve update" in u for u in report.upgrades)
    assert "in-place Serve update" in diff.format_markdown(report, "prod")
