"""The node pools: the CPU system nodes and one GPU pool per engine role, sized for the replicas."""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import Field, field_validator, model_validator

from infra.model import catalog, sizing
from infra.model.stack.formats import instance_type_format
from serving.spec import Mode, SpecModel, check_order

if TYPE_CHECKING:
    from infra.model.config import StackConfig

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


class NodePools(SpecModel):
    prefill: NodePool
    decode: NodePool


class PoolKeys(SpecModel):
    system_nodes: SystemNodes = Field(default_factory=SystemNodes)
    node_pools: NodePools


def engine_pools(cfg: StackConfig) -> dict[str, NodePool]:
    """The GPU pool of each engine role the serving mode runs."""
    pools = {"prefill": cfg.node_pools.prefill, "decode": cfg.node_pools.decode}
    return {role: pools[role] for role in cfg.serving.engine_roles()}


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


def _size_error(cfg: StackConfig, role: str, pool: NodePool) -> tuple[str, str] | None:
    """maxSize must hold maxReplicas, and a NewCluster upgrade's second cluster beside them."""
    spec = cfg.serving.engine_roles()[role]
    inst, need = pool.instance, spec.gpus_per_replica
    if sizing.nodes_for(spec.max_replicas, need, inst.gpus) > pool.max_size:
        return (
            f"nodePools.{role}.maxSize",
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
            f"nodePools.{role}.maxSize",
            f"{pool.max_size} nodes leave no room for a {strategy} upgrade: the "
            f"running cluster at serving.{role}.maxReplicas={spec.max_replicas} plus the new cluster's "
            f"starting replicas need {peak} nodes (raise maxSize to {peak}, lower "
            f"serving.{role}.maxReplicas, or set upgradeStrategy: None)",
        )
    return None


def pool_errors(cfg: StackConfig) -> list[tuple[str, str]]:
    """Each engine role's replicas against its pool's nodes; EFA on both pools or neither."""
    errors = []
    for role, pool in engine_pools(cfg).items():
        spec = cfg.serving.engine_roles()[role]
        shape = _shape_error(role, spec.gpus_per_replica, spec.tensor_parallel_size, pool.instance)
        size = _size_error(cfg, role, pool)
        errors += [e for e in (shape, size) if e is not None]
    if cfg.serving.mode is Mode.DISAGGREGATED:
        p, d = cfg.node_pools.prefill.instance, cfg.node_pools.decode.instance
        if p.efa != d.efa:
            errors.append(("nodePools", "prefill and decode pools must both have EFA or neither (KV transfer path)"))
    return errors
