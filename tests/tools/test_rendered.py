"""Reading a render back: the engines of a Serve config (role, parallelism, the Ray group label
they are placed by), the fallback provider's host, and the node group a node selector lands on."""

from __future__ import annotations

from tools.rendered import Rendered, engines, fallback_host, ingress

LABEL = "pd-inference/node-group"


def _engine(model, role_label, tp=1, pp=1, kv_role=None):
    kw = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    if kv_role:
        kw["kv_transfer_config"] = {"kv_role": kv_role, "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}}
    return {
        "model_loading_config": {"model_id": model},
        "engine_kwargs": kw,
        "deployment_config": {"placement_group_bundle_label_selector": [{LABEL: role_label}] * (tp * pp)},
    }


SERVE = {
    "applications": [
        {
            "name": "llm",
            "args": {
                "ingress_deployment_config": {
                    "autoscaling_config": {"min_replicas": 2, "max_replicas": 4},
                    "user_config": {"fallback": {"base_url": "https://api.provider.example/v1"}},
                },
                "prefill_config": _engine("m", "prefill", tp=8, pp=2, kv_role="kv_producer"),
                "decode_config": _engine("m", "decode", tp=8, kv_role="kv_consumer"),
            },
        },
        {"name": "llm-model-q", "args": {"llm_configs": [_engine("q", "general")]}},
    ]
}


def test_the_engines_of_a_serve_config_in_the_requests_order():
    found = engines(SERVE)
    assert [(e.app, e.model, e.role) for e in found] == [
        ("llm", "m", "decode"),
        ("llm", "m", "prefill"),
        ("llm-model-q", "q", "aggregated"),
    ]
    decode, prefill, general = found
    assert prefill.parallel == "vLLM TP 8 x PP 2, KV producer" and decode.parallel == "vLLM TP 8, KV consumer"
    assert dict(general.selector) == {LABEL: "general"} and general.parallel == "vLLM TP 1"
    assert prefill.kv_backends == "LIBFABRIC"


def test_the_ingress_replicas_and_the_fallback_host():
    assert ingress(SERVE) == ("llm", "2-4")
    assert fallback_host(SERVE) == "api.provider.example"
    assert fallback_host({"applications": [{"name": "x", "args": {}}]}) is None


def test_a_node_selector_lands_on_the_node_group_whose_labels_and_instance_type_match():
    def ng(name, role, itype):
        inputs = {"labels": {"pd-inference/role": role}, "instanceTypes": [itype]}
        return {"type": "eks:index:ManagedNodeGroup", "name": name, "parent": None, "inputs": inputs}

    r = Rendered("s", [ng("a", "decode", "p5.48xlarge"), ng("b", "decode", "p4de.24xlarge")])
    assert r.node_group({"pd-inference/role": "decode", "node.kubernetes.io/instance-type": "p4de.24xlarge"}) == "b"
    assert r.node_group({"pd-inference/role": "prefill"}) is None
    assert r.node_group({}) is None  # no selector: no particular group
