"""The node pools: the CPU system nodes and a named set of GPU pools, sized for the replicas.

What flows through here: `systemNodes` and `nodePools` (a map from pool name to pool) ->
validated models; the models of `serving` name the pool of each engine role (one-model
stacks: the pools named `prefill` and `decode`). The cross-field checks place every model's
replicas on its pools: unknown pools, replica shapes against the pool's GPUs, every replica
placed on a pool (all models together) against its maxSize and the upgrade's second cluster.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field, RootModel, field_validator, model_validator

from infra import catalog
from infra.config.formats import instance_type_format
from infra.config.kv_offload import KvOffload
from infra.sizing import nodes as sizing
from serving.spec import Mode, RoleSpec, ServingSpec, SpecModel, check_order
from serving.spec.models import pool_name_problem

if TYPE_CHECKING:
    from infra.config import StackConfig

_CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{17}$")


class CapacityType(str, Enum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"
    CAPACITY_BLOCK = "capacity-block"


class LocalStorage(str, Enum):
    # The instance-store NVMe drives striped into one RAID0 volume (kubelet and container
    # storage, so the model cache and images land on NVMe), or left alone.
    RAID0 = "raid0"
    NONE = "none"


class SystemNodes(SpecModel):
    """The CPU node group for the Ray head, the operators and other system pods."""

    instance_type: str = "m7i.2xlarge"
    min_size: int = Field(default=2, ge=1)
    desired_size: int = Field(default=2, ge=1)
    max_size: int = Field(default=4, ge=1)
    # The Ray head runs the ray-llm image (tens of GB unpacked) beside the operators and
    # Prometheus's images; EKS's default root volume is 20 GiB. Encrypted gp3 (cluster.py).
    root_volume_gib: int = Field(default=100, ge=40, le=16384, alias="rootVolumeGiB")

    @field_validator("instance_type")
    @classmethod
    def _cpu(cls, v: str) -> str:
        if v in catalog.CATALOG:
            raise ValueError(f"{v!r} is a GPU type; system nodes are CPU nodes")
        return instance_type_format(v)

    @model_validator(mode="after")
    def _sizes(self) -> SystemNodes:
        check_order(("minSize", self.min_size), ("desiredSize", self.desired_size), ("maxSize", self.max_size))
        return self


class NodePool(SpecModel):
    instance_type: str
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    capacity_reservation_id: str | None = None
    min_size: int = Field(default=1, ge=0)
    desired_size: int = Field(default=1, ge=0)
    # Room for the second Ray cluster of a NewCluster upgrade (one replica running, one starting).
    max_size: int = Field(default=2, ge=1)
    root_volume_gib: int = Field(default=200, ge=50, le=16384, alias="rootVolumeGiB")
    local_storage: LocalStorage = LocalStorage.RAID0
    # A KV offload tier per node (host memory, NVMe) behind NIXL; None: none (kv_offload.py).
    kv_offload: KvOffload | None = None
    # What one node costs you per hour, in USD: a spot pool's usual price, a Capacity Block's,
    # a discount's. None: the catalog's on-demand list price. Prices requests (infra/plan/costs.py).
    usd_per_hour: float | None = Field(default=None, gt=0, le=10_000)

    @field_validator("instance_type")
    @classmethod
    def _known(cls, v: str) -> str:
        # The catalog's types are well-formed (a test checks them against the format).
        try:
            catalog.lookup(v)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        return v

    @model_validator(mode="after")
    def _check(self) -> NodePool:
        check_order(("minSize", self.min_size), ("desiredSize", self.desired_size), ("maxSize", self.max_size))
        if self.capacity_type is CapacityType.CAPACITY_BLOCK:
            if not self.capacity_reservation_id:
                raise ValueError("capacityType capacity-block needs capacityReservationId (cr-...)")
            if not _CAPACITY_RESERVATION.match(self.capacity_reservation_id):
                raise ValueError(
                    f"capacityReservationId {self.capacity_reservation_id!r} is not a reservation id (cr-...)"
                )
        elif self.capacity_reservation_id is not None:
            raise ValueError("capacityReservationId is only used with capacityType capacity-block")
        return self

    @property
    def instance(self) -> catalog.InstanceType:
        return catalog.lookup(self.instance_type)

    @property
    def node_usd_per_hour(self) -> float:
        """What one node of the pool costs per hour: `usdPerHour`, else the on-demand list price."""
        return self.usd_per_hour if self.usd_per_hour is not None else self.instance.usd_per_hour

    @property
    def raid0(self) -> bool:
        """Whether its nodes assemble the instance-store NVMe into a RAID0 for kubelet storage
        (the node template, the planner and the KV offload tier's disk read this one rule)."""
        return self.local_storage is LocalStorage.RAID0 and self.instance.nvme_disks > 0


class NodePools(RootModel[dict[str, NodePool]]):
    """The GPU pools by name (`nodePools.<name>`): one EKS managed node group and one Ray
    worker group each. Pools are read by name (`pools["decode"]`, or `pools.decode`)."""

    model_config = ConfigDict(frozen=True)

    @field_validator("root")
    @classmethod
    def _names(cls, v: dict[str, NodePool]) -> dict[str, NodePool]:
        if not v:
            raise ValueError("name at least one GPU pool")
        for name in v:
            problem = pool_name_problem(name)
            if problem:
                raise ValueError(f"pool {problem}")
        return v

    def __getitem__(self, name: str) -> NodePool:
        return self.root[name]

    def __getattr__(self, name: str) -> NodePool:
        root = self.__dict__.get("root")
        if root is not None and name in root:
            return root[name]
        raise AttributeError(name)

    def __iter__(self) -> Iterator[tuple[str, NodePool]]:  # type: ignore[override]
        return iter(self.root.items())

    def __contains__(self, name: object) -> bool:
        return name in self.root

    def names(self) -> list[str]:
        return list(self.root)


class PoolKeys(SpecModel):
    system_nodes: SystemNodes = Field(default_factory=SystemNodes)
    node_pools: NodePools


def engine_pools(cfg: StackConfig, serving: ServingSpec | None = None) -> dict[str, NodePool]:
    """The GPU pool of each engine role the model runs (default: the stack's first model)."""
    spec = serving or cfg.serving
    return {role: cfg.node_pools[spec.pool_of(role)] for role in spec.engine_roles()}


def model_key(cfg: StackConfig, index: int) -> str:
    """How errors name a model's keys: `serving` (one-model form) or `serving.models[i] (id)`."""
    if not cfg.serving.many:
        return "serving"
    return f"serving.models[{index}] ({cfg.serving.served[index].model.id})"


def rekey(cfg: StackConfig, index: int, errors: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A model's (key, message) errors written for its place in the stack file: `serving.x`
    becomes `serving.models[i] (id).x` in the many-model form."""
    if not cfg.serving.many:
        return errors
    prefix = model_key(cfg, index)
    shared = ("serving.fallback", "serving.limits", "serving.ingress", "serving.resilience", "serving.streaming")
    return [
        (prefix + k[len("serving") :] if k.startswith("serving.") and not k.startswith(shared) else k, m)
        for k, m in errors
    ]


@dataclass(frozen=True, eq=False)
class Placement:
    """One engine role of one model on its pool."""

    index: int  # the model's place in serving.served
    spec: ServingSpec
    role: str
    role_spec: RoleSpec
    pool: str


def placements(cfg: StackConfig) -> list[Placement]:
    """Every engine role of every model with the pool it runs on, in the stack file's order."""
    return [
        Placement(i, spec, role, rs, spec.pool_of(role))
        for i, spec in enumerate(cfg.serving.served)
        for role, rs in spec.engine_roles().items()
    ]


def pool_reference_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """Each model's roles must name a pool of nodePools: one error per unknown pool."""
    errors = []
    known = ", ".join(cfg.node_pools.names())
    for p in placements(cfg):
        if p.pool in cfg.node_pools:
            continue
        if p.spec.pools.prefill is None and p.spec.pools.decode is None and not cfg.serving.many:
            errors.append((f"nodePools.{p.pool}", f"required key is missing (serving's {p.role} role runs there)"))
        else:
            errors.append(
                (
                    f"{model_key(cfg, p.index)}.pools.{p.role}",
                    f"model {p.spec.model.id!r} runs its {p.role} role on pool {p.pool!r}, "
                    f"which nodePools does not define (it has {known})",
                )
            )
    return errors


def _shape_error(role: str, need: int, tp: int, inst: catalog.InstanceType) -> tuple[str, str] | None:
    """A replica of `need` GPUs must fit one node or span whole nodes, TP within one node."""
    key = f"serving.{role}.tensorParallelSize"
    if need > inst.gpus and need % inst.gpus:
        return key, f"TP x PP = {need} GPUs neither fits one {inst.name} ({inst.gpus} GPUs) nor spans whole nodes"
    if need > inst.gpus and tp > inst.gpus:
        return (
            key,
            f"tensorParallelSize {tp} is larger than one {inst.name} "
            f"({inst.gpus} GPUs); span nodes with pipelineParallelSize instead",
        )
    if need < inst.gpus and inst.gpus % need:
        return key, f"TP x PP = {need} does not divide the {inst.gpus} GPUs of {inst.name}"
    return None


def _size_error(cfg: StackConfig, role: str, pool: NodePool, name: str) -> tuple[str, str] | None:
    """maxSize must hold maxReplicas, and a NewCluster upgrade's second cluster beside them."""
    spec = cfg.serving.engine_roles()[role]
    inst, need = pool.instance, spec.gpus_per_replica
    if sizing.nodes_for(spec.max_replicas, need, inst.gpus) > pool.max_size:
        return (
            f"nodePools.{name}.maxSize",
            f"{pool.max_size} nodes cannot hold serving.{role}.maxReplicas={spec.max_replicas} "
            f"({sizing.nodes_per_replica(need, inst.gpus)} node(s) per replica on {inst.name})",
        )
    strategy = cfg.upgrade_strategy.value
    peak = sizing.upgrade_peak_nodes(
        strategy, spec.min_replicas, spec.max_replicas, spec.initial_replicas, need, inst.gpus
    )
    if peak > pool.max_size:
        # kuberay#1476: a NewCluster upgrade without room stays Pending forever.
        return (
            f"nodePools.{name}.maxSize",
            f"{pool.max_size} nodes leave no room for a {strategy} upgrade: the "
            f"running cluster at serving.{role}.maxReplicas={spec.max_replicas} plus the new cluster's "
            f"starting replicas need {peak} nodes (raise maxSize to {peak}, lower "
            f"serving.{role}.maxReplicas, or set upgradeStrategy: None)",
        )
    return None


def _shared_size_error(cfg: StackConfig, name: str, users: list[Placement]) -> tuple[str, str] | None:
    """A pool several models' roles share: its maxSize must hold all of them at maxReplicas,
    and the starting replicas of a NewCluster upgrade's second cluster beside them."""
    pool = cfg.node_pools[name]
    inst = pool.instance
    at_max = [sizing.nodes_for(p.role_spec.max_replicas, p.role_spec.gpus_per_replica, inst.gpus) for p in users]
    need = sum(at_max)
    parts = ", ".join(f"{p.spec.model.id} {p.role} {n}" for p, n in zip(users, at_max, strict=True))
    if need > pool.max_size:
        return (
            f"nodePools.{name}.maxSize",
            f"{pool.max_size} nodes cannot hold the models placed on pool {name} at maxReplicas "
            f"({parts} node(s) on {inst.name}: {need})",
        )
    strategy = cfg.upgrade_strategy.value
    peak = sum(
        sizing.upgrade_peak_nodes(
            strategy,
            p.role_spec.min_replicas,
            p.role_spec.max_replicas,
            p.role_spec.initial_replicas,
            p.role_spec.gpus_per_replica,
            inst.gpus,
        )
        for p in users
    )
    if peak > pool.max_size:
        return (
            f"nodePools.{name}.maxSize",
            f"{pool.max_size} nodes leave no room for a {strategy} upgrade of the models on pool {name} "
            f"({parts} node(s) at maxReplicas, plus the new cluster's starting replicas: {peak} nodes); "
            "raise maxSize, lower their maxReplicas, or set upgradeStrategy: None",
        )
    return None


def pool_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """Each model's replicas against its pools' nodes; EFA on both pools of a P/D model or neither."""
    errors: list[tuple[str, str]] = []
    by_pool: dict[str, list[Placement]] = {}
    for p in placements(cfg):
        by_pool.setdefault(p.pool, []).append(p)
        inst = cfg.node_pools[p.pool].instance
        shape = _shape_error(p.role, p.role_spec.gpus_per_replica, p.role_spec.tensor_parallel_size, inst)
        if shape is not None:
            errors += rekey(cfg, p.index, [(shape[0], f"{shape[1]} (pool {p.pool})" if cfg.serving.many else shape[1])])
    for name, users in by_pool.items():
        if len(users) == 1:
            one = users[0]
            view = cfg.model_copy(update={"serving": one.spec})
            size = _size_error(view, one.role, cfg.node_pools[name], name)
            if size is not None and cfg.serving.many:
                size = (size[0], size[1].replace("serving.", model_key(cfg, one.index) + "."))
        else:
            size = _shared_size_error(cfg, name, users)
        if size is not None:
            errors.append(size)
    for i, spec in enumerate(cfg.serving.served):
        if spec.mode is not Mode.DISAGGREGATED:
            continue
        pre, dec = (cfg.node_pools[spec.pool_of(r)].instance for r in ("prefill", "decode"))
        if spec.pool_of("prefill") == spec.pool_of("decode") and pre.efa:
            # EFA has no intra-host loopback: a prefill and a decode replica on one node cannot
            # move KV over it (ai-dynamo/dynamo#7764), and one pool lets Ray place them so.
            errors.append(
                (
                    f"{model_key(cfg, i)}.pools",
                    f"prefill and decode of {spec.model.id!r} share the EFA pool {spec.pool_of('decode')}: "
                    "EFA has no loopback between two replicas on one node (ai-dynamo/dynamo#7764); "
                    "give each role its own pool",
                )
            )
        if pre.efa != dec.efa:
            key = "nodePools" if not cfg.serving.many else f"{model_key(cfg, i)}.pools"
            errors.append((key, "prefill and decode pools must both have EFA or neither (KV transfer path)"))
    return errors
