"""Contract: what Ray's own autoscaler does with our RayService, for one more engine replica.

Upstream rules, run as upstream code (Ray 2.60, installed for the serving tests):
- ray/autoscaler/_private/kuberay/autoscaling_config.py `_derive_autoscaling_config_from_ray_cr`:
  a worker group's Ray resources come from CPU/GPU/memory and the group's `resources` field
  (or rayStartParams.resources); its labels from the group's `labels` field.
- ray/autoscaler/v2/scheduler.py `ResourceDemandScheduler`: places a gang (placement group)
  demand on node types whose resources AND labels satisfy it, else reports it infeasible.
- ray/llm/_internal/serve/engines/vllm/vllm_models.py `VLLMEngineConfig.placement_bundles`:
  an engine replica's bundles ask for `GPU: 1` and `accelerator_type:<X>: 0.001` each.
The scheduler is fed the demand of one engine replica of each role, built from the rendered
Serve config by Ray Serve LLM itself, and must answer "add one pod of that role's group".
"""

from __future__ import annotations

import copy
import logging

import pytest
import yaml

from serving.spec import MODEL_APP_PREFIX
from tests.conftest import STACKS

pytestmark = pytest.mark.filterwarnings("ignore")


def _rayservice(rendered) -> dict:
    return next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")


def _node_types(rayservice: dict, *, from_zero: bool = True, strip_resources: bool = False):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

    spec = copy.deepcopy(rayservice["spec"]["rayClusterConfig"])
    for group in spec["workerGroupSpecs"]:
        if from_zero:  # no nodes yet: every node the scheduler adds is for the demand
            group["minReplicas"] = 0
        if strip_resources:
            group.pop("resources", None)
    cr = {"metadata": {"name": rayservice["metadata"]["name"], "namespace": "llm"}, "spec": spec}
    config = _derive_autoscaling_config_from_ray_cr(cr)
    return AutoscalingConfig(config).get_node_type_configs(), config["max_workers"]


def _engine_config(rayservice: dict, role: str, model_id: str | None = None) -> dict:
    """A role's LLMConfig as rendered: the one application's args, or with several models
    (serving.models) the args of that model's own application."""
    apps = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    args = (
        apps[0]["args"]
        if model_id is None
        else next(a for a in apps if a["name"] == MODEL_APP_PREFIX + model_id)["args"]
    )
    return args[f"{role}_config"] if f"{role}_config" in args else args["llm_configs"][0]


def _replica_gang(rayservice: dict, role: str, model_id: str | None = None):
    """One engine replica's placement-group demand, as Ray Serve LLM builds it."""
    from ray.autoscaler.v2.utils import ResourceRequestUtil
    from ray.core.generated.autoscaler_pb2 import GangResourceRequest
    from ray.core.generated.common_pb2 import LabelSelectorOperator
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig
    from ray.serve.llm import LLMConfig

    raw = _engine_config(rayservice, role, model_id)
    llm = LLMConfig.model_validate(raw)
    bundles = VLLMEngineConfig.from_llm_config(llm).placement_bundles
    selectors = raw["deployment_config"]["placement_group_bundle_label_selector"]
    op = LabelSelectorOperator.Value("LABEL_OPERATOR_IN")
    requests = [
        ResourceRequestUtil.make(dict(b), label_selectors=[[(k, op, [v]) for k, v in sel.items()]])
        for b, sel in zip(bundles, selectors, strict=True)
    ]
    return GangResourceRequest(requests=requests, details=f"{role} replica")


def _schedule(node_types, max_workers, gangs):
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest

    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)
    reply = ResourceDemandScheduler().schedule(
        SchedulingRequest(
            disable_launch_config_check=True,
            node_type_configs=node_types,
            max_num_nodes=max_workers,
            gang_resource_requests=gangs,
        )
    )
    launched: dict[str, int] = {}
    for launch in reply.to_launch:
        launched[launch.instance_type] = launched.get(launch.instance_type, 0) + launch.count
    return launched, [g.details for g in reply.infeasible_gang_resource_requests]


@pytest.mark.parametrize("stack_name", STACKS)
def test_one_more_replica_adds_one_pod_of_its_own_group(stack_name, rendered_stacks):
    from infra.sizing import nodes as sizing

    rendered = rendered_stacks[stack_name]
    rs = _rayservice(rendered)
    node_types, max_workers = _node_types(rs)
    serving = rendered.config.serving
    # Every model's roles (one-model stacks: the one model; its pools are named after the roles).
    for model in serving.served:
        model_id = model.model.id if serving.many else None
        for role, spec in model.engine_roles().items():
            pool = model.pool_of(role)
            inst = rendered.config.node_pools[pool].instance
            launched, infeasible = _schedule(node_types, max_workers, [_replica_gang(rs, role, model_id)])
            assert infeasible == [], f"{stack_name}: Ray's autoscaler finds a {role} replica infeasible"
            # One Serve replica is one engine rank (TP x PP GPUs); with data parallelism a DP group
            # is data_parallel_size such replicas, each a gang of its own.
            expected = sizing.nodes_for(1, spec.gpus_per_rank, inst.gpus)
            assert launched == {pool: expected}, f"{stack_name}: a {model.model.id} {role} replica launched {launched}"


@pytest.mark.parametrize("stack_name", STACKS)
def test_the_groups_advertise_what_the_engines_ask_for(stack_name, rendered_stacks):
    rs = _rayservice(rendered_stacks[stack_name])
    node_types, _ = _node_types(rs)
    config = rendered_stacks[stack_name].config
    for role in config.serving.engine_roles():
        inst = getattr(config.node_pools, role).instance
        assert node_types[role].resources.get(f"accelerator_type:{inst.ray_accelerator}") == 1
        assert node_types[role].resources["GPU"] == inst.gpus
        assert node_types[role].labels == {config.serving.placement.label_key: getattr(config.serving.placement, role)}


def test_without_the_accelerator_resource_the_demand_is_infeasible(rendered_stacks):
    """The test can fail: the groups as KubeRay's default would build them (no `resources`)."""
    rs = _rayservice(rendered_stacks["prod"])
    node_types, max_workers = _node_types(rs, strip_resources=True)
    launched, infeasible = _schedule(node_types, max_workers, [_replica_gang(rs, "decode")])
    assert infeasible == ["decode replica"] and launched == {}


def test_autoscaler_v2_and_safe_to_evict(rendered_stacks):
    from infra.k8s.labels import SAFE_TO_EVICT

    for name, rendered in rendered_stacks.items():
        cluster = _rayservice(rendered)["spec"]["rayClusterConfig"]
        assert cluster["enableInTreeAutoscaling"] is True, name
        # KubeRay 1.7 utils.IsAutoscalingV2Enabled: autoscalerOptions.version == "v2".
        assert cluster["autoscalerOptions"]["version"] == "v2", name
        templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        for t in templates:
            assert t["metadata"]["annotations"].items() >= SAFE_TO_EVICT.items(), name
            # KubeRay 1.7 validation: autoscaler v2 wants restartPolicy unset or Never.
            assert t["spec"].get("restartPolicy") in (None, "Never"), name
