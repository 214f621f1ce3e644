"""Packets the stack's NetworkPolicies must let through, walked hop by hop through upstream rules.

What flows through here: the rendered stacks (Pulumi mocks: the namespace's ingress policy, the
serve Service, the head's egress policy with a fallback, the collector chart's values) -> the
path a packet takes, each hop as its upstream code decides (tests/upstream_network.py):
- a client of the internal NLB: the node security group rules the AWS service controller
  writes (kubernetes/cloud-provider-aws v1.35.2 `updateInstanceSecurityGroupsForNLB`, instance
  targets), kube-proxy's NodePort forwarding with `externalTrafficPolicy: Cluster`
  (kubernetes/kubernetes v1.35.0 pkg/proxy/iptables/proxier.go; kubernetes/website#10151:
  the source becomes the forwarding node's address) and the EKS network policy agent, which
  admits only the pod's own node without a rule (aws/aws-network-policy-agent#56, PR #65);
- the head's spans to the trace collector when a fallback restricts its egress: the agent
  checks the Service's ClusterIP before translation (aws/aws-network-policy-agent#549) against
  what the policy controller resolves (aws/amazon-network-policy-controller-k8s
  pkg/resolvers/endpoints.go `getMatchingServiceClusterIPs`), for the Service the collector
  chart renders (open-telemetry/opentelemetry-helm-charts opentelemetry-collector-0.170.0).
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress

import kubernetes_validate
import pytest

from infra.components.network import subnet_cidrs
from infra.k8s import tracing
from infra.k8s.api_access import namespace_ingress_policy
from infra.k8s.egress import collector_egress_rule, fallback_egress_policy
from infra.k8s.monitoring import MONITORING_NAMESPACE
from serving.spec import SERVE_PORT
from tests.upstream_network import (
    Pod,
    agent_admits_egress,
    agent_admits_ingress,
    collector_pod_labels,
    collector_service,
    egress_endpoints,
    kube_proxy_nodeport_source,
    nlb_node_security_group_rules,
    security_group_admits,
)
from tools import mock_runtime, stackfile

NETPOL = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"
NODE_PORT, HEALTH_PORT = 31234, 32456  # what Kubernetes would allocate; any will do
SERVICE_CIDR = "172.20.0.0/16"  # EKS's default service range (10.100.0.0/16 when the VPC is in 10/8)


def _run(stack: str, secrets_added: frozenset[str] = frozenset(), **changes):
    """The stack as deployed (its secrets set), with `changes` to its values, under mocks."""
    asyncio.set_event_loop(asyncio.new_event_loop())
    values, secrets, others = stackfile.read_as_deployed(stack)
    values = copy.deepcopy(values)
    values.update(changes)
    return mock_runtime.run(stack, values, secrets | secrets_added, others), values


def _policy(result, name: str) -> dict:
    (r,) = [r for r in result.of_type(NETPOL) if r.inputs["metadata"]["name"] == name]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", **r.inputs}


def _node_ips(vpc_cidr: str, zones: int) -> list[str]:
    """A few node addresses in each private subnet of the VPC (infra/components/network.py)."""
    private, _ = subnet_cidrs(vpc_cidr, zones)
    return [str(ipaddress.ip_network(s)[i]) for s in private for i in (10, 200)]


# --- 1. clients of the internal NLB -------------------------------------------------------------
PEERED = "172.16.0.0/12"  # a client range outside the VPC (a peered VPC, an on-premises network)


@pytest.mark.parametrize(
    "allowed, client",
    [
        ([PEERED], "172.16.20.7"),  # the case prod's 10.0.0.0/8 hid: clients outside the VPC range
        (None, "10.12.3.4"),  # prod as shipped: 10.0.0.0/8 covers its VPC
    ],
)
def test_nlb_clients_reach_the_serving_pod_from_any_node(allowed, client):
    changes = {"serviceAllowedCidrs": allowed} if allowed else {}
    result, values = _run("prod", **changes)
    assert values["serviceExposure"] == "internal-nlb"
    rs = result.one(RAYSERVICE).inputs["spec"]["serveService"]
    assert rs["spec"]["type"] == "LoadBalancer"
    etp = rs["spec"].get("externalTrafficPolicy", "Cluster")  # the Kubernetes default
    allowed_cidrs = rs["spec"]["loadBalancerSourceRanges"]
    assert allowed_cidrs == values["serviceAllowedCidrs"]
    policy = _policy(result, "llm-ingress")
    kubernetes_validate.validate(policy, "1.35", strict=True)
    zones = len(values["availabilityZones"])
    nodes = _node_ips(values["vpcCidr"], zones)
    # An internal NLB sits in the private subnets (their CIDRs: its health checks' sources).
    sg = nlb_node_security_group_rules(allowed_cidrs, subnet_cidrs(values["vpcCidr"], zones)[0], NODE_PORT, HEALTH_PORT)
    assert security_group_admits(sg, client, NODE_PORT)
    pod_node = nodes[-1]
    refused = []
    for entry in nodes:  # the NLB spreads connections over every registered node
        for node, source in kube_proxy_nodeport_source(client, entry, [pod_node], etp) or []:
            if not agent_admits_ingress(policy, source, SERVE_PORT, node):
                refused.append(f"{client} via node {entry} arrives from {source}")
    assert not refused, refused


def test_a_client_outside_the_allowed_cidrs_is_stopped_at_the_node_security_group():
    """Admitting the VPC range on the pods does not widen who may use the NLB."""
    result, values = _run("prod", serviceAllowedCidrs=[PEERED])
    spec = result.one(RAYSERVICE).inputs["spec"]["serveService"]["spec"]
    private = subnet_cidrs(values["vpcCidr"], len(values["availabilityZones"]))[0]
    sg = nlb_node_security_group_rules(spec["loadBalancerSourceRanges"], private, NODE_PORT, HEALTH_PORT)
    vpc_host = str(ipaddress.ip_network(private[0])[77])
    assert not security_group_admits(sg, "192.168.1.1", NODE_PORT)
    assert not security_group_admits(sg, vpc_host, NODE_PORT)  # a VPC host, too: only on the health port
    assert security_group_admits(sg, vpc_host, HEALTH_PORT)
    assert security_group_admits(sg, "172.16.20.7", NODE_PORT)


def test_without_the_nlb_the_serve_port_admits_the_clients_only():
    nlb = namespace_ingress_policy("llm", "llm", [PEERED], "10.40.0.0/16", behind_nlb=True)
    cluster_ip = namespace_ingress_policy("llm", "llm", [PEERED], "10.40.0.0/16", behind_nlb=False)
    covered = namespace_ingress_policy("llm", "llm", ["10.0.0.0/8"], "10.40.0.0/16", behind_nlb=True)

    def sources(p):
        return [b["ipBlock"]["cidr"] for b in p["spec"]["ingress"][-1]["from"]]

    assert sources(nlb) == [PEERED, "10.40.0.0/16"]
    assert sources(cluster_ip) == [PEERED]
    assert sources(covered) == ["10.0.0.0/8"]  # already covered: no second rule
    for p in (nlb, cluster_ip):
        assert p["spec"]["ingress"][-1]["ports"] == [{"port": SERVE_PORT, "protocol": "TCP"}]
        kubernetes_validate.validate(p, "1.35", strict=True)


# --- 2. spans from the head when a fallback restricts its egress ---------------------------------
FALLBACK = {"baseUrl": "https://api.provider.example/v1", "model": "provider/llama-3.1-8b-instruct"}


def _cluster(namespace: str, head_labels: dict[str, str]):
    """The pods and Services the head talks to: the collector (as its chart renders it) and a worker."""
    values = tracing.collector_values()
    svc = collector_service(values, tracing.COLLECTOR_RELEASE, MONITORING_NAMESPACE, "172.20.47.11")
    assert ipaddress.ip_address(svc.cluster_ip) in ipaddress.ip_network(SERVICE_CIDR)
    namespaces = {n: {"kubernetes.io/metadata.name": n} for n in (namespace, MONITORING_NAMESPACE, "kube-system")}
    pods = [
        Pod(MONITORING_NAMESPACE, collector_pod_labels(values, tracing.COLLECTOR_RELEASE), "10.40.131.5"),
        Pod(namespace, head_labels, "10.40.130.4"),
    ]
    return namespaces, pods, [svc]


@pytest.mark.parametrize("tracing_on", [True, False])
def test_the_head_reaches_the_collector_service_when_a_fallback_restricts_its_egress(tracing_on):
    serving = {**stackfile.read("prod")[0]["serving"], "fallback": FALLBACK}
    obs = {} if tracing_on else {"observability": {"tracing": {"enabled": False}}}
    result, _ = _run("prod", frozenset({"fallbackApiKey"}), serving=serving, fallbackApiKey="sk-provider", **obs)
    policy = _policy(result, "llm-ingress-egress")
    kubernetes_validate.validate(policy, "1.35", strict=True)
    head = result.one(RAYSERVICE).inputs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]
    namespaces, pods, services = _cluster("llm", head["labels"])
    endpoints = egress_endpoints(policy, namespaces, pods, services)
    collector = services[0]
    assert agent_admits_egress(endpoints, collector.cluster_ip, tracing.COLLECTOR_OTLP_GRPC_PORT) is tracing_on
    # What it reached before stays reachable: a worker pod, DNS, the provider; nothing else opens.
    assert agent_admits_egress(endpoints, "10.40.140.8", 8265)
    assert agent_admits_egress(endpoints, "172.20.0.10", 53, "UDP")
    assert agent_admits_egress(endpoints, "203.0.113.9", 443)
    assert not agent_admits_egress(endpoints, collector.cluster_ip, 4318)
    assert not agent_admits_egress(endpoints, "172.20.9.9", tracing.COLLECTOR_OTLP_GRPC_PORT)  # another Service


def test_an_ip_block_for_the_vpc_does_not_cover_the_collector_service():
    """Why the rule names the collector's namespace and pods: the old policy's VPC ipBlock
    reaches the collector's pod address, never its Service address, which is what the head dials."""
    namespaces, pods, services = _cluster("llm", {"app.kubernetes.io/component": "ray-head"})
    without = fallback_egress_policy("llm", "llm", "10.40.0.0/16", 443, tracing=False)
    endpoints = egress_endpoints(without, namespaces, pods, services)
    assert agent_admits_egress(endpoints, pods[0].ip, tracing.COLLECTOR_OTLP_GRPC_PORT)
    assert not agent_admits_egress(endpoints, services[0].cluster_ip, tracing.COLLECTOR_OTLP_GRPC_PORT)
    rule = collector_egress_rule()
    assert rule["to"][0]["podSelector"]["matchLabels"].items() <= services[0].selector.items()
