"""The policy pack's rules over every stack (clean) and over crafted violations (each fires).

What flows through here: every shipped stack rendered under mocks (plus prod with a
capacity-block pool, the only path that builds its own launch template) -> every rule of
`policies.rules.RULES` through its real ResourceValidationPolicy (harness.py builds the
analyzer's arguments) -> mandatory rules report nothing, advisory rules only what the
stacks choose on purpose. Then copies of real rendered resources, each broken one way ->
the rule it breaks fires, with a message that says what to change.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pulumi_policy import EnforcementLevel
from pulumi_policy.proxy import UNKNOWN_ARRAY_VALUE, UNKNOWN_OBJECT_VALUE, UNKNOWN_STRING_VALUE

from infra.components.cluster import LOG_TYPES
from infra.k8s.labels import GPU_TAINT_KEY
from infra.k8s.rayservice import HF_TOKEN_ENV
from infra.paths import ROOT
from policies import rules
from policies.rules import control_plane, nodes
from policies.rules.inputs import (
    EKS_CLUSTER,
    EKS_MNG,
    HELM_CHART_V4,
    K8S_CONFIGMAP,
    K8S_NETWORK_POLICY,
    K8S_SECRET,
    LAUNCH_TEMPLATE,
    RAY_TYPES,
    SECURITY_GROUP,
    SG_INGRESS_RULE,
    plain,
)
from policies.rules.secrets import secret_like
from serving.spec import API_KEYS_ENV
from tests.conftest import STACKS
from tests.policies.harness import scan, violations
from tools import mock_runtime, stackfile
from tools.mock_runtime import Registered

REQUIRED = {
    "eks-endpoint-allow-list",
    "eks-secrets-encryption",
    "eks-control-plane-logging",
    "nodes-imdsv2-required",
    "gpu-nodes-tainted",
    "efa-single-zone",
    "helm-charts-pinned",
    "images-pinned",
    "ray-head-no-gpu",
    "secrets-by-reference",
    "no-open-ingress",
}
# Advisory findings the shipped stacks make on purpose: none (dev's API endpoint is private since
# its allow-list was a documentation range, issue 10).
EXPECTED_ADVISORIES: dict[str, set[tuple[str, str]]] = {}


@pytest.fixture(scope="module")
def capacity_block() -> mock_runtime.RunResult:
    """prod with its prefill pool on a Capacity Block (its launch template `gpu-prefill-lt` targets the Block)."""
    values, secrets, others = stackfile.read_as_deployed("prod")
    values = copy.deepcopy(values)
    values["nodePools"]["prefill"].update(capacityType="capacity-block", capacityReservationId="cr-0123456789abcdef0")
    return mock_runtime.run("prod", values, secrets, others)


@pytest.fixture(scope="module")
def resources(rendered_stacks, capacity_block) -> dict[str, list[Registered]]:
    out = {s: r.result.resources for s, r in rendered_stacks.items()}
    out["prod-capacity-block"] = capacity_block.resources
    return out


# --- the pack itself ----------------------------------------------------------------------------
def test_rules_are_well_formed() -> None:
    names = [r.name for r in rules.RULES]
    assert len(set(names)) == len(names)
    assert set(names) >= REQUIRED
    for rule, policy in zip(rules.RULES, rules.POLICIES, strict=False):
        assert policy.name == rule.name and policy.description and policy.enforcement_level is rule.level
        assert rule.level in (EnforcementLevel.MANDATORY, EnforcementLevel.ADVISORY)
        assert policy.has_validation()
    assert {r.name for r in rules.RULES if r.level is EnforcementLevel.MANDATORY} >= REQUIRED
    assert {r.name for r in rules.RULES if r.level is EnforcementLevel.ADVISORY} == {
        "no-spot-in-prod",
        "eks-endpoint-private",
    }


def test_entry_point_only_assembles_the_pack() -> None:
    # Never import __main__: PolicyPack() serves forever. Read it instead.
    tree = ast.parse((ROOT / "policies" / "__main__.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"sys", "pathlib", "pulumi_policy", "rules"}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "PolicyPack"]
    assert len(calls) == 1
    kwargs = {k.arg: k.value for k in calls[0].keywords}
    assert getattr(kwargs["policies"], "id", None) == "POLICIES"
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


def test_pack_pins_match_the_program() -> None:
    def pins(path: Path) -> dict[str, str]:
        out = {}
        for line in path.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
            if m:
                out[m.group(1).lower()] = m.group(2)
        return out

    pack = pins(ROOT / "policies" / "requirements.txt")
    program = {**pins(ROOT / "requirements.txt"), **pins(ROOT / "requirements-dev.txt")}
    assert pack["pulumi-policy"] == program["pulumi-policy"]
    assert pack["pulumi"] == program["pulumi"]
    text = (ROOT / "policies" / "PulumiPolicy.yaml").read_text()
    assert re.search(r"^\s+name: python$", text, re.M) and "virtualenv: venv" in text


def test_constants_agree_with_the_program() -> None:
    assert nodes.GPU_TAINT_KEY == GPU_TAINT_KEY
    assert set(control_plane.REQUIRED_LOG_TYPES) <= set(LOG_TYPES)
    assert secret_like(API_KEYS_ENV) and secret_like(HF_TOKEN_ENV)


# --- every stack: clean ---------------------------------------------------------------------------
def test_the_shipped_stacks_are_all_scanned(resources) -> None:
    assert {"dev", "staging", "prod"} <= set(STACKS) and set(resources) >= set(STACKS)
    types = {r.type for rs in resources.values() for r in rs}
    # The types the mandatory rules are about are all there (so "clean" means something).
    for t in (
        EKS_CLUSTER,
        EKS_MNG,
        HELM_CHART_V4,
        RAY_TYPES[0],
        K8S_NETWORK_POLICY,
        K8S_SECRET,
        LAUNCH_TEMPLATE,
        "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
    ):
        assert t in types, t
    # The OpenAI API's Service is KubeRay's, from spec.serveService: every RayService has one.
    for rs in resources.values():
        for r in rs:
            if r.type == RAY_TYPES[0]:
                assert r.inputs["spec"]["serveService"]["spec"]["ports"], r.name


@pytest.mark.parametrize("stack", [*STACKS, "prod-capacity-block"])
def test_every_rule_over_every_stack(stack: str, resources) -> None:
    found = scan(resources[stack], "prod" if stack == "prod-capacity-block" else stack)
    mandatory = {r.name for r in rules.RULES if r.level is EnforcementLevel.MANDATORY}
    assert {k: v for k, v in found.items() if k in mandatory and v} == {}
    advisories = {(k, name) for k, v in found.items() if k not in mandatory for name, _ in v}
    if stack in ("dev", "staging", "prod", "prod-capacity-block"):  # stacks added later may choose otherwise
        assert advisories == EXPECTED_ADVISORIES.get(stack, set())


# --- crafted violations: each rule fires ---------------------------------------------------------------
def _one(resources: dict[str, list[Registered]], stack: str, type_: str, name: str | None = None) -> Registered:
    found = [r for r in resources[stack] if r.type == type_ and (name is None or r.name == name)]
    assert len(found) == 1, (stack, type_, name, [r.name for r in found])
    return copy.deepcopy(found[0])


def _head(rs: dict[str, Any]) -> dict[str, Any]:
    return rs["spec"]["rayClusterConfig"]["headGroupSpec"]


def _worker(rs: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][i]


def _container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


RAYSERVICE = RAY_TYPES[0]


def _drop_nixl_backends(inputs: dict[str, Any]) -> None:
    """Remove kv_connector_extra_config.backends: vLLM then uses its default, UCX."""
    doc = yaml.safe_load(inputs["spec"]["serveConfigV2"])
    for app in doc["applications"]:
        for side in ("prefill_config", "decode_config"):
            kv = app["args"][side]["engine_kwargs"]["kv_transfer_config"]
            # staging's prefill pool has a KV offload tier: its NIXL config is MultiConnector's first child.
            nixl = kv["kv_connector_extra_config"]["connectors"][0] if kv["kv_connector"] == "MultiConnector" else kv
            nixl["kv_connector_extra_config"].pop("backends")
    inputs["spec"]["serveConfigV2"] = yaml.safe_dump(doc, sort_keys=False)


def _drop_nested_nixl_backends(inputs: dict[str, Any]) -> None:
    """Only the NIXL config that staging's KV offload tier nests under MultiConnector (prefill)."""
    doc = yaml.safe_load(inputs["spec"]["serveConfigV2"])
    kv = doc["applications"][0]["args"]["prefill_config"]["engine_kwargs"]["kv_transfer_config"]
    kv["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"].pop("backends")
    inputs["spec"]["serveConfigV2"] = yaml.safe_dump(doc, sort_keys=False)


Mutate = Callable[[dict[str, Any]], Any]
# (case id, rule, stack, resource type, resource name or None, mutation of a copy of its inputs, what the message must say)
CRAFTED: list[tuple[str, str, str, str, str | None, Mutate, str]] = [
    (
        "nixl-ucx-on-efa",
        "nixl-backend-matches-fabric",
        "prod",
        RAYSERVICE,
        None,
        lambda i: i["spec"].update(serveConfigV2=i["spec"]["serveConfigV2"].replace("LIBFABRIC", "UCX")),
        "falls back to TCP",
    ),
    (
        "nixl-default-backend-on-efa",
        "nixl-backend-matches-fabric",
        "staging",
        RAYSERVICE,
        None,
        _drop_nixl_backends,
        "['UCX']",
    ),
    (
        "nixl-nested-default-backend-on-efa",
        "nixl-backend-matches-fabric",
        "staging",
        RAYSERVICE,
        None,
        _drop_nested_nixl_backends,
        "connectors[0] NIXL backends ['UCX']",
    ),
    (
        "nixl-libfabric-without-efa",
        "nixl-backend-matches-fabric",
        "dev",
        RAYSERVICE,
        None,
        lambda i: i["spec"].update(serveConfigV2=i["spec"]["serveConfigV2"].replace("- UCX", "- LIBFABRIC")),
        "no worker group has EFA",
    ),
    (
        "public-no-allow-list",
        "eks-endpoint-allow-list",
        "prod",
        EKS_CLUSTER,
        None,
        lambda i: i.update(endpointPublicAccess=True),
        "publicAccessCidrs",
    ),
    (
        "public-by-default",
        "eks-endpoint-allow-list",
        "prod",
        EKS_CLUSTER,
        None,
        lambda i: i.pop("endpointPublicAccess"),
        "endpointAccess: private",
    ),
    (
        "allow-list-open",
        "eks-endpoint-allow-list",
        "dev",
        EKS_CLUSTER,
        None,
        lambda i: i.update(endpointPublicAccess=True, publicAccessCidrs=["100.64.0.0/16", "0.0.0.0/0"]),
        "list your own networks",
    ),
    (
        "no-kms-key",
        "eks-secrets-encryption",
        "prod",
        EKS_CLUSTER,
        None,
        lambda i: i.pop("encryptionConfigKeyArn"),
        "encryptionConfigKeyArn",
    ),
    (
        "audit-log-off",
        "eks-control-plane-logging",
        "staging",
        EKS_CLUSTER,
        None,
        lambda i: i.update(enabledClusterLogTypes=["api", "authenticator"]),
        "enabledClusterLogTypes",
    ),
    (
        "no-logs",
        "eks-control-plane-logging",
        "dev",
        EKS_CLUSTER,
        None,
        lambda i: i.pop("enabledClusterLogTypes"),
        "'audit'",
    ),
    (
        "system-imdsv1",
        "nodes-imdsv2-required",
        "prod",
        EKS_MNG,
        "eks-system",
        # The system nodes boot from the stack's template (IMDSv2 there); without it, IMDSv1.
        lambda i: i.pop("launchTemplate"),
        "httpPutResponseHopLimit 1",
    ),
    (
        "gpu-pulumi-eks-imdsv2",
        "nodes-imdsv2-required",
        "dev",
        EKS_MNG,
        "gpu-decode-ng",
        # pulumi-eks's own template for enableIMDSv2 has hop limit 2 (tests.upstream.mng_metadata_options).
        lambda i: (i.pop("launchTemplate"), i.update(enableIMDSv2=True)),
        "hop limit of 2",
    ),
    (
        "template-hop-limit-2",
        "nodes-imdsv2-required",
        "prod",
        LAUNCH_TEMPLATE,
        "gpu-prefill-lt",
        lambda i: i["metadataOptions"].update(httpPutResponseHopLimit=2),
        "httpPutResponseHopLimit is 2",
    ),
    (
        "template-imdsv1",
        "nodes-imdsv2-required",
        "prod-capacity-block",
        LAUNCH_TEMPLATE,
        "gpu-prefill-lt",
        lambda i: i["metadataOptions"].update(httpTokens="optional"),
        "set it to 'required'",
    ),
    (
        "template-no-metadata-options",
        "nodes-imdsv2-required",
        "prod-capacity-block",
        LAUNCH_TEMPLATE,
        "gpu-prefill-lt",
        lambda i: i.pop("metadataOptions"),
        "'required'",
    ),
    (
        "gpu-untainted",
        "gpu-nodes-tainted",
        "prod",
        EKS_MNG,
        "gpu-decode-ng",
        lambda i: i.pop("taints"),
        "nvidia.com/gpu=true:NoSchedule",
    ),
    (
        "gpu-soft-taint",
        "gpu-nodes-tainted",
        "dev",
        EKS_MNG,
        "gpu-prefill-ng",
        lambda i: i["taints"][0].update(effect="PREFER_NO_SCHEDULE"),
        "NO_SCHEDULE",
    ),
    (
        "nvidia-ami-untainted",
        "gpu-nodes-tainted",
        "staging",
        EKS_MNG,
        "gpu-prefill-ng",
        lambda i: (i.pop("gpu", None), i.pop("taints")),
        "add the taint",
    ),
    (
        "efa-three-subnets",
        "efa-single-zone",
        "prod",
        EKS_MNG,
        "gpu-prefill-ng",
        lambda i: i.update(subnetIds=["subnet-a", "subnet-b", "subnet-c"]),
        "exactly one subnet",
    ),
    (
        # EFA pools run on the stack's own launch template (infra/components/gpu_node_pool.py):
        # the placement group is the template's.
        "efa-no-placement-group",
        "efa-single-zone",
        "staging",
        LAUNCH_TEMPLATE,
        "gpu-decode-lt",
        lambda i: i.pop("placement"),
        "placement.groupName",
    ),
    (
        "capacity-block-two-subnets",
        "efa-single-zone",
        "prod-capacity-block",
        EKS_MNG,
        "gpu-prefill-ng",
        lambda i: i.update(subnetIds=["subnet-a", "subnet-b"]),
        "exactly one subnet",
    ),
    (
        "efa-template-unplaced",
        "efa-single-zone",
        "prod-capacity-block",
        LAUNCH_TEMPLATE,
        "gpu-prefill-lt",
        lambda i: (i.pop("instanceMarketOptions"), i.pop("capacityReservationSpecification")),
        "placement.groupName",
    ),
    (
        "chart-range",
        "helm-charts-pinned",
        "prod",
        HELM_CHART_V4,
        "kuberay-chart",
        lambda i: i.update(version="^1.7.0"),
        "pin an exact version",
    ),
    (
        "chart-latest",
        "helm-charts-pinned",
        "dev",
        HELM_CHART_V4,
        "nvidia-device-plugin-chart",
        lambda i: i.update(version="latest"),
        "pin an exact version",
    ),
    (
        "chart-unversioned",
        "helm-charts-pinned",
        "staging",
        HELM_CHART_V4,
        "efa-device-plugin-chart",
        lambda i: i.pop("version"),
        "pin an exact version",
    ),
    (
        "chart-wildcard",
        "helm-charts-pinned",
        "prod",
        HELM_CHART_V4,
        "kuberay-chart",
        lambda i: i.update(version="1.x"),
        "infra/versions.py",
    ),
    (
        "head-image-latest",
        "images-pinned",
        "prod",
        RAYSERVICE,
        None,
        lambda i: _container(_head(i)).update(image="rayproject/ray-llm:latest"),
        "pin a release tag",
    ),
    (
        "worker-image-untagged",
        "images-pinned",
        "staging",
        RAYSERVICE,
        None,
        lambda i: _container(_worker(i, 1)).update(image="rayproject/ray-llm"),
        "or a digest",
    ),
    (
        "worker-image-nightly",
        "images-pinned",
        "dev",
        RAYSERVICE,
        None,
        lambda i: _container(_worker(i)).update(image="rayproject/ray-llm:nightly-py311-cu128"),
        "pin a release tag",
    ),
    (
        "autoscaler-image-floating",
        "images-pinned",
        "prod",
        RAYSERVICE,
        None,
        lambda i: i["spec"]["rayClusterConfig"]["autoscalerOptions"].update(image="rayproject/ray:latest"),
        "pin",
    ),
    (
        "chart-values-image-latest",
        "images-pinned",
        "prod",
        HELM_CHART_V4,
        "kuberay-chart",
        lambda i: i["values"].update(image={"repository": "quay.io/kuberay/operator", "tag": "latest"}),
        "pin the tag",
    ),
    (
        "head-num-gpus",
        "ray-head-no-gpu",
        "prod",
        RAYSERVICE,
        None,
        lambda i: _head(i)["rayStartParams"].update({"num-gpus": "1"}),
        'set it to "0"',
    ),
    (
        "head-num-gpus-unset",
        "ray-head-no-gpu",
        "dev",
        RAYSERVICE,
        None,
        lambda i: _head(i)["rayStartParams"].pop("num-gpus"),
        'set it to "0"',
    ),
    (
        "head-gpu-limit",
        "ray-head-no-gpu",
        "staging",
        RAYSERVICE,
        None,
        lambda i: _container(_head(i))["resources"]["limits"].update({"nvidia.com/gpu": "1"}),
        "remove it",
    ),
    (
        "api-keys-literal",
        "secrets-by-reference",
        "prod",
        RAYSERVICE,
        None,
        lambda i: _container(_head(i)).update(env=[{"name": "PD_API_KEYS", "value": "sk-1,sk-2"}]),
        "secretKeyRef",
    ),
    (
        "hf-token-literal",
        "secrets-by-reference",
        "staging",
        RAYSERVICE,
        None,
        lambda i: _container(_worker(i)).update(env=[{"name": "HF_TOKEN", "value": "hf_x"}]),
        "secretKeyRef",
    ),
    (
        "runtime-env-token",
        "secrets-by-reference",
        "dev",
        RAYSERVICE,
        None,
        lambda i: i["spec"].update(
            serveConfigV2="applications:\n- name: llm\n  runtime_env:\n    env_vars:\n"
            "      HUGGING_FACE_HUB_TOKEN: hf_x\n"
        ),
        "Kubernetes Secret",
    ),
    (
        "fallback-plain-http-in-prod",
        "fallback-https-outside-dev",
        "prod",
        RAYSERVICE,
        None,
        lambda i: i["spec"].update(
            serveConfigV2="applications:\n- name: llm\n  deployments:\n  - name: AuthenticatedIngress\n"
            "    user_config:\n      fallback:\n        base_url: http://api.provider.example/v1\n"
        ),
        "use an https:// baseUrl",
    ),
    (
        "redis-password-literal",
        "secrets-by-reference",
        "prod",
        RAYSERVICE,
        None,
        lambda i: i["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"].update(redisPassword={"value": "hunter2"}),
        "valueFrom.secretKeyRef",
    ),
    (
        "string-data-off-secret",
        "secrets-by-reference",
        "prod",
        K8S_NETWORK_POLICY,
        "llm-netpol",
        lambda i: i.update(stringData={"api-keys": "sk-1"}),
        "only a Secret",
    ),
    (
        "token-in-configmap",
        "secrets-by-reference",
        "prod",
        K8S_NETWORK_POLICY,
        "llm-netpol",
        lambda i: i.update(kind="ConfigMap", data={"OPENAI_API_KEY": "sk-1"}),
        "Kubernetes Secret",
    ),
    (
        "lb-open-v4",
        "no-open-ingress",
        "prod",
        RAY_TYPES[0],
        None,
        lambda i: i["spec"]["serveService"]["spec"].update(loadBalancerSourceRanges=["0.0.0.0/0"]),
        "list the client CIDRs",
    ),
    (
        "lb-no-ranges",
        "no-open-ingress",
        "prod",
        RAY_TYPES[0],
        None,
        lambda i: i["spec"]["serveService"]["spec"].pop("loadBalancerSourceRanges"),
        "serviceAllowedCidrs",
    ),
    (
        "lb-open-by-annotation",
        "no-open-ingress",
        "prod",
        RAY_TYPES[0],
        None,
        lambda i: i["spec"]["serveService"]["metadata"]["annotations"].update(
            {"service.beta.kubernetes.io/load-balancer-source-ranges": "::/0"}
        ),
        "list the client CIDRs",
    ),
    (
        "netpol-open-ipblock",
        "no-open-ingress",
        "dev",
        K8S_NETWORK_POLICY,
        "llm-netpol",
        lambda i: i["spec"]["ingress"][2]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "list the client CIDRs",
    ),
    (
        "netpol-rule-without-from",
        "no-open-ingress",
        "staging",
        K8S_NETWORK_POLICY,
        "llm-netpol",
        lambda i: i["spec"]["ingress"][2].pop("from"),
        "list pod/namespace selectors",
    ),
    (
        "sg-rule-open",
        "no-open-ingress",
        "prod-capacity-block",
        SG_INGRESS_RULE,
        "gpu-prefill-efa-in",
        lambda i: (i.pop("referencedSecurityGroupId"), i.update(cidrIpv4="0.0.0.0/0")),
        "allow only the networks",
    ),
    (
        "sg-inline-open-v6",
        "no-open-ingress",
        "prod",
        "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup",
        None,
        lambda i: i.update(ingress=[{"protocol": "-1", "fromPort": 0, "toPort": 0, "ipv6CidrBlocks": ["::/0"]}]),
        "allow only the networks",
    ),
    (
        "spot-in-prod-by-config",
        "no-spot-in-prod",
        "dev",
        EKS_MNG,
        "gpu-decode-ng",
        lambda i: i,
        "on-demand or a capacity block",
    ),
    (
        "spot-in-prod-by-tag",
        "no-spot-in-prod",
        "prod",
        EKS_MNG,
        "gpu-decode-ng",
        lambda i: i.update(capacityType="SPOT"),
        "on-demand or a capacity block",
    ),
    (
        "public-endpoint-advice",
        "eks-endpoint-private",
        "staging",
        EKS_CLUSTER,
        None,
        lambda i: i.update(endpointPublicAccess=True, publicAccessCidrs=["198.51.100.0/24"]),
        "endpointAccess: private",
    ),
]
# Some cases only make sense with a type other than the one they copy.
_RETYPE = {
    "token-in-configmap": K8S_CONFIGMAP,
    "sg-inline-open-v6": SECURITY_GROUP,
}
_CONFIG = {"spot-in-prod-by-config": {"stack": "prod"}}
_STACK_OF = {"prod-capacity-block": "prod"}


def test_every_rule_has_a_crafted_violation() -> None:
    assert {c[1] for c in CRAFTED} == {r.name for r in rules.RULES}


@pytest.mark.parametrize("case", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_violation_fires(case, resources) -> None:
    case_id, rule_name, stack, type_, name, mutate, hint = case
    res = _one(resources, stack, type_, name)
    stack_name = _STACK_OF.get(stack, stack)
    rule = rules.BY_NAME[rule_name]
    config = _CONFIG.get(case_id)
    if case_id != "spot-in-prod-by-config":  # that one is clean until it is called prod
        assert violations(rule, res.type, res.name, res.inputs, stack_name, config and {}) == []
    mutate(res.inputs)
    found = violations(rule, _RETYPE.get(case_id, res.type), res.name, res.inputs, stack_name, config)
    assert found, f"{rule_name} did not fire for {case_id}"
    assert any(hint in msg for msg in found), f"{case_id}: no message says {hint!r}: {found}"


def test_spot_outside_prod_is_fine(resources) -> None:
    res = _one(resources, "dev", EKS_MNG, "gpu-decode-ng")
    assert res.inputs["capacityType"] == "SPOT"
    rule = rules.BY_NAME["no-spot-in-prod"]
    assert violations(rule, res.type, res.name, res.inputs, "dev") == []
    # The URN's stack counts, and so does a custom list of prod stacks.
    assert violations(rule, res.type, res.name, res.inputs, "prod")
    assert violations(rule, res.type, res.name, res.inputs, "dev", {"prodStacks": ["dev"]})


# --- previews: unknown values ---------------------------------------------------------------------------------
def test_unknown_values_pass_until_known(resources) -> None:
    # During a preview, values from resources not yet created are unknown: no rule may fail on them
    # (they are checked again on `pulumi up`), and none may crash.
    cluster = _one(resources, "prod", EKS_CLUSTER)
    cluster.inputs["encryptionConfigKeyArn"] = UNKNOWN_STRING_VALUE
    cluster.inputs["publicAccessCidrs"] = UNKNOWN_ARRAY_VALUE
    rs = _one(resources, "staging", RAYSERVICE)
    rs.inputs["spec"] = UNKNOWN_OBJECT_VALUE
    pool = _one(resources, "prod", EKS_MNG, "gpu-prefill-ng")
    pool.inputs["subnetIds"] = UNKNOWN_ARRAY_VALUE
    lt = _one(resources, "prod-capacity-block", LAUNCH_TEMPLATE, "gpu-prefill-lt")
    lt.inputs["metadataOptions"]["httpTokens"] = UNKNOWN_STRING_VALUE
    for res in (cluster, rs, pool, lt):
        for rule in rules.RULES:
            if rule.level is EnforcementLevel.MANDATORY:
                assert violations(rule, res.type, res.name, res.inputs, "prod") == [], (rule.name, res.name)


def test_wrapped_secrets_are_unwrapped(resources) -> None:
    # Inputs may still carry Pulumi's secret wrapper (the wire format); the rules see the value inside.
    secret = _one(resources, "prod", K8S_SECRET, "llm-api-keys-secret")
    wrapped = {"4dabf18193072939515e22adb298388d": "1b47061264138c4ac30d75fd1eb44270", "value": "sk-1"}
    secret.inputs["stringData"] = {"api-keys": wrapped}
    assert plain(secret.inputs)["stringData"] == {"api-keys": "sk-1"}
    rs = _one(resources, "prod", RAYSERVICE)
    _container(_head(rs.inputs))["env"].append({"name": "HF_TOKEN", "value": wrapped})
    assert violations(rules.BY_NAME["secrets-by-reference"], rs.type, rs.name, rs.inputs, "prod")
