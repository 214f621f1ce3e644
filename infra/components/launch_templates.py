"""What every node launch template the stack builds carries, in one place.

What flows through here: a root volume size -> the encrypted gp3 root volume mapping, and
the instance metadata options, for the system nodes' template (cluster.py) and every GPU
pool's own template (gpu_node_pool.py).

Instance metadata: IMDSv2 only, with a PUT response hop limit of 1 (AWS EKS best practices,
"Restrict access to the instance profile assigned to the worker node"). A container on the
pod network is one hop further from IMDS than its node, so with a limit of 1 its token
request never returns: no pod can take the node role's credentials (CNI, ECR pull, SSM)
or read the instance's identity. Host-network pods (the VPC CNI, kube-proxy, the device
plugins) keep IMDS. Nothing on the pod network needs it: every workload that calls AWS gets
its own role through EKS Pod Identity and its region from its configuration (the Ray pods'
AWS_REGION: infra/k8s/ray_env.py; the Cluster Autoscaler's awsRegion; Tempo's S3 region),
and the EBS CSI driver falls back to Kubernetes metadata when IMDS is out of reach
(kubernetes-sigs/aws-ebs-csi-driver docs/install.md, "Metadata").
"""

from __future__ import annotations

import pulumi_aws as aws

# IMDSv2 only; hop limit 1: the node reaches IMDS, its pod-network containers do not.
IMDS_HOP_LIMIT = 1
IMDSV2 = aws.ec2.LaunchTemplateMetadataOptionsArgs(
    http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=IMDS_HOP_LIMIT
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
