"""bench/decode_autoscale.py dry: the stack it measures, built without Ray (tests/bench/dry_run.py):
decode autoscales 1 -> 2 (the scale-out it times) and prefill stays at one."""

from __future__ import annotations

from bench import decode_autoscale
from tests.bench import dry_run


def test_the_stack_autoscales_decode_from_one_to_two():
    built = dry_run.build(dry_run.plan(decode_autoscale.stack_options()).config)
    assert list(built) == ["llm"]
    assert built["llm"]["Decode:tiny-llama"] == dry_run.Replicas(1, 2)
    assert built["llm"]["Prefill:tiny-llama"] == dry_run.Replicas(1, 1)
