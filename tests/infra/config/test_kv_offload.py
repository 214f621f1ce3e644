"""`nodePools.<name>.kvOffload` against the instance catalog and the roles placed on the pool.

What a user sees: a tier that does not fit the node, or a pool it cannot work on, is refused
with one line naming the stack file key; a tier that fits reaches the engines as vLLM's
`cpu_bytes_to_use`, split among the engines of a node so that they never take more than the
node's `cpuGiB` together. Limits come from the catalog (the node's memory, the worker pod's
share and its /dev/shm), never from literals here. A disk tier is refused: vLLM's file-system
tier has no capacity bound and never deletes a block (vllm/v1/kv_offload/tiering/fs/manager.py,
0.29 and 0.32; in 0.32, read here, nothing removes a block file and its lookup is a
file-existence check).
"""

from __future__ import annotations

import copy

import pytest

from infra import catalog
from infra.config import ConfigError, load
from infra.config.kv_offload import role_tiers
from tools import stackfile

GIB = 1 << 30


def _load(stack: str, pool: str, offload: dict | None, **pool_changes):
    values, secrets, others = stackfile.read_as_deployed(stack)
    values = copy.deepcopy(values)
    p = values["nodePools"][pool]
    p.pop("kvOffload", None)
    if offload is not None:
        p["kvOffload"] = offload
    p.update(pool_changes)
    return load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml", region=others.get("aws:region"))


def _refused(stack: str, pool: str, offload: dict, **pool_changes) -> str:
    with pytest.raises(ConfigError) as info:
        _load(stack, pool, offload, **pool_changes)
    msg = str(info.value)
    assert len(msg.strip().splitlines()) == 1, msg
    assert msg.startswith(f"stacks/Pulumi.{stack}.yaml: "), msg
    return msg


def test_a_tier_larger_than_the_pods_memory_beside_dev_shm_is_refused() -> None:
    inst = catalog.lookup("p5.48xlarge")
    # More than the worker pod holds beyond its /dev/shm can never fit, whatever the reserve.
    msg = _refused("prod", "prefill", {"cpuGiB": inst.pod_memory_gib - inst.shm_gib + 1})
    assert "nodePools.prefill.kvOffload.cpuGiB" in msg and "p5.48xlarge" in msg


@pytest.mark.parametrize("disk_gib", [1, 1000])
def test_a_disk_tier_of_any_size_is_refused_with_its_reason(disk_gib: int) -> None:
    """Staging's 1000 GiB tier as it was shipped, and the smallest: each fills and gets the pod
    evicted (infra/sizing/offload.py: at prefill's planned rate in minutes)."""
    msg = _refused("staging", "prefill", {"cpuGiB": 256, "diskGiB": disk_gib})
    assert msg.startswith("stacks/Pulumi.staging.yaml: nodePools.prefill.kvOffload.diskGiB: "), msg
    assert "never deletes a block" in msg and "evicts the pod" in msg


def test_a_tier_without_host_memory_is_refused() -> None:
    msg = _refused("prod", "prefill", {"diskGiB": 100})
    assert "nodePools.prefill.kvOffload" in msg and "cpuGiB" in msg


def test_aggregated_models_get_no_tier() -> None:
    values, secrets, others = stackfile.read_as_deployed("dev")
    values = copy.deepcopy(values)
    values["serving"]["mode"] = "aggregated"
    cfg = load(values, secret_keys=secrets, source="x", region=others.get("aws:region"))
    pool = cfg.serving.pool_of(next(iter(cfg.serving.engine_roles())))
    values["nodePools"][pool]["kvOffload"] = {"cpuGiB": 1}
    with pytest.raises(ConfigError) as info:
        load(values, secret_keys=secrets, source="stacks/Pulumi.dev.yaml", region=others.get("aws:region"))
    assert f"nodePools.{pool}.kvOffload" in str(info.value) and "P/D" in str(info.value)


def test_engines_that_span_nodes_are_refused() -> None:
    # deepseek-p5's prefill engine is TP 8 x PP 2: two p5 nodes per engine.
    msg = _refused("deepseek-p5", "prefill", {"cpuGiB": 64})
    assert "nodePools.prefill.kvOffload" in msg and "one node" in msg


@pytest.mark.parametrize("stack", ["prod", "staging"])
def test_engines_of_a_node_share_its_tier(stack: str) -> None:
    cfg = _load(stack, "decode", {"cpuGiB": 128})
    inst = cfg.node_pools["decode"].instance
    rs = cfg.serving.engine_roles()["decode"]
    engines = inst.gpus // rs.gpus_per_rank
    tiers = role_tiers(cfg)
    assert "decode" in tiers
    if stack == "prod":
        assert set(tiers) == {"decode"}, "only the pool that sets the key gets a tier"
    assert tiers["decode"].cpu_bytes * engines <= 128 * GIB


def test_the_shipped_staging_stack_has_a_prefill_tier_only() -> None:
    values, secrets, others = stackfile.read_as_deployed("staging")
    cfg = load(values, secret_keys=secrets, source="x", region=others.get("aws:region"))
    tiers = role_tiers(cfg)
    assert set(tiers) == {"prefill"}
    assert tiers["prefill"].disk_dir is None, "host memory only: no stack has a disk tier"
