"""`make plan` shows what a pool's KV offload tier holds, what it takes of the node and how long
it lasts at the plan's rate.

The extra tokens are the engine's share of the node's tier (by its GPUs) over the KV bytes
of one token on all the engine's GPUs, the planner's own per-GPU figure; the staging stack
opts its prefill pool in (stacks/Pulumi.staging.yaml), its decode pool not.
"""

from __future__ import annotations

import pytest

from infra import catalog
from infra.config import load
from infra.plan.plan_text import format_plan
from infra.plan.planning import plan
from infra.sizing.offload import fill_seconds
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
    assert f"{cpu} of {inst.memory_gib} GiB RAM" in size and disk == 0 and "NVMe" not in size
    per_token_engine = prefill.figures.kv_bytes_per_token_per_gpu * prefill.tensor_parallel_size
    tokens = _row(text, "  extra KV tokens/engine")
    assert f"{cpu * 2**30 // per_token_engine:,} host" in tokens
    assert tokens.rstrip().endswith("-"), "decode has no tier"


def _staging():
    values, secrets, others = stackfile.read_as_deployed("staging")
    p = plan(load(values, secret_keys=secrets, source="x", region=others.get("aws:region")))
    return p, format_plan(p)


def test_staging_plan_shows_how_long_the_prefill_tier_lasts_at_the_planned_rate() -> None:
    """At the rate a prefill replica is planned for (the scale-out rate of the plan's workload,
    1,024-token prompts), every prompt new: the node's tier over what the engine stores per second."""
    p, text = _staging()
    prefill = next(r for r in p.roles if r.role == "prefill")
    assert prefill.kv_offload and prefill.figures and prefill.scaling and prefill.scaling.max_rps
    inst = catalog.lookup(prefill.instance_type)
    engines_per_node = inst.gpus // (prefill.tensor_parallel_size * prefill.pipeline_parallel_size)
    rate = prefill.scaling.max_rps / prefill.max_replicas
    stored_per_s = rate * 1024 * prefill.figures.kv_bytes_per_token
    expected = prefill.kv_offload[0] * 2**30 / engines_per_node / stored_per_s
    assert prefill.kv_offload_fill == pytest.approx((expected, rate), rel=1e-3)
    row = _row(text, "  full after (planned rate)")
    assert f"at {rate:.2f} req/s, then LRU" in row and row.rstrip().endswith("-"), "decode has no tier"
    assert expected < 120, "the CPU tier turns over in a minute or two at that rate: LRU keeps it bounded"


def test_the_refused_disk_tier_would_have_filled_within_the_hour():
    """Staging's 1000 GiB disk tier (refused: infra/config/kv_offload.py) at one new
    1,024-token prompt a second, Llama 70B's 327,680 KV bytes per token (80 layers x 8 KV heads
    x 128 x 2 (K, V) x 2 B): full in under an hour, then the kubelet evicts the pod."""
    seconds = fill_seconds(1000 * 2**30, 1.0, 1024, 80 * 8 * 128 * 2 * 2)
    assert seconds is not None and 3000 < seconds < 3600
    assert fill_seconds(2**30, 0.0, 1024, 1) is None, "no rate: it never fills"
