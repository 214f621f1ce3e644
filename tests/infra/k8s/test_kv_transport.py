"""The KV cache's path: NIXL's backend follows the nodes' fabric, from the instance catalog.

Upstream rules encoded here:
- vLLM's NixlConnector uses `kv_connector_extra_config.backends`, default ["UCX"]
  (vllm-project/vllm v0.29.0 and 0.32.0, `vllm/distributed/kv_transfer/kv_connector/v1/nixl/
  base_worker.py`, `get_from_extra_config("backends", ["UCX"])`).
- NIXL's UCX backend gets no RDMA on EFA and silently uses TCP (ai-dynamo/nixl#909,
  ai-dynamo/dynamo#4185); EFA deployments select LIBFABRIC (ai-dynamo/dynamo
  tests/deploy/efa/disagg-efa.yaml: `"kv_connector_extra_config":{"backends":["LIBFABRIC"]}`).
- EFA has no loopback between prefill and decode on one node (ai-dynamo/dynamo#7764): the
  two roles must never share a node.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from infra import catalog
from infra.k8s import rayservice
from infra.k8s.ray_env import efa_engine_env
from infra.k8s.rayservice import RayServiceInputs
from local import config as local_config
from tests.conftest import STACKS


def _rayservice(rendered) -> dict:
    return next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")


def _nixl(kv: dict) -> dict:
    """The NIXL config itself: a pool with a KV offload tier nests it first under
    MultiConnector (serving/spec/offload.py)."""
    if kv["kv_connector"] == "MultiConnector":
        return kv["kv_connector_extra_config"]["connectors"][0]
    return kv


def _kv_configs(serve: dict) -> dict[str, dict]:
    """Every P/D side's NIXL config, by "<application> <side>" (one application per
    model with serving.models)."""
    return {
        f"{app['name']} {side}": _nixl(app["args"][side]["engine_kwargs"]["kv_transfer_config"])
        for app in serve["applications"]
        for side in ("prefill_config", "decode_config")
        if side in app["args"]
    }


def test_every_stack_selects_the_backend_its_fabric_calls_for(rendered_stacks) -> None:
    seen = set()
    for name in STACKS:
        r = rendered_stacks[name]
        efa = r.config.node_pools.prefill.instance.efa
        serve = yaml.safe_load(_rayservice(r)["spec"]["serveConfigV2"])
        kvs = _kv_configs(serve)
        assert kvs, f"{name}: no KV transfer configured"
        want = ["LIBFABRIC"] if efa else ["UCX"]
        for side, kv in kvs.items():
            assert kv["kv_connector_extra_config"]["backends"] == want, f"{name} {side}"
        seen.add(efa)
    assert seen == {True, False}, "the shipped stacks should cover both fabrics"


def test_the_local_run_keeps_ucx() -> None:
    serve = local_config.render_local_config("disaggregated", Path("/tmp/model"), port=8000)
    for kv in _kv_configs(serve).values():
        assert kv["kv_connector_extra_config"]["backends"] == ["UCX"]


def test_efa_environment_follows_the_catalog() -> None:
    p5, p4de, g5 = (catalog.lookup(n) for n in ("p5.48xlarge", "p4de.24xlarge", "g5.xlarge"))
    assert efa_engine_env([g5]) == {}
    env = efa_engine_env([p5, p4de])
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
    no_rdma = dataclasses.replace(p5, name="x.efa-without-rdma", efa_rdma=False)
    assert "FI_EFA_USE_DEVICE_RDMA" not in efa_engine_env([p5, no_rdma])


def _inputs(rendered, **instances: str) -> RayServiceInputs:
    cfg = rendered.config
    inst = {r: catalog.lookup(getattr(cfg.node_pools, r).instance_type) for r in cfg.serving.engine_roles()}
    inst.update({r: catalog.lookup(t) for r, t in instances.items()})
    return RayServiceInputs(
        name="llm",
        namespace=cfg.namespace,
        image=cfg.ray_image,
        serving=cfg.serving,
        instances=inst,
        working_dir="s3://bucket/serving/x.zip",
        head_service_account="h",
        worker_service_account="w",
        api_keys=None,
    )


def test_p5_prefill_with_p4de_decode(rendered_stacks) -> None:
    """Heterogeneous EFA pools: both sides LIBFABRIC, each engine asks for its own GPU type."""
    inp = _inputs(rendered_stacks["prod"], prefill="p5.48xlarge", decode="p4de.24xlarge")
    serve = yaml.safe_load(rayservice.serve_config_yaml(inp))
    args = serve["applications"][0]["args"]
    assert args["prefill_config"]["accelerator_type"] == "H100"
    assert args["decode_config"]["accelerator_type"] == "A100"
    for kv in _kv_configs(serve).values():
        assert kv["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]
    groups = {
        g["groupName"]: g for g in rayservice.rayservice_manifest(inp)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    }
    assert (
        groups["prefill"]["template"]["spec"]["containers"][0]["resources"]["limits"][rayservice.EFA_RESOURCE] == "32"
    )
    assert groups["decode"]["template"]["spec"]["containers"][0]["resources"]["limits"][rayservice.EFA_RESOURCE] == "4"


def test_prefill_and_decode_never_share_a_node(rendered_stacks) -> None:
    """Each role's pods select only their own pool's nodes (by role label), so no node has both."""
    for name in STACKS:
        groups = _rayservice(rendered_stacks[name])["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        selectors = {g["groupName"]: g["template"]["spec"]["nodeSelector"] for g in groups}
        if {"prefill", "decode"} <= set(selectors):
            p, d = selectors["prefill"], selectors["decode"]
            shared = set(p) & set(d)
            assert any(p[k] != d[k] for k in shared), f"{name}: {p} and {d} could pick the same node"
