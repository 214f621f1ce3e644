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
