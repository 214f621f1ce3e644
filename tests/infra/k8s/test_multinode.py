"""Multi-node engine replicas in the rendered RayService: pods, devices, placement, NCCL env.

What flows through here: every shipped stack whose engine replicas span nodes (found from its
config, not by name) -> tools.render under mocks -> the RayService's worker groups and its
serveConfigV2. Upstream rules encoded:
- vLLM's Ray executor starts one worker per placement-group bundle that has a GPU
  (vllm/v1/executor/ray_executor.py, 0.32; same in 0.29): bundles are per GPU, never per node.
- Ray Serve's schema takes either one bundle label selector or one per bundle
  (ray/serve/schema.py validate_bundle_label_selector, Ray 2.60).
- NCCL loads libnccl-net-${NCCL_NET_PLUGIN}.so; aws-ofi-nccl installs libnccl-net-ofi.so
  (aws/aws-ofi-nccl src/Makefile.am).
"""

from __future__ import annotations

import pytest
import yaml

from infra import catalog
from infra.k8s.rayservice import EFA_RESOURCE, GPU_RESOURCE
from infra.sizing import nodes as sizing
from tests.conftest import STACKS
from tests.upstream import async_engine_kwargs


def _rayservice(stack) -> dict:
    return next(o for o in stack.manifests().values() if o.get("kind") == "RayService")


def _multinode(rendered_stacks) -> list:
    out = []
    for name in STACKS:
        stack = rendered_stacks[name]
        cfg = stack.config
        for role, spec in cfg.serving.engine_roles().items():
            inst = getattr(cfg.node_pools, role).instance
            if spec.gpus_per_replica > inst.gpus:
                out.append((stack, role))
    return out


def test_a_multinode_stack_ships(rendered_stacks):
    assert _multinode(rendered_stacks), "no shipped stack has an engine replica spanning nodes"


def test_a_replica_spanning_n_nodes_gets_n_pods_with_all_gpus_and_efa(rendered_stacks):
    for stack, role in _multinode(rendered_stacks):
        cfg = stack.config
        spec = cfg.serving.engine_roles()[role]
        inst = getattr(cfg.node_pools, role).instance
        group = next(
            g for g in _rayservice(stack)["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == role
        )
        n = spec.gpus_per_replica // inst.gpus  # whole nodes, by hand
        assert group["minReplicas"] == n * spec.min_replicas
        assert group["maxReplicas"] == n * spec.max_replicas
        assert group["minReplicas"] == sizing.nodes_for(spec.min_replicas, spec.gpus_per_replica, inst.gpus)
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits[GPU_RESOURCE] == str(inst.gpus)
        assert limits[EFA_RESOURCE] == str(inst.efa_interfaces)


def test_the_serve_config_carries_each_layout(rendered_stacks):
    for stack, _ in _multinode(rendered_stacks):
        cfg = stack.config
        args = yaml.safe_load(_rayservice(stack)["spec"]["serveConfigV2"])["applications"][0]["args"]
        for role, spec in cfg.serving.engine_roles().items():
            llm = args[f"{role}_config"]
            kw = llm["engine_kwargs"]
            assert kw["tensor_parallel_size"] == spec.tensor_parallel_size
            assert kw["pipeline_parallel_size"] == spec.pipeline_parallel_size
            assert kw.get("data_parallel_size", 1) == spec.data_parallel_size
            assert kw.get("enable_expert_parallel", False) is (spec.moe_parallelism.value == "expert")
            selectors = llm["deployment_config"]["placement_group_bundle_label_selector"]
            # one per GPU of a Serve replica (TP x PP), all on the role's own pool
            assert len(selectors) == spec.tensor_parallel_size * spec.pipeline_parallel_size
            assert all(s == {cfg.serving.placement.label_key: getattr(cfg.serving.placement, role)} for s in selectors)
            assert "placement_group_strategy" not in llm["deployment_config"]  # Ray refuses it there
            if catalog.lookup(getattr(cfg.node_pools, role).instance_type).efa:
                assert llm["runtime_env"]["env_vars"]["NCCL_NET_PLUGIN"] == "ofi"
        if cfg.serving.prefill.pipeline_parallel_size > 1:
            assert args["prefill_config"]["engine_kwargs"]["kv_transfer_config"]["kv_connector"] == "NixlPushConnector"
            assert args["decode_config"]["engine_kwargs"]["pipeline_parallel_size"] == 1


def test_rendered_multinode_configs_pass_ray_and_vllm_validators(rendered_stacks):
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
    from ray.serve.schema import ServeDeploySchema
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    for stack, _ in _multinode(rendered_stacks):
        serve = yaml.safe_load(_rayservice(stack)["spec"]["serveConfigV2"])
        ServeDeploySchema.model_validate(serve)
        args = serve["applications"][0]["args"]
        pd = PDServingArgs.model_validate(
            {"prefill_config": args["prefill_config"], "decode_config": args["decode_config"]}
        )
        for llm in (pd.prefill_config, pd.decode_config):
            kw = async_engine_kwargs(dict(llm.engine_kwargs))
            kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
            engine = AsyncEngineArgs(model=stack.config.serving.model.source, **kw)
            assert engine.tensor_parallel_size * engine.pipeline_parallel_size == len(
                llm.deployment_config["placement_group_bundle_label_selector"]
            )


@pytest.mark.parametrize("tp, pp, dp", [(8, 2, 1), (1, 1, 16), (8, 1, 2)])
def test_ray_turns_the_rendered_layout_into_per_gpu_bundles(tp, pp, dp):
    """What Ray Serve LLM 2.60 makes of a rendered engine config: TP x PP bundles of one GPU,
    PACK strategy (engines/vllm/vllm_models.py placement_bundles / placement_strategy), matched
    one to one by the label selectors."""
    from ray.serve.llm import LLMConfig

    from serving.spec import ServingSpec, Target

    spec = ServingSpec.model_validate(
        {
            "model": {"id": "m", "source": "deepseek-ai/DeepSeek-V3"},
            "prefill": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
            "decode": {"tensorParallelSize": tp, "dataParallelSize": dp, "moeParallelism": "expert"}
            if pp == 1
            else {"tensorParallelSize": 8},
            "kvTransfer": {"connector": "NixlPushConnector"},
        }
    )
    raw = spec.app_args(Target(accelerator_type="H100"))["prefill_config" if pp > 1 else "decode_config"]
    engine = LLMConfig.model_validate(raw).get_engine_config()
    assert engine.placement_strategy == "PACK"
    assert [b.get("GPU") for b in engine.placement_bundles] == [1] * (tp * pp)
    assert len(raw["deployment_config"]["placement_group_bundle_label_selector"]) == len(engine.placement_bundles)
