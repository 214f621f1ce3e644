"""The node autoscaler under mocks: every stack has one, with its own least-privilege role,
scaling only the GPU pools, whose desired size Pulumi leaves alone.

Upstream rules encoded here (kubernetes/autoscaler, tag cluster-autoscaler-1.35.2):
- cloudprovider/aws/aws_manager.go `parseASGAutoDiscoverySpec`: `asg:tag=k=v,...` selects the
  Auto Scaling groups carrying ALL those tags; `buildNodeFromTemplate`: the template node of an
  empty group has the instance type's CPU, memory and `nvidia.com/gpu`, the capacity named by
  `k8s.io/cluster-autoscaler/node-template/resources/<name>` tags (ASG tags, or the EKS node
  group's tags read through DescribeNodegroup), the node group's labels and its taints
  (`aws_wrapper.go getManagedNodegroupInfo`, EKS `NO_SCHEDULE` -> `NoSchedule`).
- cloudprovider/aws/README.md: the IAM actions the autoscaler calls.
- cloudprovider/aws/aws_cloud_provider.go `GPULabel` (k8s.amazonaws.com/accelerator) and
  processors/customresources/gpu_processor.go `FilterOutNodesWithUnreadyResources` (chart
  cluster-autoscaler-9.59.0 runs this 1.35 line): a new node with the label and no GPU
  allocatable yet is capacity still coming; without the label it is a ready node without GPUs
  and the pending engine pod makes the autoscaler add another (its AWS README, "Special note on
  GPU instances"). Reproduced in tests.upstream.ca_counts_node_ready.
pulumi/pulumi-eks `ManagedNodeGroup.ignoreScalingChanges`: ignore desiredSize changes made
by the Cluster Autoscaler.
"""

from __future__ import annotations

import json

import pytest

from infra import catalog, versions
from infra.components.node_autoscaler import (
    ASG_CLUSTER_TAG,
    ASG_NODEGROUP_TAG,
    NAMESPACE,
    SCALE_ACTIONS,
    SERVICE_ACCOUNT,
)
from infra.k8s.labels import INSTANCE_TYPE_LABEL, ROLE_LABEL, SYSTEM_ROLE
from infra.k8s.node_template import NODE_TEMPLATE_RESOURCES
from tests.conftest import STACKS
from tests.upstream import CA_AWS_GPU_LABEL, ca_counts_node_ready

MNG = "eks:index:ManagedNodeGroup"
CHART = "kubernetes:helm.sh/v4:Chart"
ROLE = "aws:iam/role:Role"
POLICY = "aws:iam/rolePolicy:RolePolicy"
ASSOC = "aws:eks/podIdentityAssociation:PodIdentityAssociation"
EKS_EFFECTS = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _gpu_groups(stack) -> dict:
    # By role label (the pool's name): a pool with a pinned amiId carries no `gpu` flag (amiId
    # excludes it). Every nodePools entry is a GPU node group (platform: prefill, decode, general).
    pools = set(stack.config.node_pools.names())
    return {
        r.inputs["labels"][ROLE_LABEL]: r
        for r in stack.result.of_type(MNG)
        if (r.inputs.get("labels") or {}).get(ROLE_LABEL) in pools
    }


def _chart(stack):
    return next(r for r in stack.result.of_type(CHART) if r.inputs["chart"] == "cluster-autoscaler")


def _discovery_specs(values: dict) -> list[dict[str, str]]:
    """The `--node-group-auto-discovery` flags the chart renders, parsed as the autoscaler does."""
    specs = []
    if values.get("autoDiscovery", {}).get("clusterName"):
        specs.append("asg:tag=" + ",".join(values["autoDiscovery"]["tags"]))
    prefix = "--node-group-auto-discovery="
    specs += [a[len(prefix) :] for a in values.get("customArgs", []) if a.startswith(prefix)]
    parsed = []
    for spec in specs:
        kind, _, param = spec.partition(":")
        key, _, tags = param.partition("=")
        assert kind == "asg" and key == "tag", spec
        parsed.append(dict([*t.split("=", 1), ""][:2] for t in tags.split(",")))
    return parsed


def test_every_stack_runs_the_pinned_autoscaler_on_the_system_nodes(stack):
    chart = _chart(stack)
    assert chart.inputs["version"] == versions.CLUSTER_AUTOSCALER.version
    assert chart.inputs["repositoryOpts"]["repo"] == versions.CLUSTER_AUTOSCALER.repo
    assert chart.inputs["namespace"] == NAMESPACE
    values = chart.inputs["values"]
    assert values["nodeSelector"] == {ROLE_LABEL: SYSTEM_ROLE}
    assert values["image"]["tag"] == versions.cluster_autoscaler_tag(stack.config.kubernetes_version)
    assert values["rbac"]["serviceAccount"]["name"] == SERVICE_ACCOUNT
    assert values["containerSecurityContext"]["allowPrivilegeEscalation"] is False


def test_it_discovers_exactly_the_gpu_node_groups(stack):
    """Each discovery spec matches one GPU node group's ASG (EKS tags it eks:nodegroup-name)."""
    specs = _discovery_specs(_chart(stack).inputs["values"])
    gpu_names = sorted(g.inputs["nodeGroupName"] for g in _gpu_groups(stack).values())
    assert sorted(s[ASG_NODEGROUP_TAG] for s in specs) == gpu_names
    system = [r for r in stack.result.of_type(MNG) if (r.inputs.get("labels") or {}).get(ROLE_LABEL) == SYSTEM_ROLE]
    assert all(s[ASG_NODEGROUP_TAG] != system[0].inputs["nodeGroupName"] for s in specs)


def test_its_role_is_its_own_and_least_privilege(stack):
    assoc = [a for a in stack.result.of_type(ASSOC) if a.inputs["serviceAccount"] == SERVICE_ACCOUNT]
    assert len(assoc) == 1 and assoc[0].inputs["namespace"] == NAMESPACE
    role = stack.result.one(ROLE, "node-autoscaler-role")
    trust = json.loads(role.inputs["assumeRolePolicy"])
    assert [s["Principal"] for s in trust["Statement"]] == [{"Service": "pods.eks.amazonaws.com"}]
    policy = json.loads(stack.result.one(POLICY, "node-autoscaler-policy").inputs["policy"])
    gpu_names = sorted(g.inputs["nodeGroupName"] for g in _gpu_groups(stack).values())
    cluster = f"pd-inference-{stack.stack}"
    writes = []
    for st in policy["Statement"]:
        actions = st["Action"]
        assert "*" not in actions and not any(a.endswith(":*") for a in actions)
        mutating = [a for a in actions if not a.split(":")[1].startswith(("Describe", "Get"))]
        if mutating:
            writes.append(st)
            assert sorted(mutating) == sorted(SCALE_ACTIONS)
            cond = st["Condition"]["StringEquals"]
            assert cond[f"autoscaling:ResourceTag/{ASG_CLUSTER_TAG}"] == cluster
            assert sorted(cond[f"autoscaling:ResourceTag/{ASG_NODEGROUP_TAG}"]) == gpu_names
        if "eks:DescribeNodegroup" in actions:
            assert sorted(st["Resource"]) == sorted(f"arn:aws:eks:*:*:nodegroup/{cluster}/{n}/*" for n in gpu_names)
    assert len(writes) == 1


def test_gpu_pools_leave_their_desired_size_to_the_autoscaler(stack):
    for role, group in _gpu_groups(stack).items():
        assert group.inputs["ignoreScalingChanges"] is True, role
        pool = getattr(stack.config.node_pools, role)
        sizes = group.inputs["scalingConfig"]
        assert (sizes["minSize"], sizes["maxSize"]) == (pool.min_size, pool.max_size)


def _template_node(group, inst: catalog.InstanceType) -> dict:
    """The node the Cluster Autoscaler imagines for an empty managed node group."""
    capacity = {"cpu": inst.vcpus, "memory_gib": inst.memory_gib, "nvidia.com/gpu": inst.gpus, "pods": 110}
    for key, value in (group.inputs.get("tags") or {}).items():
        if key.startswith(NODE_TEMPLATE_RESOURCES):
            capacity[key[len(NODE_TEMPLATE_RESOURCES) :]] = int(value)
    labels = {INSTANCE_TYPE_LABEL: inst.name, **group.inputs["labels"]}
    taints = [{**t, "effect": EKS_EFFECTS[t["effect"]]} for t in group.inputs.get("taints") or []]
    return {"capacity": capacity, "labels": labels, "taints": taints}


def _fits(pod_spec: dict, node: dict) -> list[str]:
    why = []
    for k, v in (pod_spec.get("nodeSelector") or {}).items():
        if node["labels"].get(k) != v:
            why.append(f"nodeSelector {k}={v}")
    tolerated = {(t["key"], t.get("effect")) for t in pod_spec.get("tolerations") or []}
    for t in node["taints"]:
        if (t["key"], t["effect"]) not in tolerated:
            why.append(f"taint {t['key']}")
    requests = pod_spec["containers"][0]["resources"]["requests"]
    for name, value in requests.items():
        if name == "memory":
            need, have = int(value.removesuffix("Gi")), node["capacity"]["memory_gib"]
        else:
            need, have = int(value), node["capacity"].get(name, 0)
        if need > have:
            why.append(f"{name} {need} > {have}")
    return why


def test_an_empty_pool_can_take_its_engine_pod(stack):
    """Scale from zero: the template node of each empty GPU pool fits that role's Ray pod."""
    rs = next(o for o in stack.manifests().values() if o.get("kind") == "RayService")
    workers = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    groups = _gpu_groups(stack)
    for role, worker in workers.items():
        inst = getattr(stack.config.node_pools, role).instance
        assert _fits(worker["template"]["spec"], _template_node(groups[role], inst)) == [], role


def test_without_the_efa_tag_an_empty_efa_pool_looks_useless(rendered_stacks):
    """The check can fail: drop the EFA capacity tag and prod's decode pod no longer fits."""
    stack = rendered_stacks["prod"]
    group = _gpu_groups(stack)["decode"]
    inst = stack.config.node_pools.decode.instance
    assert inst.efa
    node = _template_node(group, inst)
    node["capacity"].pop("vpc.amazonaws.com/efa")
    rs = next(o for o in stack.manifests().values() if o.get("kind") == "RayService")
    pod = next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "decode")
    assert _fits(pod["template"]["spec"], node) == [f"vpc.amazonaws.com/efa {inst.efa_interfaces} > 0"]


@pytest.mark.parametrize(
    ("k8s", "tag"), [("1.28", "v1.28.7"), ("1.35", "v1.35.2"), ("1.36", "v1.36.1"), ("1.37", "v1.36.1")]
)
def test_autoscaler_release_follows_the_cluster_version(k8s, tag):
    assert versions.cluster_autoscaler_tag(k8s) == tag


def _engine_pod(stack, role: str) -> dict:
    rs = next(o for o in stack.manifests().values() if o.get("kind") == "RayService")
    group = next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == role)
    return group["template"]["spec"]


def _joined_node(group, inst: catalog.InstanceType, gpus: int, efa: int) -> dict:
    """A node of the group just after it registers: the group's labels (EKS applies them at
    registration), and only the device resources whose plugins have registered."""
    capacity = {"cpu": inst.vcpus, "memory_gib": inst.memory_gib, "pods": 110}
    if gpus:
        capacity["nvidia.com/gpu"] = gpus
    if efa:
        capacity["vpc.amazonaws.com/efa"] = efa
    labels = {INSTANCE_TYPE_LABEL: inst.name, **group.inputs["labels"]}
    taints = [{**t, "effect": EKS_EFFECTS[t["effect"]]} for t in group.inputs.get("taints") or []]
    return {"capacity": capacity, "labels": labels, "taints": taints}


def test_a_new_gpu_node_counts_as_coming_until_its_gpus_register(stack):
    """No second scale-up while a node's device plugin starts: the autoscaler holds the new node
    as unready capacity (the pending pod will land there) until its GPUs are allocatable."""
    for role, group in _gpu_groups(stack).items():
        inst = getattr(stack.config.node_pools, role).instance
        assert group.inputs["labels"].get(CA_AWS_GPU_LABEL), role
        fresh = _joined_node(group, inst, gpus=0, efa=0)
        assert not ca_counts_node_ready(fresh["labels"], fresh["capacity"]), role
        up = _joined_node(group, inst, gpus=inst.gpus, efa=inst.efa_interfaces)
        assert ca_counts_node_ready(up["labels"], up["capacity"]) and _fits(_engine_pod(stack, role), up) == []
        # Scale from zero: the template node (DescribeNodegroup labels) carries it too.
        assert CA_AWS_GPU_LABEL in _template_node(group, inst)["labels"], role


def test_without_the_gpu_label_a_fresh_node_looks_useless(rendered_stacks):
    """The rule bites: without the label, the fresh node is ready capacity on which the engine
    pod does not fit, so the autoscaler scales out again (at p5 prices, until scale-down)."""
    stack = rendered_stacks["prod"]
    group = _gpu_groups(stack)["prefill"]
    inst = stack.config.node_pools.prefill.instance
    fresh = _joined_node(group, inst, gpus=0, efa=0)
    fresh["labels"].pop(CA_AWS_GPU_LABEL)
    assert ca_counts_node_ready(fresh["labels"], fresh["capacity"])
    assert f"nvidia.com/gpu {inst.gpus} > 0" in _fits(_engine_pod(stack, "prefill"), fresh)


def test_efa_has_no_such_grace(rendered_stacks):
    """What stays exposed (docs/scaling.md): the autoscaler waits for GPUs only. A node whose
    NVIDIA plugin registered before the EFA plugin is ready capacity the EFA pod does not fit."""
    stack = rendered_stacks["prod"]
    group = _gpu_groups(stack)["decode"]
    inst = stack.config.node_pools.decode.instance
    assert inst.efa
    half = _joined_node(group, inst, gpus=inst.gpus, efa=0)
    assert ca_counts_node_ready(half["labels"], half["capacity"])
    assert _fits(_engine_pod(stack, "decode"), half) == [f"vpc.amazonaws.com/efa {inst.efa_interfaces} > 0"]
