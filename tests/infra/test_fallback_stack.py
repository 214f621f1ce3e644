"""A stack with serving.fallback, through the real program under Pulumi's mocks and the policy pack.

What is checked: the provider key travels Pulumi secret -> Kubernetes Secret -> secretKeyRef
on the head (where the ingress runs) and nowhere else; the ingress pods get the egress
NetworkPolicy (infra/k8s/egress.py), valid against Kubernetes' OpenAPI schema; the rendered
serveConfigV2 hands the fallback to the ingress as user_config; the config refuses a missing
key and plain http outside dev; the policy pack's rule refuses plain http outside dev.
"""

from __future__ import annotations

import asyncio
import copy

import kubernetes_validate
import pytest
import yaml

from infra import config
from infra.k8s.egress import POD_IDENTITY_AGENT, fallback_egress_policy, head_selector
from policies import rules
from serving.spec import FALLBACK_API_KEY_ENV, INGRESS_DEPLOYMENT
from tests.policies.harness import violations
from tools import mock_runtime, stackfile

PROVIDER_KEY = "sk-provider-secret-value"
FALLBACK = {"baseUrl": "https://api.provider.example/v1", "model": "provider/llama-3.1-8b-instruct"}


def _stack(name="prod", fallback=FALLBACK, key=True):
    # The stack as its owner deploys it: the secrets its config needs set (stand-ins here).
    values, secrets, others = stackfile.read_as_deployed(name)
    values = copy.deepcopy(values)
    values["serving"] = {**values["serving"], "fallback": fallback}
    if key:
        values["fallbackApiKey"] = PROVIDER_KEY
        secrets = secrets | {"fallbackApiKey"}
    return values, secrets, others


@pytest.fixture(scope="module")
def run():
    # Pulumi's mock runtime wants a current event loop; asyncio.run() elsewhere leaves none.
    asyncio.set_event_loop(asyncio.new_event_loop())
    values, secrets, others = _stack()
    return mock_runtime.run("prod", values, secrets, others)


def _by_type(run, t):
    return [r for r in run.resources if r.type == t]


def test_the_provider_key_reaches_only_the_head_by_secret_reference(run):
    secret = [r for r in _by_type(run, "kubernetes:core/v1:Secret") if "fallback" in r.name]
    assert len(secret) == 1
    sname = secret[0].inputs["metadata"]["name"]
    (rs,) = _by_type(run, "kubernetes:ray.io/v1:RayService")
    cluster = rs.inputs["spec"]["rayClusterConfig"]
    head_env = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in head_env if e["name"] == FALLBACK_API_KEY_ENV)
    assert ref["valueFrom"]["secretKeyRef"]["name"] == sname and "value" not in ref
    for g in cluster["workerGroupSpecs"]:
        assert FALLBACK_API_KEY_ENV not in repr(g)
    assert PROVIDER_KEY not in repr(rs.inputs)
    serve = yaml.safe_load(rs.inputs["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    (dep,) = [d for d in app["deployments"] if d["name"] == INGRESS_DEPLOYMENT]
    assert dep["user_config"]["fallback"]["base_url"] == FALLBACK["baseUrl"]
    assert list(dep["user_config"]["fallback"]["models"].values()) == [FALLBACK["model"]]


def test_the_ingress_pods_get_the_egress_policy(run):
    pols = [r for r in _by_type(run, "kubernetes:networking.k8s.io/v1:NetworkPolicy") if "egress" in r.name]
    assert len(pols) == 1
    spec = pols[0].inputs["spec"]
    (rs,) = _by_type(run, "kubernetes:ray.io/v1:RayService")
    head_labels = rs.inputs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= head_labels.items()
    for g in rs.inputs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert not spec["podSelector"]["matchLabels"].items() <= g["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Egress"]


def test_egress_policy_is_valid_kubernetes_and_opens_only_what_it_says():
    pol = fallback_egress_policy("llm", "llm", "10.0.0.0/16", 443, tracing=False)
    kubernetes_validate.validate(pol, "1.35", strict=True)
    rules_ = pol["spec"]["egress"]
    assert rules_[0] == {"to": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]}
    assert {p["port"] for r in rules_ if "to" not in r for p in r["ports"]} == {53, 443}
    assert any(r.get("to") == [{"ipBlock": {"cidr": POD_IDENTITY_AGENT}}] for r in rules_)
    other = fallback_egress_policy("llm", "llm", "10.0.0.0/16", 8443, tracing=False)
    assert {p["port"] for p in other["spec"]["egress"][-1]["ports"]} == {443, 8443}
    assert pol["spec"]["podSelector"]["matchLabels"] == head_selector("llm")


def test_no_fallback_no_secret_no_egress_policy(rendered_stacks):
    for stack in rendered_stacks.values():
        if stack.config.serving.fallback is None:
            names = [r.name for r in stack.result.resources]
            assert not any("fallback" in n or "egress" in n for n in names)


def _error(values, secrets, source="stacks/Pulumi.prod.yaml"):
    with pytest.raises(config.ConfigError) as e:
        config.load(values, secret_keys=secrets, source=source)
    return str(e.value)


def test_config_needs_the_provider_key():
    values, secrets, _ = _stack(key=False)
    assert "fallbackApiKey: serving.fallback is set but no fallbackApiKey secret is set" in _error(values, secrets)


def test_config_refuses_plain_http_outside_dev_and_allows_it_in_dev():
    http = {**FALLBACK, "baseUrl": "http://api.provider.example/v1"}
    values, secrets, _ = _stack(fallback=http)
    assert "serving.fallback.baseUrl: 'http://api.provider.example/v1' is plain http" in _error(values, secrets)
    values, secrets, _ = _stack("dev", fallback=http)
    assert config.load(values, secret_keys=secrets, source="stacks/Pulumi.dev.yaml").serving.fallback.plain_http


def _rayservice_inputs(url):
    serve = {
        "applications": [
            {
                "name": "llm",
                "deployments": [{"name": INGRESS_DEPLOYMENT, "user_config": {"fallback": {"base_url": url}}}],
            }
        ]
    }
    return {"spec": {"serveConfigV2": yaml.safe_dump(serve), "rayClusterConfig": {}}}


@pytest.mark.parametrize(
    "stack,url,refused",
    [
        ("prod", "http://api.provider.example/v1", True),
        ("staging", "HTTP://api.provider.example/v1", True),
        ("prod", "https://api.provider.example/v1", False),
        ("dev", "http://10.0.0.5:8000/v1", False),
    ],
)
def test_policy_refuses_plain_http_fallback_outside_dev(stack, url, refused):
    rule = rules.BY_NAME["fallback-https-outside-dev"]
    found = violations(rule, "kubernetes:ray.io/v1:RayService", "llm-rayservice", _rayservice_inputs(url), stack)
    assert bool(found) == refused, found
    if refused:
        assert "plain http" in found[0] and "https://" in found[0]


def test_policy_passes_the_rendered_stack(run):
    (rs,) = _by_type(run, "kubernetes:ray.io/v1:RayService")
    rule = rules.BY_NAME["fallback-https-outside-dev"]
    assert violations(rule, rs.type, rs.name, rs.inputs, "prod") == []
