"""gcsFaultTolerance managed: the stack's own ElastiCache (Valkey) group behind Ray's GCS.

Contracts:
- hashicorp/terraform-provider-aws `internal/service/elasticache/replication_group.go`
  (mirror of 2026-08; pulumi-aws 7 bridges it): validateReplicationGroupID,
  replicationGroupValidateMultiAZAutomaticFailover, ...AutomaticFailoverNumCacheClusters,
  validReplicationGroupAuthToken; the ElastiCache API's AuthToken constraints (printable,
  16-128, only !&#$^<>- as special characters, only with TransitEncryptionEnabled:
  CreateReplicationGroup reference, "Authenticating with the Valkey and Redis OSS AUTH
  command"). Reproduced in `tests.upstream.elasticache_replication_group_errors`.
- ray-project/ray 2.60 `python/ray/_private/services.py` `get_address`: only `rediss://`
  turns TLS on for the GCS's Redis client (run here, from the installed Ray: no cluster).
- ray-project/ray `doc/source/cluster/kubernetes/user-guides/kuberay-gcs-ft.md`: a single-shard
  Redis; KubeRay builds the Redis cleanup Job from the head's pod template (so it runs where
  the head runs, on the system nodes).
"""

from __future__ import annotations

import pytest

from infra import versions
from infra.components.gcs_redis import AUTH_TOKEN_LENGTH, PORT, replication_group_id
from infra.k8s.labels import ROLE_LABEL, SYSTEM_ROLE
from tests.upstream import elasticache_replication_group_errors

GROUP = "aws:elasticache/replicationGroup:ReplicationGroup"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"
MNG = "eks:index:ManagedNodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"


@pytest.fixture
def managed(rendered_stacks):
    """The shipped stacks on gcsFaultTolerance managed (deepseek-p5 at least)."""
    found = {s: r for s, r in rendered_stacks.items() if r.config.gcs_fault_tolerance.value == "managed"}
    assert "deepseek-p5" in found
    return found


def _rayservice(result):
    return result.one(RAYSERVICE).inputs


def test_the_group_passes_the_provider_and_api_checks(managed):
    for stack, rendered in managed.items():
        group = rendered.result.one(GROUP).inputs
        assert elasticache_replication_group_errors(group) == [], stack
        assert group["engine"] == versions.GCS_REDIS_ENGINE == "valkey"
        assert group["engineVersion"] == versions.GCS_REDIS_ENGINE_VERSION
        settings = rendered.config.gcs_redis
        assert group["nodeType"] == settings.node_type
        assert group["numCacheClusters"] == settings.replicas + 1
        assert group["automaticFailoverEnabled"] is group["multiAzEnabled"] is settings.failover


def test_the_rules_bite():
    good = {
        "replicationGroupId": "pd-inference-x-gcs",
        "engine": "valkey",
        "numCacheClusters": 2,
        "automaticFailoverEnabled": True,
        "multiAzEnabled": True,
        "transitEncryptionEnabled": True,
        "authToken": "A" * 32,
    }
    assert elasticache_replication_group_errors({**good, "engineVersion": versions.GCS_REDIS_ENGINE_VERSION}) == []
    for change in (
        {"numCacheClusters": 1},
        {"automaticFailoverEnabled": False},
        {"authToken": "short"},
        {"authToken": "A" * 20 + "@"},
        {"authToken": "A" * 20 + "%"},  # the provider would pass it, the API refuses it
        {"transitEncryptionEnabled": False},
        {"replicationGroupId": "pd--x"},
        {"replicationGroupId": "x" * 41},
        {"clusterMode": "enabled"},
        {"engineVersion": "8.0.1"},
    ):
        assert elasticache_replication_group_errors({**good, **change}), change


def test_encrypted_in_transit_and_at_rest(managed):
    for rendered in managed.values():
        res = rendered.result
        group = res.one(GROUP).inputs
        assert group["transitEncryptionEnabled"] is True and group["transitEncryptionMode"] == "required"
        assert group["atRestEncryptionEnabled"] is True
        key = next(r for r in res.of_type("aws:kms/key:Key") if r.name == "gcs-key")
        assert key.inputs["enableKeyRotation"] is True
        assert group["kmsKeyId"].endswith("/gcs-key")
        subnets = res.one("aws:elasticache/subnetGroup:SubnetGroup").inputs
        assert group["subnetGroupName"] == subnets["name"]
        private = sorted(f"{r.name}-id" for r in res.of_type("aws:ec2/subnet:Subnet") if "-private-" in r.name)
        assert sorted(subnets["subnetIds"]) == private, "the private subnets, one per zone"


def test_only_the_heads_nodes_reach_port_6379(managed):
    """The group's security group admits 6379 from the clients group alone; only the system
    nodes (the head's, by its nodeSelector) carry that group, never a GPU node."""
    for stack, rendered in managed.items():
        res = rendered.result
        group = res.one(GROUP).inputs
        (redis_sg,) = group["securityGroupIds"]
        rules = [r.inputs for r in res.of_type(INGRESS) if r.inputs["securityGroupId"] == redis_sg]
        assert rules == [
            {
                "description": rules[0]["description"],
                "securityGroupId": redis_sg,
                "ipProtocol": "tcp",
                "fromPort": PORT,
                "toPort": PORT,
                "referencedSecurityGroupId": "gcs-clients-sg-id",
            }
        ], stack
        templates = {f"{r.name}-id": r.inputs for r in res.of_type(LAUNCH_TEMPLATE)}
        carriers = set()
        for ng in res.of_type(MNG):
            lt = templates.get((ng.inputs.get("launchTemplate") or {}).get("id"), {})
            sgs = lt.get("vpcSecurityGroupIds", []) + [
                sg for ni in lt.get("networkInterfaces", []) for sg in ni.get("securityGroups", [])
            ]
            if "gcs-clients-sg-id" in sgs:
                carriers.add(ng.inputs["labels"][ROLE_LABEL])
                assert "sg-0eksmanaged000001" in sgs, "the EKS cluster security group stays on the nodes"
                assert lt["metadataOptions"]["httpTokens"] == "required"
        assert carriers == {SYSTEM_ROLE}, stack
        head = _rayservice(res)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
        assert head["nodeSelector"] == {ROLE_LABEL: SYSTEM_ROLE}


def test_the_rediss_address_and_the_token_reach_the_rayservice(managed):
    from ray._private.services import get_address  # Ray's own parser; starts nothing

    for stack, rendered in managed.items():
        res = rendered.result
        group = res.one(GROUP)
        gcs = _rayservice(res)["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
        host = f"master.{group.inputs['replicationGroupId']}.mock01.use1.cache.amazonaws.com"
        assert gcs["redisAddress"] == f"rediss://{host}:{PORT}", stack
        assert get_address(gcs["redisAddress"]) == (host, str(PORT), True), "TLS on"
        ref = gcs["redisPassword"]["valueFrom"]["secretKeyRef"]
        secret = next(
            r for r in res.of_type("kubernetes:core/v1:Secret") if r.inputs["metadata"]["name"] == ref["name"]
        )
        # The same generated token: in the group's AUTH and in the Secret the head reads.
        token = res.one("random:index/randomPassword:RandomPassword").inputs
        assert token["length"] == AUTH_TOKEN_LENGTH and token["special"] is False
        assert secret.inputs["stringData"][ref["key"]] == group.inputs["authToken"]
        # ... and a Pulumi secret on both ways out (encrypted in the state, masked in previews).
        assert "authToken" in group.secret_inputs and "stringData" in secret.secret_inputs


def test_managed_needs_no_redis_secret_from_the_user(managed):
    for rendered in managed.values():
        assert "gcsRedisPassword" not in rendered.stand_ins
        assert rendered.config.gcs_redis_address is None


@pytest.mark.parametrize(
    "cluster",
    ["pd-inference-prod", "pd-inference-a-very-long-stack-name-for-team-x", "pd-inference-Team_X", "1-pd"],
)
def test_replication_group_ids_are_valid(cluster):
    rid = replication_group_id(cluster)
    assert elasticache_replication_group_errors({"replicationGroupId": rid, "engine": "valkey"}) == [], rid
    assert rid == rid.lower()
