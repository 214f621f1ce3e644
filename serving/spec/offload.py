"""The KV offload tier: vLLM's OffloadingConnector beside NIXL, as engine kwargs.

What flows through here: a pool's `kvOffload` (infra/config/kv_offload.py validates it
against the instance) -> one `OffloadTier` per engine role on the `Target` (the bytes of host
memory one engine may fill, and the directory of the disk tier, if any) -> `compose`, which
wraps the role's NIXL `kv_transfer_config` in vLLM's MultiConnector with an
OffloadingConnector after it. A role without a tier keeps its NIXL config unchanged.

vLLM's surface, read in the 0.29 (the ray-llm image) and 0.32 (the local run) sources, the
same in both:
- `MultiConnector` builds each child as `KVTransferConfig(**child, engine_id=...)` from
  `kv_connector_extra_config.connectors` (kv_connector/v1/multi_connector.py
  `_get_connector_classes_and_configs`) and loads a request from the FIRST child that reports
  matched tokens (`get_num_new_matched_tokens`): NIXL goes first, so decode always takes the
  prefilled KV from prefill, and prefill (NIXL's producer side matches nothing) asks the tier.
  Saves go to every child. The scheduler reads `kv_load_failure_policy` from the outer config
  (v1/core/sched/scheduler.py), the NIXL worker its `kv_buffer_device` from its own child.
- `OffloadingConnector` picks its backend by `spec_name` (v1/kv_offload/factory.py):
  `CPUOffloadingSpec` needs `cpu_bytes_to_use` (bytes for ALL the engine's workers together,
  v1/kv_offload/cpu/spec.py); `TieringOffloadingSpec` puts `secondary_tiers` behind that CPU
  tier, the `fs` one with a `root_dir` (v1/kv_offload/tiering/factory.py, fs/manager.py).
  On CUDA the CPU tier is one mmap file under /dev/shm (`vllm_offload_<engine_id>.mmap`,
  cpu/shared_offload_region.py), so the pod's /dev/shm must hold it.
- The fs tier never deletes a file (tiering/fs/manager.py has no capacity or eviction): the
  directory only grows while the engine lives. Its volume's size limit is what bounds it.

Standard library only, like render.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MULTI_CONNECTOR = "MultiConnector"
OFFLOADING_CONNECTOR = "OffloadingConnector"
CPU_SPEC = "CPUOffloadingSpec"
TIERING_SPEC = "TieringOffloadingSpec"
FS_TIER = "fs"
# Where a worker pod mounts the disk tier's volume (an emptyDir on the node's NVMe RAID0).
DISK_MOUNT = "/mnt/kv-offload"
GIB = 1 << 30


@dataclass(frozen=True)
class OffloadTier:
    """One engine's share of its node's offload tier.

    cpu_bytes: host memory the engine's CPU tier may fill (vLLM's `cpu_bytes_to_use`).
    disk_dir: the fs tier's directory, or None for the CPU tier alone.
    """

    cpu_bytes: int
    disk_dir: str | None = None


def offloading_connector(tier: OffloadTier) -> dict[str, Any]:
    """The OffloadingConnector child of a MultiConnector for `tier`."""
    extra: dict[str, Any] = {"spec_name": CPU_SPEC, "cpu_bytes_to_use": tier.cpu_bytes}
    if tier.disk_dir is not None:
        extra["spec_name"] = TIERING_SPEC
        extra["secondary_tiers"] = [{"type": FS_TIER, "root_dir": tier.disk_dir}]
    # The offloading connector stores and loads on the same engine: no producer/consumer side.
    return {"kv_connector": OFFLOADING_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": extra}


def compose(nixl: dict[str, Any], tier: OffloadTier | None) -> dict[str, Any]:
    """A role's kv_transfer_config: `nixl` itself without a tier, else NIXL then the tier."""
    if tier is None:
        return nixl
    outer_keys = ("kv_role", "kv_load_failure_policy")
    child = {k: v for k, v in nixl.items() if k != "kv_load_failure_policy"}
    return {
        "kv_connector": MULTI_CONNECTOR,
        **{k: nixl[k] for k in outer_keys if k in nixl},
        "kv_connector_extra_config": {"connectors": [child, offloading_connector(tier)]},
    }


def children(kv: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The connectors a MultiConnector kv_transfer_config composes (`compose`'s NIXL and
    offloading children); [] for any other connector."""
    if kv.get("kv_connector") != MULTI_CONNECTOR:
        return []
    extra = kv.get("kv_connector_extra_config") or {}
    return [c for c in extra.get("connectors") or [] if isinstance(c, Mapping)]


def engine_share(node_gib: float, engines_per_node: int) -> int:
    """Bytes of a node's tier that one engine gets: the node's GiB split evenly, rounded down."""
    return int(node_gib * GIB) // max(1, engines_per_node)
