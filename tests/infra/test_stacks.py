"""Every shipped stack, run through the real program under mocks: what a reviewer checks.

What flows through here: each stacks/Pulumi.<env>.yaml -> `tools.render.render` (the real
__main__.py under Pulumi's mock runtime) -> assertions on the registered resources' inputs.
"""

from __future__ import annotations

import base64
import json
import re

import pytest
import yaml

from infra import catalog, config, versions
from infra.components.gpu_node_pool import AMI_TYPE
from infra.k8s.labels import ROLE_LABEL
from infra.paths import ROOT
from tests.conftest import STACKS
from tests.upstream import mng_image

MNG = "eks:index:ManagedNodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
CLUSTER = "eks:index:Cluster"
CHART = "kubernetes:helm.sh/v4:Chart"


def test_three_environments_ship():
    assert {"dev", "staging", "prod"} <= set(STACKS)


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _gpu_groups(stack):
    return {
        r.inputs["labels"][ROLE_LABEL]: r
        for r in stack.result.of_type(MNG)
        if r.inputs["labels"][ROLE_LABEL] in ("prefill", "decode")
    }


def test_registers_cluster_system_group_gpu_pools_plugins_and_operator(stack):
    res = stack.result
    assert len(res.of_type(CLUSTER)) == 1
    system = [r for r in res.of_type(MNG) if r.inputs["labels"][ROLE_LABEL] == "system"]
    assert len(system) == 1 and system[0].inputs["labels"] == {ROLE_LABEL: "system"}
    assert set(_gpu_groups(stack)) == {"prefill", "decode"}
    charts = {r.inputs["chart"] for r in res.of_type(CHART)}
    assert charts == {
        "nvidia-device-plugin",
        "aws-efa-k8s-device-plugin",
        "kuberay-operator",
        "kube-prometheus-stack",
        "dcgm-exporter",
        "cluster-autoscaler",
        # observability.tracing is on by default: the collector and the trace store.
        "opentelemetry-collector",
        "tempo",
    }


def _template_of(result, group):
    """The aws.ec2.LaunchTemplate a node group's `launchTemplate` points at (mock ids are `<name>-id`)."""
    lt_id = group.inputs["launchTemplate"]["id"]
    return next(r for r in result.of_type(LAUNCH_TEMPLATE) if f"{r.name}-id" == lt_id)


def _user_data(template) -> str:
    return base64.b64decode(template.inputs["userData"]).decode() if template.inputs.get("userData") else ""


def test_gpu_pools_efa_taint_label_ami(stack):
    cfg = stack.config
    pools = {"prefill": cfg.node_pools.prefill, "decode": cfg.node_pools.decode}
    efa_subnet = next(r for r in stack.result.resources if r.name == f"net-private-{cfg.efa_zone_name}")
    for role, group in _gpu_groups(stack).items():
        inp, inst = group.inputs, catalog.lookup(pools[role].instance_type)
        assert inp["instanceTypes"] == [inst.name]
        # The AL2023 NVIDIA AMI of the pinned release (tests/infra/components/test_ami_pin_contract.py).
        image = mng_image(inp)
        assert image["pinned"] and image["source"] == "eks-release", (role, image)
        assert inp["amiType"] == AMI_TYPE == "AL2023_x86_64_NVIDIA"
        assert inp["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]
        # The role, and the Cluster Autoscaler's GPU label (test_node_autoscaler.py, GPU contract).
        assert inp["labels"][ROLE_LABEL] == role and set(inp["labels"]) == {ROLE_LABEL, "k8s.amazonaws.com/accelerator"}
        sizes = inp["scalingConfig"]
        assert (sizes["minSize"], sizes["desiredSize"], sizes["maxSize"]) == (
            pools[role].min_size,
            pools[role].desired_size,
            pools[role].max_size,
        )
        # Our own launch template for every pool (pulumi-eks's have no `encrypted` and hop limit 2:
        # test_efa_node_template_contract.py, test_imds_contract.py).
        assert not inp.get("enableEfaSupport") and not inp.get("enableIMDSv2")
        lt = _template_of(stack.result, group).inputs
        assert lt["metadataOptions"]["httpTokens"] == "required"
        assert inp["releaseVersion"] == cfg.ami_release_version
        user_data = _user_data(_template_of(stack.result, group))
        if inst.nvme_disks:
            assert "RAID0" in user_data
        if inst.efa:
            assert len(lt["networkInterfaces"]) == inst.efa_interfaces
            assert lt["placement"]["groupName"], "EFA pools run in a cluster placement group"
            assert inp["subnetIds"] == [f"{efa_subnet.name}-id"], "EFA pools live in one zone"
            assert "LimitMEMLOCK=infinity" in user_data
        else:
            assert not lt.get("placement") and "LimitMEMLOCK" not in user_data
            assert len(inp["subnetIds"]) == len(cfg.availability_zones)


def test_p5_and_p4de_pools_have_efa(rendered_stacks):
    seen = set()
    for stack in rendered_stacks.values():
        for group in _gpu_groups(stack).values():
            if group.inputs["instanceTypes"][0].startswith(("p5", "p4de")):
                seen.add(group.inputs["instanceTypes"][0])
                nics = _template_of(stack.result, group).inputs["networkInterfaces"]
                assert {n["interfaceType"] for n in nics} == {"efa", "efa-only"}
    assert {"p5.48xlarge", "p4de.24xlarge"} <= seen


def test_charts_pinned_to_versions_module(stack):
    pinned = {
        c.chart: c
        for c in (
            versions.NVIDIA_DEVICE_PLUGIN,
            versions.EFA_DEVICE_PLUGIN,
            versions.KUBERAY_OPERATOR,
            versions.KUBE_PROMETHEUS_STACK,
            versions.DCGM_EXPORTER,
            versions.CLUSTER_AUTOSCALER,
            versions.OTEL_COLLECTOR,
            versions.TEMPO,
        )
    }
    for chart in stack.result.of_type(CHART):
        want = pinned[chart.inputs["chart"]]
        assert chart.inputs["version"] == want.version
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", chart.inputs["version"])
        assert chart.inputs["repositoryOpts"]["repo"] == want.repo
    assert versions.KUBERAY_OPERATOR.version.startswith("1.7.")


def test_device_plugins_tolerate_gpu_taint_and_efa_only_on_efa_types(stack):
    charts = {c.inputs["chart"]: c.inputs["values"] for c in stack.result.of_type(CHART)}
    efa = charts["aws-efa-k8s-device-plugin"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in efa["tolerations"]
    assert "affinity" not in efa, "the chart ignores it (see test_efa_chart_contract.py)"
    types = efa["supportedInstanceLabels"]["values"]
    assert types and all(catalog.lookup(t).efa for t in types)
    assert {t for t, i in catalog.CATALOG.items() if i.efa} == set(types)
    nvidia = charts["nvidia-device-plugin"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in nvidia["tolerations"]


def test_cluster_encryption_logging_auth_and_endpoint(stack):
    cluster = stack.result.one(CLUSTER).inputs
    key = stack.result.one("aws:kms/key:Key", "eks-secrets-key").inputs
    assert key["enableKeyRotation"] is True
    assert cluster["encryptionConfigKeyArn"].startswith("arn:")
    assert set(cluster["enabledClusterLogTypes"]) == {"api", "audit", "authenticator", "controllerManager", "scheduler"}
    assert cluster["authenticationMode"] == "API"
    assert cluster["endpointPrivateAccess"] is True
    assert cluster["skipDefaultNodeGroup"] is True
    assert cluster["createOidcProvider"] is True
    admins = {e["principalArn"] for k, e in cluster["accessEntries"].items() if k.startswith("admin-")}
    assert admins == set(stack.config.admin_role_arns)
    if stack.config.environment is config.Environment.PROD:
        assert cluster["endpointPublicAccess"] is False
        assert "publicAccessCidrs" not in cluster
    if cluster["endpointPublicAccess"]:
        assert cluster["publicAccessCidrs"] and "0.0.0.0/0" not in cluster["publicAccessCidrs"]
    addon = stack.result.one("aws:eks/addon:Addon", "eks-pod-identity-agent").inputs
    assert addon["addonName"] == "eks-pod-identity-agent"


def test_prod_endpoint_is_private(rendered_stacks):
    assert rendered_stacks["prod"].result.one(CLUSTER).inputs["endpointPublicAccess"] is False


def test_kubernetes_provider_gets_cluster_kubeconfig_and_is_used_in_cluster(stack):
    provider = stack.result.one("pulumi:providers:kubernetes")
    kubeconfig = json.loads(provider.inputs["kubeconfig"])
    assert kubeconfig["clusters"][0]["cluster"]["server"] == f"https://pd-inference-{stack.stack}.eks.mock"
    for r in stack.result.resources:
        if r.type.startswith("kubernetes:") and r.type != "pulumi:providers:kubernetes":
            assert r.provider and f"::{provider.name}::" in r.provider, f"{r.name} bypasses the cluster provider"


def test_stack_outputs(stack):
    out = stack.result.outputs
    assert out["clusterName"] == f"pd-inference-{stack.stack}"
    assert json.loads(out["kubeconfig"])["kind"] == "Config"
    assert out["oidcIssuer"].startswith("https://oidc.eks.")
    # One EKS node group per nodePools entry (one-model stacks: prefill and decode).
    assert out["nodePools"] == {name: f"pd-inference-{stack.stack}-{name}" for name in stack.config.node_pools.names()}
    assert out["systemNodeGroup"] == f"pd-inference-{stack.stack}-system"
    assert out["endpoint"].endswith(":8000/v1")


def test_network_new_vpc(stack):
    cfg = stack.config
    subnets = stack.result.of_type("aws:ec2/subnet:Subnet")
    private = [s for s in subnets if s.inputs["tags"].get("kubernetes.io/role/internal-elb") == "1"]
    public = [s for s in subnets if s.inputs["tags"].get("kubernetes.io/role/elb") == "1"]
    assert sorted(s.inputs["availabilityZone"] for s in private) == sorted(cfg.availability_zones)
    assert len(public) == len(cfg.availability_zones)
    assert all(not s.inputs.get("mapPublicIpOnLaunch") for s in subnets)
    nats = stack.result.of_type("aws:ec2/natGateway:NatGateway")
    assert len(nats) == (len(cfg.availability_zones) if cfg.nat_gateways is config.NatGateways.PER_ZONE else 1)


def test_existing_vpc_creates_no_network(rendered_stacks):
    from tools import mock_runtime, stackfile

    values, secrets, others = stackfile.read_as_deployed("staging")
    values["existingVpc"] = {
        "vpcId": "vpc-0123456789abcdef0",
        "privateSubnetIds": ["subnet-0aaaaaaaaaaaaaaa1", "subnet-0bbbbbbbbbbbbbbb2"],
        "publicSubnetIds": ["subnet-0ccccccccccccccc3"],
        "efaSubnetId": "subnet-0bbbbbbbbbbbbbbb2",
    }
    result = mock_runtime.run("staging", values, secrets, others)
    assert not result.of_type("aws:ec2/vpc:Vpc") and not result.of_type("aws:ec2/subnet:Subnet")
    assert result.one(CLUSTER).inputs["vpcId"] == "vpc-0123456789abcdef0"
    for group in result.of_type(MNG):
        if group.inputs["labels"][ROLE_LABEL] != "system":  # staging's pools are p4de: EFA
            assert group.inputs["subnetIds"] == ["subnet-0bbbbbbbbbbbbbbb2"]


def test_capacity_block_pool_builds_its_own_efa_launch_template():
    from tools import mock_runtime, stackfile

    values, secrets, others = stackfile.read_as_deployed("prod")
    values["nodePools"]["decode"].update(capacityType="capacity-block", capacityReservationId="cr-0123456789abcdef0")
    result = mock_runtime.run("prod", values, secrets, others)
    decode = next(r for r in result.of_type(MNG) if r.inputs["labels"].get(ROLE_LABEL) == "decode")
    assert decode.inputs["capacityType"] == "CAPACITY_BLOCK"
    assert "launchTemplate" in decode.inputs and not decode.inputs.get("enableEfaSupport")
    lt = _template_of(result, decode).inputs
    nics = lt["networkInterfaces"]
    assert len(nics) == catalog.lookup("p5.48xlarge").efa_interfaces == 32
    assert nics[0]["interfaceType"] == "efa" and nics[0]["deviceIndex"] == 0
    assert all(n["interfaceType"] == "efa-only" and n["deviceIndex"] == 1 for n in nics[1:])
    assert [n["networkCardIndex"] for n in nics] == list(range(32))
    assert all("sg-0eksmanaged000001" in n["securityGroups"] for n in nics), "nodes need the EKS cluster SG"
    assert lt["metadataOptions"]["httpTokens"] == "required"
    assert lt["instanceMarketOptions"]["marketType"] == "capacity-block"
    target = lt["capacityReservationSpecification"]["capacityReservationTarget"]
    assert target["capacityReservationId"] == "cr-0123456789abcdef0"
    assert "placement" not in lt, "a Capacity Block carries its own placement"
    sg = result.one("aws:ec2/securityGroup:SecurityGroup", "gpu-decode-efa-sg")
    rules = [
        r
        for r in result.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
        if r.name.startswith("gpu-")
    ]
    assert rules and all(r.inputs["referencedSecurityGroupId"] == r.inputs["securityGroupId"] for r in rules)
    assert sg.name.endswith("efa-sg")


def test_pulumi_yaml_declares_scalar_keys_with_model_defaults():
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    assert project["name"] == config.PROJECT
    assert project["stackConfigDir"] == "stacks"
    assert project["runtime"]["name"] == "python"
    declared = project["config"]
    fields = config.StackConfig.model_fields
    by_alias = {(f.alias or name): f for name, f in fields.items()}
    # A key declared `secret: true` is required in every stack by Pulumi itself (its merged
    # default would be plain text: "must be encrypted"); secrets stay undeclared.
    assert not set(declared) & set(config.SECRET_KEYS)
    for key, decl in declared.items():
        assert key in by_alias, f"Pulumi.yaml declares {key}, which the config model does not have"
        field = by_alias[key]
        if "default" in decl:
            default = field.get_default(call_default_factory=True)
            default = default.value if hasattr(default, "value") else default
            if key in config.EMPTY_MEANS_UNSET:
                assert decl["default"] == "" and default is None, key  # "" reaches load() as unset
            else:
                assert decl["default"] == default, key
        else:
            assert field.is_required(), f"{key}: optional in the model, so it needs a default in Pulumi.yaml"
    scalar = {
        a
        for a, f in by_alias.items()
        if f.annotation in (str, int, bool)
        or "Enum" in str(f.annotation)
        or str(f.annotation).startswith(("list[str]", "str |"))
    }
    assert scalar <= set(declared), f"undeclared scalar keys: {scalar - set(declared)}"


def test_charts_install_after_their_namespaces(stack):
    charts = {c.inputs["chart"]: c for c in stack.result.of_type(CHART)}
    assert "nvidia-device-plugin-ns" in charts["nvidia-device-plugin"].depends_on
    kuberay = charts["kuberay-operator"].depends_on
    assert "kuberay-ns" in kuberay
    assert f"kuberay-{stack.config.namespace}-ns" in kuberay, "its Roles live in the watched namespace"
