"""What KubeRay makes of our RayService: the pods' labels, the serve Service, worker readiness.

Contracts (reproduced in tests/upstream.py, each from ray-project/kuberay v1.7.0):
- `ray-operator/controllers/ray/common/pod.go` `labelPod` + `BuildPod`: the labels a pod
  really carries (ray.io/cluster, node-type, group, identifier, is-ray-node, the template's,
  and ray.io/serve: "true" on RayService workers, "false" on the head until the RayService
  controller's proxy health check flips it, `rayservice_controller.go` updateHeadPodServeLabel).
  `ray.io/originated-from-cr-name` is NOT among them (only on the RayCluster and Services).
- `common/service.go` `BuildServeService` + `rayservice_controller.go` `reconcileServices`:
  `spec.serveService` becomes the Service, selector {ray.io/cluster: <active>, ray.io/serve:
  "true"}, rewritten when a NewCluster upgrade switches the active cluster; ignored under
  NewClusterWithIncrementalUpgrade.
- `common/pod.go` `initLivenessAndReadinessProbe`: a RayService WORKER container without its
  own readinessProbe gets one that also wgets the Serve proxy's /-/healthz on its "serve" port
  (default 8000); a container with its own probe keeps it. Ray 2.60
  `serve/_private/controller.py` `_update_proxy_nodes`: with proxy_location EveryNode a proxy
  runs on the head and on every NODE holding a replica actor; with HeadOnly only on the head.
  `serve/_private/deployment_scheduler.py` `_schedule_replica`: a replica's actor sits on bundle
  0 of its placement group, so the other pods of a replica spanning pods (TP x PP over nodes)
  run no proxy. A worker under KubeRay's probe is Ready only if a proxy runs on it.
- kubernetes/kubernetes `staging/src/k8s.io/endpointslice/utils.go` (commit e637659d)
  `getEndpointPorts`/`findPort`: a Service port with a named targetPort reaches only the pods
  that declare a container port of that name.
- `common/pod.go` `convertParamMap`: the `ray start` flags a group's rayStartParams become (a
  "false" dropped unless the option takes an explicit boolean; include-log-monitor does since
  v1.7.0, kuberay#4857); Ray 2.60 `ray/scripts/scripts.py` `start` must take every one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from local.config import render_local_config
from serving.spec import SERVE_PORT
from tests.conftest import STACKS
from tests.upstream import (
    RAY_SERVE_LABEL,
    endpoint_port,
    incremental_upgrade,
    ray_start_flags,
    rayservice_pod,
    readiness_passes,
    selects,
    serve_replica_nodes,
    serve_service,
)


@pytest.fixture(params=STACKS)
def rs(request, rendered_stacks) -> dict:
    found = [o for o in rendered_stacks[request.param].manifests().values() if o.get("kind") == "RayService"]
    assert len(found) == 1
    return found[0]


def _cluster(rs: dict, suffix: str) -> str:
    # RayService names its clusters <rayservice>-<random>; a NewCluster upgrade makes a new one.
    return f"{rs['metadata']['name']}-{suffix}"


def _groups(rs: dict) -> list[str]:
    return [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]


# --- item 2: the OpenAI Service selects the serving head, before and after an upgrade ----------------
def test_serve_service_selects_the_active_clusters_serving_head(rs):
    assert not incremental_upgrade(rs), "serveService is ignored under incremental upgrades"
    old, new = _cluster(rs, "x7k2p"), _cluster(rs, "q9m4t")
    svc = serve_service(rs, old)
    assert svc is not None and svc["metadata"]["name"] == f"{rs['metadata']['name']}-openai"
    head_old = rayservice_pod(rs, old, None, head_proxy_healthy=True)
    assert selects(svc["spec"]["selector"], head_old["metadata"]["labels"])
    # Before its proxy is healthy the head is not an endpoint.
    assert not selects(
        svc["spec"]["selector"], rayservice_pod(rs, old, None, head_proxy_healthy=False)["metadata"]["labels"]
    )
    # A NewCluster upgrade: KubeRay moves the selector to the new cluster's head, off the old one.
    moved = serve_service(rs, new)
    assert moved is not None
    head_new = rayservice_pod(rs, new, None, head_proxy_healthy=True)
    assert selects(moved["spec"]["selector"], head_new["metadata"]["labels"])
    assert not selects(moved["spec"]["selector"], head_old["metadata"]["labels"])


def test_serve_service_port_is_the_heads_serve_port(rs):
    svc = serve_service(rs, _cluster(rs, "x7k2p"))
    assert svc is not None
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    serve_ports = [p for p in head["ports"] if p["name"] == "serve"]
    assert serve_ports == [{"containerPort": SERVE_PORT, "name": "serve"}]
    assert [p["port"] for p in svc["spec"]["ports"]] == [SERVE_PORT]
    head_pod = rayservice_pod(rs, _cluster(rs, "x7k2p"), None)
    assert endpoint_port(svc["spec"]["ports"][0], head_pod) == SERVE_PORT


def test_mirror_sanity_a_selector_on_the_cr_name_label_matches_no_pod(rs):
    """Mirror sanity test (tests.upstream.rayservice_pod alone): the selector we once rendered,
    on `ray.io/originated-from-cr-name`, matches none of the pods KubeRay builds. The mirror is
    applied to the project's own Service selector above."""
    old_selector = {
        "ray.io/originated-from-cr-name": rs["metadata"]["name"],
        "ray.io/node-type": "head",
        RAY_SERVE_LABEL: "true",
    }
    cluster = _cluster(rs, "x7k2p")
    pods = [rayservice_pod(rs, cluster, None)] + [rayservice_pod(rs, cluster, g) for g in _groups(rs)]
    assert not any(selects(old_selector, p["metadata"]["labels"]) for p in pods)


def test_nlb_settings_ride_on_the_serve_service(rendered_stacks):
    for stack in STACKS:
        rendered = rendered_stacks[stack]
        rs = next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")
        svc = serve_service(rs, "c")
        assert svc is not None
        if rendered.config.service_exposure.value == "internal-nlb":
            assert svc["spec"]["type"] == "LoadBalancer"
            assert svc["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
            assert svc["spec"]["loadBalancerSourceRanges"] == rendered.config.service_allowed_cidrs
        else:
            assert svc["spec"]["type"] == "ClusterIP" and "loadBalancerSourceRanges" not in svc["spec"]
        # No Service of our own competes with KubeRay's.
        assert not [o for o in rendered.manifests().values() if o.get("kind") == "Service"]


# --- item 4: every pod becomes Ready; only pods that run a proxy get API traffic -------------------
def _engines(rs: dict) -> list[dict]:
    """Every engine config of every application (several with serving.models: one per model)."""
    out: list[dict] = []
    for app in yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]:
        args = app["args"]
        out += [args[k] for k in ("prefill_config", "decode_config") if k in args] + list(args.get("llm_configs", []))
    return out


def _group_of(rs: dict, engine: dict) -> str:
    """The worker group an engine's placement bundles select (by the groups' Ray labels)."""
    labels = {
        (k, v): g["groupName"]
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for k, v in g["labels"].items()
    }
    groups = {
        labels[(k, v)]
        for sel in engine["deployment_config"]["placement_group_bundle_label_selector"]
        for k, v in sel.items()
        if (k, v) in labels
    }
    assert len(groups) == 1, groups
    return groups.pop()


def _pods_per_group(rs: dict, size: str) -> dict[str, int]:
    field = {"min": "minReplicas", "max": "maxReplicas"}[size]
    return {g["groupName"]: int(g[field]) for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _proxy_pods(rs: dict, proxy_location: str, size: str) -> dict[str, set[int]]:
    """Per worker group, the pods (by index) that run a Serve proxy when the engines are at
    their min or max replicas, under Ray 2.60's rule: per node, where a replica actor sits."""
    pods = _pods_per_group(rs, size)
    out: dict[str, set[int]] = {g: set() for g in pods}
    if proxy_location != "EveryNode":
        return out
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for engine in _engines(rs):
        group = _group_of(rs, engine)
        kw = engine["engine_kwargs"]
        bundles = int(kw.get("tensor_parallel_size") or 1) * int(kw.get("pipeline_parallel_size") or 1)
        dp = int(kw.get("data_parallel_size") or 1)
        auto = engine["deployment_config"].get("autoscaling_config") or {}
        replicas = int(auto.get(f"{size}_replicas") or engine["deployment_config"].get("num_replicas") or 1)
        node_gpus = int(groups[group]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        # Ray Serve LLM DP: one Serve replica per rank, the ranks of a group as one gang.
        out[group] |= serve_replica_nodes(node_gpus, pods[group], replicas * dp, bundles, gang_size=dp)
    return out


def _readiness(rs: dict, proxy_location: str, size: str) -> dict[tuple[str, int], bool]:
    """Every worker pod's readiness, raylets alive, proxies where Ray 2.60 starts them."""
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    port = config["http_options"]["port"]
    cluster = _cluster(rs, "x7k2p")
    ready = {}
    for group, proxies in _proxy_pods(rs, proxy_location, size).items():
        probe = rayservice_pod(rs, cluster, group)["spec"]["containers"][0]["readinessProbe"]
        for i in range(_pods_per_group(rs, size)[group]):
            ready[(group, i)] = readiness_passes(probe, raylet_alive=True, proxy_port=port if i in proxies else None)
    return ready


@pytest.mark.parametrize("size", ["min", "max"])
def test_every_worker_group_becomes_ready(rs, size):
    """Per node, not per group: each pod of each group passes its readiness probe, including the
    pods of a multi-node replica that hold no replica actor (bundle 0 is elsewhere)."""
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert config["proxy_location"] == "EveryNode"
    readiness = _readiness(rs, "EveryNode", size)
    assert readiness and all(readiness.values()), [p for p, ok in readiness.items() if not ok]


def test_a_multi_node_replica_leaves_pods_without_a_proxy(rendered_stacks):
    """The case the rule is about: deepseek-p5's prefill (TP 8 x PP 2 on 8-GPU nodes) has one
    pod with the replica actor and one without, which would fail KubeRay's proxy probe."""
    rs = next(o for o in rendered_stacks["deepseek-p5"].manifests().values() if o.get("kind") == "RayService")
    proxies = _proxy_pods(rs, "EveryNode", "min")
    assert _pods_per_group(rs, "min")["prefill"] == 2 and proxies["prefill"] == {0}
    # Decode there is DP 16 x TP 1: every pod holds ranks, so every pod runs a proxy.
    assert proxies["decode"] == {0, 1}
    yesterday = copy.deepcopy(rs)
    for g in yesterday["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        g["template"]["spec"]["containers"][0].pop("readinessProbe", None)
    assert _readiness(yesterday, "EveryNode", "min")[("prefill", 1)] is False


def test_only_pods_that_run_a_proxy_receive_api_traffic(rs):
    """Workers are selected by KubeRay's serve Service; a Ready worker that declares the
    targeted port must run a proxy, or a share of the requests would be refused."""
    cluster = _cluster(rs, "x7k2p")
    svc = serve_service(rs, cluster)
    assert svc is not None
    for size in ("min", "max"):
        proxies = _proxy_pods(rs, "EveryNode", size)
        readiness = _readiness(rs, "EveryNode", size)
        for (group, i), ready in readiness.items():
            pod = rayservice_pod(rs, cluster, group)
            assert selects(svc["spec"]["selector"], pod["metadata"]["labels"]), group
            gets_traffic = ready and endpoint_port(svc["spec"]["ports"][0], pod) is not None
            assert not gets_traffic or i in proxies[group], (group, i)


def test_head_only_would_leave_proxy_probed_workers_unready(rs):
    """The rule bites: under yesterday's HeadOnly no worker runs a proxy, so every pod that
    relies on KubeRay's injected probe stays unready."""
    cluster = _cluster(rs, "x7k2p")
    readiness = _readiness(rs, "HeadOnly", "min")
    for (group, i), ready in readiness.items():
        probe = rayservice_pod(rs, cluster, group)["spec"]["containers"][0]["readinessProbe"]
        if "checks" in probe:
            assert not ready, (group, i)


def test_local_serve_config_keeps_head_only():
    # Several Ray nodes on one host would clash on the proxy port; no KubeRay probes there.
    rendered = render_local_config("both", Path("/models/tiny"), port=8000)
    assert rendered["proxy_location"] == "HeadOnly"


# --- the `ray start` command of every pod ----------------------------------------------------------
def test_every_pods_ray_start_takes_its_flags_and_starts_no_log_monitor(rs):
    """Each group's rayStartParams, as KubeRay turns them into flags, parse as `ray start`'s
    own options (an unknown one fails the pod at start), and no pod starts a log monitor
    (serving.spec.base.LOG_MONITOR: a "false" KubeRay dropped would leave Ray's default, on)."""
    import click
    from ray.scripts.scripts import start

    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        name = group.get("groupName", "head")
        try:
            ctx = start.make_context("ray start", ray_start_flags(group["rayStartParams"]))
        except click.UsageError as e:
            pytest.fail(f"{name}: {e}")
        assert ctx.params["include_log_monitor"] is False, name
