"""The order a first `pulumi up` creates a stack in, and what must exist before what.

What flows through here: a mock run (`tools.mock_runtime.RunResult`: every registered resource
with the dependencies the SDK sent the engine) and what the stack adopts instead of creating
(`existingVpc`) -> `Graph`: the resources the engine creates and, for each, what it waits for
-> `waves` (topological levels: the order a first `pulumi up` takes, printed by `make render`)
and `violations` (per resource type, what must exist first: `RULES`, each naming the AWS or
Kubernetes behaviour it encodes).

What a resource waits for (pulumi/pulumi sdk/python/lib/pulumi/runtime/resource.py
`prepare_resource`, rpc.py `_add_dependency`, pulumi 3.272): the SDK registers a resource only
once every URN in its `dependencies` has resolved (its explicit `depends_on` plus the resources
whose outputs flow into its inputs), and once its explicit provider has an id; a custom
resource's URN resolves when the engine has created it. Resources with no path between them
are created in parallel. A local component is no node: a dependency on it stands for its
children, and its own `depends_on` is not inherited by them. A remote component (pulumi-eks's
cluster and node groups, a Helm v4 chart) is one node, created when its children are.

What this cannot see: the children of remote components (they are not registered under
mocks), ordering that an `apply` enforces without carrying a resource (a value computed from a
plain string carries none), and anything outside Pulumi (the pods KubeRay creates).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from infra import versions
from tools.mock_runtime import Registered, RunResult

EKS_CLUSTERS = ("eks:index:Cluster", "aws:eks/cluster:Cluster")
VPC = "aws:ec2/vpc:Vpc"
SUBNET = "aws:ec2/subnet:Subnet"
NAMESPACE = "kubernetes:core/v1:Namespace"
HELM_CHART = "kubernetes:helm.sh/v4:Chart"
K8S_PROVIDER = "pulumi:providers:kubernetes"
CRD = "kubernetes:apiextensions.k8s.io/v1:CustomResourceDefinition"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"
REDIS_GROUP = "aws:elasticache/replicationGroup:ReplicationGroup"

# Namespaces every cluster has (the API server creates them; NamespaceLifecycle refuses to
# delete default, kube-system and kube-public).
BUILT_IN_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
# API groups whose CRDs a chart of this stack installs: ray.io from the KubeRay operator chart
# (ray-project/kuberay helm-chart/kuberay-operator/crds/), monitoring.coreos.com from
# kube-prometheus-stack (prometheus-community/helm-charts charts/kube-prometheus-stack/charts/crds/).
CRD_CHARTS = {
    "ray.io": versions.KUBERAY_OPERATOR.chart,
    "monitoring.coreos.com": versions.KUBE_PROMETHEUS_STACK.chart,
}


@dataclass(frozen=True)
class Adopted:
    """What the stack uses without creating it: an existing VPC and its subnets (`existingVpc`)."""

    vpc_ids: frozenset[str] = frozenset()
    subnet_ids: frozenset[str] = frozenset()


@dataclass
class Graph:
    """The resources the engine creates (custom resources and remote components), by URN, and
    for each the URNs it waits for."""

    nodes: dict[str, Registered]
    waits_for: dict[str, set[str]]
    _before: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)

    def before(self, urn: str) -> frozenset[str]:
        """Every node that exists before `urn` is created: what it waits for, transitively."""
        if urn not in self._before:
            seen: set[str] = set()
            todo = list(self.waits_for.get(urn, ()))
            while todo:
                n = todo.pop()
                if n not in seen:
                    seen.add(n)
                    todo.extend(self._before.get(n, self.waits_for.get(n, ())))
            self._before[urn] = frozenset(seen)
        return self._before[urn]

    def of_type(self, *types: str) -> list[Registered]:
        return [r for r in self.nodes.values() if r.type in types]


def _provider_urn(ref: str | None) -> str | None:
    """The provider's URN from the SDK's `urn::id` reference."""
    return ref.rsplit("::", 1)[0] if ref else None


def graph(result: RunResult | Iterable[Registered]) -> Graph:
    """The graph the engine walks: a node per custom resource and remote component, edges to its
    dependencies and its explicit provider (the SDK waits for the provider's id)."""
    resources = result.resources if isinstance(result, RunResult) else list(result)
    nodes = {r.urn: r for r in resources if (r.custom or r.remote) and r.urn}
    waits_for: dict[str, set[str]] = {}
    for urn, r in nodes.items():
        deps = set(r.dependency_urns)
        provider = _provider_urn(r.provider)
        if provider:
            deps.add(provider)
        waits_for[urn] = {d for d in deps if d in nodes and d != urn}
    return Graph(nodes, waits_for)


def waves(g: Graph) -> list[list[Registered]]:
    """Topological levels: wave 1 waits for nothing, wave n for something in wave n-1. A first
    `pulumi up` creates a wave's resources in parallel once what each waits for exists."""
    level: dict[str, int] = {}

    def of(urn: str, path: tuple[str, ...] = ()) -> int:
        if urn in path:
            raise ValueError(f"dependency cycle through {urn}")
        if urn not in level:
            level[urn] = 1 + max((of(d, (*path, urn)) for d in g.waits_for[urn]), default=0)
        return level[urn]

    for urn in g.nodes:
        of(urn)
    out: list[list[Registered]] = [[] for _ in range(max(level.values(), default=0))]
    for urn, n in level.items():
        out[n - 1].append(g.nodes[urn])
    return [sorted(w, key=lambda r: (r.type, r.name)) for w in out]


def _short(type_: str) -> str:
    """`aws:eks/addon:Addon` -> Addon; a provider: `pulumi:providers:kubernetes` -> provider:kubernetes."""
    if type_.startswith("pulumi:providers:"):
        return "provider:" + type_.rsplit(":", 1)[-1]
    return type_.rsplit(":", 1)[-1]


def format_waves(g: Graph, width: int = 110) -> str:
    """The waves as `make render` prints them: `NN (count): Type name, ...` per wave, wrapped
    between resources (never inside one)."""
    lines = ["Creation waves (a first `pulumi up`: each resource waits for what it names; tools/creation_order.py)"]
    for i, wave in enumerate(waves(g), 1):
        head = f"  {i:2d} ({len(wave)}): "
        line = head
        for j, r in enumerate(wave):
            item = f"{_short(r.type)} {r.name}" + ("," if j < len(wave) - 1 else "")
            if line != head and len(line) + len(item) > width:
                lines.append(line.rstrip())
                line = " " * len(head)
            line += item + " "
        lines.append(line.rstrip())
    return "\n".join(lines)


# --- the rules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Violation:
    resource: str  # "type name"
    needs: str  # what must exist first
    source: str  # the AWS or Kubernetes behaviour that makes it so

    def __str__(self) -> str:
        return f"{self.resource}: created without waiting for {self.needs} ({self.source})"


@dataclass(frozen=True)
class Rule:
    """Resources of `types` (all, when empty) need what `needs` returns before them:
    [(urn or None, what)]; a None urn is a need nothing in the stack can meet."""

    name: str
    types: tuple[str, ...]
    source: str
    needs: Callable[[Registered, Graph, Adopted], list[tuple[str | None, str]]]


def _named(r: Registered) -> str:
    return f"{r.type} {r.name}"


CLUSTER_SCOPED = (
    "aws:eks/podIdentityAssociation:PodIdentityAssociation",
    "aws:eks/accessEntry:AccessEntry",
    "aws:eks/accessPolicyAssociation:AccessPolicyAssociation",
    "aws:eks/addon:Addon",
    "aws:eks/nodeGroup:NodeGroup",
    "aws:eks/fargateProfile:FargateProfile",
    "eks:index:ManagedNodeGroup",
    K8S_PROVIDER,
)


def _cluster_needs(r: Registered, g: Graph, _: Adopted) -> list[tuple[str | None, str]]:
    """The stack's cluster that `r` names: by `clusterName`, by its `cluster` input (a URN
    under mocks) or, for a Kubernetes provider, by the name in its kubeconfig."""
    clusters = g.of_type(*EKS_CLUSTERS)
    if "clusterName" in r.inputs:
        named = [c for c in clusters if c.inputs.get("name") == r.inputs["clusterName"]]
    elif isinstance(r.inputs.get("cluster"), str):
        named = [c for c in clusters if c.urn == r.inputs["cluster"] or c.id == r.inputs["cluster"]]
    else:
        text = json.dumps(r.inputs.get("kubeconfig"))
        named = [c for c in clusters if c.inputs.get("name") and c.inputs["name"] in text]
    return [(c.urn, f"EKS cluster {c.inputs.get('name')} ({c.name})") for c in named]


def _ids(value: Any) -> list[str]:
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]


def _vpc_needs(r: Registered, g: Graph, adopted: Adopted) -> list[tuple[str | None, str]]:
    """The VPC a resource lives in (`vpcId`) and the subnets it names: the stack's own ones
    before it; a VPC neither created nor adopted cannot be met."""
    by_id = {n.id: n for n in g.nodes.values() if n.type in (VPC, SUBNET)}
    needs: list[tuple[str | None, str]] = []
    for vpc in _ids(r.inputs.get("vpcId")):
        if vpc in by_id:
            needs.append((by_id[vpc].urn, f"VPC {by_id[vpc].name}"))
        elif vpc not in adopted.vpc_ids:
            needs.append((None, f"VPC {vpc} (neither created by the stack nor its existingVpc)"))
    for key in ("subnetId", "subnetIds", "privateSubnetIds", "publicSubnetIds"):
        for sid in _ids(r.inputs.get(key)):
            if sid in by_id:
                needs.append((by_id[sid].urn, f"subnet {by_id[sid].name}"))
            elif sid not in adopted.subnet_ids:
                needs.append((None, f"subnet {sid} (neither created by the stack nor in its existingVpc)"))
    return needs


def _namespace_of(r: Registered) -> str | None:
    if r.type == HELM_CHART:
        return r.inputs.get("namespace")
    return (r.inputs.get("metadata") or {}).get("namespace")


def _is_k8s_object(r: Registered) -> bool:
    return r.type.startswith("kubernetes:") and r.type != K8S_PROVIDER


def _namespace_needs(r: Registered, g: Graph, _: Adopted) -> list[tuple[str | None, str]]:
    ns = _namespace_of(r)
    if not ns:
        return []
    made = [n for n in g.of_type(NAMESPACE) if (n.inputs.get("metadata") or {}).get("name") == ns]
    if made:
        return [(n.urn, f"namespace {ns} ({n.name})") for n in made]
    if ns in BUILT_IN_NAMESPACES:
        return []
    return [(None, f"namespace {ns} (neither created by the stack nor one every cluster has)")]


_TYPE = re.compile(r"^kubernetes:(?P<group>[^/]+)/(?P<version>[^:]+):(?P<kind>.+)$")


def _custom_group(r: Registered) -> str | None:
    """The API group of a custom resource's type; None for Kubernetes' own groups and for
    Pulumi's constructs (Helm charts)."""
    m = _TYPE.match(r.type)
    if not m or r.type == HELM_CHART:
        return None
    group = m["group"]
    if group == "core" or "." not in group or group.endswith(".k8s.io"):
        return None
    return group


def _crd_needs(r: Registered, g: Graph, _: Adopted) -> list[tuple[str | None, str]]:
    group = _custom_group(r)
    if group is None:
        return []
    crds = [c for c in g.of_type(CRD) if (c.inputs.get("spec") or {}).get("group") == group]
    charts = [c for c in g.of_type(HELM_CHART) if c.inputs.get("chart") == CRD_CHARTS.get(group)]
    if crds or charts:
        return [(c.urn, f"the CRDs of {group} ({c.name})") for c in [*crds, *charts]]
    return [(None, f"the CRDs of {group} (no chart or CustomResourceDefinition of the stack installs them)")]


def _redis_needs(r: Registered, g: Graph, adopted: Adopted) -> list[tuple[str | None, str]]:
    """A RayService's GCS Redis: the stack's own ElastiCache group before it; an endpoint outside
    the stack is reachable only from a VPC that exists already (existingVpc)."""
    ft = ((r.inputs.get("spec") or {}).get("rayClusterConfig") or {}).get("gcsFaultToleranceOptions") or {}
    address = ft.get("redisAddress")
    if not address:
        return []
    groups = [n for n in g.of_type(REDIS_GROUP) if n.urn in g.before(r.urn)]
    if groups:
        return [(n.urn, f"the GCS Redis {n.name}") for n in groups]
    if adopted.vpc_ids:
        return []
    return [
        (None, f"a route to the external Redis {address} (the stack's VPC is new: nothing peers it with the Redis's)")
    ]


RULES: tuple[Rule, ...] = (
    Rule(
        "cluster",
        CLUSTER_SCOPED,
        "AWS EKS API Reference: CreatePodIdentityAssociation, CreateAccessEntry, AssociateAccessPolicy, "
        "CreateAddon, CreateNodegroup and CreateFargateProfile answer ResourceNotFoundException for a "
        "cluster that does not exist yet; a Kubernetes provider's kubeconfig points at the cluster's API endpoint",
        _cluster_needs,
    ),
    Rule(
        "vpc",
        (),
        "Amazon EC2 API Reference: a VPC-scoped create (subnet, security group, route table, endpoint, "
        "flow log) with a VpcId that does not exist answers InvalidVpcID.NotFound, one naming a missing subnet "
        "InvalidSubnetID.NotFound; EKS CreateCluster and ElastiCache CreateCacheSubnetGroup refuse unknown subnets",
        _vpc_needs,
    ),
    Rule(
        "namespace",
        (),
        "Kubernetes NamespaceLifecycle admission (kubernetes/kubernetes plugin/pkg/admission/namespace/"
        "lifecycle/admission.go): an object in a namespace that does not exist is refused (NotFound)",
        _namespace_needs,
    ),
    Rule(
        "crd",
        (),
        "Kubernetes API: an object of a kind whose CustomResourceDefinition is not installed is refused "
        '("no matches for kind"); the CRDs come with the KubeRay and kube-prometheus-stack charts',
        _crd_needs,
    ),
    Rule(
        "gcs-redis",
        (RAYSERVICE,),
        "Amazon ElastiCache User Guide, 'Access patterns for accessing an ElastiCache cache in an Amazon VPC': "
        "a cache is reached from its own VPC or one peered or routed to it, through a security group it admits",
        _redis_needs,
    ),
)


def _applies(rule: Rule, r: Registered) -> bool:
    if rule.types:
        return r.type in rule.types
    if rule.name in ("namespace", "crd"):
        return _is_k8s_object(r)
    return True


NOTHING_ADOPTED = Adopted()


def violations(g: Graph, adopted: Adopted = NOTHING_ADOPTED, rules: Iterable[Rule] = RULES) -> list[Violation]:
    """Every resource that a rule says needs something which it does not wait for."""
    out = []
    for rule in rules:
        for r in g.nodes.values():
            if not _applies(rule, r):
                continue
            before = g.before(r.urn)
            for urn, what in rule.needs(r, g, adopted):
                if urn is None or urn not in before:
                    out.append(Violation(_named(r), what, rule.source))
    return out


def adopted(cfg: Any) -> Adopted:
    """What a validated stack config (infra.config.StackConfig) adopts: its existingVpc."""
    ev = cfg.existing_vpc
    if ev is None:
        return Adopted()
    subnets = {*ev.private_subnet_ids, *ev.public_subnet_ids, ev.efa_subnet_id}
    return Adopted(frozenset({ev.vpc_id}), frozenset(s for s in subnets if s))
