"""The capacity plan's results as data: a `Plan`, its `RolePlan`s, their `RoleScaling`, the KV link.

What flows through here: nothing is computed; `infra.plan.planning` fills these in and
`infra.plan.plan_text` prints them (`make plan`, `make render`), `infra.plan.streaming_plan`
reads the roles' rates. Kept apart so that the printer and the planner both stand on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.sizing import startup
from infra.sizing.disaggregation import Verdict
from infra.sizing.fit import LayoutOption, ModelFigures, ModelShape
from infra.sizing.head import HeadSizing
from infra.sizing.streaming import StreamingSizing


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
    kv_offload: tuple[int, int] | None = None  # the pool's KV offload tier per node: (cpuGiB, diskGiB)
    # (seconds until one engine's share of that tier is full, the requests/s per replica that
    # assumes): the plan's rate per replica, every request new (infra/sizing/offload.py).
    kv_offload_fill: tuple[float, float] | None = None

    @property
    def cold_start_node(self) -> str:
        """Where the first replica after idle starts: a "new node" when the pool may empty
        too (minSize 0), else a "warm node" the pool kept."""
        return "new node" if self.pool_min_size == 0 else "warm node"

    @property
    def first_request_after_idle_s(self) -> float | None:
        """Seconds the first request after idle waits for this role (minReplicas 0): the time
        to serve on the node `cold_start_node` names. None when the role keeps a replica or
        the time is not known (model shape unknown)."""
        if self.min_replicas > 0 or self.startup is None:
            return None
        return self.startup.new_node_s if self.pool_min_size == 0 else self.startup.warm_node_s


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
    max_rps: float | None = None  # the same at maxReplicas: the most the role is planned for


@dataclass(frozen=True)
class Workload:
    """The request shape the scale-out rates assume (`make plan` options)."""

    prompt_tokens: int = 1024
    output_tokens: int = 256


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
    # What the planned rate asks of the Ray head (None: no roofline rate, shape unknown).
    head: HeadSizing | None = None
    streaming: StreamingSizing | None = None  # the decode replica's API-side CPU (infra/sizing/streaming.py)
    # Aggregated or disaggregated for the workload and serving.slo (infra/plan/disaggregation_plan.py).
    disaggregation: Verdict | None = None

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
