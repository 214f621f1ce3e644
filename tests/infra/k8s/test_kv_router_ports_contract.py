"""Every socket Ray's KV-aware router binds in a prefill pod is one the pod declares.

Contract: Ray 2.60 `ray/llm/_internal/serve/routing_policies/kv_aware/vllm/kv_events.py`
(`configure_kv_events_for_kv_routing`, `assign_replica_kv_events_endpoint`,
`get_token_channel_endpoints`) and `kv_aware/constants.py`: per KV-routed replica, the engine's
KV-event PUB socket at `KV_EVENTS_PORT_BASE` + the replica's node-local rank, its replay socket
1000 above, and the prompt-token PULL socket at `KV_TOKEN_PORT_BASE` + the node-local rank; with
data parallelism vLLM offsets the event sockets by the global `dp_rank` instead. Ray's own
functions are run on the rendered Serve config, once per node-local rank a pod can hold; the
ports they bind must all be declared on the prefill pool's container (infra/k8s/rayservice.py,
from serving/spec/render.py `kv_bound_ports`).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from tools import render, stackfile

STACK = "prod"


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _kv_routed(tensor_parallel_size: int) -> dict:
    """prod's RayService with the prefill tier KV-routed, at this prefill TP (p5: 8 GPUs a pod)."""
    values, secrets, others = copy.deepcopy(stackfile.read(STACK))
    values["serving"]["prefill"] = {
        **values["serving"]["prefill"],
        "router": "kv-aware",
        "tensorParallelSize": tensor_parallel_size,
    }
    rendered = render.render_parsed(STACK, (values, secrets, others), stand_in_secrets=True)
    return next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")


def _prefill_config(rs: dict) -> dict:
    apps = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    found = [a["args"]["prefill_config"] for a in apps if "prefill_config" in (a.get("args") or {})]
    assert len(found) == 1
    return found[0]


def _bound_by_ray(prefill_config: dict, local_ranks: int, monkeypatch) -> set[int]:
    """The ports Ray's own code binds for each node-local rank 0..local_ranks-1 of the pod."""
    import ray
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.llm._internal.serve.routing_policies.kv_aware.vllm import kv_events

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    bound: set[int] = set()
    for rank in range(local_ranks):
        monkeypatch.setattr(kv_events, "_get_replica_rank", lambda rank=rank: rank)
        cfg = LLMConfig(**copy.deepcopy(prefill_config))
        kv_events.configure_kv_events_for_kv_routing(cfg)  # what Ray's builder does for a KVAwareRouter
        kv_events.assign_replica_kv_events_endpoint(cfg)  # what each replica does at start
        events = cfg.engine_kwargs["kv_events_config"]
        bound |= {_port(events["endpoint"]), _port(events["replay_endpoint"])}
        token_bind, _ = kv_events.get_token_channel_endpoints(cfg)
        bound.add(_port(token_bind))
    return bound


@pytest.mark.parametrize("tp", [8, 4])
def test_every_port_rays_kv_router_binds_is_declared_on_the_prefill_pod(monkeypatch, tp):
    rs = _kv_routed(tp)
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    container = groups["prefill"]["template"]["spec"]["containers"][0]
    declared = {p["containerPort"] for p in container.get("ports", [])}
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    bound = _bound_by_ray(_prefill_config(rs), gpus // tp, monkeypatch)
    assert len(bound) == 3 * (gpus // tp)  # events, replay, tokens per replica: none shared
    assert bound <= declared, sorted(bound - declared)
    names = [p["name"] for p in container["ports"]]
    assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)  # IANA_SVC_NAME
