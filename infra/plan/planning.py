"""The capacity plan of a whole stack: pools, replicas, GPUs and prices on top of the fit.

What flows through here: a validated `StackConfig` -> per engine role its pool's hardware,
replica and node ranges (`infra.sizing.nodes`), GPU count and on-demand price at desiredSize
and at maxSize, and, when the model's shape is known, the model figures of `infra.sizing.fit`
and the time from a Pending pod to a serving replica on a new and on a warm node
(`infra.sizing.startup`); the planned request rate (the slowest role's roofline at
maxReplicas) and what it asks of the Ray head (`infra.sizing.head`) and of the decode replica's
API side (`infra.sizing.streaming`) -> a `Plan`, printed by `format_plan()` for `make plan` and
`make render`. Pure arithmetic on published figures: no Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from infra import catalog
from infra.config import NodePool, NodePools, StackConfig
from infra.config.kv_offload import engine_tier
from infra.plan.disaggregation_plan import disaggregation_for
from infra.plan.plan_text import format_layouts as format_layouts
from infra.plan.plan_text import format_plan as format_plan
from infra.plan.plans import KvLink as KvLink
from infra.plan.plans import Plan as Plan
from infra.plan.plans import RolePlan as RolePlan
from infra.plan.plans import RoleScaling as RoleScaling
from infra.plan.plans import Workload as Workload
from infra.plan.streaming_plan import streaming_for
from infra.sizing import nodes as sizing
from infra.sizing import startup
from infra.sizing.fit import (
    HEADROOM_GIB,
    LayoutOption,
    ModelFigures,
    ModelShape,
    bytes_per_element,
    exceeds_one_node,
    max_num_seqs,
    model_figures,
    propose_layouts,
    resolve,
    weights_gib,
)
from infra.sizing.head import HeadSizing, front_door_cpu, size_head, size_head_many
from infra.sizing.offload import fill_seconds
from infra.sizing.streaming import STREAMING_CPU
from serving.spec import Mode, RoleSpec, ServingSpec
from serving.spec.models import RolePools


# --- one node pool: nodes, GPUs, EFA and price -----------------------------------------------
@dataclass(frozen=True)
class PoolFigures:
    """A GPU pool's size and on-demand price: what `make render` and the plan both print."""

    instance_type: str
    capacity_type: str
    min_size: int
    desired_size: int
    max_size: int
    gpus_per_node: int
    efa_per_node: int
    gpus_desired: int
    gpus_max: int
    efa_max: int
    usd_per_hour_desired: float  # on-demand list price, whatever the capacity type
    usd_per_hour_max: float


def pool_figures(pool: NodePool) -> PoolFigures:
    inst = pool.instance
    return PoolFigures(
        instance_type=inst.name,
        capacity_type=pool.capacity_type.value,
        min_size=pool.min_size,
        desired_size=pool.desired_size,
        max_size=pool.max_size,
        gpus_per_node=inst.gpus,
        efa_per_node=inst.efa_interfaces,
        gpus_desired=pool.desired_size * inst.gpus,
        gpus_max=pool.max_size * inst.gpus,
        efa_max=pool.max_size * inst.efa_interfaces,
        usd_per_hour_desired=pool.desired_size * inst.usd_per_hour,
        usd_per_hour_max=pool.max_size * inst.usd_per_hour,
    )


# --- the plan of a whole stack ------------------------------------------------------------
def _replica_rps(
    role: str,
    spec: RoleSpec,
    inst: catalog.InstanceType,
    shape: ModelShape,
    figures_fn: Callable[..., ModelFigures],
    workload: Workload,
) -> float | None:
    """Requests/s at which one replica holds targetOngoingRequests (roofline).

    decode: a replica decoding `target` sequences at once emits tokens_per_s(target) (HBM
    roofline at the workload's context), so it holds `target` requests in flight at
    tokens_per_s(target) / output_tokens requests/s.
    prefill: compute-bound at the GPUs' dense BF16 peak, 2 x parameters FLOPs per prompt token:
    mu = TP x TFLOPS / (2 x P x prompt_tokens) requests/s; with requests sharing the engine,
    `target` are in flight at mu x target / (target + 1) (processor sharing, Little's law).
    Both are upper bounds (no MFU, no scheduling); Serve scales out above them.
    """
    target = spec.target_ongoing_requests
    if role == "decode":
        tok_s = decode_tok_s(figures_fn, workload, target)
        return None if tok_s is None else tok_s / workload.output_tokens
    flops = spec.tensor_parallel_size * catalog.DENSE_BF16_TFLOPS[inst.ray_accelerator] * 1e12
    mu = flops / (2 * shape.parameters_billions * 1e9 * workload.prompt_tokens)
    return mu * target / (target + 1)


def decode_tok_s(figures_fn: Callable[..., ModelFigures], workload: Workload, target: float) -> float | None:
    """Output tokens/s of one decode replica holding `target` sequences at once: the HBM
    roofline at the workload's context (None: unknown)."""
    figs = figures_fn(context_len=workload.prompt_tokens + workload.output_tokens, max_num_seqs=max(1, int(target)))
    return figs.decode_tokens_per_s_max_batch


def _decode_rate_at(config: StackConfig, shape: ModelShape | None, workload: Workload) -> Callable[[int], float | None]:
    """targetOngoingRequests -> the decode replica's roofline tokens/s (what the streaming
    sizing searches for the largest target its ceiling carries)."""
    spec = config.serving.engine_roles().get("decode")
    if shape is None or spec is None:
        return lambda target: None
    model, inst = config.serving.model, config.node_pools.decode.instance

    def figures_fn(**kw: int | None) -> ModelFigures:
        return model_figures(shape, model, "decode", spec, inst, **kw)

    return lambda target: decode_tok_s(figures_fn, workload, target)


def model_view(cfg: StackConfig, spec: ServingSpec) -> StackConfig:
    """The stack as the one-model planner sees one of its models: that model's spec, and its
    roles' pools under the role names the planner reads (`serving.pools` or
    `serving.models[i].pools` may name any pool). Not re-validated: the whole stack was."""
    pools = NodePools({role: cfg.node_pools[spec.pool_of(role)] for role in spec.engine_roles()})
    # In the view each role's pool is named after the role: a view of a view is the same view.
    return cfg.model_copy(update={"serving": spec.model_copy(update={"pools": RolePools()}), "node_pools": pools})


def plan(config: StackConfig, *, context_len: int | None = None, workload: Workload | None = None) -> Plan:
    """The capacity plan of a validated stack's model (with `serving.models`, the first one;
    infra/plan/model_plans.py plans each, `stack_head` sizes the head for all).

    GPU counts and prices cover the node pools of the engine roles that run (in aggregated
    mode, the decode pool only), at the pools' desiredSize and at their maxSize; system
    (CPU) nodes are left out. `context_len` is the context the decode roofline assumes
    (default: maxModelLen).
    """
    config = model_view(config, config.serving.served[0])
    model = config.serving.model
    shape, origin = resolve(model)
    wl = workload or Workload()
    roles = [
        _role_plan(config, role, spec, shape, context_len, wl) for role, spec in config.serving.engine_roles().items()
    ]
    rate = planned_rate(roles)
    head = (
        None
        if rate is None
        else size_head(
            rate[0],
            rate[1],
            config.serving.mode.value,
            config.system_nodes.instance_type,
            config.serving.ingress.max_replicas,
            front_door_cpu(config.serving.ingress.data_plane.value),
            output_tokens=wl.output_tokens,
            stream_ms_per_1k=STREAMING_CPU.ingress_ms_per_1k,
        )
    )
    layout_roles, layouts = _layouts(config, shape, context_len)
    link = kv_link(config, roles)
    return Plan(
        environment=config.environment.value,
        model_id=model.id,
        model_source=model.source,
        dtype=model.dtype.value,
        bytes_per_element=bytes_per_element(model.dtype),
        max_model_len=model.max_model_len,
        gpu_memory_utilization=model.gpu_memory_utilization,
        headroom_gib_per_gpu=HEADROOM_GIB,
        shape=shape,
        shape_origin=origin,
        roles=tuple(roles),
        layouts=tuple(layouts),
        layout_roles=tuple(layout_roles),
        kv_link=link,
        head=head,
        streaming=streaming_for(config, roles, wl.output_tokens, _decode_rate_at(config, shape, wl)),
        disaggregation=disaggregation_for(
            config, shape, roles, link, None if rate is None else rate[0], wl.prompt_tokens, wl.output_tokens
        ),
    )


def planned_rate(roles: list[RolePlan]) -> tuple[float, str] | None:
    """The request rate the stack is planned for, and the role that sets it: every request
    passes every engine role, so the slowest role's roofline rate at maxReplicas."""
    rates = [(r.scaling.max_rps, r.role) for r in roles if r.scaling is not None and r.scaling.max_rps is not None]
    if not rates or len(rates) < len(roles):
        return None
    return min(rates)


def cold_start_seconds(config: StackConfig) -> dict[str, float]:
    """Engine role -> the plan's first request after idle (s), for the roles at minReplicas 0
    whose time to serve is known: what the ingress's Retry-After for a cold start says
    (serving.spec.Target.cold_start_s). With several models, the longest of theirs."""
    out: dict[str, float] = {}
    for spec in config.serving.served:
        for r in plan(model_view(config, spec)).roles:
            if (s := r.first_request_after_idle_s) is not None:
                out[r.role] = max(out.get(r.role, 0.0), s)
    return out


def stack_head(config: StackConfig) -> HeadSizing | None:
    """The head sizing for every model behind the one front door: each model's planned rate
    (its slowest role's roofline at maxReplicas), summed, at each model's CPU per request
    (P/D and aggregated differ). None while any model's rate is unknown."""
    if not config.serving.many:
        return plan(config).head
    parts: list[tuple[float, str, str]] = []
    for spec in config.serving.served:
        rate = planned_rate(list(plan(model_view(config, spec)).roles))
        if rate is None:
            return None
        parts.append((rate[0], f"{spec.model.id} {rate[1]}", spec.mode.value))
    return size_head_many(
        parts,
        config.system_nodes.instance_type,
        config.serving.ingress.max_replicas,
        front_door_cpu(config.serving.ingress.data_plane.value),
        output_tokens=Workload().output_tokens,
        stream_ms_per_1k=STREAMING_CPU.ingress_ms_per_1k,
    )


def _role_plan(
    config: StackConfig,
    role: str,
    spec: RoleSpec,
    shape: ModelShape | None,
    context_len: int | None,
    workload: Workload,
) -> RolePlan:
    """One engine role's pool, sizes and prices, and (shape known) its model figures."""
    serving = config.serving
    model = serving.model
    pool = getattr(config.node_pools, role)
    inst = pool.instance
    gpus = spec.gpus_per_replica
    sized = pool_figures(pool)
    figures = None
    if shape is not None:
        figures = model_figures(
            shape, model, role, spec, inst, context_len=context_len, max_num_seqs=max_num_seqs(serving)
        )
    return RolePlan(
        role=role,
        instance_type=inst.name,
        gpu_model=inst.gpu_model,
        capacity_type=pool.capacity_type.value,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        data_parallel_size=spec.data_parallel_size,
        expert_parallel=spec.moe_parallelism.value == "expert",
        gpus_per_replica=gpus,
        nodes_per_replica=sizing.nodes_per_replica(gpus, inst.gpus),
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        nodes_desired=sized.desired_size,
        nodes_max=sized.max_size,
        pool_min_size=pool.min_size,
        kv_offload=(pool.kv_offload.cpu_gib, pool.kv_offload.disk_gib) if pool.kv_offload else None,
        gpus_desired=sized.gpus_desired,
        gpus_max=sized.gpus_max,
        usd_per_hour_desired=sized.usd_per_hour_desired,
        usd_per_hour_max=sized.usd_per_hour_max,
        gpu_memory_gib=inst.gpu_memory_gib,
        usable_gib_per_gpu=inst.gpu_memory_gib * model.gpu_memory_utilization,
        hbm_gbps=inst.hbm_gbps,
        network="EFA" if inst.efa else "ENA",
        network_gbps=inst.network_gbps * gpus / inst.gpus,
        figures=figures,
        scaling=(scaling := _role_scaling(config, role, spec, inst, shape, workload)),
        startup=_time_to_serve(config, role, pool, shape, figures),
        kv_offload_fill=_offload_fill(role, spec, pool, figures, scaling, workload),
    )


def _offload_fill(
    role: str, spec: RoleSpec, pool: NodePool, figures: ModelFigures | None, scaling: RoleScaling, workload: Workload
) -> tuple[float, float] | None:
    """(seconds until one engine's share of the pool's KV offload tier is full, requests/s per
    replica): at the most a replica is planned to take (maxReplicas' rate / maxReplicas), each
    request storing its prompt (prefill) or its prompt and output (decode)."""
    tier = engine_tier(pool.kv_offload, pool.instance, spec.gpus_per_rank)
    if tier is None or figures is None or not scaling.max_rps:
        return None
    per_replica = scaling.max_rps / spec.max_replicas
    tokens = workload.prompt_tokens + (workload.output_tokens if role == "decode" else 0)
    seconds = fill_seconds(tier.cpu_bytes, per_replica, tokens, figures.kv_bytes_per_token)
    return None if seconds is None else (seconds, per_replica)


def _role_scaling(
    config: StackConfig,
    role: str,
    spec: RoleSpec,
    inst: catalog.InstanceType,
    shape: ModelShape | None,
    workload: Workload,
) -> RoleScaling:
    """Node, GPU and price ranges from minReplicas to maxReplicas, the upgrade's extra nodes,
    and the request rate at which Serve scales the role out."""
    model = config.serving.model
    gpus = spec.gpus_per_replica
    nodes = [sizing.nodes_for(n, gpus, inst.gpus) for n in (spec.min_replicas, spec.max_replicas)]
    strategy = config.upgrade_strategy.value
    peak = sizing.upgrade_peak_nodes(
        strategy, spec.min_replicas, spec.max_replicas, spec.initial_replicas, gpus, inst.gpus
    )

    def figures_fn(**kw: int | None) -> ModelFigures:
        assert shape is not None  # only called when the shape is known
        return model_figures(shape, model, role, spec, inst, **kw)

    per_replica = None if shape is None else _replica_rps(role, spec, inst, shape, figures_fn, workload)

    return RoleScaling(
        nodes_min=nodes[0],
        nodes_max=nodes[1],
        gpus_min=nodes[0] * inst.gpus,
        gpus_max=nodes[1] * inst.gpus,
        usd_per_hour_min=nodes[0] * inst.usd_per_hour,
        usd_per_hour_max=nodes[1] * inst.usd_per_hour,
        upgrade_strategy=strategy,
        upgrade_peak_nodes=peak,
        upgrade_extra_nodes=peak - nodes[1],
        upgrade_extra_usd_per_hour=(peak - nodes[1]) * inst.usd_per_hour,
        target_ongoing_requests=spec.target_ongoing_requests,
        scale_out_rps=None if per_replica is None else spec.min_replicas * per_replica,
        max_rps=None if per_replica is None else spec.max_replicas * per_replica,
    )


def _time_to_serve(
    config: StackConfig, role: str, pool: NodePool, shape: ModelShape | None, figures: ModelFigures | None
) -> startup.TimeToServe:
    """Pending pod -> serving replica, on a new node and on a warm one."""
    model = config.serving.model
    inst = pool.instance
    return startup.time_to_serve(
        role,
        inst,
        raid0=pool.raid0,
        model_source=model.source,
        # A new VPC's private routes have an S3 endpoint (network.py); an existing VPC's: unknown.
        s3_gateway_endpoint=config.existing_vpc is None,
        checkpoint_gib=None if shape is None else weights_gib(shape, model),
        weights_gib_per_gpu=None if figures is None else figures.weights_gib_per_gpu,
        streamed=model.loading.streamed(model.source),
    )


def _layouts(
    config: StackConfig, shape: ModelShape | None, context_len: int | None
) -> tuple[list[str], list[LayoutOption]]:
    """The roles whose pool's one node cannot hold the weights, and the layouts that fit them."""
    serving = config.serving
    layouts: list[LayoutOption] = []
    layout_roles: list[str] = []
    if shape is not None:
        for role in serving.engine_roles():
            inst = getattr(config.node_pools, role).instance
            if exceeds_one_node(shape, serving.model, inst):
                layout_roles.append(role)
                layouts += propose_layouts(
                    shape, serving.model, inst, role, context_len=context_len, max_num_seqs=max_num_seqs(serving)
                )
    return layout_roles, layouts


def kv_link(config: StackConfig, roles: list[RolePlan] | None = None) -> KvLink | None:
    """The slower side of the prefill -> decode KV path (None in aggregated mode)."""
    if config.serving.mode is not Mode.DISAGGREGATED:
        return None
    insts = {role: getattr(config.node_pools, role).instance for role in ("prefill", "decode")}
    slower = min(insts, key=lambda r: (insts[r].gpu_share_gbps, r != "decode"))
    inst = insts[slower]
    gpus = min(spec.gpus_per_replica for spec in config.serving.engine_roles().values())
    replica_gbps = inst.gpu_share_gbps * gpus
    figures = next((r.figures for r in roles or [] if r.figures), None)
    seconds = figures.prompt_kv_bytes * 8 / (replica_gbps * 1e9) if figures else None
    return KvLink(
        backend=inst.nixl_backend.value,
        network="EFA" if inst.efa else "ENA",
        gbps_per_gpu=inst.gpu_share_gbps,
        slower_role=slower,
        slower_instance=inst.name,
        replica_gbps=replica_gbps,
        prompt_seconds=seconds,
    )
