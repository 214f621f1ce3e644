"""A pool's KV offload tier (`nodePools.<name>.kvOffload`): validated against its instance.

What flows through here: `kvOffload: {cpuGiB, diskGiB}` of a GPU pool -> checks against the
catalog entry of the pool's instance type (host memory beside what the worker pod already
holds, the instance-store NVMe of the RAID0) and against the engine roles placed on the pool
-> per engine role an `OffloadTier` (serving/spec/offload.py: one engine's share of the node's
tier) for the Target that renders the Serve config, and the node-level figures the planner
prints.

Why per pool, not per role: the limits are the node's (its RAM, its NVMe), and a pool is a
node type; a model whose roles run on two pools turns the tier on for prefill, decode or both
by where it sets the key. Prefill is where it pays: there NIXL's producer side matches no
tokens, so a prompt prefix the GPU cache lost is loaded from the tier instead of recomputed.

Sizing rules (the node's, split among its engines by GPUs, so any mix of engines on a node
stays within it):
- cpuGiB lives in /dev/shm on CUDA (vLLM's CPU tier is one mmap file there), so the pod's
  /dev/shm grows by it; with the pod's existing /dev/shm it must leave half of the rest of the
  pod's memory to the engine processes (weights read while loading, Ray's own processes).
- diskGiB is refused: vLLM's file-system tier (v1/kv_offload/tiering/fs/manager.py, 0.29 in the
  image and 0.32 locally) has no capacity bound and never deletes a block file, and every block
  stored to the CPU tier is stored there too, so its emptyDir fills and the kubelet evicts the
  pod (emptyDir sizeLimit): at prefill's planned rate in minutes (docs/kv-offload.md). The CPU
  tier is bounded by vLLM itself: it evicts its least recently used blocks.
- One engine per node at most spans it: the CPU tier is node-local /dev/shm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from infra import catalog
from serving.spec import Mode, SpecModel
from serving.spec.offload import OffloadTier, engine_share

if TYPE_CHECKING:
    from infra.config import StackConfig

# The share of the pod's memory outside /dev/shm the tier may take; the rest stays with the
# engine processes.
HOST_SHARE = 0.5


class KvOffload(SpecModel):
    """A pool's offload tier per node: host memory, in GiB. (`diskGiB` is read only to refuse it
    with its reason: `_pool_errors`.)"""

    cpu_gib: int = Field(default=0, ge=0, alias="cpuGiB")
    disk_gib: int = Field(default=0, ge=0, alias="diskGiB")

    @model_validator(mode="after")
    def _check(self) -> KvOffload:
        if self.cpu_gib == 0:
            raise ValueError("kvOffload needs cpuGiB; remove the key to turn it off")
        return self


def max_cpu_gib(inst: catalog.InstanceType) -> int:
    """The most host memory a node's tier may take: a share of the pod's memory beyond /dev/shm."""
    return int((inst.pod_memory_gib - inst.shm_gib) * HOST_SHARE)


def shm_gib(inst: catalog.InstanceType, offload: KvOffload | None) -> int:
    """The worker pod's /dev/shm: the usual size, plus the CPU tier that lives there."""
    return inst.shm_gib + (offload.cpu_gib if offload else 0)


def _pool_errors(cfg: StackConfig, name: str) -> list[tuple[str, str]]:
    pool = cfg.node_pools[name]
    off, inst = pool.kv_offload, pool.instance
    if off is None:
        return []
    key = f"nodePools.{name}.kvOffload"
    errors = []
    if off.cpu_gib > max_cpu_gib(inst):
        errors.append(
            (
                f"{key}.cpuGiB",
                f"{off.cpu_gib} GiB exceeds what a {inst.name} leaves for it: the worker pod holds "
                f"{inst.pod_memory_gib} GiB of the node's {inst.memory_gib} GiB, {inst.shm_gib} GiB of it /dev/shm; "
                f"at most {max_cpu_gib(inst)} GiB (half of the rest) may hold offloaded KV",
            )
        )
    if off.disk_gib:
        errors.append((f"{key}.diskGiB", DISK_TIER_REFUSED))
    return errors


DISK_TIER_REFUSED = (
    "vLLM's file-system KV tier (v1/kv_offload/tiering/fs, 0.29 in the image and 0.32) has no capacity "
    "bound and never deletes a block, and every block stored to the CPU tier is stored there too: its "
    "emptyDir fills (at prefill's planned rate, in minutes) and the kubelet evicts the pod; remove diskGiB "
    "(the CPU tier stays bounded: vLLM evicts its least recently used blocks)"
)


def kv_offload_errors(cfg: StackConfig, placements: Iterable[Any]) -> list[tuple[str, str]]:
    """Each pool's tier against its instance, and against the engine roles placed on it
    (`placements`: infra.config.pools.placements, every model's role on its pool)."""
    errors = [e for name, _ in cfg.node_pools for e in _pool_errors(cfg, name)]
    for p in placements:
        pool = cfg.node_pools[p.pool]
        if pool.kv_offload is None:
            continue
        key = f"nodePools.{p.pool}.kvOffload"
        if p.spec.mode is not Mode.DISAGGREGATED:
            errors.append(
                (
                    key,
                    f"model {p.spec.model.id!r} runs aggregated on pool {p.pool}: the tier composes with NIXL (P/D models only)",
                )
            )
        elif p.role_spec.gpus_per_rank > pool.instance.gpus:
            errors.append(
                (
                    key,
                    f"{p.spec.model.id!r} {p.role} spans {p.role_spec.gpus_per_rank} GPUs, more than one "
                    f"{pool.instance.name}: vLLM's CPU tier is one /dev/shm file per engine on one node "
                    "(v1/kv_offload/cpu/shared_offload_region.py); use it on pools whose engines fit a node",
                )
            )
    return errors


def engine_tier(off: KvOffload | None, inst: catalog.InstanceType, gpus_per_rank: int) -> OffloadTier | None:
    """One engine's share of its node's tier: the node's GiB in proportion to its GPUs."""
    if off is None:
        return None
    return OffloadTier(cpu_bytes=engine_share(off.cpu_gib, max(1, inst.gpus // gpus_per_rank)))


def role_tiers(cfg: StackConfig, model_index: int = 0) -> dict[str, OffloadTier]:
    """Per engine role of one model: its share of its pool's tier (roles without one left out)."""
    spec = cfg.serving.served[model_index]
    out = {}
    for role, rs in spec.engine_roles().items():
        pool = cfg.node_pools[spec.pool_of(role)]
        tier = engine_tier(pool.kv_offload, pool.instance, rs.gpus_per_rank)
        if tier is not None:
            out[role] = tier
    return out
