"""Pod Identity credentials reach the Ray containers although their pods mount no API token.

Contracts:
- aws/amazon-eks-pod-identity-webhook (v0.6.17+) `pkg/handler/handler.go` `getPodSpecPatch`
  (container-credentials mode) and `main.go` flags: a pod whose (namespace, service account)
  has a Pod Identity association gets its OWN projected service-account-token volume
  `eks-pod-identity-token` (audience pods.eks.amazonaws.com), mounted read-only at
  /var/run/secrets/pods.eks.amazonaws.com/serviceaccount in every container not named in the
  skip-containers annotation, plus AWS_CONTAINER_CREDENTIALS_FULL_URI
  (http://169.254.170.23/v1/credentials) and AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, unless the
  container already sets those. `automountServiceAccountToken` is never consulted: it only
  governs the default kube-api-access token volume.
- boto/botocore `botocore/credentials.py` `ContainerProvider` and `utils.py`
  `ContainerMetadataFetcher._ALLOWED_HOSTS` (includes 169.254.170.23): with those variables the
  SDK fetches the role's credentials from the Pod Identity agent. Ray 2.60's working_dir
  download (`ray/_private/runtime_env/protocol.py`) uses boto3's default session and falls
  back to UNSIGNED requests only when no credentials are found.
- The webhook mutates a pod only at ADMISSION, and only if the association exists then; KubeRay
  creates the pods as soon as the RayService exists. Pulumi creates resources that have no
  dependency path between them in parallel (pulumi/pulumi docs, "Resource options: dependsOn";
  the engine's step executor), so only what the RayService depends on, directly or through
  others, surely exists before its pods: asserted on the dependency graph the program
  registers under the mock runtime (`tools.mock_runtime.Registered.depends_on`).
Reproduced in tests/upstream.py; asserted on the pods KubeRay builds from our RayService.
"""

from __future__ import annotations

import pytest

from tests.conftest import STACKS
from tests.upstream import (
    POD_IDENTITY_MOUNT,
    POD_IDENTITY_VOLUME,
    botocore_container_credentials,
    pod_identity_mutate,
    rayservice_pod,
)


@pytest.fixture(params=STACKS)
def stack(request, rendered_stacks):
    return rendered_stacks[request.param]


def _pods(stack):
    rs = next(o for o in stack.manifests().values() if o.get("kind") == "RayService")
    groups = [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    cluster = f"{rs['metadata']['name']}-x7k2p"
    return rs["metadata"]["namespace"], [rayservice_pod(rs, cluster, None)] + [
        rayservice_pod(rs, cluster, g) for g in groups
    ]


def _before(stack, name: str) -> set[str]:
    """Names of every resource registered as a dependency of `name`, directly or transitively."""
    deps = {r.name: r.depends_on for r in stack.result.resources}
    seen: set[str] = set()
    todo = list(deps[name])
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(deps.get(n, []))
    return seen


def _associations_before(stack, name: str) -> set[tuple[str, str]]:
    before = _before(stack, name)
    return {
        (r.inputs["namespace"], r.inputs["serviceAccount"])
        for r in stack.result.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")
        if r.name in before
    }


def _associations(stack) -> set[tuple[str, str]]:
    return {
        (r.inputs["namespace"], r.inputs["serviceAccount"])
        for r in stack.result.of_type("aws:eks/podIdentityAssociation:PodIdentityAssociation")
    }


def test_every_ray_container_gets_pod_identity_credentials(stack):
    namespace, pods = _pods(stack)
    assert any(p["spec"].get("automountServiceAccountToken") is False for p in pods), "the case this guards"
    for pod in pods:
        mutated = pod_identity_mutate(pod, namespace, _associations(stack))
        assert mutated["metadata"]["labels"].get("eks.amazonaws.com/pod-identity") == "enabled", pod["spec"][
            "serviceAccountName"
        ]
        volumes = {v["name"]: v for v in mutated["spec"]["volumes"]}
        assert (
            volumes[POD_IDENTITY_VOLUME]["projected"]["sources"][0]["serviceAccountToken"]["audience"]
            == "pods.eks.amazonaws.com"
        )
        for c in mutated["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c["env"]}
            token = env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]
            assert any(m["name"] == POD_IDENTITY_VOLUME and token.startswith(m["mountPath"]) for m in c["volumeMounts"])
            assert botocore_container_credentials({k: v for k, v in env.items() if v}, {token}), c["name"]


def test_our_pods_do_not_shadow_what_the_webhook_injects(stack):
    """The webhook leaves a container alone if it already sets the credential variables, and
    skips containers named in eks.amazonaws.com/skip-containers: ours do neither."""
    _, pods = _pods(stack)
    for pod in pods:
        assert "eks.amazonaws.com/skip-containers" not in (pod["metadata"].get("annotations") or {})
        for c in pod["spec"]["containers"]:
            names = {e["name"] for e in c.get("env") or []}
            assert not names & {
                "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                "AWS_ACCESS_KEY_ID",
                "AWS_PROFILE",
            }
            assert all(m["mountPath"] != POD_IDENTITY_MOUNT for m in c.get("volumeMounts") or [])


def test_without_an_association_the_sdk_finds_nothing(stack):
    """The rule bites: a pod whose service account has no association is not mutated, and the
    SDK's container provider has nothing to use (Ray would then download unsigned: 403)."""
    namespace, pods = _pods(stack)
    for pod in pods:
        untouched = pod_identity_mutate(pod, namespace, set())
        env = {
            e["name"]: e.get("value")
            for c in untouched["spec"]["containers"]
            for e in c.get("env") or []
            if e.get("value")
        }
        assert not botocore_container_credentials(env, set())


RAYSERVICE = "kubernetes:ray.io/v1:RayService"
AGENT = "aws:eks/addon:Addon"


def _agent(stack):
    return next(r for r in stack.result.of_type(AGENT) if r.inputs["addonName"] == "eks-pod-identity-agent")


def test_ray_pods_are_admitted_after_their_associations(stack):
    """Every Ray pod, admitted when the RayService appears, finds its association in place."""
    rs = stack.result.one(RAYSERVICE)
    namespace, pods = _pods(stack)
    ready = _associations_before(stack, rs.name)
    for pod in pods:
        mutated = pod_identity_mutate(pod, namespace, ready)
        assert mutated["metadata"]["labels"].get("eks.amazonaws.com/pod-identity") == "enabled", pod["spec"][
            "serviceAccountName"
        ]


def test_what_the_ray_pods_use_exists_before_them(stack):
    """Their ServiceAccounts, every Secret their env references, the role's policy and the
    Pod Identity agent that serves the credentials."""
    rs = stack.result.one(RAYSERVICE)
    before = _before(stack, rs.name)
    _, pods = _pods(stack)
    accounts = {p["spec"]["serviceAccountName"] for p in pods}
    made = {r.inputs["metadata"]["name"]: r.name for r in stack.result.of_type("kubernetes:core/v1:ServiceAccount")}
    assert accounts <= set(made) and {made[a] for a in accounts} <= before
    secrets = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for p in pods
        for c in p["spec"]["containers"]
        for e in c.get("env") or []
        if "secretKeyRef" in (e.get("valueFrom") or {})
    }
    gcs = (rs.inputs["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions") or {}).get("redisPassword")
    if gcs:
        secrets.add(gcs["valueFrom"]["secretKeyRef"]["name"])
    created = {r.inputs["metadata"]["name"]: r.name for r in stack.result.of_type("kubernetes:core/v1:Secret")}
    assert secrets <= set(created) and {created[s] for s in secrets} <= before, secrets
    policies = [r.name for r in stack.result.of_type("aws:iam/rolePolicy:RolePolicy") if r.parent == "llm"]
    assert policies and set(policies) <= before
    assert _agent(stack).name in before


def test_the_node_autoscaler_starts_after_its_association_and_the_agent(stack):
    chart = next(
        r for r in stack.result.of_type("kubernetes:helm.sh/v4:Chart") if r.inputs["chart"] == "cluster-autoscaler"
    )
    values = chart.inputs["values"]
    account = ("kube-system", values["rbac"]["serviceAccount"]["name"])
    assert account in _associations_before(stack, chart.name)
    before = _before(stack, chart.name)
    policies = [r.name for r in stack.result.of_type("aws:iam/rolePolicy:RolePolicy") if r.parent == "node-autoscaler"]
    assert policies and set(policies) <= before
    assert _agent(stack).name in before
