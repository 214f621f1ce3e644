"""The order a first `pulumi up` creates each shipped stack in (tools/creation_order.py).

Contract (pulumi/pulumi sdk/python/lib/pulumi/runtime/resource.py `prepare_resource`, rpc.py
`_add_dependency`, pulumi 3.272): the SDK registers a resource once every URN in its
`dependencies` (explicit depends_on + the resources behind the Outputs in its inputs) has
resolved and its explicit provider has an id; resources with no path between them are created
in parallel. The rules each name the AWS or Kubernetes behaviour they encode (RULES).
"""

from __future__ import annotations

import dataclasses
import io
import re
from contextlib import redirect_stdout

import pulumi
import pytest

from infra.components.cluster import Cluster
from tests.conftest import STACKS
from tools import creation_order as co
from tools import mock_runtime, render, stackfile
from tools.mock_runtime import Registered

PIA = "aws:eks/podIdentityAssociation:PodIdentityAssociation"
ADDON = "aws:eks/addon:Addon"


@pytest.mark.parametrize("name", STACKS)
def test_every_shipped_stack_creates_each_resource_after_what_it_needs(rendered_stacks, name):
    stack = rendered_stacks[name]
    g = co.graph(stack.result)
    assert [str(v) for v in co.violations(g, co.adopted(stack.config))] == []


@pytest.mark.parametrize("name", STACKS)
def test_every_pod_identity_association_and_addon_comes_after_the_cluster(rendered_stacks, name):
    g = co.graph(rendered_stacks[name].result)
    (cluster,) = g.of_type("eks:index:Cluster")
    scoped = g.of_type(PIA, ADDON, "eks:index:ManagedNodeGroup", "pulumi:providers:kubernetes")
    assert len(g.of_type(PIA)) >= 4
    assert [r.name for r in scoped if cluster.urn not in g.before(r.urn)] == []


def _run_with_plain_cluster_name(monkeypatch, stack: str) -> mock_runtime.RunResult:
    """The program as it was wired before this check: the cluster's name reached the components
    as a value that carries no dependency (a copied str, as an Output of nothing)."""
    real_init = Cluster.__init__

    def init(self, name, args, opts=None):
        real_init(self, name, args, opts)
        self.core = dataclasses.replace(self.core, name=pulumi.Output.from_input(args.cluster_name))

    monkeypatch.setattr(Cluster, "__init__", init)
    values, secrets, others = stackfile.read(stack)
    loaded = stackfile.load_offline(values, secrets, others, stackfile.path_of(stack))
    return mock_runtime.run(stack, loaded.values, loaded.secrets, others)


def test_the_check_fails_on_a_cluster_name_that_carries_no_dependency(monkeypatch):
    """The wiring of the first review: Pod Identity associations and the EBS CSI add-on named the
    cluster by a plain value, so `CreatePodIdentityAssociation` ran while the cluster was being
    created. The check names each of them; the shipped wiring (above) has none."""
    result = _run_with_plain_cluster_name(monkeypatch, "dev")
    flagged = {v.resource.split()[-1] for v in co.violations(co.graph(result)) if "EKS cluster" in v.needs}
    assert {"node-autoscaler-identity", "obs-tempo-identity", "llm-head-identity", "obs-ebs-csi-driver"} <= flagged


# --- injected graphs: one per rule ----------------------------------------------------------------
def _res(type_: str, name: str, inputs: dict | None = None, deps: tuple[Registered, ...] = (), **kw) -> Registered:
    return Registered(
        type_,
        name,
        None,
        inputs or {},
        urn=f"urn:pulumi:t::p::{type_}::{name}",
        dependency_urns=[d.urn for d in deps],
        id=f"{name}-id",
        **kw,
    )


def _flagged(*resources: Registered, adopted: co.Adopted = co.NOTHING_ADOPTED, rule: str = "") -> list[tuple[str, str]]:
    rules = [r for r in co.RULES if r.name == rule] if rule else co.RULES
    return [(v.resource.split()[-1], v.needs) for v in co.violations(co.graph(resources), adopted, rules)]


def test_a_pod_identity_association_must_wait_for_its_cluster():
    cluster = _res("eks:index:Cluster", "eks", {"name": "c1"}, remote=True, custom=False)
    early = _res(PIA, "early", {"clusterName": "c1"})
    late = _res(PIA, "late", {"clusterName": "c1"}, deps=(cluster,))
    elsewhere = _res(PIA, "elsewhere", {"clusterName": "not-this-stacks"})
    assert _flagged(cluster, early, late, elsewhere) == [("early", "EKS cluster c1 (eks)")]


def test_a_kubernetes_provider_must_wait_for_the_cluster_its_kubeconfig_names():
    cluster = _res("eks:index:Cluster", "eks", {"name": "c1"}, remote=True, custom=False)
    kubeconfig = {"kubeconfig": '{"clusters": [{"name": "c1"}]}'}
    early = _res("pulumi:providers:kubernetes", "k8s", kubeconfig)
    assert _flagged(cluster, early) == [("k8s", "EKS cluster c1 (eks)")]
    assert _flagged(cluster, _res("pulumi:providers:kubernetes", "k8s", kubeconfig, deps=(cluster,))) == []


def test_a_subnet_must_wait_for_its_vpc_unless_the_vpc_is_adopted():
    vpc = _res("aws:ec2/vpc:Vpc", "vpc")
    subnet = _res("aws:ec2/subnet:Subnet", "subnet", {"vpcId": "vpc-id"})
    assert _flagged(vpc, subnet) == [("subnet", "VPC vpc")]
    assert _flagged(vpc, _res("aws:ec2/subnet:Subnet", "subnet", {"vpcId": "vpc-id"}, deps=(vpc,))) == []
    existing = _res("aws:ec2/securityGroup:SecurityGroup", "sg", {"vpcId": "vpc-0abc"})
    assert _flagged(existing, adopted=co.Adopted(vpc_ids=frozenset({"vpc-0abc"}))) == []
    assert _flagged(existing)[0][1].startswith("VPC vpc-0abc (neither created")


def test_a_node_group_must_wait_for_the_subnets_it_names():
    subnet = _res("aws:ec2/subnet:Subnet", "a")
    cluster = _res("eks:index:Cluster", "eks", {"name": "c1"}, remote=True, custom=False)
    ng = _res("eks:index:ManagedNodeGroup", "ng", {"cluster": cluster.urn, "subnetIds": ["a-id"]}, deps=(cluster,))
    assert _flagged(subnet, cluster, ng) == [("ng", "subnet a")]


def test_a_namespaced_object_must_wait_for_a_namespace_the_stack_creates():
    ns = _res("kubernetes:core/v1:Namespace", "ns", {"metadata": {"name": "llm"}})
    secret = _res("kubernetes:core/v1:Secret", "s", {"metadata": {"name": "k", "namespace": "llm"}})
    in_kube_system = _res("kubernetes:core/v1:Secret", "t", {"metadata": {"name": "k", "namespace": "kube-system"}})
    nowhere = _res("kubernetes:core/v1:Secret", "u", {"metadata": {"name": "k", "namespace": "nowhere"}})
    chart = _res("kubernetes:helm.sh/v4:Chart", "c", {"namespace": "llm"}, remote=True, custom=False)
    flagged = _flagged(ns, secret, in_kube_system, nowhere, chart)
    assert [f[0] for f in flagged] == ["s", "u", "c"]
    assert flagged[1][1].startswith("namespace nowhere (neither created")


def test_a_custom_resource_must_wait_for_the_chart_that_installs_its_crd():
    chart = _res("kubernetes:helm.sh/v4:Chart", "kuberay", {"chart": "kuberay-operator"}, remote=True, custom=False)
    rs = _res("kubernetes:ray.io/v1:RayService", "rs", {"metadata": {"name": "x"}})
    assert _flagged(chart, rs) == [("rs", "the CRDs of ray.io (kuberay)")]
    assert _flagged(chart, _res("kubernetes:ray.io/v1:RayService", "rs", {"metadata": {}}, deps=(chart,))) == []
    unknown = _res("kubernetes:example.com/v1:Widget", "w", {"metadata": {}})
    assert _flagged(unknown)[0][1].startswith("the CRDs of example.com (no chart")


def _rayservice(address: str, deps: tuple[Registered, ...] = ()) -> Registered:
    spec = {"rayClusterConfig": {"gcsFaultToleranceOptions": {"redisAddress": address}}}
    return _res("kubernetes:ray.io/v1:RayService", "rs", {"spec": spec}, deps=deps)


def test_an_external_gcs_redis_needs_a_vpc_that_already_reaches_it():
    """A new VPC has no route to a Redis outside the stack: the RayService's GCS would
    crash-loop. In an adopted VPC (existingVpc) the Redis is the VPC owner's to make reachable;
    the stack's own ElastiCache group is reached when it exists before the RayService."""
    external = _rayservice("rediss://master.other.cache.amazonaws.com:6379")
    assert _flagged(external, rule="gcs-redis")[0][1].startswith("a route to the external Redis")
    assert _flagged(external, adopted=co.Adopted(vpc_ids=frozenset({"vpc-0abc"})), rule="gcs-redis") == []
    group = _res("aws:elasticache/replicationGroup:ReplicationGroup", "gcs-group")
    own = _rayservice("rediss://master.gcs.cache.amazonaws.com:6379", (group,))
    assert _flagged(group, own, rule="gcs-redis") == []


# --- waves --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", STACKS)
def test_each_wave_waits_only_for_earlier_waves(rendered_stacks, name):
    g = co.graph(rendered_stacks[name].result)
    wave_of = {r.urn: i for i, wave in enumerate(co.waves(g)) for r in wave}
    assert set(wave_of) == set(g.nodes)
    for urn, deps in g.waits_for.items():
        assert all(wave_of[d] < wave_of[urn] for d in deps)
        assert wave_of[urn] == 0 or any(wave_of[d] == wave_of[urn] - 1 for d in deps)


def test_a_dependency_cycle_has_no_waves():
    a = _res("aws:iam/role:Role", "a")
    b = _res("aws:iam/role:Role", "b", deps=(a,))
    a.dependency_urns = [b.urn]
    with pytest.raises(ValueError, match="cycle"):
        co.waves(co.graph([a, b]))


def test_make_render_prints_the_waves_with_the_cluster_before_what_it_scopes(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        assert render.main(["--stack", "dev", "--stand-in-secrets", "--out", str(tmp_path)]) == 0
    text = out.getvalue()
    block = text[text.index("Creation waves") :].split("\n\n")[0]
    wave, current = {}, 0
    for line in block.splitlines()[1:]:
        m = re.match(r"^\s*(\d+) \(\d+\): (.*)$", line)
        if m:
            current, line = int(m[1]), m[2]
        for item in filter(None, (i.strip() for i in line.split(","))):
            wave[item.split(" ")[-1]] = current
    assert wave["eks-eks"] < wave["node-autoscaler-identity"]
    assert wave["eks-eks"] < wave["eks-k8s"] < wave["kuberay-chart"] < wave["llm-rayservice"]
