"""The Cluster component's system node group: its root volume, metadata service and groups.

Contract: EKS user guide, "Customizing managed nodes with launch templates": a launch
template that names security groups replaces the ones EKS would attach, and EKS's own
default template gives the root volume 20 GiB, encrypted only when the account's EBS default
says so; AL2023's root device is /dev/xvda (awslabs/amazon-eks-ami, `templates/al2023`).
"""

from __future__ import annotations

from infra.k8s.labels import ROLE_LABEL, SYSTEM_ROLE

MNG = "eks:index:ManagedNodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"


def _system_template(result) -> dict:
    templates = {f"{r.name}-id": r.inputs for r in result.of_type(LAUNCH_TEMPLATE)}
    (ng,) = [n for n in result.of_type(MNG) if n.inputs["labels"][ROLE_LABEL] == SYSTEM_ROLE]
    lt_id = (ng.inputs.get("launchTemplate") or {}).get("id")
    assert lt_id in templates, "the system node group boots from EKS's default template"
    return templates[lt_id]


def test_every_stacks_system_nodes_have_an_encrypted_root_volume_sized_by_the_stack(rendered_stacks):
    for stack, rendered in rendered_stacks.items():
        lt = _system_template(rendered.result)
        (root,) = lt["blockDeviceMappings"]
        assert root["deviceName"] == "/dev/xvda", stack
        ebs = root["ebs"]
        assert ebs["encrypted"] == "true" and ebs["volumeType"] == "gp3", stack
        assert ebs["volumeSize"] == rendered.config.system_nodes.root_volume_gib > 20, stack


def test_system_template_keeps_the_eks_cluster_security_group_and_imdsv2(rendered_stacks):
    for stack, rendered in rendered_stacks.items():
        lt = _system_template(rendered.result)
        assert "sg-0eksmanaged000001" in lt["vpcSecurityGroupIds"], stack
        assert lt["metadataOptions"]["httpTokens"] == "required", stack
        assert "imageId" not in lt and "userData" not in lt, "EKS picks the AMI and bootstraps"
