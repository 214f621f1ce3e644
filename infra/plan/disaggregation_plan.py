"""`make plan`'s "Disaggregate?" section: aggregated or disaggregated for the stack's workload.

What flows through here: one model's stack view (the planner's `model_view`), its shape, its
engine roles' plans, its KV link and the plan's workload (prompt and output tokens; the rate
the stack is planned for, `planning.planned_rate`) -> one replica profile per engine from the
roofline the plan already computes (the decode step from `infra.sizing.fit.model_figures`,
prompt tokens/s from `infra.sizing.signals.prefill_seconds_per_prompt`, the KV hand-over at the
KV link's rate) -> `infra.sizing.disaggregation.recommend` against `serving.slo` -> a `Verdict`
(`Plan.disaggregation`) and its lines (`format_disaggregation`).

The other mode is planned on the stack's own hardware: an aggregated stack's counterfactual
prefill replica has its decode replica's layout and pool; a disaggregated stack's aggregated
replica, its decode replica's. The GPUs on hand are the stack's at maxReplicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from infra.catalog import InstanceType
from infra.config import StackConfig
from infra.sizing import disaggregation as dis
from infra.sizing.fit import ModelShape, max_num_seqs, model_figures
from infra.sizing.signals import prefill_seconds_per_prompt
from serving.spec import Mode, RoleSpec

if TYPE_CHECKING:
    from infra.plan.plans import KvLink, RolePlan

GIB = 1024**3

# vLLM's batch limits when engineKwargs leave them unset (vllm/engine/arg_utils.py 0.32
# `get_batch_defaults`, the OpenAI server's usage context): GPUs of 70 GiB or more other than
# the A100 get max_num_batched_tokens 8192 and max_num_seqs 1024, the rest 2048 and 256.
_BIG_GPU_GIB = 70
_BATCH_DEFAULTS = {True: (8192, 1024), False: (2048, 256)}


def batch_limits(config: StackConfig, inst: InstanceType) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of the stack's engines on `inst`."""
    big = inst.gpu_memory_mib >= _BIG_GPU_GIB * 1024 and inst.ray_accelerator != "A100"
    tokens, seqs = _BATCH_DEFAULTS[big]
    set_tokens = config.serving.engine_kwargs.get("max_num_batched_tokens")
    return (set_tokens if isinstance(set_tokens, int) and set_tokens > 0 else tokens), (
        max_num_seqs(config.serving) or seqs
    )


def _replica(
    config: StackConfig, shape: ModelShape, role: str, spec: RoleSpec, inst: InstanceType, context: int
) -> dis.ReplicaProfile | None:
    """One replica's profile from the roofline at `context` tokens (None: no FLOPS figure).

    The decode step is linear in the batch (the weights once, each sequence's KV): its two
    ends, batch 1 and the largest batch the KV cache holds, give the fixed and per-sequence
    times."""
    # Every GPU of the replica computes a prompt (PP stages with batches in flight, DP ranks with
    # prompts of their own) and a token costs 2 x the parameters it uses (MoE: the active ones).
    params = shape.active_parameters_billions or shape.parameters_billions
    per_token = prefill_seconds_per_prompt(params, spec.gpus_per_replica, inst, 1)
    if per_token is None:
        return None
    chunk, seqs = batch_limits(config, inst)
    f = model_figures(shape, config.serving.model, role, spec, inst, context_len=context, max_num_seqs=seqs)
    one = 1 / f.decode_tokens_per_s_batch1
    per_seq = 0.0
    if f.max_batch >= 2 and f.decode_tokens_per_s_max_batch:
        per_seq = (f.max_batch / f.decode_tokens_per_s_max_batch - one) / (f.max_batch - 1)
    return dis.ReplicaProfile(
        prefill_tokens_per_s=1 / per_token,
        step_s=one - per_seq,
        step_s_per_seq=per_seq,
        max_batch=f.max_batch,
        max_batched_tokens=chunk,
        gpus=spec.gpus_per_replica,
        gpus_per_node=inst.gpus,
        usd_per_node_hour=inst.usd_per_hour,
    )


def roofline_profile_at(
    config: StackConfig, shape: ModelShape, link_gbps: float, prompt_tokens: int
) -> Callable[[int], dis.Profile] | None:
    """Output tokens -> the replicas' roofline profile at that context (None: a pool's GPU has
    no FLOPS figure). The aggregated replica is the decode one's layout on the decode pool."""
    serving = config.serving
    dec = (serving.decode, config.node_pools.decode.instance)
    pre = (serving.prefill, config.node_pools.prefill.instance) if serving.mode is Mode.DISAGGREGATED else dec
    per_token = model_figures(shape, serving.model, "decode", *dec).kv_bytes_per_token
    kv_s = per_token * prompt_tokens * 8 / (link_gbps * 1e9)

    def at(output_tokens: int) -> dis.Profile:
        ctx = prompt_tokens + output_tokens
        d = _replica(config, shape, "decode", *dec, ctx)
        p = d if pre == dec else _replica(config, shape, "prefill", *pre, ctx)
        assert d is not None and p is not None  # both pools' GPUs were checked below
        return dis.Profile(aggregated=d, prefill=p, decode=d, kv_transfer_s=kv_s)

    if any(
        _replica(config, shape, role, *rs, prompt_tokens + 1) is None
        for role, rs in (("decode", dec), ("prefill", pre))
    ):
        return None
    return at


def disaggregation_for(
    config: StackConfig,
    shape: ModelShape | None,
    roles: Sequence[RolePlan],
    link: KvLink | None,
    rate: float | None,
    prompt_tokens: int,
    output_tokens: int,
) -> dis.Verdict | None:
    """The verdict for one model's stack view (None: shape, planned rate or FLOPS unknown).

    The KV hand-over runs at the KV link's rate (a disaggregated stack's, `planning.kv_link`);
    an aggregated stack's would run between two replicas of its decode pool: that pool's
    per-GPU share of the line rate times the replica's GPUs, the same rule."""
    if shape is None or rate is None:
        return None
    spec, inst = config.serving.decode, config.node_pools.decode.instance
    link_gbps = link.replica_gbps if link is not None else inst.gpu_share_gbps * spec.gpus_per_replica
    profile_at = roofline_profile_at(config, shape, link_gbps, prompt_tokens)
    if profile_at is None:
        return None
    slo = config.serving.slo
    return dis.recommend(
        profile_at,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        rate=rate,
        slo=dis.Slo(ttft_s=slo.ttft_seconds, itl_s=slo.itl_seconds),
        gpus=sum(r.max_replicas * r.gpus_per_replica for r in roles),
        mode=config.serving.mode.value,
        longest_output=max(1, config.serving.model.max_model_len - prompt_tokens),
    )


# --- the plan's lines ------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def _gpus(n: int) -> str:
    return f"{n:,} GPU" + ("" if n == 1 else "s")


def _per_replica(v: dis.Verdict, mode: str) -> str:
    r = v.rates
    if mode == dis.AGGREGATED:
        return f"{r.aggregated:,.1f}"
    return f"{r.prefill:,.1f} prefill, {r.decode:,.1f} decode"


def _mode_row(v: dis.Verdict, c: dis.ModeCost) -> list[str]:
    need = (
        ("-", "-", "-", "-")
        if c.replicas is None
        else (
            " + ".join(f"{n:,}" for n in c.replicas),
            f"{c.gpus:,}",
            f"{c.usd_per_hour:,.2f}",
            "-" if c.goodput_per_gpu is None else f"{c.goodput_per_gpu:,.2f}",
        )
    )
    split = " + ".join(f"{n:,}" for n in c.split) if any(c.split) else "no room for both"
    return [c.mode, _per_replica(v, c.mode), *need, f"{c.max_rate:,.1f} ({split})"]


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _steps_line(v: dis.Verdict) -> str:
    """The roofline pieces the verdict rests on: the decode step, what a prompt chunk adds to
    it on the aggregated replica within the ITL target, and the KV hand-over against TTFT."""
    p, r = v.profile, v.rates
    agg = p.aggregated
    chunk_s = r.aggregated_chunk / agg.prefill_tokens_per_s
    budget = int(r.aggregated_batch + r.aggregated_chunk)
    hold = (
        f"; aggregated holds the ITL only with engineKwargs.max_num_batched_tokens <= {budget:,} "
        f"(now {agg.max_batched_tokens:,})"
        if r.aggregated and budget < agg.max_batched_tokens
        else ""
    )
    return (
        f"  step: decode {_ms(p.decode.step(r.decode_batch))} at batch {r.decode_batch:,.0f}; on the aggregated "
        f"replica a {r.aggregated_chunk:,.0f}-token prompt chunk adds {_ms(chunk_s)} to a "
        f"{_ms(agg.step(r.aggregated_batch))} step (ITL {v.slo.itl_s:g} s){hold}; KV transfer "
        f"{_ms(p.kv_transfer_s)} per prompt (TTFT {v.slo.ttft_s:g} s)"
    )


def _verdict_line(v: dis.Verdict) -> str:
    """The winner against the other mode: dollars an hour at the workload's rate, or on a tie
    the most each serves on the stack's GPUs; a WARNING when serving.mode is the loser."""
    if v.winner is None:
        return f"  neither mode meets serving.slo at {v.rate:,.1f} req/s for this workload: see the step line"
    costs = {dis.AGGREGATED: v.aggregated, dis.DISAGGREGATED: v.disaggregated}
    win = costs[v.winner]
    lose = costs[dis.DISAGGREGATED if v.winner == dis.AGGREGATED else dis.AGGREGATED]
    at = f"{v.rate:,.1f} req/s within the SLO"
    if lose.usd_per_hour is None:
        why = f"{lose.mode} cannot meet the SLO; {win.mode} serves {at} for ${win.usd_per_hour:,.2f}/h"
    elif lose.usd_per_hour != win.usd_per_hour:
        why = f"${win.usd_per_hour:,.2f}/h against ${lose.usd_per_hour:,.2f}/h for {at}"
    else:
        why = (
            f"the same ${win.usd_per_hour:,.2f}/h for {at}; {win.max_rate:,.1f} against {lose.max_rate:,.1f} "
            f"req/s on the stack's {_gpus(v.gpus)}"
        )
    if v.mode_loses:
        return (
            f"WARNING  serving.mode {v.mode} loses to {v.winner} for this workload: {why} "
            "(other workloads: make plan --prompt-tokens N --output-tokens M)"
        )
    return f"  ok: serving.mode {v.mode} wins over {lose.mode} for this workload: {why}"


def format_disaggregation(v: dis.Verdict | None) -> list[str]:
    """The plan's "Disaggregate?" section (one line when it could not be planned)."""
    if v is None:
        return ["Disaggregate?  not planned (no roofline: model shape or GPU FLOPS unknown)"]
    head = [
        "mode",
        "req/s per replica",
        f"replicas for {v.rate:,.1f} req/s",
        "GPUs",
        "$/h",
        "req/s per GPU",
        f"req/s on the stack's {_gpus(v.gpus)} (replicas)",
    ]
    cross = (
        f"disaggregation serves more on the stack's {_gpus(v.gpus)} from {v.crossover_output_tokens:,} output tokens"
        if v.crossover_output_tokens is not None
        else f"aggregation serves at least as much on the stack's {_gpus(v.gpus)} at every output length up to "
        f"{v.longest_output:,} tokens"
    )
    return [
        f"Disaggregate?  {v.prompt_tokens:,} prompt + {v.output_tokens:,} output tokens at the planned "
        f"{v.rate:,.1f} req/s; serving.slo TTFT {v.slo.ttft_s:g} s, ITL {v.slo.itl_s:g} s; every req/s below "
        "within both (roofline, means; docs/capacity.md)",
        *_columns([head, _mode_row(v, v.aggregated), _mode_row(v, v.disaggregated)]),
        _steps_line(v),
        f"  crossover: {cross}",
        _verdict_line(v),
    ]
