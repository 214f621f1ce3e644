"""The capacity plan of a whole stack: pools, replicas, GPUs and prices on top of the fit.

What flows through here: a validated `StackConfig` -> per engine role its pool's hardware,
replica and node ranges (`infra.model.sizing`), GPU count and on-demand price at desiredSize
and at maxSize, and, when the model's shape is known, the model figures of `infra.model.fit`
and the time from a Pending pod to a serving replica on a new and on a warm node
(`infra.model.startup`) -> a `Plan`, printed by `format_plan()` for `make plan` and `make
render`. Pure arithmetic on published figures: no Pulumi, Ray or vLLM import, nothing
downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.model import catalog, sizing, startup
from infra.model.config import LocalStorage, NodePool, StackConfig
from infra.model.fit import (
    GIB,
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
from serving.spec import Mode


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
@dataclass(frozen=True)
class RolePlan:
    """One engine role: its pool's hardware and cost, and (shape known) the model figures."""

    role: str
    instance_type: str
    gpu_model: str
    capacity_type: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    expert_parallel: bool
    gpus_per_replica: int
    nodes_per_replica: int
    min_replicas: int
    max_replicas: int
    nodes_desired: int
    nodes_max: int
    gpus_desired: int
    gpus_max: int
    usd_per_hour_desired: float  # on-demand list price, whatever the capacity type
    usd_per_hour_max: float
    gpu_memory_gib: float
    usable_gib_per_gpu: float
    hbm_gbps: int
    network: str  # "EFA" or "ENA"
    network_gbps: float  # the replica's share of its nodes' line rate
    figures: ModelFigures | None
    scaling: RoleScaling | None = None
    startup: startup.TimeToServe | None = None
    pool_min_size: int = 1  # the node pool's minSize: 0 lets its last node go when idle


@dataclass(frozen=True)
class RoleScaling:
    """What autoscaling does to one role: replica and node ranges, their GPUs and price, the
    load at which Serve adds a replica, and what a cluster upgrade adds on top."""

    nodes_min: int  # nodes at minReplicas
    nodes_max: int  # nodes at maxReplicas
    gpus_min: int
    gpus_max: int
    usd_per_hour_min: float
    usd_per_hour_max: float
    upgrade_strategy: str
    upgrade_peak_nodes: int  # at maxReplicas, during a cluster upgrade
    upgrade_extra_nodes: int
    upgrade_extra_usd_per_hour: float
    target_ongoing_requests: float
    scale_out_rps: float | None  # requests/s at which the minReplicas replicas reach the target


@dataclass(frozen=True)
class Workload:
    """The request shape the scale-out rates assume (`make plan` options)."""

    prompt_tokens: int = 1024
    output_tokens: int = 256


def _scale_out_rps(role: str, spec, inst, shape, model, serving, figures_fn, workload: Workload) -> float | None:
    """Requests/s at which minReplicas replicas hold targetOngoingRequests each (roofline).

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
        figs = figures_fn(context_len=workload.prompt_tokens + workload.output_tokens, max_num_seqs=max(1, int(target)))
        if figs.decode_tokens_per_s_max_batch is None:
            return None
        per_replica = figs.decode_tokens_per_s_max_batch / workload.output_tokens
    else:
        flops = spec.tensor_parallel_size * catalog.DENSE_BF16_TFLOPS[inst.ray_accelerator] * 1e12
        mu = flops / (2 * shape.parameters_billions * 1e9 * workload.prompt_tokens)
        per_replica = mu * target / (target + 1)
    return spec.min_replicas * per_replica


@dataclass(frozen=True)
class KvLink:
    """The prefill -> decode KV path of a disaggregated stack, set by its slower side.

    NIXL moves each TP rank's share of the KV over that rank's share of the node's line
    rate; when the pools differ (p5 prefill, p4de decode), the slower side's share bounds it.
    """

    backend: str  # NIXL backend (catalog: LIBFABRIC on EFA, UCX elsewhere)
    network: str  # "EFA" or "ENA"
    gbps_per_gpu: float  # the slower side's per-GPU share of its node's line rate
    slower_role: str
    slower_instance: str
    replica_gbps: float  # per replica: gbps_per_gpu x GPUs per replica
    prompt_seconds: float | None  # one maxModelLen prompt's KV at replica_gbps (None: shape unknown)


@dataclass(frozen=True)
class Plan:
    environment: str
    model_id: str
    model_source: str
    dtype: str
    bytes_per_element: int
    max_model_len: int
    gpu_memory_utilization: float
    headroom_gib_per_gpu: float
    shape: ModelShape | None
    shape_origin: str  # where the shape came from, or why it is unknown
    roles: tuple[RolePlan, ...]
    # Layouts that fit, per engine role whose pool's one node cannot hold the weights.
    layouts: tuple[LayoutOption, ...] = ()
    layout_roles: tuple[str, ...] = ()  # the roles whose pools were searched for layouts
    kv_link: KvLink | None = None  # disaggregated mode only

    @property
    def fit_checked(self) -> bool:
        return self.shape is not None

    @property
    def problems(self) -> tuple[tuple[str, str], ...]:
        return tuple(p for r in self.roles if r.figures for p in r.figures.problems)

    @property
    def gpus_desired(self) -> int:
        return sum(r.gpus_desired for r in self.roles)

    @property
    def gpus_max(self) -> int:
        return sum(r.gpus_max for r in self.roles)

    @property
    def usd_per_hour_desired(self) -> float:
        return sum(r.usd_per_hour_desired for r in self.roles)

    @property
    def usd_per_hour_max(self) -> float:
        return sum(r.usd_per_hour_max for r in self.roles)


def plan(config: StackConfig, *, context_len: int | None = None, workload: Workload | None = None) -> Plan:
    """The capacity plan of a validated stack.

    GPU counts and prices cover the node pools of the engine roles that run (in aggregated
    mode, the decode pool only), at the pools' desiredSize and at their maxSize; system
    (CPU) nodes are left out. `context_len` is the context the decode roofline assumes
    (default: maxModelLen).
    """
    serving = config.serving
    model = serving.model
    shape, origin = resolve(model)
    roles: list[RolePlan] = []
    for role, spec in serving.engine_roles().items():
        pool = getattr(config.node_pools, role)
        inst = pool.instance
        gpus = spec.gpus_per_replica
        sized = pool_figures(pool)
        figures = None
        if shape is not None:
            figures = model_figures(
                shape, model, role, spec, inst, context_len=context_len, max_num_seqs=max_num_seqs(serving)
            )
        nodes = [sizing.nodes_for(n, gpus, inst.gpus) for n in (spec.min_replicas, spec.max_replicas)]
        peak = sizing.upgrade_peak_nodes(
            config.upgrade_strategy.value, spec.min_replicas, spec.max_replicas, spec.initial_replicas, gpus, inst.gpus
        )

        def figures_fn(_spec=spec, _inst=inst, _role=role, _shape=shape, **kw):
            assert _shape is not None  # only called when the shape is known
            return model_figures(_shape, model, _role, _spec, _inst, **kw)

        scaling = RoleScaling(
            nodes_min=nodes[0],
            nodes_max=nodes[1],
            gpus_min=nodes[0] * inst.gpus,
            gpus_max=nodes[1] * inst.gpus,
            usd_per_hour_min=nodes[0] * inst.usd_per_hour,
            usd_per_hour_max=nodes[1] * inst.usd_per_hour,
            upgrade_strategy=config.upgrade_strategy.value,
            upgrade_peak_nodes=peak,
            upgrade_extra_nodes=peak - nodes[1],
            upgrade_extra_usd_per_hour=(peak - nodes[1]) * inst.usd_per_hour,
            target_ongoing_requests=spec.target_ongoing_requests,
            scale_out_rps=None
            if shape is None
            else _scale_out_rps(role, spec, inst, shape, model, serving, figures_fn, workload or Workload()),
        )
        time_to_serve = startup.time_to_serve(
            role,
            inst,
            # The same rule as the node pool's NodeConfig (infra/components/gpu_node_pool.py).
            raid0=pool.local_storage is LocalStorage.RAID0 and inst.nvme_disks > 0,
            model_source=model.source,
            # A new VPC gets an S3 gateway endpoint on its private route tables
            # (infra/components/network.py); an existing VPC's routes are not known here.
            s3_gateway_endpoint=config.existing_vpc is None,
            checkpoint_gib=None if shape is None else weights_gib(shape, model),
            weights_gib_per_gpu=None if figures is None else figures.weights_gib_per_gpu,
            streamed=model.loading.streamed(model.source),
        )
        roles.append(
            RolePlan(
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
                scaling=scaling,
                startup=time_to_serve,
            )
        )
    layouts: list[LayoutOption] = []
    layout_roles: list[str] = []
    if shape is not None:
        for role in serving.engine_roles():
            inst = getattr(config.node_pools, role).instance
            if exceeds_one_node(shape, model, inst):
                layout_roles.append(role)
                layouts += propose_layouts(
                    shape, model, inst, role, context_len=context_len, max_num_seqs=max_num_seqs(serving)
                )
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
        kv_link=kv_link(config, roles),
    )


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


# --- text ---------------------------------------------------------------------------------
def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.0f} tok/s"


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%} idle"


def _hops(nbytes: int | None, seconds: float | None) -> str:
    if nbytes is None or seconds is None:
        return "-"
    return f"{nbytes / 2**20:,.0f} MiB, {_duration(seconds)}"


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _serve_parts(t: startup.TimeToServe) -> str:
    if t.weights_s is None:
        return "-"
    return " + ".join(f"{x / 60:.1f}" for x in (t.node_s, t.image_s, t.weights_s, t.engine_s)) + " min"


def _weights_from(t: startup.TimeToServe) -> str:
    if t.streamed:
        return f"{t.source}, streamed to GPUs"
    return f"{t.source} to {t.disk}"


def _after_idle(r: RolePlan) -> str:
    if r.min_replicas > 0:
        return "- (minReplicas > 0)"
    t = r.startup
    if t is None:
        return "-"
    cold = t.new_node_s if r.pool_min_size == 0 else t.warm_node_s
    where = "new node" if r.pool_min_size == 0 else "warm node"
    return f"{_minutes(cold)} ({where})"


def _weights_path(t: startup.TimeToServe) -> str:
    size = "" if t.checkpoint_gib is None else f"{t.checkpoint_gib:,.0f} GiB "
    return f"{size}at {t.download_gibps:.2f} GiB/s ({t.bound_by})"


def _ep(f: ModelFigures) -> str:
    if f.ep_nodes is None:
        return "-"
    if f.ep_bytes_per_token is None or f.ep_tokens_per_s_per_node is None:
        return "none (one node, NVLink)"
    return f"{f.ep_bytes_per_token / 1e6:.2f} MB/token, <= {f.ep_tokens_per_s_per_node:,.0f} tok/s/node"


def format_layouts(p: Plan) -> list[str]:
    """The layouts that fit, one line each (what `make plan` adds for models beyond one node)."""
    if not p.layout_roles:
        return []
    missing = [r.role for r in p.roles if r.role in p.layout_roles and not any(o.role == r.role for o in p.layouts)]
    gone = [
        f"Layouts  no {r.role} layout of up to 4 nodes fits {r.instance_type}" for r in p.roles if r.role in missing
    ]
    if not p.layouts:
        return ["", *gone]
    ctx = p.layouts[0].figures.context_len
    head = (
        f"{'role':<8} {'layout':<24} {'GPUs':>4} {'nodes':>5} {'$/h':>8} {'weights/GPU':>11} "
        f"{'KV tokens':>11} {'decode b=1':>11} {'max batch':>10} {'PP bubble':>9} {'EP MB/tok':>9}"
    )
    lines = ["", f"Layouts that fit (the model's weights exceed one node; decode roofline @ {ctx:,} ctx):", head]
    for o in p.layouts:
        f = o.figures
        lines.append(
            f"{o.role:<8} {o.label:<24} {o.gpus:>4} {o.nodes:>5} {o.usd_per_hour:>8,.2f} "
            f"{f.weights_gib_per_gpu:>7.1f} GiB {f.kv_tokens_per_replica:>11,} "
            f"{_rate(f.decode_tokens_per_s_batch1) if o.role == 'decode' else '-':>11} "
            f"{_rate(f.decode_tokens_per_s_max_batch) if o.role == 'decode' else '-':>10} "
            f"{'-' if f.pp_bubble_fraction is None else f'{f.pp_bubble_fraction:.0%}':>9} "
            f"{'-' if f.ep_bytes_per_token is None else f'{f.ep_bytes_per_token / 1e6:.2f}':>9}"
        )
    return lines + gone


def format_plan(p: Plan) -> str:
    """The plan as a table, one column per engine role (what `make plan` prints)."""
    lines = [f"Model    {p.model_id} ({p.model_source})"]
    if p.shape is not None:
        s = p.shape
        lines.append(
            f"Shape    {s.name} ({p.shape_origin}): {s.parameters_billions:g}B parameters, "
            f"{s.num_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads, "
            f"{s.num_kv_heads} KV heads, head dim {s.head_dim}"
        )
        if s.moe:
            lines.append(
                f"         mixture of experts: {s.active_parameters_billions:g}B active, {s.routed_experts} routed "
                f"experts ({s.experts_per_token} per token) in {s.moe_layers} layers, "
                f"{s.expert_parameters_billions:.1f}B expert parameters"
            )
        if s.mla_kv_dim is not None:
            lines.append(f"         MLA: {s.mla_kv_dim} cached elements per token and layer, on every TP rank")
        if s.weight_bytes_per_param is not None:
            lines.append(f"         weights {s.weight_bytes_per_param:g} B/parameter as published (not the dtype's)")
    else:
        lines.append(f"Shape    unknown: {p.shape_origin}. Fit check skipped.")
    lines.append(
        f"Serving  {p.dtype} ({p.bytes_per_element} B/element), maxModelLen {p.max_model_len:,}, "
        f"gpuMemoryUtilization {p.gpu_memory_utilization:g}, headroom {p.headroom_gib_per_gpu:g} GiB/GPU"
    )

    def row(label: str, cell) -> tuple[str, list[str]]:
        return label, [cell(r) for r in p.roles]

    def fig(cell):
        return lambda r: "-" if r.figures is None else cell(r.figures)

    def decoding(cell):
        # A prefill engine of a disaggregated pair emits one token per request: no decode rate.
        return lambda r: "-" if r.figures is None or r.role != "decode" else cell(r.figures)

    ctx = next((r.figures.context_len for r in p.roles if r.figures), p.max_model_len)
    rows = [
        row("", lambda r: r.role),
        row("Instance", lambda r: f"{r.instance_type} ({r.capacity_type})"),
        row("GPU", lambda r: r.gpu_model),
        row(
            "TP x PP x DP (GPUs/replica)",
            lambda r: f"{r.tensor_parallel_size} x {r.pipeline_parallel_size} x {r.data_parallel_size}"
            f"{' +EP' if r.expert_parallel else ''} ({r.gpus_per_replica})",
        ),
        row("Nodes per replica", lambda r: f"{r.nodes_per_replica}"),
        row("Replicas min-max", lambda r: f"{r.min_replicas}-{r.max_replicas}"),
        row("GPU memory, usable", lambda r: f"{r.gpu_memory_gib:.1f}, {r.usable_gib_per_gpu:.1f} GiB"),
        row("Weights per GPU", fig(lambda f: f"{f.weights_gib_per_gpu:.1f} GiB")),
        row("KV cache per GPU", fig(lambda f: f"{f.kv_gib_per_gpu:.1f} GiB")),
        row("KV per token, per GPU", fig(lambda f: f"{f.kv_bytes_per_token:,} B, {f.kv_bytes_per_token_per_gpu:,} B")),
        row("KV tokens per replica", fig(lambda f: f"{f.kv_tokens_per_replica:,}")),
        row("maxModelLen seqs/replica", fig(lambda f: f"{f.max_length_sequences:,}")),
        row("Network per replica", lambda r: f"{r.network} {r.network_gbps:g} Gbps"),
        row("Prompt KV at maxModelLen", fig(lambda f: f"{f.prompt_kv_bytes / GIB:.2f} GiB")),
        row("  transfer at line rate", fig(lambda f: _duration(f.prompt_kv_seconds))),
        row("PP bubble, 1 batch in flight", fig(lambda f: _share(f.pp_bubble_fraction))),
        row("  stage hops per prompt", fig(lambda f: _hops(f.pp_hop_bytes, f.pp_hop_seconds))),
        row("EP all-to-all over EFA", fig(lambda f: _ep(f))),
        row("HBM per GPU", lambda r: f"{r.hbm_gbps:,} GB/s"),
        row(f"Decode @ {ctx:,} ctx, batch 1", decoding(lambda f: _rate(f.decode_tokens_per_s_batch1))),
        row("  max batch (KV-bound)", decoding(lambda f: f"{f.max_batch:,}")),
        row("  at max batch", decoding(lambda f: _rate(f.decode_tokens_per_s_max_batch))),
        row("Nodes desired/max", lambda r: f"{r.nodes_desired}/{r.nodes_max}"),
        row("GPUs desired/max", lambda r: f"{r.gpus_desired}/{r.gpus_max}"),
        row("On-demand $/h desired/max", lambda r: f"{r.usd_per_hour_desired:,.2f}/{r.usd_per_hour_max:,.2f}"),
        # Autoscaling: what minReplicas and maxReplicas cost, and when Serve scales out.
        row("Autoscaling replicas", lambda r: f"{r.min_replicas}-{r.max_replicas}"),
        row("  nodes min-max", lambda r: f"{r.scaling.nodes_min}-{r.scaling.nodes_max}"),
        row("  GPU-hours/hour min-max", lambda r: f"{r.scaling.gpus_min}-{r.scaling.gpus_max}"),
        row("  $/h at min-max", lambda r: f"{r.scaling.usd_per_hour_min:,.2f}-{r.scaling.usd_per_hour_max:,.2f}"),
        row("  target ongoing/replica", lambda r: f"{r.scaling.target_ongoing_requests:g}"),
        row(
            "  scale out above",
            lambda r: "-" if r.scaling.scale_out_rps is None else f"{r.scaling.scale_out_rps:,.2f} req/s",
        ),
        row(
            "Upgrade window",
            lambda r: f"{r.scaling.upgrade_strategy}: +{r.scaling.upgrade_extra_nodes} nodes"
            + (f" +${r.scaling.upgrade_extra_usd_per_hour:,.2f}/h" if r.scaling.upgrade_extra_nodes else ""),
        ),
        row("  peak nodes / maxSize", lambda r: f"{r.scaling.upgrade_peak_nodes}/{r.nodes_max}"),
        # Pending pod -> serving replica (infra/model/startup.py, every constant sourced there).
        row("Time to serve, new node", lambda r: _minutes(r.startup.new_node_s)),
        row("  node+image+weights+engine", lambda r: _serve_parts(r.startup)),
        row("  weights from", lambda r: _weights_from(r.startup)),
        row("  download", lambda r: _weights_path(r.startup)),
        row("  download, load to GPU", lambda r: f"{_minutes(r.startup.download_s)}, {_minutes(r.startup.load_s)}"),
        row("Time to serve, warm node", lambda r: _minutes(r.startup.warm_node_s)),
        row("  weights via Run:ai streamer", lambda r: _minutes(r.startup.streamer_s)),
        # minReplicas 0: the first request after idle waits for a replica (and its node, when
        # the pool is at zero too) unless the fallback answers it (docs/scaling.md).
        row("First request after idle", lambda r: _after_idle(r)),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(cells[i]) for _, cells in rows) for i in range(len(p.roles))]
    lines.append("")
    for label, cells in rows:
        text = label.ljust(label_w) + "".join("  " + c.ljust(w) for c, w in zip(cells, col_w, strict=False))
        lines.append(text.rstrip())
    lines.append("")
    lines.append(
        f"Total    {p.gpus_desired} GPUs ${p.usd_per_hour_desired:,.2f}/h at desiredSize, "
        f"{p.gpus_max} GPUs ${p.usd_per_hour_max:,.2f}/h at maxSize "
        "(engine node pools, on-demand list prices)"
    )
    if p.kv_link is not None:
        k = p.kv_link
        sides = {r.role: r.instance_type for r in p.roles}
        where = (
            f"both sides {sides['prefill']}"
            if len(set(sides.values())) == 1
            else f"slower side: {k.slower_role} {k.slower_instance}"
        )
        per_request = (
            f"; prompt KV at maxModelLen {_duration(k.prompt_seconds)} per request" if k.prompt_seconds else ""
        )
        lines.append(
            f"KV link  NIXL {k.backend} over {k.network}: {k.replica_gbps:g} Gbps per replica "
            f"({k.gbps_per_gpu:g} Gbps per GPU, {where}){per_request}"
        )
    if not p.fit_checked:
        lines.append("Fit      not checked (model shape unknown)")
    elif p.problems:
        lines.extend(f"Fit      FAILS {key}: {msg}" for key, msg in p.problems)
    else:
        lines.append("Fit      ok: every role holds its weights and at least one maxModelLen sequence")
    lines.extend(format_layouts(p))
    return "\n".join(lines)
