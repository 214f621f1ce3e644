"""Egress of the ingress pods when the serving spec has an external fallback, as plain data.

What flows through here: the RayService's name and namespace, the VPC CIDR and the
fallback's port -> one `networking.k8s.io/v1` NetworkPolicy selecting the Ray head pods
(the only pods that run the OpenAI ingress, hence the only ones that call the provider).

A NetworkPolicy selects destinations by IP block, pod or namespace, never by host name,
and a provider's addresses change without notice: the provider is reached through "TCP
443 (or the baseUrl's port) to any address". Once a pod is selected by an Egress policy,
everything not listed is refused, so the list also carries what the head already needs:
its own VPC (Ray's worker pods, Redis, the private API endpoint: pod IPs are VPC IPs under
the VPC CNI), DNS, and the EKS Pod Identity agent at 169.254.170.23:80 (AWS EKS user
guide, "Set up the Amazon EKS Pod Identity Agent"). Nothing new is opened: before this
policy the head's egress was not restricted at all. Engine pods are not selected.
"""

from __future__ import annotations

from typing import Any

POD_IDENTITY_AGENT = "169.254.170.23/32"
HTTPS_PORT = 443


def head_selector(name: str) -> dict[str, str]:
    """The labels infra.k8s.rayservice puts on the head pod template."""
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "ray-head"}


def fallback_egress_policy(name: str, namespace: str, vpc_cidr: str, fallback_port: int) -> dict[str, Any]:
    ports = sorted({HTTPS_PORT, fallback_port})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-ingress-egress", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": head_selector(name)},
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"ipBlock": {"cidr": vpc_cidr}}]},
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                {"to": [{"ipBlock": {"cidr": POD_IDENTITY_AGENT}}], "ports": [{"port": 80, "protocol": "TCP"}]},
                # The fallback provider (and AWS APIs: S3, STS): no host can be named here.
                {"ports": [{"port": p, "protocol": "TCP"} for p in ports]},
            ],
        },
    }
