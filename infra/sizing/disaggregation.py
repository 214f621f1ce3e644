"""Aggregated or disaggregated? Each mode's goodput for a workload and an SLO (pure arithmetic).

What flows through here: a `Profile` (how fast one replica of each engine prefills and decodes:
the GPU roofline from `infra.plan.disaggregation_plan`, or figures measured on the CPU by the
local benchmark), the workload (prompt and output tokens, the request rate), the SLO (TTFT and
ITL targets, `serving.slo`) and the GPUs on hand -> per mode the most requests per second one
replica serves within both targets (DistServe's "goodput", Zhong et al., OSDI 2024), the
replicas, GPUs and $/hour each mode needs for the rate, the most each mode serves on the GPUs,
the output length from which disaggregation is ahead, and which mode wins (`recommend()`).

The model, per replica (a step is one engine iteration; vLLM's scheduler puts every running
sequence's next token in each step and fills the rest of the step's token budget,
`max_num_batched_tokens`, with prompt chunks):

- a decode step of B running sequences takes t(B) = step_s + B x step_s_per_seq (the weights
  read once, each sequence's KV read: linear in B, as the HBM roofline is);
- prompt tokens in a step add tokens / prefill_tokens_per_s to it (additive: no overlap of the
  prefill's compute with the decode's memory reads, an upper bound on the interference);
- aggregated: a step may carry k = min(max_batched_tokens - B, (ITL - t(B)) x prefill tokens/s)
  prompt tokens, so that no step exceeds the ITL target; prompts are then served at
  k / (t(B) + k / prefill tokens/s) tokens/s. The batch follows Little's law (B = rate x
  (output - 1) x the mean step); TTFT is the prompt's service time plus an M/D/1 queue's mean
  wait. The most requests/s is the largest batch whose TTFT still meets the target;
- disaggregated: the prefill replica runs prompt-only steps of max_batched_tokens tokens, its
  TTFT adds the KV transfer and the decode replica's first step; the decode replica runs the
  largest batch whose step meets the ITL target (and its KV cache holds), B / (output x t(B))
  requests/s. A request needs a prefill and a decode replica: the mode's rate on given GPUs is
  the best split of them.

Means, not percentiles (the M/D/1 wait is a mean, steps are their means): the SLO's objective
(p99 and the like) is not modelled. No Pulumi, Ray or vLLM import: `bench/` imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from infra.sizing.nodes import nodes_for

AGGREGATED = "aggregated"
DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class ReplicaProfile:
    """One engine replica's speed and price: from the roofline, or measured."""

    prefill_tokens_per_s: float  # prompt tokens/s a step's prefill part runs at
    step_s: float  # a decode step's fixed time (the weights read), seconds
    step_s_per_seq: float  # added per running sequence (its KV read at the workload's context)
    max_batch: int  # running sequences the replica holds (KV cache, max_num_seqs)
    max_batched_tokens: int  # tokens one step carries (vLLM's max_num_batched_tokens)
    gpus: int  # per replica
    gpus_per_node: int
    usd_per_node_hour: float

    def step(self, batch: float) -> float:
        """A decode step of `batch` running sequences, seconds."""
        return self.step_s + self.step_s_per_seq * batch

    def usd_per_hour(self, replicas: int) -> float:
        """What `replicas` replicas cost: the whole nodes they take."""
        return nodes_for(replicas, self.gpus, self.gpus_per_node) * self.usd_per_node_hour if replicas else 0.0


@dataclass(frozen=True)
class Profile:
    """Each engine's replica, per mode, and the KV hand-over between the disaggregated two."""

    aggregated: ReplicaProfile
    prefill: ReplicaProfile
    decode: ReplicaProfile
    kv_transfer_s: float  # one workload prompt's KV, prefill -> decode


@dataclass(frozen=True)
class Slo:
    ttft_s: float  # time to first token, target
    itl_s: float  # time between output tokens, target


@dataclass(frozen=True)
class Rates:
    """Requests/s one replica serves within both targets (0: it cannot meet them at all)."""

    aggregated: float
    prefill: float
    decode: float
    aggregated_batch: float  # running sequences on the aggregated replica at that rate
    aggregated_chunk: float  # prompt tokens a step carries within the ITL target (k)
    decode_batch: float  # running sequences on the decode replica


def _md1_utilization(service_s: float, budget_s: float) -> float:
    """The highest utilization at which service + M/D/1 mean wait (rho s / (2 (1 - rho))) stays
    within `budget_s`; 0 when one service alone does not."""
    slack = budget_s - service_s
    if service_s <= 0 or slack <= 0:
        return 0.0
    return 2 * slack / (service_s + 2 * slack)


def decode_rate(r: ReplicaProfile, output_tokens: int, slo: Slo) -> tuple[float, float]:
    """(requests/s, batch) of one decode replica: the largest batch whose step meets the ITL
    target and that its KV cache holds; each request takes `output_tokens` steps there."""
    if r.step_s >= slo.itl_s or r.max_batch < 1:
        return 0.0, 0.0
    by_itl = (slo.itl_s - r.step_s) / r.step_s_per_seq if r.step_s_per_seq > 0 else math.inf
    batch = min(float(r.max_batch), by_itl)
    if batch < 1:
        return 0.0, 0.0
    return batch / (output_tokens * r.step(batch)), batch


def prefill_rate(r: ReplicaProfile, prompt_tokens: int, ttft_budget_s: float) -> float:
    """Requests/s of one prefill replica whose TTFT (service + queue) stays within the budget:
    prompt-only steps of max_batched_tokens tokens, each also reading the weights once."""
    per_s = r.max_batched_tokens / (r.step_s + r.max_batched_tokens / r.prefill_tokens_per_s)
    service = prompt_tokens / per_s
    return _md1_utilization(service, ttft_budget_s) / service


@dataclass(frozen=True)
class _AggPoint:
    rate: float
    feasible: bool
    chunk: float


def _aggregated_at(r: ReplicaProfile, batch: float, prompt_tokens: int, output_tokens: int, slo: Slo) -> _AggPoint:
    """The aggregated replica running `batch` sequences: the rate that keeps them there, and
    whether the prompts' TTFT meets its target at that rate."""
    t = r.step(batch)
    chunk = min(r.max_batched_tokens - batch, (slo.itl_s - t) * r.prefill_tokens_per_s)
    if t >= slo.itl_s or chunk < 1:
        return _AggPoint(0.0, False, 0.0)
    tokens_per_s = chunk / (t + chunk / r.prefill_tokens_per_s)  # every step carrying a chunk
    # Per second the prompts take rate x prompt / F of the replica's time, so the mean step is
    # t / (1 - rate x prompt / F); B = rate x (output - 1) x that mean step (Little's law):
    rate = batch / ((output_tokens - 1) * t + batch * prompt_tokens / r.prefill_tokens_per_s)
    service = prompt_tokens / tokens_per_s
    rho = rate * service
    ok = rho < 1 and service + rho * service / (2 * (1 - rho)) <= slo.ttft_s
    return _AggPoint(rate, ok, chunk)


def aggregated_rate(r: ReplicaProfile, prompt_tokens: int, output_tokens: int, slo: Slo) -> tuple[float, float, float]:
    """(requests/s, batch, chunk) of one aggregated replica at the largest batch that meets both
    targets: more running sequences leave each step less room for prompt chunks, so prompts
    wait longer; the batch is searched by bisection (feasibility falls with it)."""
    if output_tokens <= 1:
        # No token after the first: nothing to keep the ITL for, prompt-only steps.
        return prefill_rate(r, prompt_tokens, slo.ttft_s), 0.0, float(r.max_batched_tokens)
    if r.step_s >= slo.itl_s:
        return 0.0, 0.0, 0.0
    top = float(r.max_batch)
    if r.step_s_per_seq > 0:
        top = min(top, (slo.itl_s - r.step_s) / r.step_s_per_seq)
    if (hit := _aggregated_at(r, top, prompt_tokens, output_tokens, slo)).feasible:
        return hit.rate, top, hit.chunk
    lo, hi = 0.0, top
    for _ in range(60):
        mid = (lo + hi) / 2
        if _aggregated_at(r, mid, prompt_tokens, output_tokens, slo).feasible:
            lo = mid
        else:
            hi = mid
    best = _aggregated_at(r, lo, prompt_tokens, output_tokens, slo)
    return (best.rate, lo, best.chunk) if best.feasible else (0.0, 0.0, 0.0)


def rates(p: Profile, prompt_tokens: int, output_tokens: int, slo: Slo) -> Rates:
    """Each engine replica's requests/s within both targets."""
    agg, agg_batch, chunk = aggregated_rate(p.aggregated, prompt_tokens, output_tokens, slo)
    dec, dec_batch = decode_rate(p.decode, output_tokens, slo)
    # The first token comes from the decode replica's first step, after the KV hand-over.
    ttft_budget = slo.ttft_s - p.kv_transfer_s - (p.decode.step(dec_batch) if dec else 0.0)
    pre = prefill_rate(p.prefill, prompt_tokens, ttft_budget) if dec else 0.0
    return Rates(agg, pre, dec, agg_batch, chunk, dec_batch)


def _replicas(rate: float, per_replica: float) -> int | None:
    if rate <= 0:
        return 0
    return None if per_replica <= 0 else math.ceil(rate / per_replica - 1e-9)


def best_split(p: Profile, r: Rates, gpus: int) -> tuple[float, int, int]:
    """(requests/s, prefill replicas, decode replicas): the disaggregated split of `gpus` GPUs
    that serves the most within both targets (at least one replica of each)."""
    best = (0.0, 0, 0)
    for n_p in range(1, gpus // p.prefill.gpus + 1):
        n_d = (gpus - n_p * p.prefill.gpus) // p.decode.gpus
        if n_d >= 1:
            best = max(best, (min(n_p * r.prefill, n_d * r.decode), n_p, n_d))
    return best


def max_rates(p: Profile, r: Rates, gpus: int) -> tuple[float, float]:
    """(aggregated, disaggregated): the most requests/s each mode serves on `gpus` GPUs."""
    return (gpus // p.aggregated.gpus) * r.aggregated, best_split(p, r, gpus)[0]


def crossover_output_tokens(
    profile_at: Callable[[int], Profile], prompt_tokens: int, slo: Slo, gpus: int, longest: int
) -> int | None:
    """The shortest output (1..longest tokens) at which disaggregation serves more requests/s
    within the SLO than aggregation on `gpus` GPUs; None when it never does.

    `profile_at(output_tokens)`: the replicas' speed at that output (the roofline's KV read
    grows with the context). Searched on a grid 1, 2, 3, 4, 5, 6, 8, ... (about 1.2x apart),
    then narrowed between the last point behind and the first ahead, so a window of P/D
    ahead narrower than the grid's step can be missed.
    """

    def ahead(output_tokens: int) -> bool:
        p = profile_at(output_tokens)
        agg, pd = max_rates(p, rates(p, prompt_tokens, output_tokens, slo), gpus)
        return pd > agg

    last_behind = 0
    o = 1
    while o <= longest:
        if ahead(o):
            lo, hi = last_behind, o  # behind at lo (or lo = 0), ahead at hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if ahead(mid) else (mid, hi)
            return hi
        last_behind = o
        o = max(o + 1, int(o * 1.2))
    return None


@dataclass(frozen=True)
class ModeCost:
    """What one mode needs for the workload's rate, and the most it serves on the GPUs on hand."""

    mode: str
    replicas: tuple[int, ...] | None  # aggregated (n,), disaggregated (prefill, decode); None: never meets the SLO
    gpus: int | None
    usd_per_hour: float | None
    goodput_per_gpu: float | None  # the workload's rate / those GPUs
    max_rate: float  # requests/s within the SLO on the GPUs on hand
    split: tuple[int, ...]  # the replicas that serve max_rate there


@dataclass(frozen=True)
class Verdict:
    """Which mode serves the workload within the SLO for less, and why (`recommend()`)."""

    prompt_tokens: int
    output_tokens: int
    rate: float  # the workload's requests/s
    slo: Slo
    gpus: int  # the GPUs on hand for max_rate and the crossover
    longest_output: int  # where the crossover's search stops
    mode: str  # the mode the stack runs (serving.mode)
    profile: Profile
    rates: Rates
    aggregated: ModeCost
    disaggregated: ModeCost
    winner: str | None  # None: neither mode meets the SLO
    # The crossover's search (tens of profiles): run when first asked for, not by every plan.
    search: Callable[[], int | None] = dataclasses.field(repr=False, compare=False, default=lambda: None)

    @property
    def mode_loses(self) -> bool:
        return self.winner is not None and self.winner != self.mode

    @functools.cached_property
    def crossover_output_tokens(self) -> int | None:
        """The shortest output from which disaggregation serves more on `gpus` GPUs (None: never
        up to the search's longest output)."""
        return self.search()


def _cost(mode: str, reps: tuple[int | None, ...], parts: tuple[ReplicaProfile, ...], rate: float) -> ModeCost:
    if any(n is None for n in reps):
        return ModeCost(mode, None, None, None, None, 0.0, ())
    counts = tuple(n or 0 for n in reps)
    gpus = sum(n * r.gpus for n, r in zip(counts, parts, strict=True))
    usd = sum(r.usd_per_hour(n) for n, r in zip(counts, parts, strict=True))
    return ModeCost(mode, counts, gpus, usd, rate / gpus if gpus else None, 0.0, ())


def _winner(agg: ModeCost, pd: ModeCost, mode: str) -> str | None:
    """The mode that meets the SLO at the rate for fewer dollars an hour; on a tie, the one that
    serves more on the GPUs on hand; then the stack's own."""
    if agg.usd_per_hour is None or pd.usd_per_hour is None:
        return AGGREGATED if agg.usd_per_hour is not None else DISAGGREGATED if pd.usd_per_hour is not None else None
    key = {AGGREGATED: (-agg.usd_per_hour, agg.max_rate), DISAGGREGATED: (-pd.usd_per_hour, pd.max_rate)}
    if key[AGGREGATED] == key[DISAGGREGATED]:
        return mode
    return max(key, key=lambda m: key[m])


def recommend(
    profile_at: Callable[[int], Profile],
    *,
    prompt_tokens: int,
    output_tokens: int,
    rate: float,
    slo: Slo,
    gpus: int,
    mode: str,
    longest_output: int,
) -> Verdict:
    """Aggregated or disaggregated for this workload, SLO and GPUs (the stack's `mode` runs now).

    `profile_at(output_tokens)`: the replicas' speed at an output length (a measured profile
    passes `lambda _: profile`); `longest_output`: where the crossover search stops.
    """
    p = profile_at(output_tokens)
    r = rates(p, prompt_tokens, output_tokens, slo)
    agg = _cost(AGGREGATED, (_replicas(rate, r.aggregated),), (p.aggregated,), rate)
    pd = _cost(DISAGGREGATED, (_replicas(rate, r.prefill), _replicas(rate, r.decode)), (p.prefill, p.decode), rate)
    agg_max, pd_max = max_rates(p, r, gpus)
    _, n_p, n_d = best_split(p, r, gpus)
    agg = dataclasses.replace(agg, max_rate=agg_max, split=(gpus // p.aggregated.gpus,))
    pd = dataclasses.replace(pd, max_rate=pd_max, split=(n_p, n_d))
    return Verdict(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        rate=rate,
        slo=slo,
        gpus=gpus,
        longest_output=longest_output,
        mode=mode,
        profile=p,
        rates=r,
        aggregated=agg,
        disaggregated=pd,
        winner=_winner(agg, pd, mode),
        search=lambda: crossover_output_tokens(profile_at, prompt_tokens, slo, gpus, longest_output),
    )
