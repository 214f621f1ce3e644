"""Sizing the streaming replica's API-side CPU from what it costs per output token.

What flows through here: the tokens/s one streaming replica is planned for (decode in P/D, the
aggregated replica otherwise: the capacity plan's decode roofline at targetOngoingRequests,
the rate its scale-out rate rests on, `infra.plan.streaming_plan`), the serving mode, what one
node gives the replica's pod, and `STREAMING_CPU` (the measured input: CPU-ms per 1,000
output tokens of the streaming replica outside its engine and of the ingress replicas, with
its date, machine and source) -> `StreamingSizing`: the CPUs the replica's actor asks Ray for
(its API side: Ray Serve LLM's server, vLLM's front end that detokenizes and streams) and its
streaming ceiling -> `format_streaming` (the plan's text),
`streaming_errors` (the stack's refusal, one line naming the key and the largest
targetOngoingRequests that fits, through `infra.plan.stack.load`) and `replica_cpus` (what the
RayService renders). The ingress's figure goes to the head sizing (`infra.sizing.head`: the
ingress replicas relay every token of the planned requests).

The arithmetic, for a planned T output tokens/s per replica, c CPU-ms per 1,000 output tokens
and a target utilization U:
  busy CPUs    T x c / 1e6 (c / 1000 CPU-ms per token, 1,000 CPU-ms per core-second)
  usable       1 / s cores: the replica's Python (vLLM's output processing, Serve's
               streaming) runs on one event loop thread, which carries a share s of the
               process's CPU (the rest: Ray's and gRPC's C++ threads), so one process uses at
               most 1 / s cores however many it asks for
  CPUs         max(RAY_DEFAULT_CPUS, ceil(busy / U)), at most ceil(1 / s) and at most what
               the node's pod gives each replica on it
  ceiling      min(CPUs, 1 / s) x 1e6 / c tokens/s: below T, the layout is refused. The
               figure comes from a slower host than a GPU node's (a 2-core CPU machine), which
               errs on the safe side.
Pure arithmetic: no Pulumi, Ray or vLLM import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from infra.sizing.head import TARGET_UTILIZATION


@dataclass(frozen=True)
class StreamingCpu:
    """A measured input: CPU-ms per 1,000 output tokens, by serving mode, of the replica that
    streams the tokens (outside its engine) and of the ingress replicas."""

    replica_ms_per_1k: Mapping[str, float]
    ingress_ms_per_1k: Mapping[str, float]
    measured: str
    machine: str
    source: str
    # The streaming replica's busiest thread's share of its CPU under load, by mode (its event
    # loop), and where that was read.
    loop_share: Mapping[str, float]
    loop_source: str


# THE figure, in one place: a "CPU per output token, net of idle" table of docs/performance.md
# (make bench: bench/per_token.py, build/bench/serving.json
# per_token.<mode>.hops.<hop>.net_ms_per_1k_tokens), levels 1, 4 and 16 pooled: "P/D
# orchestration: decode replica outside the engine", "aggregated replica outside the engine"
# and "ingress replicas", with the bench's idle rate times the load's wall time taken off and
# Serve tracing at the prod stack's ratio. Not the latest run's but the 01:23 run's, kept on
# purpose: the decode figure moves between runs of the same code (247-463 in the six runs of
# 2026-12-05 after the replica-count watch was cut, 04:49-06:56 UTC), and this one is at the
# top of that spread, as the ingress figures (193.7 / 185.0 against 104-136 since) are above
# theirs. Measured on a 2-core CPU machine with a tiny model: a p5 host's cores are faster, so
# it sizes on the safe side; lowering it changes every stack's rendered replica CPUs and
# what the stacks are refused for.
STREAMING_CPU = StreamingCpu(
    replica_ms_per_1k={"disaggregated": 465.8, "aggregated": 278.1},
    ingress_ms_per_1k={"disaggregated": 193.7, "aggregated": 185.0},
    measured="2026-12-05 01:23 UTC",
    machine="the project's 2-core, 24 GiB CPU machine, tiny model, Serve tracing at prod's ratio (0.01)",
    source="docs/performance.md, CPU per output token net of idle, all levels pooled",
    # The busiest thread's share of the P/D decode and the aggregated replica's CPU under 16
    # streams: make bench's "busiest thread at the top level" column (build/bench/serving.json
    # per_token.<mode>.hops.<hop>.busiest_thread_share) read 90.7% / 86.3% (22:41 UTC) and
    # 86.5% / 82.8% (22:55 UTC); a first reading by hand (45 s, 15:45 UTC) 91.5% / 91.3%. The
    # plan keeps that top of the readings: a larger share is a smaller one-process cap.
    loop_share={"disaggregated": 0.915, "aggregated": 0.913},
    loop_source="busiest thread of the replica under 16 streams, the top of the readings of 2026-12-05 (make bench's per-token table, 82.8-91.5%), the same machine (docs/capacity.md)",
)
# What a Serve replica's actor asks Ray for when its deployment says nothing: Ray Serve LLM
# puts `ray_actor_options.num_cpus` (default 1) into the first placement-group bundle
# (ray/llm/_internal/serve/core/server/llm_server.py `get_deployment_options`, Ray 2.60).
RAY_DEFAULT_CPUS = 1
# What each engine bundle asks besides its GPU: nothing (Ray Serve LLM's default bundle per GPU
# worker is `{"GPU": 1, "accelerator_type:<type>": 0.001}`, core/configs/accelerators.py).
CPUS_PER_GPU_BUNDLE = 0


@dataclass(frozen=True)
class StreamingSizing:
    """What the planned tokens ask of one streaming replica's API side and of the ingress."""

    mode: str
    role: str  # the engine role that streams ("decode": the aggregated engine runs under it)
    planned_tok_s: float  # per Serve replica (one DP rank of a data-parallel group)
    ms_per_1k: float
    cpus: int  # the replica actor's CPU request
    cpus_needed: int  # before the node's limit
    node_cpus: int  # what the node gives the replica beside its engine's bundles
    figure: StreamingCpu
    # Below the plan: the largest targetOngoingRequests whose roofline the ceiling carries
    # (None: not even 1, or not searched).
    fitting_target: int | None = None
    data_parallel_size: int = 1  # the group's ranks, each such a replica

    @property
    def replica(self) -> str:
        """What one streaming process is, in the plan's words."""
        dp = f" (one of a group's {self.data_parallel_size} DP ranks)" if self.data_parallel_size > 1 else ""
        return f"{self.role} replica{dp}"

    @property
    def loop_share(self) -> float:
        """The event loop thread's share of the replica's CPU (the figure's, for this mode)."""
        return self.figure.loop_share[self.mode]

    @property
    def usable_cores(self) -> float:
        """What one replica process turns into streaming: its CPUs, at most 1 / loop share."""
        return min(self.cpus, 1 / self.loop_share)

    @property
    def ceiling_tok_s(self) -> float:
        return self.usable_cores * 1e6 / self.ms_per_1k

    @property
    def one_core_tok_s(self) -> float:
        return 1e6 / self.ms_per_1k


def size_streaming(
    planned_tok_s: float,
    mode: str,
    *,
    pod_cpus: int,
    replicas_per_node: int,
    gpus_per_replica: int,
    data_parallel_size: int = 1,
    figure: StreamingCpu | None = None,
) -> StreamingSizing:
    """The CPUs one streaming replica's actor asks for at `planned_tok_s`, within its node
    (`figure`: STREAMING_CPU unless given; `data_parallel_size`: the ranks of the replica's
    group, each a Serve replica of its own, for the plan's words)."""
    figure = figure or STREAMING_CPU
    ms = figure.replica_ms_per_1k[mode]
    needed = max(RAY_DEFAULT_CPUS, math.ceil(planned_tok_s * ms / 1e6 / TARGET_UTILIZATION))
    node = max(0, pod_cpus // max(1, replicas_per_node) - gpus_per_replica * CPUS_PER_GPU_BUNDLE)
    # More than the process can use is never asked for.
    cpus = min(needed, math.ceil(1 / figure.loop_share[mode]))
    return StreamingSizing(
        mode=mode,
        role="decode",
        planned_tok_s=planned_tok_s,
        ms_per_1k=ms,
        cpus=min(cpus, node) if node >= RAY_DEFAULT_CPUS else RAY_DEFAULT_CPUS,
        cpus_needed=needed,
        node_cpus=node,
        figure=figure,
        data_parallel_size=data_parallel_size,
    )


def replica_cpus(s: StreamingSizing | None) -> dict[str, int]:
    """Engine role -> the CPUs its replica actor asks for, where that differs from Ray's
    default (what the RayService renders: serving.spec.Target.replica_cpus)."""
    return {s.role: s.cpus} if s is not None and s.cpus != RAY_DEFAULT_CPUS else {}


def below_plan(s: StreamingSizing) -> bool:
    return s.ceiling_tok_s < s.planned_tok_s


def streaming_errors(s: StreamingSizing) -> list[tuple[str, str]]:
    """The streaming replica's ceiling must carry its planned tokens; (key, message), the key
    in the one-model form (`infra.config.rekey` places it in `serving.models[i]`)."""
    if not below_plan(s):
        return []
    fix = (
        f"set targetOngoingRequests to {s.fitting_target} or less"
        if s.fitting_target is not None
        else "even targetOngoingRequests 1 plans more than that: pick an instance type whose node gives it more CPUs"
    )
    return [
        (
            f"serving.{s.role}.targetOngoingRequests",
            f"a {s.replica} is planned for {s.planned_tok_s:,.0f} output tokens/s (roofline at "
            f"targetOngoingRequests, make plan) but its API side streams at most {s.ceiling_tok_s:,.0f}: "
            f"{s.usable_cores:.2f} of its {s.cpus} CPUs (one process, {s.loop_share:.1%} of its CPU on its event "
            f"loop) x 1e6 / {s.ms_per_1k:g} CPU-ms per 1,000 tokens (docs/capacity.md); it needs "
            f"{s.cpus_needed} CPUs and its node gives it {s.node_cpus}: {fix}",
        )
    ]


def format_streaming(s: StreamingSizing | None) -> list[str]:
    """The plan's lines on the streaming replica's API side (none when the rate is unknown)."""
    if s is None:
        return ["Stream   not sized (no roofline rate: model shape unknown)"]
    ok = "ok" if not below_plan(s) else "FAILS"
    return [
        f"Stream   {s.replica} planned for {s.planned_tok_s:,.0f} output tok/s; {s.ms_per_1k:g} CPU-ms per "
        f"1,000 tokens outside the engine -> {s.cpus} CPU{'s' if s.cpus != 1 else ''} (needs {s.cpus_needed}, "
        f"node gives {s.node_cpus}); one process uses {s.usable_cores:.2f} ({s.loop_share:.1%} of its CPU on its "
        f"event loop): ceiling {s.ceiling_tok_s:,.0f} tok/s (one core: {s.one_core_tok_s:,.0f}): {ok}",
        f"         CPU figure: {s.figure.measured}, {s.figure.machine}; {s.figure.source}; event loop share: "
        f"{s.figure.loop_source}",
    ]
