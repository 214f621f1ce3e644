"""What a token costs on the cluster, per model and phase: the price the per-key cost counters
multiply by (serving/ingress/costs.py), from the capacity plan's figures.

What flows through here: a validated stack -> per served model, per phase, one replica's price
per hour (its GPUs' share of its pool's nodes at `nodePools.<pool>.usdPerHour`, else the
catalog's on-demand list price) and its tokens per second (`model.throughput` where the stack
gives measured figures, else the plan's roofline) -> USD per token (`token_prices`,
rendered through the Target into the ingress's user_config) and the lines `make plan` could
print (`PhasePrice`).

The two phases: prefill is the prompt tokens an engine computes, at the replica that computes
them (the prefill role's in P/D, the aggregated engine's otherwise) at its prompt tokens/s (the
dense BF16 roofline, 2 x active parameters FLOPs a token, as the plan's prefill rate); decode is
the output tokens at the decode replica's output tokens/s when it holds
`targetOngoingRequests` sequences (the batch autoscaling keeps it at; the HBM roofline at the
plan's workload context), i.e. one token is its share of one decode step of that batch. A
roofline is an upper bound on speed, so a price from it is a lower bound on cost: measured
figures in `model.throughput` replace it. Pure arithmetic: no Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.config import NodePool, StackConfig
from infra.plan.plans import Workload
from infra.sizing.fit import model_figures
from infra.sizing.shapes import resolve
from infra.sizing.signals import prefill_seconds_per_prompt
from serving.spec import Mode, RoleSpec, ServingSpec

PREFILL, DECODE = "prefill", "decode"
ROOFLINE, MEASURED = "roofline", "measured"


@dataclass(frozen=True)
class PhasePrice:
    """One phase of one model: the replica that runs it, its price and speed."""

    role: str  # the engine role whose replica runs the phase
    usd_per_hour: float  # one replica
    tokens_per_s: float  # one replica: prompt tokens computed (prefill), output tokens (decode)
    basis: str  # ROOFLINE or MEASURED

    @property
    def usd_per_token(self) -> float:
        return self.usd_per_hour / 3600 / self.tokens_per_s


def replica_usd_per_hour(pool: NodePool, spec: RoleSpec) -> float:
    """One replica's share of its pool's nodes: its GPUs' fraction of a node, or whole nodes."""
    return pool.node_usd_per_hour * spec.gpus_per_replica / pool.instance.gpus


def _tokens_per_s(cfg: StackConfig, spec: ServingSpec, phase: str, role: str) -> tuple[float, str] | None:
    measured = getattr(spec.model.throughput, f"{phase}_tokens_per_s")
    if measured is not None:
        return measured, MEASURED
    shape, _ = resolve(spec.model)
    if shape is None:
        return None
    rs = spec.engine_roles()[role]
    inst = cfg.node_pools[spec.pool_of(role)].instance
    if phase == PREFILL:
        per_token = prefill_seconds_per_prompt(
            shape.active_parameters_billions or shape.parameters_billions, rs.gpus_per_replica, inst, 1
        )
        return None if per_token is None else (1 / per_token, ROOFLINE)
    wl = Workload()
    batch = max(1, int(rs.target_ongoing_requests))
    figs = model_figures(
        shape, spec.model, role, rs, inst, context_len=wl.prompt_tokens + wl.output_tokens, max_num_seqs=batch
    )
    tok_s = figs.decode_tokens_per_s_max_batch
    return None if not tok_s else (tok_s, ROOFLINE)


def phase_prices(cfg: StackConfig, spec: ServingSpec) -> dict[str, PhasePrice]:
    """The priced phases of one served model (`spec`: an entry of `cfg.serving.served`); a
    phase whose speed is unknown (model shape unknown, no FLOPS figure, nothing measured) is
    left out."""
    out: dict[str, PhasePrice] = {}
    for phase in (PREFILL, DECODE):
        role = PREFILL if phase == PREFILL and spec.mode is Mode.DISAGGREGATED else DECODE
        speed = _tokens_per_s(cfg, spec, phase, role)
        if speed is None:
            continue
        pool = cfg.node_pools[spec.pool_of(role)]
        out[phase] = PhasePrice(role, replica_usd_per_hour(pool, spec.engine_roles()[role]), *speed)
    return out


def token_prices(cfg: StackConfig) -> dict[str, dict[str, float]]:
    """Per served model id, USD per token by phase (serving.spec.Target.token_prices)."""
    out = {}
    for spec in cfg.serving.served:
        prices = {phase: p.usd_per_token for phase, p in phase_prices(cfg, spec).items()}
        if prices:
            out[spec.model.id] = prices
    return out
