"""The RayService manifest, as plain data: head, prefill and decode groups from one spec.

What flows through here: the serving spec (which renders `serveConfigV2` through
`ServingSpec.serve_config`, the same function `make serve` uses), the catalog entry of each
pool's instance type, the pools' role labels and GPU taint, secret and service-account names
-> a `ray.io/v1` RayService dict. No Pulumi here: `LlmService` calls it inside an apply once
the code bucket's name is known, and the tests call it directly.

Sizing rules (all from the catalog, never literals): a worker pod owns its node, asks for
every GPU and every EFA interface of the type, most of its CPUs and memory, and a RAM-backed
/dev/shm. Pods per role = ceil(replicas / replicas-per-node) x nodes-per-replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from infra.k8s.labels import GPU_TOLERATION, INSTANCE_TYPE_LABEL, ROLE_LABEL, SYSTEM_ROLE
from infra.model import catalog, sizing
from infra.model.versions import RAY_VERSION
from serving.spec import API_KEYS_ENV, SERVE_PORT, RoleSpec, ServingSpec, Target

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
RAY_UID = 1000  # the `ray` user of Ray's images
HF_TOKEN_ENV = "HF_TOKEN"

# libfabric/UCX over EFA for NIXL (and NCCL): GPUDirect RDMA on p4d/p5, fork safety for
# Python workers that fork.
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str

    def env(self, var: str) -> dict[str, Any]:
        return {"name": var, "valueFrom": {"secretKeyRef": {"name": self.name, "key": self.key}}}


@dataclass(frozen=True)
class RayServiceInputs:
    name: str
    namespace: str
    image: str
    serving: ServingSpec
    instances: dict[str, catalog.InstanceType]  # by engine role
    working_dir: str  # s3:// URL of the packaged serving/ code
    head_service_account: str
    worker_service_account: str
    api_keys: SecretRef | None
    hf_token: SecretRef | None = None
    redis_password: SecretRef | None = None
    gcs_redis_address: str | None = None
    upgrade_strategy: str = "NewCluster"
    extra_env: dict[str, str] = field(default_factory=dict)
    # The OpenAI API's Service, as KubeRay's `spec.serveService`: KubeRay creates it and keeps
    # its selector on the serving pods of the ACTIVE cluster across NewCluster upgrades
    # (ray-operator/controllers/ray/common/service.go BuildServeService, v1.7.0).
    service_name: str | None = None  # default <name>-openai
    service_type: str = "ClusterIP"  # or LoadBalancer (internal NLB)
    service_annotations: dict[str, str] = field(default_factory=dict)
    load_balancer_source_ranges: list[str] = field(default_factory=list)


def serve_service(inp: RayServiceInputs) -> dict[str, Any]:
    """`spec.serveService`: KubeRay sets the selector itself, so none is given here; the port is
    named "serve" like the head's container port, which KubeRay merges by name."""
    spec: dict[str, Any] = {
        "type": inp.service_type,
        "ports": [{"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT, "protocol": "TCP"}],
    }
    if inp.load_balancer_source_ranges:
        spec["loadBalancerSourceRanges"] = list(inp.load_balancer_source_ranges)
    meta: dict[str, Any] = {
        "name": inp.service_name or f"{inp.name}-openai",
        "labels": {"app.kubernetes.io/name": inp.name},
    }
    if inp.service_annotations:
        meta["annotations"] = dict(inp.service_annotations)
    return {"metadata": meta, "spec": spec}


def pods_for(role: RoleSpec, inst: catalog.InstanceType, replicas: int) -> int:
    """Worker pods (= nodes) that hold `replicas` engine replicas of `role` on `inst`."""
    return sizing.nodes_for(replicas, role.gpus_per_replica, inst.gpus)


def _security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": RAY_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "fsGroup": 100, "seccompProfile": {"type": "RuntimeDefault"}}


def _target(inp: RayServiceInputs) -> Target:
    accel = {i.ray_accelerator for i in inp.instances.values()}
    if len(accel) != 1:
        raise ValueError(f"prefill and decode pools must have the same GPU model (got {sorted(accel)})")
    engine_env = dict(inp.extra_env)
    if any(i.efa for i in inp.instances.values()):
        engine_env.update(EFA_ENV)
    return Target(accelerator_type=accel.pop(), working_dir=inp.working_dir, engine_env=engine_env)


def serve_config_yaml(inp: RayServiceInputs) -> str:
    return yaml.safe_dump(inp.serving.serve_config(_target(inp)), sort_keys=False)


def _head(inp: RayServiceInputs) -> dict[str, Any]:
    env = [inp.api_keys.env(API_KEYS_ENV)] if inp.api_keys else []
    return {
        # The head runs the GCS, the Serve controller, the proxy and the ingress; no model work.
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "labels": {inp.serving.placement.label_key: inp.serving.placement.head},
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": inp.name, "app.kubernetes.io/component": "ray-head"}},
            "spec": {
                "serviceAccountName": inp.head_service_account,
                "nodeSelector": {ROLE_LABEL: SYSTEM_ROLE},
                "securityContext": _pod_security(),
                "containers": [
                    {
                        "name": "ray-head",
                        "image": inp.image,
                        "ports": [
                            {"containerPort": 6379, "name": "gcs"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": SERVE_PORT, "name": "serve"},
                        ],
                        "env": env,
                        "resources": {
                            "requests": {"cpu": "2", "memory": "8Gi"},
                            "limits": {"cpu": "4", "memory": "12Gi"},
                        },
                        "securityContext": _security_context(),
                        "volumeMounts": [{"name": "ray-tmp", "mountPath": "/tmp/ray"}],
                    }
                ],
                "volumes": [{"name": "ray-tmp", "emptyDir": {"sizeLimit": "20Gi"}}],
            },
        },
    }


def _worker(inp: RayServiceInputs, role: str, spec: RoleSpec) -> dict[str, Any]:
    inst = inp.instances[role]
    label = getattr(inp.serving.placement, role)
    limits = {
        "cpu": str(inst.pod_cpus),
        "memory": f"{inst.pod_memory_gib}Gi",
        GPU_RESOURCE: str(inst.gpus),
    }
    if inst.efa:
        limits[EFA_RESOURCE] = str(inst.efa_interfaces)
    env: list[dict[str, Any]] = [
        # NIXL's side channel must be reachable from the other pool, not bound to localhost.
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if inp.hf_token:
        env.append(inp.hf_token.env(HF_TOKEN_ENV))
    initial = spec.initial_replicas or spec.min_replicas
    return {
        "groupName": role,
        "replicas": pods_for(spec, inst, initial),
        "minReplicas": pods_for(spec, inst, spec.min_replicas),
        "maxReplicas": pods_for(spec, inst, spec.max_replicas),
        "labels": {inp.serving.placement.label_key: label},
        "rayStartParams": {},
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": inp.name, "app.kubernetes.io/component": f"ray-{role}"}},
            "spec": {
                "serviceAccountName": inp.worker_service_account,
                "automountServiceAccountToken": False,
                "nodeSelector": {ROLE_LABEL: role, INSTANCE_TYPE_LABEL: inst.name},
                "tolerations": [GPU_TOLERATION],
                "securityContext": _pod_security(),
                "containers": [
                    {
                        "name": f"ray-{role}",
                        "image": inp.image,
                        "env": env,
                        "resources": {"requests": dict(limits), "limits": dict(limits)},
                        "securityContext": _security_context(),
                        "volumeMounts": [
                            {"name": "dshm", "mountPath": "/dev/shm"},
                            {"name": "ray-tmp", "mountPath": "/tmp/ray"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{inst.shm_gib}Gi"}},
                    {"name": "ray-tmp", "emptyDir": {"sizeLimit": "100Gi"}},
                ],
            },
        },
    }


def rayservice_manifest(inp: RayServiceInputs) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "upscalingMode": "Default",
            "idleTimeoutSeconds": 600,
            "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
            "securityContext": _security_context(),
        },
        "headGroupSpec": _head(inp),
        "workerGroupSpecs": [_worker(inp, role, spec) for role, spec in inp.serving.engine_roles().items()],
    }
    if inp.gcs_redis_address:
        gcs: dict[str, Any] = {"redisAddress": inp.gcs_redis_address}
        if inp.redis_password:
            gcs["redisPassword"] = {
                "valueFrom": {"secretKeyRef": {"name": inp.redis_password.name, "key": inp.redis_password.key}}
            }
        cluster["gcsFaultToleranceOptions"] = gcs
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": inp.name, "namespace": inp.namespace, "labels": {"app.kubernetes.io/name": inp.name}},
        "spec": {
            "upgradeStrategy": {"type": inp.upgrade_strategy},
            "serveService": serve_service(inp),
            "serveConfigV2": serve_config_yaml(inp),
            "rayClusterConfig": cluster,
        },
    }
