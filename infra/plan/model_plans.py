"""The capacity plan of a stack that serves several models (`serving.models`): per model, per pool.

What flows through here: a validated `StackConfig` -> for each model a one-model view of the
stack (`model_view`: its spec, and its roles' pools under the role names the one-model planner
reads) that `infra.plan.planning.plan` plans as before; the GPUs and on-demand price of each
model's replicas at minReplicas and maxReplicas on its pools (`ModelCost`); each pool's size,
price and the models placed on it (`PoolCost`) -> the text `make plan` prints above each
model's own plan. The per-model figures count only that model's nodes (replicas x nodes per
replica), so models sharing a pool are not charged the whole pool each; the pool rows are
what AWS bills. Pure arithmetic on published figures: no Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.config import StackConfig
from infra.plan.planning import Workload, format_plan, model_view, plan, pool_figures
from infra.sizing import nodes as sizing


@dataclass(frozen=True)
class ModelCost:
    model_id: str
    mode: str
    pools: dict[str, str]  # engine role -> pool
    gpus_min: int
    gpus_max: int
    usd_per_hour_min: float  # on-demand list prices of the model's nodes at minReplicas
    usd_per_hour_max: float  # ... and at maxReplicas


@dataclass(frozen=True)
class PoolCost:
    name: str
    instance_type: str
    models: tuple[str, ...]  # "model-id (role)" placed on the pool
    nodes_desired: int
    nodes_max: int
    usd_per_hour_desired: float
    usd_per_hour_max: float


def model_costs(cfg: StackConfig) -> list[ModelCost]:
    out = []
    for spec in cfg.serving.served:
        gpus = [0, 0]
        usd = [0.0, 0.0]
        for role, rs in spec.engine_roles().items():
            inst = cfg.node_pools[spec.pool_of(role)].instance
            for i, replicas in enumerate((rs.min_replicas, rs.max_replicas)):
                nodes = sizing.nodes_for(replicas, rs.gpus_per_replica, inst.gpus)
                gpus[i] += nodes * inst.gpus
                usd[i] += nodes * inst.usd_per_hour
        out.append(
            ModelCost(
                spec.model.id,
                spec.mode.value,
                {role: spec.pool_of(role) for role in spec.engine_roles()},
                gpus[0],
                gpus[1],
                usd[0],
                usd[1],
            )
        )
    return out


def pool_costs(cfg: StackConfig) -> list[PoolCost]:
    out = []
    for name, pool in cfg.node_pools:
        users = tuple(
            f"{spec.model.id} ({role})"
            for spec in cfg.serving.served
            for role in spec.engine_roles()
            if spec.pool_of(role) == name
        )
        f = pool_figures(pool)
        out.append(
            PoolCost(
                name, f.instance_type, users, f.desired_size, f.max_size, f.usd_per_hour_desired, f.usd_per_hour_max
            )
        )
    return out


def format_costs(cfg: StackConfig) -> str:
    """Cost per model (its replicas' nodes) and per pool (what AWS bills), as `make plan` prints."""
    lines = [f"Models ({len(cfg.serving.served)}, one RayService, one front door):"]
    for m in model_costs(cfg):
        where = ", ".join(f"{r} on {p}" for r, p in m.pools.items())
        lines.append(
            f"  {m.model_id:28s} {m.mode:14s} {where:34s} GPUs {m.gpus_min}-{m.gpus_max}  "
            f"${m.usd_per_hour_min:,.2f}-{m.usd_per_hour_max:,.2f}/h (min-max replicas)"
        )
    lines.append("Pools (what AWS bills; on-demand list prices):")
    for p in pool_costs(cfg):
        used = ", ".join(p.models) or "no model (idle pool)"
        lines.append(
            f"  {p.name:10s} {p.instance_type:14s} nodes {p.nodes_desired}/{p.nodes_max} (desired/max)  "
            f"${p.usd_per_hour_desired:,.2f}/h desired, ${p.usd_per_hour_max:,.2f}/h max  <- {used}"
        )
    total_d = sum(p.usd_per_hour_desired for p in pool_costs(cfg))
    total_m = sum(p.usd_per_hour_max for p in pool_costs(cfg))
    lines.append(f"  all pools: ${total_d:,.2f}/h at desired size, ${total_m:,.2f}/h at max")
    return "\n".join(lines)


def format_stack_plan(cfg: StackConfig, *, context_len: int | None = None, workload: Workload | None = None) -> str:
    """The whole plan: one model's plan as before; several models: costs, then each model's plan."""
    if not cfg.serving.many:
        return format_plan(plan(cfg, context_len=context_len, workload=workload))
    parts = [format_costs(cfg)]
    for spec in cfg.serving.served:
        parts.append(f"\n=== model {spec.model.id} ({spec.mode.value}) ===")
        parts.append(format_plan(plan(model_view(cfg, spec), context_len=context_len, workload=workload)))
    return "\n".join(parts)
