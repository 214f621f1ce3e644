"""The capacity plan as text: the table `make plan` and `make render` print.

What flows through here: a `Plan` (infra/plan/plans.py) -> the model and its shape, one column per engine
role (hardware, memory, KV cache, network, decode speed, cost, autoscaling, time to serve),
the totals, the KV link, the head's sizing, the decode replica's API-side CPU and the fit verdict, then
whether to disaggregate (infra/plan/disaggregation_plan.py) and the multi-node layouts that fit. Text only:
every figure is computed in `infra.plan.planning` and `infra.sizing.fit`. `planning` re-exports
`format_plan` and `format_layouts`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from infra import catalog
from infra.plan.disaggregation_plan import format_disaggregation
from infra.sizing import startup
from infra.sizing.fit import GIB, ModelFigures
from infra.sizing.head import format_head
from infra.sizing.streaming import format_streaming

if TYPE_CHECKING:
    from infra.plan.plans import Plan, RolePlan, RoleScaling


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
    if r.startup is None:
        return "-"
    return f"{_minutes(r.first_request_after_idle_s)} ({r.cold_start_node})"


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


Cell = Callable[["RolePlan"], str]


def _fig(cell: Callable[[ModelFigures], str]) -> Cell:
    return lambda r: "-" if r.figures is None else cell(r.figures)


def _decoding(cell: Callable[[ModelFigures], str]) -> Cell:
    # A prefill engine of a disaggregated pair emits one token per request: no decode rate.
    return lambda r: "-" if r.figures is None or r.role != "decode" else cell(r.figures)


def _scaling(cell: Callable[[RoleScaling], str]) -> Cell:
    return lambda r: cell(r.scaling) if r.scaling is not None else "-"


def _startup(cell: Callable[[startup.TimeToServe], str]) -> Cell:
    return lambda r: cell(r.startup) if r.startup is not None else "-"


def _header_lines(p: Plan) -> list[str]:
    """The model, its shape (or why it is unknown) and the serving settings the figures use."""
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
    return lines


def _engine_rows(ctx: int) -> list[tuple[str, Cell]]:
    """Hardware, memory, KV cache, network and decode speed per role."""
    return [
        ("", lambda r: r.role),
        ("Instance", lambda r: f"{r.instance_type} ({r.capacity_type})"),
        ("GPU", lambda r: r.gpu_model),
        (
            "TP x PP x DP (GPUs/replica)",
            lambda r: f"{r.tensor_parallel_size} x {r.pipeline_parallel_size} x {r.data_parallel_size}"
            f"{' +EP' if r.expert_parallel else ''} ({r.gpus_per_replica})",
        ),
        ("Nodes per replica", lambda r: f"{r.nodes_per_replica}"),
        ("Replicas min-max", lambda r: f"{r.min_replicas}-{r.max_replicas}"),
        ("GPU memory, usable", lambda r: f"{r.gpu_memory_gib:.1f}, {r.usable_gib_per_gpu:.1f} GiB"),
        ("Weights per GPU", _fig(lambda f: f"{f.weights_gib_per_gpu:.1f} GiB")),
        ("KV cache per GPU", _fig(lambda f: f"{f.kv_gib_per_gpu:.1f} GiB")),
        ("KV per token, per GPU", _fig(lambda f: f"{f.kv_bytes_per_token:,} B, {f.kv_bytes_per_token_per_gpu:,} B")),
        ("KV tokens per replica", _fig(lambda f: f"{f.kv_tokens_per_replica:,}")),
        ("maxModelLen seqs/replica", _fig(lambda f: f"{f.max_length_sequences:,}")),
        ("KV offload tier per node", _offload_size),
        ("  extra KV tokens/engine", _offload_tokens),
        ("  full after (planned rate)", _offload_fill),
        ("Network per replica", lambda r: f"{r.network} {r.network_gbps:g} Gbps"),
        ("Prompt KV at maxModelLen", _fig(lambda f: f"{f.prompt_kv_bytes / GIB:.2f} GiB")),
        ("  transfer at line rate", _fig(lambda f: _duration(f.prompt_kv_seconds))),
        ("PP bubble, 1 batch in flight", _fig(lambda f: _share(f.pp_bubble_fraction))),
        ("  stage hops per prompt", _fig(lambda f: _hops(f.pp_hop_bytes, f.pp_hop_seconds))),
        ("EP all-to-all over EFA", _fig(lambda f: _ep(f))),
        ("HBM per GPU", lambda r: f"{r.hbm_gbps:,} GB/s"),
        (f"Decode @ {ctx:,} ctx, batch 1", _decoding(lambda f: _rate(f.decode_tokens_per_s_batch1))),
        ("  max batch (KV-bound)", _decoding(lambda f: f"{f.max_batch:,}")),
        ("  at max batch", _decoding(lambda f: _rate(f.decode_tokens_per_s_max_batch))),
    ]


def _offload_size(r: RolePlan) -> str:
    """What the pool's KV offload tier takes of each node (kvOffload): host memory, NVMe."""
    if r.kv_offload is None:
        return "-"
    cpu, disk = r.kv_offload
    inst = catalog.lookup(r.instance_type)
    return f"{cpu} of {inst.memory_gib} GiB RAM" + (f", {disk} of {inst.nvme_gib} GiB NVMe" if disk else "")


def _offload_tokens(r: RolePlan) -> str:
    """Tokens of KV the tier holds for one engine beyond its GPU cache: the engine's share of
    the node's tier (by its GPUs) over the KV bytes of a token on all its GPUs."""
    if r.kv_offload is None or r.figures is None:
        return "-"
    inst = catalog.lookup(r.instance_type)
    gpus = r.tensor_parallel_size * r.pipeline_parallel_size
    per_token = r.figures.kv_bytes_per_token_per_gpu * gpus
    cpu, disk = (gib * GIB * gpus // inst.gpus // per_token for gib in r.kv_offload)
    return f"{cpu:,} host" + (f" + {disk:,} disk" if disk else "")


def _offload_fill(r: RolePlan) -> str:
    """How long one engine's share of the tier lasts at the plan's rate per replica, every
    request new (infra/sizing/offload.py); then vLLM evicts its least recently used blocks."""
    if r.kv_offload_fill is None:
        return "-"
    seconds, rps = r.kv_offload_fill
    held = f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
    return f"{held} at {rps:.2f} req/s, then LRU"


def _cost_rows() -> list[tuple[str, Cell]]:
    """Nodes, GPUs and price at desiredSize and maxSize; autoscaling's ranges, when Serve scales
    out, and what a cluster upgrade adds."""
    return [
        ("Nodes desired/max", lambda r: f"{r.nodes_desired}/{r.nodes_max}"),
        ("GPUs desired/max", lambda r: f"{r.gpus_desired}/{r.gpus_max}"),
        ("On-demand $/h desired/max", lambda r: f"{r.usd_per_hour_desired:,.2f}/{r.usd_per_hour_max:,.2f}"),
        # Autoscaling: what minReplicas and maxReplicas cost, and when Serve scales out.
        ("Autoscaling replicas", lambda r: f"{r.min_replicas}-{r.max_replicas}"),
        ("  nodes min-max", _scaling(lambda s: f"{s.nodes_min}-{s.nodes_max}")),
        ("  GPU-hours/hour min-max", _scaling(lambda s: f"{s.gpus_min}-{s.gpus_max}")),
        ("  $/h at min-max", _scaling(lambda s: f"{s.usd_per_hour_min:,.2f}-{s.usd_per_hour_max:,.2f}")),
        ("  target ongoing/replica", _scaling(lambda s: f"{s.target_ongoing_requests:g}")),
        (
            "  scale out above",
            _scaling(lambda s: "-" if s.scale_out_rps is None else f"{s.scale_out_rps:,.2f} req/s"),
        ),
        (
            "Upgrade window",
            _scaling(
                lambda s: f"{s.upgrade_strategy}: +{s.upgrade_extra_nodes} nodes"
                + (f" +${s.upgrade_extra_usd_per_hour:,.2f}/h" if s.upgrade_extra_nodes else "")
            ),
        ),
        (
            "  peak nodes / maxSize",
            lambda r: f"{'-' if r.scaling is None else r.scaling.upgrade_peak_nodes}/{r.nodes_max}",
        ),
    ]


def _startup_rows() -> list[tuple[str, Cell]]:
    """Pending pod -> serving replica (infra/sizing/startup.py, every constant sourced there)."""
    return [
        ("Time to serve, new node", _startup(lambda t: _minutes(t.new_node_s))),
        ("  node+image+weights+engine", _startup(_serve_parts)),
        ("  weights from", _startup(_weights_from)),
        ("  download", _startup(_weights_path)),
        ("  download, load to GPU", _startup(lambda t: f"{_minutes(t.download_s)}, {_minutes(t.load_s)}")),
        ("Time to serve, warm node", _startup(lambda t: _minutes(t.warm_node_s))),
        ("  weights via Run:ai streamer", _startup(lambda t: _minutes(t.streamer_s))),
        # minReplicas 0: the first request after idle waits for a replica (and its node, when
        # the pool is at zero too) unless the fallback answers it (docs/scaling.md).
        ("First request after idle", _after_idle),
    ]


def _table(p: Plan, rows: list[tuple[str, Cell]]) -> list[str]:
    """One line per row: the label, then one left-aligned column per engine role."""
    cells = [(label, [cell(r) for r in p.roles]) for label, cell in rows]
    label_w = max(len(label) for label, _ in cells)
    col_w = [max(len(texts[i]) for _, texts in cells) for i in range(len(p.roles))]
    return [
        (label.ljust(label_w) + "".join("  " + c.ljust(w) for c, w in zip(texts, col_w, strict=False))).rstrip()
        for label, texts in cells
    ]


def _footer_lines(p: Plan) -> list[str]:
    """Totals, the KV link of a disaggregated stack, and the fit verdict."""
    lines = [
        f"Total    {p.gpus_desired} GPUs ${p.usd_per_hour_desired:,.2f}/h at desiredSize, "
        f"{p.gpus_max} GPUs ${p.usd_per_hour_max:,.2f}/h at maxSize "
        "(engine node pools, on-demand list prices)"
    ]
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
    lines.extend(format_head(p.head))
    lines.extend(format_streaming(p.streaming))
    if not p.fit_checked:
        lines.append("Fit      not checked (model shape unknown)")
    elif p.problems:
        lines.extend(f"Fit      FAILS {key}: {msg}" for key, msg in p.problems)
    else:
        lines.append("Fit      ok: every role holds its weights and at least one maxModelLen sequence")
    return lines


def format_plan(p: Plan) -> str:
    """The plan as a table, one column per engine role (what `make plan` prints)."""
    ctx = next((r.figures.context_len for r in p.roles if r.figures), p.max_model_len)
    rows = _engine_rows(ctx) + _cost_rows() + _startup_rows()
    if not any(r.kv_offload for r in p.roles):  # no pool has a KV offload tier: no rows for it
        rows = [(label, cell) for label, cell in rows if cell not in (_offload_size, _offload_tokens, _offload_fill)]
    lines = [*_header_lines(p), "", *_table(p, rows), "", *_footer_lines(p)]
    lines += ["", *format_disaggregation(p.disaggregation), *format_layouts(p)]
    return "\n".join(lines)
