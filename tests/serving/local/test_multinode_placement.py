"""A multi-node engine's placement on a real (local) Ray cluster, from the rendered config.

What flows through here: a P/D spec with prefill TP 2 x PP 2 (the shape of the cloud's TP 8 x
PP 2 on 8-GPU nodes, scaled to 2-GPU nodes) rendered for a GPU target -> Ray Serve LLM's own
`LLMServer.get_deployment_options` (the placement-group bundles and strategy Serve will ask
for) -> a placement group created with those bundles, that strategy and the rendered bundle
label selectors on a local Ray cluster whose nodes declare GPUs (Ray counts them; no GPU is
used) -> which node each bundle landed on. vLLM cannot run PP 2 on this CPU (see
docs/multinode.md: its CPU worker never allocates the pipeline's intermediate tensors), so this
is the part of the layout that runs here: Ray places a two-node replica on two distinct nodes
of its own pool and nowhere else.
"""

from __future__ import annotations

import os

import pytest

from serving.spec import ServingSpec, Target

LABEL = "ray.io/node-group"


@pytest.mark.e2e
def test_prefill_tp2_pp2_lands_on_two_distinct_prefill_nodes():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster
    from ray.llm._internal.serve.core.server.llm_server import LLMServer
    from ray.serve.llm import LLMConfig
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    spec = ServingSpec.model_validate(
        {
            "model": {"id": "m", "source": "deepseek-ai/DeepSeek-V3"},
            "prefill": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
            "decode": {"tensorParallelSize": 2},
            "kvTransfer": {"connector": "NixlPushConnector"},
        }
    )
    raw = spec.app_args(Target(accelerator_type="H100"))["prefill_config"]
    accel = {"accelerator_type:H100": 1}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {LABEL: "head"}})
    try:
        # two 2-GPU prefill nodes, and a decode node with room for the whole replica
        prefill_ids = {
            cluster.add_node(num_cpus=2, num_gpus=2, resources=accel, labels={LABEL: "prefill"}).node_id
            for _ in range(2)
        }
        decode = cluster.add_node(num_cpus=4, num_gpus=4, resources=accel, labels={LABEL: "decode"})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        opts = LLMServer.get_deployment_options(LLMConfig.model_validate(raw))
        bundles, strategy = opts["placement_group_bundles"], opts["placement_group_strategy"]
        selectors = opts["placement_group_bundle_label_selector"]
        assert strategy == "PACK"
        assert [b.get("GPU") for b in bundles] == [1, 1, 1, 1]  # one per GPU worker, TP x PP
        assert len(selectors) == len(bundles)
        pg = placement_group(bundles, strategy=strategy, bundle_label_selector=selectors)
        assert pg.wait(60), "the placement group was not placed"
        nodes = list(placement_group_table(pg)["bundles_to_node_id"].values())
        assert set(nodes) == prefill_ids, "the replica must span both prefill nodes"
        assert decode.node_id not in nodes
        assert sorted(nodes.count(n) for n in set(nodes)) == [2, 2]  # a whole node each
        remove_placement_group(pg)
    finally:
        ray.shutdown()
        cluster.shutdown()
