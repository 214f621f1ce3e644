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
  (default 8000). Ray 2.60 `serve/_private/controller.py` `_update_proxy_nodes`: with
  proxy_location EveryNode a proxy runs on the head and on every node holding a replica; with
  HeadOnly only on the head. A worker is Ready only if a proxy runs on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.local.config import render_local_config
from serving.spec import SERVE_PORT
from tests.conftest import STACKS
from tests.upstream import (
    RAY_SERVE_LABEL,
    incremental_upgrade,
    rayservice_pod,
    selects,
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
    assert svc["spec"]["ports"][0].get("targetPort", SERVE_PORT) == SERVE_PORT


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


# --- item 4: workers become Ready, so the Service's worker endpoints answer ----------------------------
def _proxy_nodes(proxy_location: str, replica_nodes: set[str]) -> set[str]:
    """Ray 2.60 Serve controller: which nodes run an HTTP proxy."""
    if proxy_location == "HeadOnly":
        return {"head"}
    if proxy_location == "EveryNode":
        return {"head", *replica_nodes}
    return set()  # Disabled


def _replica_groups(rs: dict) -> set[str]:
    """Worker groups that Serve places engine replicas on (the placement label selectors)."""
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    args = config["applications"][0]["args"]
    engines = [args[k] for k in ("prefill_config", "decode_config") if k in args] + list(args.get("llm_configs", []))
    labels = {}
    for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        labels.update({(k, v): g["groupName"] for k, v in g["labels"].items()})
    groups = set()
    for engine in engines:
        for selector in engine["deployment_config"]["placement_group_bundle_label_selector"]:
            groups |= {labels[(k, v)] for k, v in selector.items() if (k, v) in labels}
    return groups


def _worker_ready(rs: dict, group: str, proxy_location: str) -> bool:
    pod = rayservice_pod(rs, _cluster(rs, "x7k2p"), group)
    probe = pod["spec"]["containers"][0]["readinessProbe"]
    needs_proxy = [c for c in probe.get("checks", []) if c.startswith("serve-proxy:")]
    if not needs_proxy:
        return True  # our own probe (none is set today: KubeRay injects its own)
    port = int(needs_proxy[0].split(":")[1].split("/")[0])
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    proxy_here = group in _proxy_nodes(proxy_location, _replica_groups(rs))
    return proxy_here and config["http_options"]["port"] == port


def test_every_worker_group_becomes_ready(rs):
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert config["proxy_location"] == "EveryNode"
    assert set(_groups(rs)) <= _replica_groups(rs), "a worker group without replicas would run no proxy"
    for group in _groups(rs):
        assert _worker_ready(rs, group, config["proxy_location"]), group


def test_workers_are_serve_endpoints_so_each_must_run_a_proxy(rs):
    cluster = _cluster(rs, "x7k2p")
    svc = serve_service(rs, cluster)
    assert svc is not None
    for group in _groups(rs):
        worker = rayservice_pod(rs, cluster, group)
        assert selects(svc["spec"]["selector"], worker["metadata"]["labels"]), group


def test_mirror_sanity_head_only_would_leave_workers_unready(rs):
    """Mirror sanity test (this module's _worker_ready alone): with HeadOnly proxies no worker
    gets Ready. test_every_worker_group_becomes_ready applies it to the rendered proxy_location."""
    for group in _groups(rs):
        assert not _worker_ready(rs, group, "HeadOnly")


def test_local_serve_config_keeps_head_only():
    # Several Ray nodes on one host would clash on the proxy port; no KubeRay probes there.
    rendered = render_local_config("both", Path("/models/tiny"), port=8000)
    assert rendered["proxy_location"] == "HeadOnly"
