"""Names that nodes, pods and namespaces share: labels, taints, tolerations, namespaces.

What flows through here: constants only. Node pools set the role label and the GPU taint;
the RayService, the device plugins and the operator select and tolerate with the same
values; the config refuses the reserved namespaces. (The policy pack is a separate program
with its own virtualenv and states the taint key itself; a test keeps the two equal.)
"""

from __future__ import annotations

# Node label and AWS tag that say which pool a node belongs to: system, prefill or decode.
ROLE_LABEL = "pd-inference/role"
SYSTEM_ROLE = "system"
STACK_TAG = "pd-inference/stack"
ENVIRONMENT_TAG = "pd-inference/environment"
# Set by the kubelet on every node; device plugins and engine pods pin instance types with it.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"

# Extended resources the device plugins advertise and engine pods ask for.
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# GPU nodes are tainted so that only pods that tolerate it (and ask for GPUs) land there.
GPU_TAINT_KEY = GPU_RESOURCE
GPU_TAINT_VALUE = "true"
GPU_TOLERATION = {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}

# Ray pods: the node autoscaler may only remove nodes the KubeRay autoscaler has emptied.
SAFE_TO_EVICT = {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}

KUBERAY_NAMESPACE = "kuberay-system"
NVIDIA_DEVICE_PLUGIN_NAMESPACE = "nvidia-device-plugin"
# Namespaces the stack owns or Kubernetes reserves: the serving namespace cannot be one of them.
RESERVED_NAMESPACES = ("default", KUBERAY_NAMESPACE, NVIDIA_DEVICE_PLUGIN_NAMESPACE)


def instance_type_affinity(types: list[str]) -> dict:
    """Required node affinity: only nodes of these instance types."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": INSTANCE_TYPE_LABEL, "operator": "In", "values": types}]}
                ]
            }
        }
    }
