"""The composition root: read and validate the stack config, then wire the components.

What flows through here: Pulumi's config for this stack -> `infra.plan.stack.load` (one
line naming the stack file and key on any error, before anything is registered) -> Network ->
the GCS Redis (gcsFaultTolerance managed) -> Cluster, whose `core` (a `ClusterCore`: name,
kubernetes Provider, node role, subnets, region, tags, ...) everything built on it takes -> a
GPU node pool per `nodePools` entry (one-model stacks: prefill and decode) -> the node
autoscaler, device plugins and the KubeRay operator -> the LLM service -> observability
(metrics pipeline, GPU metrics, monitors, alerts, dashboards, request traces) -> stack
outputs. Only this file reads config.
"""

import pulumi

from infra import catalog
from infra.components.cluster import Cluster, ClusterArgs
from infra.components.device_plugins import DevicePluginArgs, EfaDevicePlugin, NvidiaDevicePlugin
from infra.components.gcs_redis import GcsRedis, GcsRedisArgs
from infra.components.gpu_node_pool import GpuNodePool, GpuNodePoolArgs
from infra.components.kuberay import KubeRayOperator, KubeRayOperatorArgs
from infra.components.llm_service import LlmService, LlmServiceArgs
from infra.components.network import Network, NetworkArgs
from infra.components.node_autoscaler import NodeAutoscaler, NodeAutoscalerArgs
from infra.components.observability import ObservabilityArgs, ObservabilityStack
from infra.components.worker_image import WorkerImage, WorkerImageArgs
from infra.config import PROJECT, SECRET_KEYS, ConfigError, Environment, GcsFaultTolerance
from infra.k8s.kv_alerts import kv_rule_groups
from infra.k8s.kv_offload import offload_rule_groups
from infra.k8s.labels import KUBERAY_NAMESPACE
from infra.k8s.monitoring import kuberay_operator_target
from infra.k8s.node_alerts import node_rule_groups
from infra.k8s.rayservice import PoolBounds, used_pools
from infra.k8s.tracing import export_for
from infra.paths import stack_file
from infra.plan.costs import token_prices
from infra.plan.planning import KvLink, cold_start_seconds, kv_link, model_view, stack_head
from infra.plan.stack import load, stack_replica_cpus
from infra.sizing.head import HEAD_BASE_VCPUS
from serving.spec import Mode


def _raw_config() -> tuple[dict, set, str | None]:
    """This project's config values (bare keys), which of them are secrets, and aws:region."""
    prefix = f"{PROJECT}:"
    all_config = {**pulumi.runtime.get_config_env(), **pulumi.runtime.config.CONFIG.get()}
    values = {k[len(prefix) :]: v for k, v in all_config.items() if k.startswith(prefix)}
    secrets = {k for k in values if pulumi.runtime.is_config_secret(prefix + k)}
    return values, secrets, all_config.get("aws:region")


values, secret_keys, region = _raw_config()
try:
    cfg = load(values, secret_keys=secret_keys, source=stack_file(pulumi.get_stack()), region=region)
except ConfigError as err:
    raise pulumi.RunError(str(err)) from None

conf = pulumi.Config()
secrets = {k: conf.get_secret(k) for k in SECRET_KEYS}
stack = pulumi.get_stack()
# Before anything is registered: the cluster's core carries the region to its add-ons.
if not region:
    raise pulumi.RunError(f"{stack_file(stack)}: aws:region: required (the node autoscaler calls the AWS APIs there)")
cluster_name = f"{PROJECT}-{stack}"
tags = {"pd-inference/stack": stack, "pd-inference/environment": cfg.environment.value}

network = Network(
    "net",
    NetworkArgs(
        cidr=cfg.vpc_cidr,
        availability_zones=cfg.availability_zones,
        efa_zone=cfg.efa_zone_name,
        nat_gateways=cfg.nat_gateways,
        existing=cfg.existing_vpc,
        tags=tags,
    ),
)
# gcsFaultTolerance managed: the stack's own ElastiCache (Valkey) group; its clients' security
# group goes onto the system nodes, where the Ray head runs.
gcs_redis = (
    GcsRedis(
        "gcs",
        GcsRedisArgs(
            cluster_name=cluster_name,
            vpc_id=network.vpc_id,
            subnet_ids=network.private_subnet_ids,
            settings=cfg.gcs_redis,
            tags=tags,
        ),
    )
    if cfg.gcs_fault_tolerance is GcsFaultTolerance.MANAGED
    else None
)
cluster = Cluster(
    "eks",
    ClusterArgs(
        cluster_name=cluster_name,
        kubernetes_version=cfg.kubernetes_version,
        vpc_id=network.vpc_id,
        vpc_cidr=cfg.vpc_cidr,
        private_subnet_ids=network.private_subnet_ids,
        public_subnet_ids=network.public_subnet_ids,
        efa_subnet_id=network.efa_subnet_id,
        efa_zone=cfg.efa_zone_name,
        region=region,
        endpoint_access=cfg.endpoint_access,
        public_access_cidrs=cfg.public_access_cidrs,
        admin_role_arns=cfg.admin_role_arns,
        view_role_arns=cfg.view_role_arns,
        ami_release_version=cfg.ami_release_version,
        system_nodes=cfg.system_nodes,
        system_security_group_ids=[gcs_redis.client_security_group_id] if gcs_redis else [],
        deletion_protection=cfg.environment is Environment.PROD,
        tags=tags,
    ),
)
# Everything built on the cluster takes its core (name, provider, node role, subnets, region,
# tags, ...), as pulumi-eks's node groups take a cluster.
core = cluster.core
pools = {
    name: GpuNodePool(f"gpu-{name}", GpuNodePoolArgs(role=name, pool=pool, cluster=core))
    for name, pool in cfg.node_pools
}
node_autoscaler = NodeAutoscaler("node-autoscaler", NodeAutoscalerArgs(cluster=core, pools=list(pools.values())))
plugins = DevicePluginArgs(cluster=core)
NvidiaDevicePlugin("nvidia-device-plugin", plugins)
EfaDevicePlugin("efa-device-plugin", plugins)
operator = KubeRayOperator("kuberay", KubeRayOperatorArgs(cluster=core, watch_namespaces=[cfg.namespace]))
# The worker image (images/ray-llm-efa FROM rayImage: EFA userspace, Run:ai streamer) when the
# pools have EFA or weights stream from S3; else rayImage.
worker_image = (
    WorkerImage(
        "worker-image", WorkerImageArgs(repository=f"{cluster_name}/ray-llm-efa", base_image=cfg.ray_image, tags=tags)
    )
    if cfg.builds_worker_image
    else None
)
service = LlmService(
    "llm",
    LlmServiceArgs(
        cluster=core,
        namespace=cfg.namespace,
        operator=operator,
        serving=cfg.serving,
        # In nodePools order: a pool added at the end becomes an appended worker group.
        instances={name: pools[name].instance for name in pools if name in used_pools(cfg.serving)},
        pool_bounds={name: PoolBounds(p.min_size, p.desired_size, p.max_size) for name, p in cfg.node_pools},
        kv_offload={name: p.kv_offload for name, p in cfg.node_pools if p.kv_offload is not None},
        image=worker_image.ref if worker_image else cfg.ray_image,
        exposure=cfg.service_exposure,
        allowed_cidrs=cfg.service_allowed_cidrs,
        upgrade_strategy=cfg.upgrade_strategy.value,
        api_keys=secrets["apiKeys"],
        fallback_api_key=secrets["fallbackApiKey"],
        hf_token=secrets["hfToken"],
        redis_password=gcs_redis.password if gcs_redis else secrets["gcsRedisPassword"],
        gcs_redis_address=gcs_redis.address if gcs_redis else cfg.gcs_redis_address,
        model_bucket=cfg.model_bucket,
        # Spans go to the observability stack's collector (a fixed in-cluster address).
        tracing=export_for(cfg.observability.tracing, cfg.environment.value),
        # The head pod asks for what the planned rate needs (make plan; the config refused a
        # system node that cannot give it).
        head_cpus=head.head_vcpus if (head := stack_head(cfg)) else HEAD_BASE_VCPUS,
        cold_start_s=cold_start_seconds(cfg),
        # The decode replica's API side asks for what its planned tokens need (make plan).
        replica_cpus=stack_replica_cpus(cfg),
        # What a token costs per model and phase, for the per-key cost counters (make plan's figures).
        token_prices=token_prices(cfg),
    ),
    opts=pulumi.ResourceOptions(depends_on=list(pools.values())),
)


_offload = any(p.kv_offload is not None for _, p in cfg.node_pools)


def _kv_link() -> KvLink | None:
    """The prefill -> decode link of the first disaggregated model, planned on its own pools."""
    pd = next((m for m in cfg.serving.served if m.mode is Mode.DISAGGREGATED), None)
    return kv_link(model_view(cfg, pd)) if pd is not None else None


observability = ObservabilityStack(
    "obs",
    ObservabilityArgs(
        cluster=core,
        settings=cfg.observability,
        slo=cfg.serving.slo,
        llm_namespace=cfg.namespace,
        gpu_instance_types=sorted(catalog.CATALOG),
        # The monitor list is data: a component that exposes metrics adds its target here.
        targets=[kuberay_operator_target(KUBERAY_NAMESPACE), node_autoscaler.scrape_target],
        # P/D only: KV bytes at zero while requests succeed, transfers slower than the plan's link.
        # (With several models: the first P/D model's link, on its own pools.)
        # Every stack: a node's disk nearing the kubelet's eviction threshold (infra/k8s/node_alerts.py).
        extra_rule_groups=(kv_rule_groups(link) if (link := _kv_link()) else [])
        + (offload_rule_groups() if _offload else [])
        + node_rule_groups(),
        # A pool with a KV offload tier: its dashboard row and alerts (infra/k8s/kv_offload.py).
        kv_offload=_offload,
        # The LLM and KubeRay namespaces, as outputs of the operator's Namespace resources: the
        # monitors, rules and NetworkPolicy placed there are created after them.
        namespaces=dict(operator.namespaces),
    ),
)

pulumi.export("clusterName", cluster.cluster_name)
pulumi.export("kubeconfig", cluster.kubeconfig)
pulumi.export("oidcIssuer", cluster.oidc_issuer)
pulumi.export("nodePools", {role: p.node_group_name for role, p in pools.items()})
pulumi.export("systemNodeGroup", cluster.system_node_group_name)
pulumi.export("namespace", cfg.namespace)
pulumi.export("endpoint", service.endpoint)
pulumi.export("endpointService", f"{cfg.namespace}/{service.service_name}")
pulumi.export("codeBucket", service.code_bucket)
pulumi.export("prometheusUrl", observability.prometheus_url)
pulumi.export("ampWorkspaceId", observability.workspace_id)
pulumi.export("tracesBucket", observability.traces_bucket)
pulumi.export("workerImage", worker_image.ref if worker_image else cfg.ray_image)
