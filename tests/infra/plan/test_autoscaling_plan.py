"""Autoscaling arithmetic: replicas that fit their pool, room for a cluster upgrade, the plan's
scaling lines. KubeRay 1.7 (ray-operator/controllers/ray/rayservice_controller.go): a
NewCluster upgrade starts a whole new RayCluster next to the running one and moves traffic
when it is ready (kuberay#1476: without room it stays Pending); None never starts one.
"""

from __future__ import annotations

import copy

import pytest

from infra.config import ConfigError, load
from infra.paths import stack_file
from infra.plan.planning import Workload, plan
from infra.sizing import nodes as sizing
from tools.stackfile import read_as_deployed


def _prod(mutate=None):
    values, secrets, others = read_as_deployed("prod")
    values = copy.deepcopy(values)
    if mutate:
        mutate(values)
    return load(values, secret_keys=secrets, source=stack_file("prod"), region=others.get("aws:region"))


def _set_decode_max(n):
    def m(values):
        values["serving"]["decode"]["maxReplicas"] = n

    return m


@pytest.mark.parametrize("replicas", [5, 7])
def test_decode_max_replicas_beyond_the_pool_is_one_line_naming_both_keys(replicas):
    with pytest.raises(ConfigError) as e:
        _prod(_set_decode_max(replicas))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("stacks/Pulumi.prod.yaml: nodePools.decode.maxSize: ")
    assert "serving.decode.maxReplicas" in msg


def test_upgrade_strategy_none_needs_no_second_cluster():
    def m(values):
        values["nodePools"]["decode"]["maxSize"] = 4
        values["upgradeStrategy"] = "None"

    assert _prod(m).node_pools.decode.max_size == 4


@pytest.mark.parametrize(
    ("strategy", "mn", "mx", "initial", "gpus", "per_node", "nodes"),
    [
        ("NewCluster", 2, 4, None, 8, 8, 6),  # prod decode: 4 running + 2 starting
        ("NewCluster", 2, 4, 3, 8, 8, 7),  # the new cluster starts at initialReplicas
        ("NewCluster", 1, 2, None, 16, 8, 6),  # two-node replicas
        ("NewCluster", 1, 3, None, 1, 8, 2),  # 8 replicas share a node: 1 + 1
        ("None", 2, 4, None, 8, 8, 4),
    ],
)
def test_upgrade_peak_nodes(strategy, mn, mx, initial, gpus, per_node, nodes):
    assert sizing.upgrade_peak_nodes(strategy, mn, mx, initial, gpus, per_node) == nodes


def test_plan_scaling_lines_for_prod():
    cfg = _prod()
    roles = {r.role: r for r in plan(cfg).roles}
    d = roles["decode"].scaling
    assert (d.nodes_min, d.nodes_max, d.gpus_min, d.gpus_max) == (2, 4, 16, 32)
    assert d.usd_per_hour_max == pytest.approx(4 * cfg.node_pools.decode.instance.usd_per_hour)
    assert (d.upgrade_peak_nodes, d.upgrade_extra_nodes) == (6, 2)
    # Prefill, compute-bound: TP 8 x 989 TFLOPS / (2 x 70.6e9 x 1024) requests/s per replica,
    # 16 in flight at 16/17 of that (processor sharing), one replica at minimum.
    mu = 8 * 989e12 / (2 * 70.6e9 * 1024)
    assert roles["prefill"].scaling.scale_out_rps == pytest.approx(mu * 16 / 17)
    # Decode scales out later with longer outputs (fewer requests hold the same batch).
    short = {r.role: r for r in plan(cfg, workload=Workload(1024, 128)).roles}["decode"].scaling.scale_out_rps
    assert short > d.scale_out_rps > 0
