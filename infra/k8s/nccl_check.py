"""NCCL between two nodes of one GPU pool, over EFA: a two-pod Indexed Job, as plain data.

What flows through here: a pool's role and catalog entry, the image and namespace -> a
ConfigMap (the all-reduce script, infra/k8s/scripts/nccl_allreduce.py), a headless Service
(stable pod DNS names for the rendezvous) and an Indexed Job of two pods, each owning a whole
node of the pool (every GPU, every EFA interface, anti-affinity on the hostname). The pods run
`torchrun` across both nodes: one process per GPU, an all-reduce per message size, bus
bandwidth per size as nccl-tests' all_reduce_perf reports it. The Job fails when NCCL did not
use the aws-ofi-nccl network ("Using network Libfabric" in its own debug log: without the
plugin NCCL silently falls back to TCP sockets), when the sums are wrong, or when the bus
bandwidth is below `min_busbw_gbps`.

`make efa-check` (tools/efa_check.py) applies these objects next to its own Jobs for every role
whose engine replicas span nodes (TP x PP, DP + EP), which depend on exactly this path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.catalog import InstanceType
from infra.k8s.labels import GPU_TOLERATION, INSTANCE_TYPE_LABEL, ROLE_LABEL
from infra.k8s.ray_env import efa_engine_env

SCRIPT = Path(__file__).parent / "scripts" / "nccl_allreduce.py"
PORT = 29500
JOB_DEADLINE_S = 1200  # the Job's activeDeadlineSeconds: image pull on two new nodes, NCCL init, sizes
RUN_AS = 1000  # the `ray` user of Ray's images, as the engine pods

# NCCL over EFA (sources in infra/k8s/ray_env.py NCCL_EFA_ENV): the plugin by name, and its
# debug lines in a file the script reads back to prove which network NCCL chose.
NCCL_ENV = {
    "NCCL_NET_PLUGIN": "ofi",
    "FI_PROVIDER": "efa",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
    "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p.log",
}


def nccl_check_manifests(
    *,
    name: str,
    namespace: str,
    image: str,
    role: str,
    instance: InstanceType,
    min_busbw_gbps: float = 0.0,
    sizes_mib: tuple[int, ...] = (1, 16, 128, 1024),
    service_account: str | None = None,
) -> list[dict[str, Any]]:
    """ConfigMap, headless Service and Indexed Job checking NCCL across two `role` nodes."""
    if not instance.efa:
        raise ValueError(f"{instance.name} has no EFA interfaces: nothing to check between nodes")
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "nccl-check"}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {SCRIPT.name: SCRIPT.read_text()},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"clusterIP": "None", "selector": {"job-name": name}, "ports": [{"name": "rdzv", "port": PORT}]},
    }
    torchrun = (
        f"exec torchrun --nnodes=2 --nproc-per-node={instance.gpus} --node-rank=$JOB_COMPLETION_INDEX "
        f"--master-addr={name}-0.{name}.{namespace}.svc --master-port={PORT} /scripts/{SCRIPT.name} "
        f"--sizes-mib={','.join(str(s) for s in sizes_mib)} --min-busbw-gbps={min_busbw_gbps:g}"
    )
    pod = _pod(name, role, instance, _container(image, instance, torchrun))
    if service_account:
        pod["serviceAccountName"] = service_account
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 0,
            "activeDeadlineSeconds": JOB_DEADLINE_S,
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    return [config_map, service, job]


def _pod(name: str, role: str, instance: InstanceType, container: dict[str, Any]) -> dict[str, Any]:
    """The Job's pod spec: on a `role` node of the type, never beside its peer, the script mounted."""
    return {
        "subdomain": name,  # <name>-<index>.<name> resolves through the headless Service
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "nodeSelector": {ROLE_LABEL: role, INSTANCE_TYPE_LABEL: instance.name},
        "tolerations": [GPU_TOLERATION],
        # two different nodes of the pool, never one (the pods ask for a whole node anyway)
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {"job-name": name}}, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "fsGroup": 100,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "script", "configMap": {"name": name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{instance.shm_gib}Gi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }


def _container(image: str, instance: InstanceType, torchrun: str) -> dict[str, Any]:
    """The `torchrun` container: the whole node's GPUs and EFA interfaces, NCCL's environment."""
    devices = {
        "cpu": str(instance.pod_cpus),
        "memory": f"{instance.pod_memory_gib}Gi",
        "nvidia.com/gpu": str(instance.gpus),
        "vpc.amazonaws.com/efa": str(instance.efa_interfaces),
    }
    return {
        "name": "nccl",
        "image": image,
        "command": ["sh", "-c", torchrun],
        # The engines' libfabric settings (FI_EFA_FORK_SAFE=1: no huge pages, so no
        # hugepages-2Mi request; libfabric prov/efa/src/efa_fork_support.c), then NCCL's.
        "env": [{"name": k, "value": v} for k, v in {**efa_engine_env([instance]), **NCCL_ENV}.items()],
        "ports": [{"containerPort": PORT, "name": "rdzv"}],
        "resources": {"requests": dict(devices), "limits": dict(devices)},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "script", "mountPath": "/scripts", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
