"""Pod-level hardening of the Ray pods, which checkov cannot see inside a RayService.

What flows through here: every shipped stack's rendered manifests -> the RayService's head
and worker pod templates (and the autoscaler sidecar's settings), the ServiceAccounts, the
NetworkPolicy and the Namespace of the LLM service -> the rules checkov applies to plain
pods, applied here: non-root as the image's own user, no privilege escalation, every
capability dropped, requests and limits on every container, a service-account token only
where the autoscaler needs it (the head), dedicated service accounts, no host namespaces or
host paths, a NetworkPolicy over the whole namespace.

The device plugins are the documented exceptions: their DaemonSets must be privileged (they
register devices with the kubelet through a hostPath socket), so they run from their pinned
charts in their own namespaces, never in the workload namespace.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra.k8s.rayservice import RAY_UID
from infra.paths import ROOT
from tests.conftest import STACKS

# Helm releases allowed to run privileged pods, with why; every other release must not be.
PRIVILEGED_EXCEPTIONS = {
    "nvidia-device-plugin": "registers nvidia.com/gpu with the kubelet over a hostPath socket",
    "aws-efa-k8s-device-plugin": "registers vpc.amazonaws.com/efa with the kubelet over a hostPath socket",
    # Monitoring (infra/components/observability.py), outside the workload namespace.
    "kube-prometheus-stack": "its node-exporter reads host metrics with hostNetwork, hostPID and read-only hostPath mounts",
    "dcgm-exporter": "reads GPU telemetry through the driver as root with CAP_SYS_ADMIN (DCGM profiling counters) "
    "and the kubelet's pod-resources socket (hostPath)",
}
# Reviewed: no privileged container, host path or host network in the values we give them (the
# collector's presets that mount host paths stay off; Tempo runs as its non-root user).
UNPRIVILEGED_CHARTS = {"kuberay-operator", "cluster-autoscaler", "opentelemetry-collector", "tempo"}


def _pod_problems(spec: dict[str, Any], role: str) -> list[str]:
    """What is wrong with one Ray pod template's spec, in checkov's terms ([] if nothing)."""
    problems: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(f"{flag} is on")
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            problems.append(f"volume {v.get('name')} is a hostPath")
    sa = spec.get("serviceAccountName")
    if not sa or sa == "default":
        problems.append("no dedicated service account")
    token = spec.get("automountServiceAccountToken")
    if role == "worker" and token is not False:
        problems.append("a worker mounts a service-account token (only the head's autoscaler needs one)")
    if (pod_sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        problems.append("pod seccompProfile is not RuntimeDefault")
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    if not containers:
        problems.append("no containers")
    for c in containers:
        name = c.get("name")
        sc = c.get("securityContext") or {}
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if non_root is not True:
            problems.append(f"{name}: runAsNonRoot is not set")
        if uid != RAY_UID:
            problems.append(f"{name}: runs as uid {uid}, not the image's ray user ({RAY_UID})")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{name}: capabilities are not all dropped")
        if caps.get("add"):
            problems.append(f"{name}: adds capabilities {caps['add']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"{name}: hostPort {port['hostPort']}")
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if not (res.get(kind) or {}).get(r):
                    problems.append(f"{name}: no {r} {kind}")
    return problems


def _objects(rendered, kind: str) -> list[dict[str, Any]]:
    return [o for o in rendered.manifests().values() if o.get("kind") == kind]


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _rayservice(rendered) -> dict[str, Any]:
    (rs,) = _objects(rendered, "RayService")
    return rs


def _groups(rs: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    cluster = rs["spec"]["rayClusterConfig"]
    out = [("head", "head", cluster["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], "worker", g["template"]["spec"]) for g in cluster["workerGroupSpecs"]]
    return out


def test_ray_pods_are_hardened(stack) -> None:
    problems = {group: p for group, role, spec in _groups(_rayservice(stack)) if (p := _pod_problems(spec, role))}
    assert problems == {}


def test_autoscaler_sidecar_is_hardened_and_bounded(stack) -> None:
    opts = _rayservice(stack)["spec"]["rayClusterConfig"]["autoscalerOptions"]
    sc = opts["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and "ALL" in sc["capabilities"]["drop"]
    assert sc["runAsNonRoot"] is True and not sc.get("privileged")
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(opts["resources"][kind])


def test_only_the_head_mounts_a_token_through_dedicated_accounts(stack) -> None:
    rs = _rayservice(stack)
    ns = rs["metadata"]["namespace"]
    accounts = {(sa["metadata"]["namespace"], sa["metadata"]["name"]): sa for sa in _objects(stack, "ServiceAccount")}
    head_sa = {spec["serviceAccountName"] for _, role, spec in _groups(rs) if role == "head"}
    worker_sa = {spec["serviceAccountName"] for _, role, spec in _groups(rs) if role == "worker"}
    assert len(head_sa) == 1 and len(worker_sa) == 1 and head_sa.isdisjoint(worker_sa)
    for name in head_sa | worker_sa:
        assert (ns, name) in accounts, f"service account {name} is not declared in {ns}"
    (head,) = head_sa
    (worker,) = worker_sa
    # The head's autoscaler sidecar calls the API server; nothing else in the pods does.
    assert accounts[(ns, head)].get("automountServiceAccountToken") is True
    assert accounts[(ns, worker)].get("automountServiceAccountToken") is False
    head_spec = next(spec for _, role, spec in _groups(rs) if role == "head")
    assert head_spec.get("automountServiceAccountToken") is not False


def test_a_network_policy_covers_the_namespace(stack) -> None:
    ns = _rayservice(stack)["metadata"]["namespace"]
    policies = [p for p in _objects(stack, "NetworkPolicy") if p["metadata"]["namespace"] == ns]
    covering = [p for p in policies if p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]]
    assert covering, f"no NetworkPolicy selects every pod of {ns}"
    for p in covering:
        assert all(rule.get("from") for rule in p["spec"]["ingress"]), "an ingress rule without 'from' admits anyone"


def test_workload_namespace_enforces_pod_security(stack) -> None:
    ns = _rayservice(stack)["metadata"]["namespace"]
    (namespace,) = [n for n in _objects(stack, "Namespace") if n["metadata"]["name"] == ns]
    labels = namespace["metadata"].get("labels") or {}
    assert labels.get("pod-security.kubernetes.io/enforce") in ("baseline", "restricted")


def test_privileged_pods_are_only_the_documented_device_plugins(stack) -> None:
    ns = _rayservice(stack)["metadata"]["namespace"]
    releases = [o for o in stack.manifests().values() if "helmRelease" in o]
    charts = {r["chart"] for r in releases}
    assert charts <= set(PRIVILEGED_EXCEPTIONS) | UNPRIVILEGED_CHARTS, f"unreviewed chart(s): {charts}"
    for r in releases:
        assert r["namespace"] != ns, f"{r['chart']} installs into the workload namespace {ns}"
    doc = (ROOT / "docs" / "guardrails.md").read_text()
    for chart in PRIVILEGED_EXCEPTIONS:
        assert chart in doc, f"the privileged exception {chart} is not documented in docs/guardrails.md"


# --- the checks can fail -------------------------------------------------------------------------------
def test_the_pod_checks_catch_a_bad_template(rendered_stacks) -> None:
    rs = _rayservice(rendered_stacks["prod"])
    _, _, worker = _groups(rs)[1]
    bad = {
        **worker,
        "hostNetwork": True,
        "serviceAccountName": "default",
        "automountServiceAccountToken": True,
        "volumes": [*worker["volumes"], {"name": "host", "hostPath": {"path": "/"}}],
        "containers": [
            {
                **worker["containers"][0],
                "securityContext": {"runAsUser": 0, "privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                "resources": {"limits": {"cpu": "1"}},
                "ports": [{"containerPort": 8000, "hostPort": 8000}],
            }
        ],
    }
    problems = " | ".join(_pod_problems(bad, "worker"))
    for expected in (
        "hostNetwork",
        "hostPath",
        "dedicated service account",
        "mounts a service-account token",
        "runs as uid 0",
        "allowPrivilegeEscalation",
        "privileged",
        "capabilities are not all dropped",
        "adds capabilities",
        "hostPort",
        "no memory limits",
        "no cpu requests",
    ):
        assert expected in problems, expected
