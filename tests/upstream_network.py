"""Upstream network rules, reproduced for the contract tests: how a packet reaches a pod on EKS.

What flows through here: our rendered NetworkPolicies, the serve Service and chart values ->
what the AWS service controller, kube-proxy, the EKS network policy controller and agent, and
the OpenTelemetry collector chart would do with them: which source address a pod sees behind
an NLB, which node security group rules admit a client, which addresses and ports a pod's
egress policy admits. Each function names its source (repository, path, version) and follows
that code's logic; the tests assert on the results. Nothing here is imported by the program.
(`tests/upstream.py` holds the other mirrors; MIRRORS below records where these were read.)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from tests.upstream import Mirror


def _in(ip: str, cidr: str, except_: list[str] | None = None) -> bool:
    addr = ipaddress.ip_address(ip)
    net = ipaddress.ip_network(cidr)
    if addr.version != net.version or addr not in net:
        return False
    return not any(addr in ipaddress.ip_network(e) for e in except_ or [])


def _matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelectorAsSelector(...).Matches: an absent or empty selector matches all
    (matchLabels only: the rendered policies use nothing else)."""
    sel = (selector or {}).get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in sel.items())


# --- kubernetes/cloud-provider-aws v1.35.2 pkg/providers/v1/aws_loadbalancer.go, aws.go ----------
def nlb_node_security_group_rules(
    client_cidrs: list[str], subnet_cidrs: list[str], node_port: int, health_check_port: int
) -> list[tuple[int, str]]:
    """(port, source CIDR) rules `updateInstanceSecurityGroupsForNLB` puts on the nodes'
    security group for an NLB with instance targets: the traffic port (the NodePort) from
    `loadBalancerSourceRanges` (0.0.0.0/0 when none, ensureLoadBalancer), the health-check port
    from the NLB's subnets' CIDRs; the health rule is skipped when the client rule is
    0.0.0.0/0 on the same ports."""
    clients = client_cidrs or ["0.0.0.0/0"]
    rules = [(node_port, c) for c in clients]
    if clients != ["0.0.0.0/0"] or health_check_port != node_port:
        rules += [(health_check_port, c) for c in subnet_cidrs]
    return rules


def security_group_admits(rules: list[tuple[int, str]], source_ip: str, port: int) -> bool:
    return any(p == port and _in(source_ip, c) for p, c in rules)


# --- kubernetes/kubernetes v1.35.0 pkg/proxy/iptables/proxier.go (KUBE-EXT chains) ----------------
def kube_proxy_nodeport_source(
    client_ip: str, entry_node_ip: str, endpoint_node_ips: list[str], external_traffic_policy: str
) -> list[tuple[str, str]] | None:
    """(pod's node, source address the pod sees) for each endpoint a NodePort packet arriving at
    `entry_node_ip` may go to. Cluster: any endpoint, and external traffic is masqueraded to the
    entry node's address (KUBE-EXT-* jumps to KUBE-MARK-MASQ; Kubernetes "Using Source IP",
    kubernetes/website#10151). Local: local endpoints only, no masquerade; none: dropped (None)."""
    if external_traffic_policy == "Cluster":
        return [(node, entry_node_ip) for node in endpoint_node_ips]
    local = [(node, client_ip) for node in endpoint_node_ips if node == entry_node_ip]
    return local or None


# --- aws/aws-network-policy-agent (#56, PR #65: the node's own address is never restricted) -------
def agent_admits_ingress(policy: dict[str, Any], source_ip: str, port: int, pod_node_ip: str) -> bool:
    """Does the agent let `source_ip` reach `port` of a pod the policy selects? Traffic from the
    pod's own node is always admitted (probes); otherwise an ingress rule must admit it by
    ipBlock (pod and namespace peers resolve to pod addresses, never to a node's)."""
    if source_ip == pod_node_ip:
        return True
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            block = peer.get("ipBlock")
            if block and _in(source_ip, block["cidr"], block.get("except")):
                return True
    return False


# --- aws/amazon-network-policy-controller-k8s pkg/resolvers/endpoints.go (v1.1.7 line, main at
# ecc7e6a79394): computeEgressEndpoints, getMatchingServiceClusterIPs; pkg/k8s/service_utils.go ---
@dataclass
class Pod:
    namespace: str
    labels: dict[str, str]
    ip: str


@dataclass
class Service:
    namespace: str
    selector: dict[str, str]
    cluster_ip: str
    ports: list[dict[str, Any]] = field(default_factory=list)  # {"port", "targetPort", "protocol"}


def egress_endpoints(
    policy: dict[str, Any], namespaces: dict[str, dict[str, str]], pods: list[Pod], services: list[Service]
) -> list[dict[str, Any]]:
    """The PolicyEndpoint egress entries ({"cidr", "except", "ports"}) the controller computes.

    A rule without `to` allows every address on its ports; an ipBlock peer is its CIDR; a
    namespace/pod peer is the address of every matching pod plus the ClusterIP of every
    non-headless Service in those namespaces whose selector the peer's pod selector matches,
    on the Service's listen port whose (numeric) targetPort is the rule's port. The agent
    enforces these on the pod's interface, before kube-proxy translates a ClusterIP
    (aws/aws-network-policy-agent#549): an ipBlock never covers a Service address by accident."""
    ns = policy["metadata"]["namespace"]
    out: list[dict[str, Any]] = []
    for rule in policy["spec"].get("egress") or []:
        ports = [{"port": p.get("port"), "protocol": p.get("protocol", "TCP")} for p in rule.get("ports") or []]
        if rule.get("to") is None:
            out.append({"cidr": "0.0.0.0/0", "except": [], "ports": ports})
            continue
        for peer in rule["to"]:
            if "ipBlock" in peer:
                out.append(
                    {"cidr": peer["ipBlock"]["cidr"], "except": peer["ipBlock"].get("except", []), "ports": ports}
                )
                continue
            if "namespaceSelector" in peer:
                names = [n for n, labels in namespaces.items() if _matches(peer["namespaceSelector"], labels)]
            else:
                names = [ns]
            sel = peer.get("podSelector")
            for name in names:
                out += [
                    {"cidr": f"{p.ip}/32", "except": [], "ports": ports}
                    for p in pods
                    if p.namespace == name and _matches(sel, p.labels)
                ]
                for svc in services:
                    if svc.namespace != name or svc.cluster_ip in ("", "None") or not _matches(sel, svc.selector):
                        continue
                    listen = [
                        {"port": sp["port"], "protocol": sp.get("protocol", "TCP")}
                        for want in ports
                        for sp in svc.ports
                        if sp.get("targetPort") == want["port"] and sp.get("protocol", "TCP") == want["protocol"]
                    ]
                    if ports and not listen:
                        continue
                    out.append({"cidr": f"{svc.cluster_ip}/32", "except": [], "ports": listen})
    return out


def agent_admits_egress(endpoints: list[dict[str, Any]], dest_ip: str, port: int, protocol: str = "TCP") -> bool:
    """Is a packet to `dest_ip:port` (as the pod sent it: a Service's ClusterIP, not yet the
    backend pod) admitted by any endpoint entry?"""
    for e in endpoints:
        if not _in(dest_ip, e["cidr"], e["except"]):
            continue
        if not e["ports"] or any(p["port"] == port and p["protocol"] == protocol for p in e["ports"]):
            return True
    return False


# --- open-telemetry/opentelemetry-helm-charts opentelemetry-collector-0.170.0 ---------------------
# templates/service.yaml, templates/_helpers.tpl (selectorLabels, component), templates/_config.tpl
# (servicePortsConfig), values.yaml (ports).
def collector_service(values: dict[str, Any], release: str, namespace: str, cluster_ip: str) -> Service:
    """The collector chart's Service: selector = name/instance + the mode's component label,
    one port per enabled entry of `ports` (servicePort -> containerPort)."""
    component = {"deployment": "standalone-collector", "daemonset": "agent-collector"}.get(values.get("mode", ""))
    selector = {"app.kubernetes.io/name": "opentelemetry-collector", "app.kubernetes.io/instance": release}
    if component:
        selector["component"] = component
    defaults = {"otlp": 4317, "otlp-http": 4318}  # values.yaml: containerPort = servicePort
    ports = [
        {
            "port": port.get("servicePort", defaults[name]),
            "targetPort": port.get("containerPort", defaults[name]),
            "protocol": "TCP",
        }
        for name, port in (values.get("ports") or {}).items()
        if port.get("enabled") and name in defaults
    ]
    return Service(namespace, selector, cluster_ip, ports)


def collector_pod_labels(values: dict[str, Any], release: str) -> dict[str, str]:
    """The collector Deployment's pod labels (selectorLabels + component, templates/deployment.yaml)."""
    return collector_service(values, release, "", "").selector


_CLOUD_PROVIDER_AWS = Mirror(
    "kubernetes/cloud-provider-aws",
    ("pkg/providers/v1/aws_loadbalancer.go (updateInstanceSecurityGroupsForNLB)", "pkg/providers/v1/aws.go"),
    "v1.35.2",
    ("DEFAULT_KUBERNETES_VERSION", "1.35"),
    "EKS runs the cloud controller of its Kubernetes minor version; instance targets (TargetTypeEnumInstance)",
)
_KUBE_PROXY = Mirror(
    "kubernetes/kubernetes",
    ("pkg/proxy/iptables/proxier.go (KUBE-EXT chains)",),
    "v1.35.0",
    ("DEFAULT_KUBERNETES_VERSION", "1.35"),
    "plus kubernetes/website content/en/docs/tutorials/services/source-ip.md and kubernetes/website#10151",
)
_NETWORK_POLICY = Mirror(
    "aws/amazon-network-policy-controller-k8s",
    ("pkg/resolvers/endpoints.go (computeEgressEndpoints, getMatchingServiceClusterIPs)", "pkg/k8s/service_utils.go"),
    "ecc7e6a79394",
    None,
    "main after v1.1.7 (2026-05); the agent side: aws/aws-network-policy-agent#56 (PR #65), #549",
)
_COLLECTOR_CHART = Mirror(
    "open-telemetry/opentelemetry-helm-charts",
    (
        "charts/opentelemetry-collector/templates/service.yaml",
        "charts/opentelemetry-collector/templates/_helpers.tpl",
        "charts/opentelemetry-collector/templates/_config.tpl",
    ),
    "opentelemetry-collector-0.170.0",
    ("OTEL_COLLECTOR.version", "0.170.0"),
)

MIRRORS: dict[str, Mirror] = {
    "nlb_node_security_group_rules": _CLOUD_PROVIDER_AWS,
    "security_group_admits": _CLOUD_PROVIDER_AWS,
    "kube_proxy_nodeport_source": _KUBE_PROXY,
    "agent_admits_ingress": _NETWORK_POLICY,
    "egress_endpoints": _NETWORK_POLICY,
    "agent_admits_egress": _NETWORK_POLICY,
    "collector_service": _COLLECTOR_CHART,
    "collector_pod_labels": _COLLECTOR_CHART,
}
