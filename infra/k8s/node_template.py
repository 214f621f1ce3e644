"""What a GPU pool's nodes tell the Cluster Autoscaler: the GPU label and scale-from-zero tags.

What flows through here: an instance type from the catalogue -> the node labels and the node
group tags its pool carries (infra/components/gpu_node_pool.py), from which the autoscaler
(infra/components/node_autoscaler.py) builds the template node of an empty pool: CPU, memory
and GPUs it reads from EC2; the GPU label and the EFA interfaces only from these.
"""

from __future__ import annotations

from infra import catalog
from infra.k8s.labels import EFA_RESOURCE, GPU_RESOURCE

# kubernetes/autoscaler cluster-autoscaler/cloudprovider/aws/aws_manager.go: tags with this
# prefix on the Auto Scaling group, or on the EKS node group (read through DescribeNodegroup),
# set the capacity of the template node of an empty group.
NODE_TEMPLATE_RESOURCES = "k8s.io/cluster-autoscaler/node-template/resources/"
# kubernetes/autoscaler cluster-autoscaler/cloudprovider/aws/aws_cloud_provider.go `GPULabel`
# (CA 1.35): a node with this label but no allocatable GPU yet is counted as not ready
# (processors/customresources/gpu_processor.go FilterOutNodesWithUnreadyResources), i.e. as
# capacity still coming; without it a new GPU node whose device plugin has not registered is
# a ready node without GPUs, and the autoscaler adds another one (its AWS README, "Special
# note on GPU instances"). EKS applies a managed node group's labels at registration, and
# for an empty group CA reads them through DescribeNodegroup (aws_manager.go
# buildNodeFromTemplate), so the group's labels carry it both ways.
GPU_LABEL = "k8s.amazonaws.com/accelerator"
# Values per GPU model: the names CA's AWS provider lists (availableGPUTypes: nvidia-tesla-a100,
# nvidia-a10g, nvidia-l40s) where it has one, else the same form. The value only names the
# type in CA's metrics; presence is what counts.
GPU_LABEL_VALUES = {
    "A100": "nvidia-tesla-a100",
    "A10G": "nvidia-a10g",
    "L40S": "nvidia-l40s",
    "H100": "nvidia-h100",
    "H200": "nvidia-h200",
}


def scale_from_zero_tags(instance: catalog.InstanceType) -> dict[str, str]:
    """Node-group tags that tell the autoscaler what a node of an empty pool offers.

    CPU, memory and GPUs come from the instance type (EC2 DescribeInstanceTypes); the EFA
    interfaces, which the engine pods ask for, do not, so an empty EFA pool would look unable
    to run them. The GPU count is stated too (types newer than the autoscaler's built-in
    list are looked up at run time; the tag makes the figure certain).
    """
    tags = {f"{NODE_TEMPLATE_RESOURCES}{GPU_RESOURCE}": str(instance.gpus)}
    if instance.efa:
        tags[f"{NODE_TEMPLATE_RESOURCES}{EFA_RESOURCE}"] = str(instance.efa_interfaces)
    return tags


def gpu_node_labels(instance: catalog.InstanceType) -> dict[str, str]:
    """Node labels a GPU pool carries for the autoscaler (see GPU_LABEL)."""
    return {GPU_LABEL: GPU_LABEL_VALUES[instance.ray_accelerator]}
