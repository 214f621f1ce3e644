"""bench/hybrid.py dry: the stack with the stand-in provider as its fallback, built without Ray
(tests/bench/dry_run.py), for either provider backend and the overflow threshold."""

from __future__ import annotations

import pytest

from bench import hybrid
from local.provider import Backend
from tests.bench import dry_run

PROVIDER = "http://127.0.0.1:9/v1"


@pytest.mark.parametrize("backend", [b.value for b in Backend])
def test_the_stack_overflows_to_the_provider(backend):
    args = hybrid.parse_args(["--provider", backend])
    stack = dry_run.plan(hybrid.stack_options(PROVIDER, args.overflow_at))
    built = dry_run.build(stack.config)
    assert list(built) == ["llm"] and "Prefill:tiny-llama" in built["llm"]
    (ingress,) = stack.config["applications"][0]["deployments"]
    fallback = ingress["user_config"]["fallback"]
    assert fallback["base_url"] == PROVIDER
    assert fallback["overflow_at"] == args.overflow_at == hybrid.OVERFLOW_AT
