"""Who may reach the LLM namespace's pods, as plain data: its ingress NetworkPolicy.

What flows through here: the RayService's name and namespace, the client CIDRs
(`serviceAllowedCidrs`), the VPC range and whether the API is behind an internal NLB -> one
`networking.k8s.io/v1` NetworkPolicy over every pod of the namespace: all traffic between its
own pods, the KubeRay operator's namespace, and the API's clients on the Serve port.

Behind the internal NLB the clients' own addresses do not reach the pods. Without the AWS
Load Balancer Controller, EKS's service controller registers instance targets (the nodes'
NodePort; kubernetes/cloud-provider-aws pkg/providers/v1/aws_loadbalancer.go), and with the
Service's default `externalTrafficPolicy: Cluster` kube-proxy on the node the NLB picked
forwards to the serving pod, wherever it runs, after rewriting the source to that node's own
address (Kubernetes "Using Source IP"; kubernetes/website#10151). The EKS network policy agent
admits the pod's own node without a rule (aws/aws-network-policy-agent#56, PR #65), any other
node only by a rule. So the Serve port also admits the VPC range (the nodes' addresses) when
the API is behind the NLB, unless a client CIDR already covers it; which clients may reach
the NLB at all stays with the NLB: its `loadBalancerSourceRanges` become the node security
group's rules for the NodePort (cloud-provider-aws `updateInstanceSecurityGroupsForNLB`), and
the NLB keeps the client's address up to the node (instance targets preserve it).

Not `externalTrafficPolicy: Local`, which keeps client addresses up to the pod: the NLB would
then send only to the node running the serving pod, found by its health check (HTTP on the
Service's healthCheckNodePort, 10 s interval, 2 checks either way: cloud-provider-aws
`buildNLBHealthCheckConfiguration`), and every NewCluster upgrade moves the serving pods to
other nodes: about 20 s in which the NLB sends to a node that drops the traffic.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from infra.k8s.labels import KUBERAY_NAMESPACE
from serving.spec import SERVE_PORT


def api_sources(allowed_cidrs: list[str], vpc_cidr: str, *, behind_nlb: bool) -> list[str]:
    """The CIDRs admitted on the Serve port: the client CIDRs (the VPC when none are given),
    plus the VPC range behind the NLB (the forwarding nodes) unless a client CIDR covers it."""
    sources = list(allowed_cidrs) or [vpc_cidr]
    vpc = ipaddress.ip_network(vpc_cidr)
    nets = [ipaddress.ip_network(c) for c in sources]
    if behind_nlb and not any(n.version == vpc.version and vpc.subnet_of(n) for n in nets):  # type: ignore[arg-type]
        sources.append(vpc_cidr)
    return sources


def namespace_ingress_policy(
    name: str, namespace: str, allowed_cidrs: list[str], vpc_cidr: str, *, behind_nlb: bool
) -> dict[str, Any]:
    """The namespace's ingress NetworkPolicy.

    Args:
        name: the RayService's name (the policy is `<name>-ingress`).
        namespace: the LLM namespace; the policy selects every pod in it.
        allowed_cidrs: the API's client CIDRs (`serviceAllowedCidrs`).
        vpc_cidr: the VPC's range.
        behind_nlb: the API is exposed through the internal NLB (`serviceExposure: internal-nlb`).
    """
    sources = api_sources(allowed_cidrs, vpc_cidr, behind_nlb=behind_nlb)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ingress", "namespace": namespace},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": KUBERAY_NAMESPACE}}}]},
                {
                    "from": [{"ipBlock": {"cidr": c}} for c in sources],
                    "ports": [{"port": SERVE_PORT, "protocol": "TCP"}],
                },
            ],
        },
    }
