"""`make plan` shows what a pool's KV offload tier holds and what it takes of the node.

The extra tokens are the engine's share of the node's tier (by its GPUs) over the KV bytes
of one token on all the engine's GPUs, the planner's own per-GPU figure; the staging stack
opts its prefill pool in (stacks/Pulumi.staging.yaml), its decode pool not.
"""

from __future__ import annotations

from infra import catalog
from infra.config import load
from infra.plan.plan_text import format_plan
from infra.plan.planning import plan
from tools import stackfile


def _row(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(label))


def test_staging_plan_shows_the_prefill_tier_and_its_tokens() -> None:
    values, secrets, others = stackfile.read_as_deployed("staging")
    p = plan(load(values, secret_keys=secrets, source="x", region=others.get("aws:region")))
    text = format_plan(p)
    prefill = next(r for r in p.roles if r.role == "prefill")
    inst = catalog.lookup(prefill.instance_type)
    assert prefill.kv_offload is not None and prefill.figures is not None
    cpu, disk = prefill.kv_offload
    size = _row(text, "KV offload tier per node")
    assert f"{cpu} of {inst.memory_gib} GiB RAM" in size and f"{disk} of {inst.nvme_gib} GiB NVMe" in size
    per_token_engine = prefill.figures.kv_bytes_per_token_per_gpu * prefill.tensor_parallel_size
    tokens = _row(text, "  extra KV tokens/engine")
    assert f"{cpu * 2**30 // per_token_engine:,} host" in tokens
    assert tokens.rstrip().endswith("-"), "decode has no tier"
