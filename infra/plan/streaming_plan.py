"""The streaming replica's API-side CPU, from the capacity plan: what `make plan` prints, the
stack refuses, and the RayService renders.

What flows through here: a model's engine-role plans (infra/plan/planning.py `RolePlan`: the
decode role's roofline rate at maxReplicas and its GPUs per replica) and its stack (the decode
pool's instance, the mode, the ingress's maxReplicas) -> the planned output tokens/s of one
decode replica (the roofline at targetOngoingRequests: the rate per replica its scale-out rate
rests on) -> `infra.sizing.streaming.size_streaming` -> a `StreamingSizing` per model
(`Plan.streaming`; infra/plan/stack.py reads every model's for the refusal and the render).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from infra.config import StackConfig
from infra.sizing.streaming import StreamingSizing, below_plan, size_streaming

if TYPE_CHECKING:
    from infra.plan.plans import RolePlan


def streaming_for(
    config: StackConfig,
    roles: Sequence[RolePlan],
    output_tokens: int,
    rate_at: Callable[[int], float | None],
) -> StreamingSizing | None:
    """One model's streaming replica (`config`: the planner's one-model view; `output_tokens`:
    the plan's workload; `rate_at`: targetOngoingRequests -> the decode roofline's tokens/s),
    or None while the decode roofline is unknown."""
    dec = next((r for r in roles if r.role == "decode"), None)
    if dec is None or dec.scaling is None or not dec.scaling.max_rps or dec.max_replicas < 1:
        return None
    inst = config.node_pools.decode.instance
    # Each data-parallel rank is a Serve replica of its own with its own API side (Ray 2.60
    # serving_patterns/data_parallel/dp_server.py `get_deployment_options`: num_replicas = DP
    # groups x data_parallel_size), and targetOngoingRequests is each rank's: the group's
    # roofline (target x DP sequences, infra/sizing/fit.py) is split over its ranks.
    dp = dec.data_parallel_size
    rank_gpus = dec.gpus_per_replica // dp

    def sized(group_tok_s: float) -> StreamingSizing:
        return size_streaming(
            group_tok_s / dp,
            config.serving.mode.value,
            pod_cpus=inst.pod_cpus,
            replicas_per_node=max(1, inst.gpus // rank_gpus),
            gpus_per_replica=rank_gpus,
            data_parallel_size=dp,
        )

    # max_rps = maxReplicas x roofline tokens/s at targetOngoingRequests / output tokens
    # (planning._replica_rps): per replica (DP group), back in tokens/s.
    s = sized(dec.scaling.max_rps / dec.max_replicas * output_tokens)
    if not below_plan(s):
        return s
    # The roofline grows with the batch: the first lower target whose rate fits is the largest.
    target = int(config.serving.engine_roles()["decode"].target_ongoing_requests)
    fits = (t for t in range(target - 1, 0, -1) if (r := rate_at(t)) is not None and not below_plan(sized(r)))
    return dataclasses.replace(s, fitting_target=next(fits, None))
