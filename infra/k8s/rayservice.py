"""The RayService manifest, as plain data: the head and one worker group per GPU pool.

What flows through here: the serving spec (which renders `serveConfigV2` through
`ServingSpec.serve_config`, the same function `make serve` uses; one model, or several behind
one front door), the catalog entry of each pool's instance type, the pools' role labels and
GPU taint, secret and service-account names -> a `ray.io/v1` RayService dict.

Worker groups are per pool, never per model: a one-model stack has the groups `prefill` and
`decode` sized from the model's replicas, as always; in the many-model form a pool's group
takes the pool's node bounds (`PoolBounds`), so that adding a model to existing pools changes
serveConfigV2 only, which KubeRay 1.7 applies to the running cluster's Serve in place
(infra/k8s/upgrades.py). Every model's Serve deployments reach their pools through the pool's
Ray node label (`ServingSpec.pool_label`) in their placement bundles' label selectors. The
containers' environment (EFA and NCCL, the GCS's CA bundle, the region, the data plane's Ray
switches, the node drain) comes from `infra.k8s.ray_env`. No Pulumi here: `LlmService` calls
it inside an apply once the code bucket's name is known, and the tests call it directly.

Sizing rules (all from the catalog, never literals): a worker pod owns its node, asks for
every GPU and every EFA interface of the type, most of its CPUs and memory, and a RAM-backed
/dev/shm. Pods per role = ceil(replicas / replicas-per-node) x nodes-per-replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from infra import catalog
from infra.config.kv_offload import KvOffload, engine_tier
from infra.k8s.kv_offload import pod_parts
from infra.k8s.labels import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    GPU_TOLERATION,
    INSTANCE_TYPE_LABEL,
    ROLE_LABEL,
    SAFE_TO_EVICT,
    SYSTEM_ROLE,
)
from infra.k8s.monitoring import PROMETHEUS_URL
from infra.k8s.monitoring import ROLE as METRICS_ROLE_LABEL
from infra.k8s.ray_env import (
    NCCL_EFA_ENV,
    PROMETHEUS_HOST_ENV,
    REDIS_CA_CERT_ENV,
    SYSTEM_CA_BUNDLE,
    data_plane_env,
    efa_engine_env,
    gcs_uses_tls,
    node_drain_env,
    ray_start_params,
    region_env,
)
from infra.k8s.tracing import TraceExport, exporter_mount, exporter_volume, pod_env
from infra.sizing import nodes as sizing
from infra.sizing.head import HEAD_BASE_VCPUS
from infra.sizing.signals import role_thresholds
from infra.versions import RAY_VERSION
from serving.spec import API_KEYS_ENV, FALLBACK_API_KEY_ENV, SERVE_PORT, RoleSpec, ServingSpec, Target, pool_label
from serving.spec.offload import OffloadTier
from serving.spec.render import kv_bound_ports

RAY_UID = 1000  # the `ray` user of Ray's images
HF_TOKEN_ENV = "HF_TOKEN"
# Ray's dashboard agent port and unified node health path (KubeRay v1.7.0 utils
# DefaultDashboardAgentListenPort, RayNodeHealthPath; Ray 2.60 dashboard/modules/reporter/
# healthz_agent.py: 200 while the local raylet lives, public without token auth).
DASHBOARD_AGENT_PORT = 52365
NODE_HEALTH_PATH = "/api/healthz"
# The head's and proxy-running workers' container port name; the serve Service targets it by
# name, so only pods that declare it receive API traffic.
SERVE_PORT_NAME = "serve"


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str

    def env(self, var: str) -> dict[str, Any]:
        return {"name": var, "valueFrom": {"secretKeyRef": {"name": self.name, "key": self.key}}}


@dataclass(frozen=True)
class PoolBounds:
    """A pool's node group sizes: the worker group's bounds in the many-model form."""

    min_size: int
    desired_size: int
    max_size: int


@dataclass(frozen=True)
class RayServiceInputs:
    name: str
    namespace: str
    image: str
    serving: ServingSpec
    # By pool name (nodePools); a one-model stack's pools are named after its roles.
    instances: dict[str, catalog.InstanceType]
    working_dir: str  # s3:// URL of the packaged serving/ code
    head_service_account: str
    worker_service_account: str
    api_keys: SecretRef | None
    # The external fallback provider's key (serving.fallback), for the ingress on the head.
    fallback_api_key: SecretRef | None = None
    hf_token: SecretRef | None = None
    redis_password: SecretRef | None = None
    gcs_redis_address: str | None = None
    upgrade_strategy: str = "NewCluster"
    # The stack's AWS region (aws:region): every Ray container's REGION_ENV (infra/k8s/ray_env.py); None sets none.
    region: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Request tracing (observability.tracing): every Ray pod exports Serve's spans and every
    # engine vLLM's to this collector; None renders none of it (infra/k8s/tracing.py).
    tracing: TraceExport | None = None
    # The OpenAI API's Service, as KubeRay's `spec.serveService`: KubeRay creates it and keeps
    # its selector on the serving pods of the ACTIVE cluster across NewCluster upgrades
    # (ray-operator/controllers/ray/common/service.go BuildServeService, v1.7.0).
    service_name: str | None = None  # default <name>-openai
    service_type: str = "ClusterIP"  # or LoadBalancer (internal NLB)
    service_annotations: dict[str, str] = field(default_factory=dict)
    load_balancer_source_ranges: list[str] = field(default_factory=list)
    # The head pod's CPU request: the head sizing's need at the planned rate
    # (infra/sizing/head.py, `make plan`), at least Ray's own work.
    head_cpus: int = HEAD_BASE_VCPUS
    # Engine role -> the planner's first request after idle (s), for roles at minReplicas 0
    # (infra/plan/planning.py cold_start_seconds): decode's becomes the ingress's Retry-After
    # while it has no running replica (serving.spec.Target.cold_start_s).
    cold_start_s: dict[str, float] = field(default_factory=dict)
    # Model id -> engine role -> its replica actor's CPUs where the plan sizes them above Ray's
    # default (infra/sizing/streaming.py; serving.spec.Target.replica_cpus).
    replica_cpus: dict[str, dict[str, int]] = field(default_factory=dict)
    # By pool name: the node group sizes (needed in the many-model form only).
    pool_bounds: dict[str, PoolBounds] = field(default_factory=dict)
    # By pool name: the pool's KV offload tier (nodePools.<name>.kvOffload); absent: none.
    kv_offload: dict[str, KvOffload] = field(default_factory=dict)
    token_prices: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> phase -> USD/token


def serve_service(inp: RayServiceInputs) -> dict[str, Any]:
    """`spec.serveService`: KubeRay sets the selector itself, so none is given here; the port is
    named "serve" like the head's container port, which KubeRay merges by name."""
    spec: dict[str, Any] = {
        "type": inp.service_type,
        # Targeted by name: pods without a "serve" container port (workers whose replicas
        # span pods, where most pods run no proxy) get no traffic (Kubernetes EndpointSlice
        # controller, staging/src/k8s.io/endpointslice/utils.go getEndpointPorts/findPort).
        "ports": [{"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT_NAME, "protocol": "TCP"}],
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


def accelerator_resource(inst: catalog.InstanceType) -> str:
    """Ray's custom resource for the GPU model, as Ray Serve LLM's placement bundles name it."""
    return f"accelerator_type:{inst.ray_accelerator}"


def pods_for(role: RoleSpec, inst: catalog.InstanceType, replicas: int) -> int:
    """Worker pods (= nodes) that hold `replicas` engine replicas of `role` on `inst`."""
    return sizing.nodes_for(replicas, role.gpus_per_replica, inst.gpus)


def replicas_span_pods(role: RoleSpec, inst: catalog.InstanceType) -> bool:
    """Whether one Serve replica of the role (TP x PP GPUs; a DP rank is a replica of its own)
    spans several worker pods. Ray Serve puts the replica actor on its placement group's bundle
    0 and starts a proxy only on nodes holding a replica actor (Ray 2.60 deployment_scheduler.py,
    controller.py _update_proxy_nodes), so the other pods of such a replica never run a proxy."""
    return role.gpus_per_rank > inst.gpus


def node_readiness_probe() -> dict[str, Any]:
    """The readiness probe of a worker that may run no Serve proxy: the node's own health
    (raylet alive), the check KubeRay itself gives plain RayCluster workers on Ray >= 2.53
    (pod.go initLivenessAndReadinessProbe, v1.7.0); KubeRay injects its proxy check only into
    containers without a probe. Timings are KubeRay's defaults (utils/constant.go)."""
    return {
        "httpGet": {"path": NODE_HEALTH_PATH, "port": DASHBOARD_AGENT_PORT},
        "initialDelaySeconds": 10,
        "timeoutSeconds": 2,
        "periodSeconds": 5,
        "successThreshold": 1,
        "failureThreshold": 10,
    }


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


def used_pools(serving: ServingSpec) -> list[str]:
    """The pools some model's engine role runs on, in the order the models first name them."""
    return list(dict.fromkeys(m.pool_of(r) for m in serving.served for r in m.engine_roles()))


def group_order(inp: RayServiceInputs) -> list[str]:
    """The worker groups' order: the roles' (prefill, decode) with one model; with several, the
    order of `instances` (nodePools order). KubeRay 1.7 adds worker groups APPENDED at the end
    to the running cluster in place and starts a new cluster for any other change of the groups
    (rayservice_controller.go shouldPrepareNewCluster -> isClusterSpecHashEqual partial=true),
    so a new pool goes at the end of nodePools."""
    used = used_pools(inp.serving)
    if not inp.serving.many:
        return used
    return [p for p in inp.instances if p in used]


def _target(inp: RayServiceInputs, spec: ServingSpec) -> Target:
    """One model's Target: its pools' GPU types, fabric, planned thresholds and metric selectors."""
    pools = used_pools(inp.serving)
    engine_env = dict(inp.extra_env)
    engine_env.update(efa_engine_env([inp.instances[p] for p in pools]))
    if any(inp.instances[p].efa for p in pools):
        engine_env.update(NCCL_EFA_ENV)
    insts = {role: inp.instances[spec.pool_of(role)] for role in spec.engine_roles()}
    backends = {i.nixl_backend for i in insts.values()}
    if len(backends) != 1:  # the config refuses EFA on one side only; never render it
        raise ValueError(f"prefill and decode pools need the same fabric (got {sorted(b.value for b in backends)})")
    per_role = {role: i.ray_accelerator for role, i in insts.items()}
    # The scrape gives engine series a `role` label from the worker group's (pool's) name
    # (infra/k8s/monitoring.py); the policies read them through RAY_PROMETHEUS_HOST. On a
    # pool several models share, vLLM's own `model_name` label tells their series apart.
    model_sel = f',model_name="{spec.model.id}"' if inp.serving.many else ""
    return Target(
        accelerator_type=next(iter(per_role.values())),
        role_accelerator_types=per_role,
        working_dir=inp.working_dir,
        engine_env=engine_env,
        kv_backend=backends.pop(),
        role_thresholds=role_thresholds(spec, insts),
        metrics_selectors={role: f'{METRICS_ROLE_LABEL}="{spec.pool_of(role)}"{model_sel}' for role in insts},
        cold_start_s=dict(inp.cold_start_s),
        replica_cpus=dict(inp.replica_cpus.get(spec.model.id, {})),
        traces_endpoint=inp.tracing.endpoint if inp.tracing else None,
        role_kv_offload=_role_tiers(inp, spec),
        token_prices=dict(inp.token_prices.get(spec.model.id, {})),
    )


def _role_tiers(inp: RayServiceInputs, spec: ServingSpec) -> dict[str, OffloadTier]:
    """Each engine role's share of its pool's KV offload tier (roles on pools without one: none)."""
    tiers = {}
    for role, rs in spec.engine_roles().items():
        pool = spec.pool_of(role)
        tier = engine_tier(inp.kv_offload.get(pool), inp.instances[pool], rs.gpus_per_rank)
        if tier is not None:
            tiers[role] = tier
    return tiers


def serve_config_yaml(inp: RayServiceInputs) -> str:
    targets = {m.model.id: _target(inp, m) for m in inp.serving.served}
    main = targets[inp.serving.served[0].model.id]
    config = inp.serving.serve_config(main, model_targets=targets if inp.serving.many else None)
    return yaml.safe_dump(config, sort_keys=False)


# The head pod's CPU limit when its sizing asks for less: room for bursts of Ray's own work.
HEAD_CPU_LIMIT = 4


def _head(inp: RayServiceInputs) -> dict[str, Any]:
    env = [inp.api_keys.env(API_KEYS_ENV)] if inp.api_keys else []
    if inp.fallback_api_key:
        env.append(inp.fallback_api_key.env(FALLBACK_API_KEY_ENV))
    if gcs_uses_tls(inp.gcs_redis_address):
        env.append({"name": REDIS_CA_CERT_ENV, "value": SYSTEM_CA_BUNDLE})
    # The Serve controller (on the head) runs the per-role autoscaling policies; their
    # PrometheusQueryMixin reads the engines' metrics from here (serving/engines/autoscaling.py).
    env.append({"name": PROMETHEUS_HOST_ENV, "value": PROMETHEUS_URL})
    env.append(node_drain_env(inp.serving))
    env.extend(data_plane_env(inp.serving))
    env.extend(region_env(inp.region))
    volumes: list[dict[str, Any]] = [{"name": "ray-tmp", "emptyDir": {"sizeLimit": "20Gi"}}]
    mounts: list[dict[str, Any]] = [{"name": "ray-tmp", "mountPath": "/tmp/ray"}]
    _add_tracing(inp, "head", env, volumes, mounts)
    return {
        # The head runs the GCS, the Serve controller, the proxy and the ingress; no model work.
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0", **ray_start_params()},
        "labels": {inp.serving.placement.label_key: inp.serving.placement.head},
        "template": {
            "metadata": {
                "labels": {"app.kubernetes.io/name": inp.name, "app.kubernetes.io/component": "ray-head"},
                "annotations": dict(SAFE_TO_EVICT),
            },
            "spec": {
                "serviceAccountName": inp.head_service_account,
                "terminationGracePeriodSeconds": inp.serving.drain().termination_grace_s,
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
                            {"containerPort": SERVE_PORT, "name": SERVE_PORT_NAME},
                        ],
                        "env": env,
                        "resources": {
                            "requests": {"cpu": str(inp.head_cpus), "memory": "8Gi"},
                            "limits": {"cpu": str(max(HEAD_CPU_LIMIT, inp.head_cpus)), "memory": "12Gi"},
                        },
                        "securityContext": _security_context(),
                        "volumeMounts": mounts,
                    }
                ],
                "volumes": volumes,
            },
        },
    }


def _add_tracing(
    inp: RayServiceInputs,
    role: str,
    env: list[dict[str, Any]],
    volumes: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
) -> None:
    """With tracing on: Serve's and the SDK's variables (service name `<name>-<role>`) and the
    exporter factory's ConfigMap mounted where PYTHONPATH points."""
    if inp.tracing is None:
        return
    env.extend(pod_env(inp.tracing, f"{inp.name}-{role}"))
    volumes.append(exporter_volume(inp.tracing, inp.name))
    mounts.append(exporter_mount())


def _pool_roles(serving: ServingSpec, pool: str) -> list[RoleSpec]:
    """Every engine role (of every model) that runs on `pool`."""
    return [rs for m in serving.served for r, rs in m.engine_roles().items() if m.pool_of(r) == pool]


def _kv_routing_ports(serving: ServingSpec, pool: str, inst: catalog.InstanceType) -> list[dict[str, Any]]:
    """The ports a KV-routed prefill tier's engines bind on `pool`, for each replica a pod can
    hold (declared: the scorer connects to them; serving/spec/render.py kv_bound_ports)."""
    return [
        {"containerPort": port, "name": name, "protocol": "TCP"}
        for slot, m in enumerate(serving.served)
        if m.kv_routed and m.pool_of("prefill") == pool
        for name, port in kv_bound_ports(
            slot, max(1, inst.gpus // m.prefill.gpus_per_rank), m.prefill.data_parallel_size
        )
    ]


def _group_sizes(inp: RayServiceInputs, pool: str, roles: list[RoleSpec]) -> dict[str, int]:
    """The worker group's pods: from the one model's replicas (one-model form), or the pool's
    node bounds (many-model form: adding a model leaves the group as it is)."""
    inst = inp.instances[pool]
    if not inp.serving.many and len(roles) == 1:
        (spec,) = roles
        return {
            "replicas": pods_for(spec, inst, spec.starting_replicas),
            "minReplicas": pods_for(spec, inst, spec.min_replicas),
            "maxReplicas": pods_for(spec, inst, spec.max_replicas),
        }
    b = inp.pool_bounds.get(pool)
    if b is None:
        raise ValueError(f"pool {pool!r}: its node bounds are needed to size its worker group (pool_bounds)")
    return {"replicas": b.desired_size, "minReplicas": b.min_size, "maxReplicas": b.max_size}


def _worker(inp: RayServiceInputs, pool: str) -> dict[str, Any]:
    role = pool  # the group, its container and its node label are named after the pool
    inst = inp.instances[pool]
    roles = _pool_roles(inp.serving, pool)
    label = pool_label(inp.serving.placement, pool)
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
    env.append(node_drain_env(inp.serving))
    env.extend(data_plane_env(inp.serving))
    env.extend(region_env(inp.region))
    # /dev/shm (grown by a KV offload tier's CPU share, which vLLM keeps there) and its disk tier.
    volumes, mounts, start_params = pod_parts(inst, inp.kv_offload.get(pool))
    volumes.insert(1, {"name": "ray-tmp", "emptyDir": {"sizeLimit": "100Gi"}})
    mounts.insert(1, {"name": "ray-tmp", "mountPath": "/tmp/ray"})
    _add_tracing(inp, role, env, volumes, mounts)
    container: dict[str, Any] = {
        "name": f"ray-{role}",
        "image": inp.image,
        "env": env,
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "securityContext": _security_context(),
        "volumeMounts": mounts,
    }
    # Several models share a pool, and its group follows the pool's node bounds: a pod may hold
    # no replica at all, so no proxy. Such pods (and those of replicas that span pods) are Ready
    # on their node's health and are no serve endpoint; the head's proxy takes the API traffic.
    if inp.serving.many or any(replicas_span_pods(spec, inst) for spec in roles):
        # Only bundle 0's pod of a replica runs a proxy: every pod is Ready on its node's
        # health, and none is a serve endpoint (no "serve" port for the Service to target).
        container["readinessProbe"] = node_readiness_probe()
    else:
        # Every pod holds a replica, so a proxy: KubeRay's probe (node + proxy) and an endpoint.
        container["ports"] = [{"containerPort": SERVE_PORT, "name": SERVE_PORT_NAME}]
    kv = _kv_routing_ports(inp.serving, pool, inst)
    if kv:
        container["ports"] = [*container.get("ports", []), *kv]
    return {
        "groupName": role,
        **_group_sizes(inp, pool, roles),
        "labels": {inp.serving.placement.label_key: label},
        # What the engines' placement bundles ask for besides CPU/GPU/memory: without it the
        # Ray autoscaler sees the demand as infeasible and never adds a pod (Ray 2.60
        # autoscaler/_private/kuberay/autoscaling_config.py reads this field; KubeRay 1.7
        # passes it to `ray start --resources`). Ray sets the same value on GPU nodes itself.
        "resources": {accelerator_resource(inst): "1"},
        "rayStartParams": {**ray_start_params(), **start_params},
        "template": {
            "metadata": {
                "labels": {"app.kubernetes.io/name": inp.name, "app.kubernetes.io/component": f"ray-{role}"},
                "annotations": dict(SAFE_TO_EVICT),
            },
            "spec": {
                "serviceAccountName": inp.worker_service_account,
                "terminationGracePeriodSeconds": inp.serving.drain().termination_grace_s,
                "automountServiceAccountToken": False,
                "nodeSelector": {ROLE_LABEL: role, INSTANCE_TYPE_LABEL: inst.name},
                "tolerations": [GPU_TOLERATION],
                "securityContext": _pod_security(),
                "containers": [container],
                "volumes": volumes,
            },
        },
    }


def rayservice_manifest(inp: RayServiceInputs) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            # v2: the only Ray autoscaler that honours label selectors, so a decode replica's
            # demand adds a decode pod, never a prefill one (ray/autoscaler/v2/scheduler.py).
            "version": "v2",
            "upscalingMode": "Default",
            "idleTimeoutSeconds": 600,
            "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
            "securityContext": _security_context(),
        },
        "headGroupSpec": _head(inp),
        "workerGroupSpecs": [_worker(inp, pool) for pool in group_order(inp)],
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
            # After a NewCluster switch KubeRay deletes the old cluster this long after the serve
            # Service's selector moved, and waits for nothing else (rayservice_controller.go
            # cleanUpRayClusterInstance, v1.7.0): its streams must have ended by then.
            "rayClusterDeletionDelaySeconds": inp.serving.drain().cluster_deletion_delay_s,
            "serveService": serve_service(inp),
            "serveConfigV2": serve_config_yaml(inp),
            "rayClusterConfig": cluster,
        },
    }
