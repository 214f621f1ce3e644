"""Graceful drain in the RayService: pods and the old cluster of a switch outlive their streams.

Upstream rules encoded here, each read in the source named:
- KubeRay v1.7.0 `ray-operator/controllers/ray/rayservice_controller.go`: after a NewCluster
  switch (the serve Service's selector moves to the new cluster once all its Serve applications
  are RUNNING, `getAndCheckServeStatus`, `reconcileServices`), `cleanUpRayClusterInstance` sets
  the old cluster's deletion time to now + `spec.rayClusterDeletionDelaySeconds` (default
  `RayClusterDeletionDelayDuration`, 60 s) and deletes it then, waiting for nothing else; the
  field is an int32 (`apis/ray/v1/rayservice_types.go`).
- Ray 2.60 `python/ray/_private/node.py` `_drain_node_before_shutdown`: on SIGTERM, a node
  drains for `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` (default 30 s) before its processes are
  killed; Serve (`serve/_private/deployment_state.py` `_partition_groups_to_stop`) stops a
  replica on a draining node once the node's deadline minus the replica's
  `graceful_shutdown_timeout_s` has come, so a drain at least that long gives every replica its
  full graceful shutdown. The kubelet kills the pod at `terminationGracePeriodSeconds`
  (Kubernetes default 30 s).
- KubeRay v1.7.0 `rayservice_controller.go` `shouldPrepareNewCluster` /
  `isClusterSpecHashEqual`: a change to a pod template builds a new cluster; a change to
  serveConfigV2 alone is applied in place (infra/k8s/upgrades.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from infra import catalog
from infra.k8s.rayservice import RayServiceInputs, rayservice_manifest
from infra.k8s.upgrades import classify
from infra.paths import ROOT
from serving.spec import PROXY_TIMEOUT_MARGIN_S, ResilienceSpec
from serving.spec.drain import (
    K8S_DEFAULT_TERMINATION_GRACE_S,
    KUBERAY_DEFAULT_DELETION_DELAY_S,
    NODE_DRAIN_ENV,
    DrainPlan,
)
from tests.conftest import STACKS

CRD_DIR = Path(os.environ.get("KUBERAY_CRD_DIR", ROOT.parent / "shared" / "schemas" / "kuberay-1.7.0"))


def _crd() -> dict:
    path = CRD_DIR / "ray.io_rayservices.yaml"
    assert path.is_file(), f"KubeRay CRD not found at {path}: set KUBERAY_CRD_DIR (see README)"
    crd = yaml.safe_load(path.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def _rayservice(rendered) -> dict:
    return next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")


def _render(rendered, **resilience) -> dict:
    """The stack's RayService with its resilience deadlines changed (validated by the spec)."""
    cfg = rendered.config
    merged = {**cfg.serving.resilience.model_dump(by_alias=True), **resilience}
    serving = cfg.serving.model_copy(update={"resilience": ResilienceSpec.model_validate(merged)})
    return rayservice_manifest(
        RayServiceInputs(
            name="llm",
            namespace=cfg.namespace,
            image=cfg.ray_image,
            serving=serving,
            instances={r: catalog.lookup(getattr(cfg.node_pools, r).instance_type) for r in serving.engine_roles()},
            working_dir="s3://bucket/serving/x.zip",
            head_service_account="h",
            worker_service_account="w",
            api_keys=None,
        )
    )


def _pods(rs: dict) -> dict[str, dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return pods


def _node_drain_s(pod: dict) -> float:
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    return float(env[NODE_DRAIN_ENV])


def _serve(rs: dict) -> tuple[float, list[float]]:
    """(Serve's proxy request timeout, every deployment's graceful_shutdown_timeout_s)."""
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    timeouts = []
    # One application (one model), or a front door plus one application per model.
    for app in serve["applications"]:
        args = app["args"]
        engines = [args[k] for k in ("prefill_config", "decode_config") if k in args] + list(
            args.get("llm_configs", [])
        )
        if "ingress_deployment_config" in args:
            timeouts.append(args["ingress_deployment_config"]["graceful_shutdown_timeout_s"])
        timeouts += [e["deployment_config"]["graceful_shutdown_timeout_s"] for e in engines]
    return serve["http_options"]["request_timeout_s"], timeouts


@pytest.mark.parametrize("name", STACKS)
def test_the_old_cluster_outlives_every_stream_it_holds_at_the_switch(rendered_stacks, name):
    rs = _rayservice(rendered_stacks[name])
    proxy_timeout, deployments = _serve(rs)
    delay = rs["spec"]["rayClusterDeletionDelaySeconds"]
    # A stream that reached an old-cluster proxy just before the selector moved ends within the
    # proxy's request timeout; KubeRay's own 60 s allowance for the switch stays on top.
    assert delay >= proxy_timeout + KUBERAY_DEFAULT_DELETION_DELAY_S
    assert delay >= max(deployments) + KUBERAY_DEFAULT_DELETION_DELAY_S


@pytest.mark.parametrize("name", STACKS)
def test_every_ray_pod_drains_its_streams_before_kubernetes_kills_it(rendered_stacks, name):
    rs = _rayservice(rendered_stacks[name])
    proxy_timeout, deployments = _serve(rs)
    for group, pod in _pods(rs).items():
        drain = _node_drain_s(pod)
        # Every pod may run a proxy holding a client's stream; Serve stops a replica on a draining
        # node at (deadline - its graceful timeout), so the drain covers the longest of them.
        assert drain >= proxy_timeout and drain >= max(deployments), group
        # The kubelet waits for the drain and for Ray's teardown after it.
        assert pod["terminationGracePeriodSeconds"] >= drain + K8S_DEFAULT_TERMINATION_GRACE_S, group


def test_the_drain_follows_total_timeout_and_stays_schema_valid(rendered_stacks):
    schema = _crd()
    rendered = rendered_stacks[STACKS[0]]
    short, long = (_render(rendered, totalTimeoutS=t) for t in (300, 3600))
    for rs in (short, long):
        jsonschema.validate(rs, schema)
    assert long["spec"]["rayClusterDeletionDelaySeconds"] - short["spec"]["rayClusterDeletionDelaySeconds"] == 3300
    for group, pod in _pods(long).items():
        assert pod["terminationGracePeriodSeconds"] > _pods(short)[group]["terminationGracePeriodSeconds"], group
        assert _node_drain_s(pod) >= 3600 + PROXY_TIMEOUT_MARGIN_S, group


def test_tuning_the_deadline_within_a_step_is_an_in_place_serve_update(rendered_stacks):
    """Pod-level drain values are rounded up to a step: a small change to totalTimeoutS does not
    make KubeRay build a second cluster; a large one does, and the preview says so."""
    rendered = rendered_stacks[STACKS[0]]
    before = _render(rendered, totalTimeoutS=600)
    assert classify(before, _render(rendered, totalTimeoutS=650)).kind == "serve-in-place"
    assert classify(before, _render(rendered, totalTimeoutS=1800)).kind == "new-cluster"


def test_the_longest_deadline_the_spec_allows_fits_kubernetes_and_kuberay(rendered_stacks):
    """No Kubernetes or KubeRay limit is reachable: the spec's largest totalTimeoutS renders a
    RayService the CRD accepts, with a deletion delay inside its int32."""
    schema = _crd()
    longest = ResilienceSpec.model_fields["total_timeout_s"].metadata
    le = next(m.le for m in longest if hasattr(m, "le"))
    rs = _render(rendered_stacks[STACKS[0]], totalTimeoutS=le)
    jsonschema.validate(rs, schema)
    delay_schema = schema["properties"]["spec"]["properties"]["rayClusterDeletionDelaySeconds"]
    assert delay_schema["format"] == "int32"
    assert rs["spec"]["rayClusterDeletionDelaySeconds"] <= 2**31 - 1


def test_a_deadline_kuberay_cannot_hold_is_refused_with_one_line():
    # Past the spec's own bound (model_construct skips it), as a guard should the bound move.
    beyond = ResilienceSpec.model_construct(**{**ResilienceSpec().model_dump(), "total_timeout_s": 2.0**31})
    plan = DrainPlan.for_deadlines(beyond, PROXY_TIMEOUT_MARGIN_S)
    with pytest.raises(ValueError, match=r"^serving\.resilience\.totalTimeoutS: .*int32") as err:
        _ = plan.cluster_deletion_delay_s
    assert "\n" not in str(err.value)


def test_a_crd_rejects_a_negative_delay(rendered_stacks):
    """The schema check above is not a rubber stamp."""
    bad = copy.deepcopy(_rayservice(rendered_stacks[STACKS[0]]))
    bad["spec"]["rayClusterDeletionDelaySeconds"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _crd())
