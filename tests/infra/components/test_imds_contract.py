"""No pod reaches the instance metadata service, and the Ray pods never need it.

Contracts:
- AWS EKS best practices, Security, "Restrict access to the instance profile assigned to the
  worker node": require IMDSv2 with a PUT response hop limit of 1; a container on the pod
  network is one hop further than its node, so its token request expires on the way (EC2 User
  Guide, "How Instance Metadata Service Version 2 works": the hop limit of the PUT response).
  A limit of 2, the old value here, let every pod take the node role (CNI, ECR pull, SSM).
- pulumi/pulumi-eks v4 nodejs/eks/nodes/nodegroup.ts `createMNGCustomLaunchTemplate`: the
  template behind `enableIMDSv2` hard-codes `httpPutResponseHopLimit: 2`, so no node group may
  rely on it (reproduced in tests.upstream.mng_metadata_options).
- botocore (installed: `botocore/configprovider.py`, the `region` variable) takes the region
  from AWS_DEFAULT_REGION; the other AWS SDKs (the Run:ai streamer's C++ S3 client among them)
  from AWS_REGION: the Ray pods carry both, so no SDK looks the region up in IMDS.
"""

from __future__ import annotations

import botocore.session
import pytest

from infra.components.launch_templates import IMDS_HOP_LIMIT
from infra.k8s.ray_env import REGION_ENV
from tests.conftest import STACKS
from tests.upstream import mng_metadata_options
from tools import stackfile

MNG = "eks:index:ManagedNodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"


@pytest.mark.parametrize("stack", STACKS)
def test_every_node_group_keeps_pods_away_from_imds(stack, rendered_stacks):
    result = rendered_stacks[stack].result
    templates = {f"{r.name}-id": r.inputs for r in result.of_type(LAUNCH_TEMPLATE)}
    groups = result.of_type(MNG)
    assert groups
    for group in groups:
        options = mng_metadata_options(group.inputs, templates)
        assert options == {"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 1}, (
            group.name,
            options,
        )
    assert IMDS_HOP_LIMIT == 1


def test_the_rule_bites_on_yesterdays_gpu_pools():
    """dev's g5 pools used pulumi-eks's enableIMDSv2 template: hop limit 2."""
    old = {"enableIMDSv2": True, "diskSize": 100, "amiType": "AL2023_x86_64_NVIDIA", "gpu": True}
    assert mng_metadata_options(old, {})["httpPutResponseHopLimit"] == 2


def _ray_containers(rendered) -> list[dict]:
    cluster = rendered.result.one(RAYSERVICE).inputs["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize("stack", STACKS)
def test_every_ray_container_names_the_stack_region(stack, rendered_stacks, monkeypatch):
    rendered = rendered_stacks[stack]
    region = stackfile.read(stack)[2]["aws:region"]
    for container in _ray_containers(rendered):
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        assert {v: env.get(v) for v in REGION_ENV} == dict.fromkeys(REGION_ENV, region), container["name"]
        # What botocore (Ray's S3 working_dir download, the streamer's listing) makes of it.
        for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_PROFILE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
        assert botocore.session.Session().get_config_variable("region") is None  # else: IMDS, or fail
        for var in REGION_ENV:
            monkeypatch.setenv(var, env[var])
        assert botocore.session.Session().get_config_variable("region") == region
