"""What every node launch template the stack builds carries, in one place.

What flows through here: a root volume size -> the encrypted gp3 root volume mapping, and
IMDSv2 metadata options, for the system nodes' template (cluster.py) and the GPU pools'
own templates (gpu_node_pool.py).
"""

from __future__ import annotations

import pulumi_aws as aws

# IMDSv2 only; hop limit 2: a container is one network hop further from IMDS than its node.
IMDSV2 = aws.ec2.LaunchTemplateMetadataOptionsArgs(
    http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=2
)


def encrypted_root_volume(size_gib: int) -> aws.ec2.LaunchTemplateBlockDeviceMappingArgs:
    """AL2023's root device (/dev/xvda) as encrypted gp3 of `size_gib`, deleted with the node."""
    return aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name="/dev/xvda",
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
            volume_size=size_gib,
            volume_type="gp3",
            encrypted="true",
            delete_on_termination="true",
        ),
    )
