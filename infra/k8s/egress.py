"""Egress of the ingress pods when the serving spec has an external fallback, as plain data.

What flows through here: the RayService's name and namespace, the VPC CIDR, the
fallback's port and whether request tracing is on -> one `networking.k8s.io/v1`
NetworkPolicy selecting the Ray head pods (the only pods that run the OpenAI ingress, hence
the only ones that call the provider).

A NetworkPolicy selects destinations by IP block, pod or namespace, never by host name,
and a provider's addresses change without notice: the provider is reached through "TCP
443 (or the baseUrl's port) to any address". Once a pod is selected by an Egress policy,
everything not listed is refused, so the list also carries what the head already needs:
its own VPC (Ray's worker pods, Redis, the private API endpoint: pod IPs are VPC IPs under
the VPC CNI), DNS, and the EKS Pod Identity agent at 169.254.170.23:80 (AWS EKS user
guide, "Set up the Amazon EKS Pod Identity Agent") and, with tracing on, the trace
collector. Nothing new is opened: before this policy the head's egress was not restricted
at all. Engine pods are not selected.

In-cluster Services are listed by namespace and pod selector, never by address: the EKS
network policy agent checks egress on the pod's own interface, before kube-proxy translates
a Service's ClusterIP (aws/aws-network-policy-agent#549), and ClusterIPs come from the
service range (172.20.0.0/16 or 10.100.0.0/16), not the VPC's. For a selector, the policy
controller adds the ClusterIP of every Service whose selector the pod selector matches
(aws/amazon-network-policy-controller-k8s pkg/resolvers/endpoints.go
getMatchingServiceClusterIPs); an ipBlock gets no such help. So the collector's rule names
its namespace and the labels of its Service's selector, on the OTLP port.
"""

from __future__ import annotations

from typing import Any

from infra.k8s.monitoring import MONITORING_NAMESPACE
from infra.k8s.tracing import COLLECTOR_OTLP_GRPC_PORT, COLLECTOR_POD_LABELS

POD_IDENTITY_AGENT = "169.254.170.23/32"
HTTPS_PORT = 443


def head_selector(name: str) -> dict[str, str]:
    """The labels infra.k8s.rayservice puts on the head pod template."""
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "ray-head"}


def collector_egress_rule() -> dict[str, Any]:
    """The trace collector's pods (and so its Service's ClusterIP), on OTLP/gRPC only."""
    return {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}},
                "podSelector": {"matchLabels": dict(COLLECTOR_POD_LABELS)},
            }
        ],
        "ports": [{"port": COLLECTOR_OTLP_GRPC_PORT, "protocol": "TCP"}],
    }


def fallback_egress_policy(
    name: str, namespace: str, vpc_cidr: str, fallback_port: int, *, tracing: bool
) -> dict[str, Any]:
    """The head pods' egress: what they already reached, plus the fallback provider's port.

    Args:
        name: the RayService's name (its head pod labels).
        namespace: the LLM namespace.
        vpc_cidr: the VPC's range (worker pods, Redis, the private API endpoint).
        fallback_port: the fallback provider's port (443 or the baseUrl's).
        tracing: request tracing is on: the head sends spans to the collector.
    """
    ports = sorted({HTTPS_PORT, fallback_port})
    egress: list[dict[str, Any]] = [
        {"to": [{"ipBlock": {"cidr": vpc_cidr}}]},
        {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
        {"to": [{"ipBlock": {"cidr": POD_IDENTITY_AGENT}}], "ports": [{"port": 80, "protocol": "TCP"}]},
        # The fallback provider (and AWS APIs: S3, STS): no host can be named here.
        {"ports": [{"port": p, "protocol": "TCP"} for p in ports]},
    ]
    if tracing:
        egress.append(collector_egress_rule())
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ingress-egress", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": head_selector(name)},
            "policyTypes": ["Egress"],
            "egress": egress,
        },
    }
