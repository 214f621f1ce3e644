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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from infra.config import StackConfig
from infra.sizing.streaming import StreamingSizing, size_streaming

if TYPE_CHECKING:
    from infra.plan.plans import RolePlan


def streaming_for(config: StackConfig, roles: Sequence[RolePlan], output_tokens: int) -> StreamingSizing | None:
    """One model's streaming replica (`config`: the planner's one-model view; `output_tokens`:
    the plan's workload), or None while the decode roofline is unknown."""
    dec = next((r for r in roles if r.role == "decode"), None)
    if dec is None or dec.scaling is None or not dec.scaling.max_rps or dec.max_replicas < 1:
        return None
    # max_rps = maxReplicas x roofline tokens/s at targetOngoingRequests / output tokens
    # (planning._replica_rps): per replica, back in tokens/s.
    inst = config.node_pools.decode.instance
    return size_streaming(
        dec.scaling.max_rps / dec.max_replicas * output_tokens,
        config.serving.mode.value,
        pod_cpus=inst.pod_cpus,
        replicas_per_node=max(1, inst.gpus // dec.gpus_per_replica),
        gpus_per_replica=dec.gpus_per_replica,
        max_replicas=dec.max_replicas,
        ingress_max_replicas=config.serving.ingress.max_replicas,
    )
