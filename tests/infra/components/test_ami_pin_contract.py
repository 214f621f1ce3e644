"""The node AMI is pinned by the stack file; a new AMI release reaches nodes only through it.

Contract: pulumi/pulumi-eks v4 `nodejs/eks/nodes/nodegroup.ts` (`createManagedNodeGroup`,
`requiresCustomLaunchTemplate`, `createMNGCustomLaunchTemplate`, `getRecommendedAMI`): when a
managed node group needs custom user data (nodeadmExtraOptions, userData or amiId), pulumi-eks
builds the launch template and sets its imageId to `amiId`, or else to an SSM lookup of
`/aws/service/eks/optimized-ami/<k8s>/<ami type>/recommended/image_id` on EVERY run (a new
release then replaces every node); it drops amiType/releaseVersion from the node group. Without
custom user data EKS picks the AMI from amiType and releaseVersion. Reproduced in
`tests.upstream.mng_image`. AMI names: awslabs/amazon-eks-ami release notes
(amazon-eks-node-al2023-x86_64-nvidia-<k8s>-v<date>; release version <k8s>.<patch>-<date>).
"""

from __future__ import annotations

import copy

from infra import versions
from tests.upstream import mng_image
from tools import mock_runtime, stackfile

MNG = "eks:index:ManagedNodeGroup"


def _groups(result) -> dict[str, dict]:
    return {r.inputs["labels"]["pd-inference/role"]: r.inputs for r in result.of_type(MNG)}


def test_no_node_group_takes_the_recommended_ami(rendered_stacks):
    for stack, rendered in rendered_stacks.items():
        for role, inputs in _groups(rendered.result).items():
            image = mng_image(inputs)
            # Every group boots from the stack's own template, which names no image: EKS picks
            # the AMI from amiType and the pinned releaseVersion.
            assert image["source"] == "eks-release", (stack, role, image)
            assert image["value"] == rendered.config.ami_release_version, (stack, role)


def test_the_rule_bites_on_yesterdays_inputs():
    """RAID0 nodeadm options, no amiId: the template's image came from the SSM recommended AMI."""
    old = {
        "nodeadmExtraOptions": [{"content": "RAID0"}],
        "enableIMDSv2": True,
        "amiType": "AL2023_x86_64_NVIDIA",
        "gpu": True,
    }
    assert mng_image(old) == {"source": "ssm-recommended", "pinned": False, "value": None}


def test_an_ami_bump_is_a_visible_change_of_the_render(monkeypatch):
    # A bump records the new release's driver first (the config refuses unrecorded releases).
    monkeypatch.setitem(versions.EKS_AMI_NVIDIA_DRIVER, "20260801", "580.159.03")
    values, secrets, others = stackfile.read_as_deployed("prod")
    before = _groups(mock_runtime.run("prod", values, secrets, others))
    bumped = copy.deepcopy(values)
    bumped["amiReleaseVersion"] = "1.35.7-20260801"
    after = _groups(mock_runtime.run("prod", bumped, secrets, others))
    assert before["system"]["releaseVersion"] != after["system"]["releaseVersion"] == "1.35.7-20260801"
    for role in ("prefill", "decode"):
        changed = {k for k in before[role] if before[role][k] != after[role].get(k)}
        assert changed == {"releaseVersion"}, role
    # Nothing else moves: the same inputs re-render the same image.
    again = _groups(mock_runtime.run("prod", values, secrets, others))
    assert again == before


def test_the_pinned_release_matches_the_kubernetes_version(rendered_stacks):
    for rendered in rendered_stacks.values():
        assert rendered.config.ami_release_version.startswith(rendered.config.kubernetes_version + ".")
