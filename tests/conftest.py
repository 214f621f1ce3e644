"""Shared fixtures: every stack in stacks/ rendered once per test session under mocks, and one
local serving stack for the whole e2e session.

`stack` runs `python -m local --mode both` (what `make serve` runs, plus the aggregated app at
/aggregated) on a free port with a known API key, waits for its ready line, and Ctrl-Cs it at
the end. Its log goes to build/test-logs/serve-e2e.log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from infra.paths import BUILD_DIR
from tools import render, stackfile

STACKS = stackfile.stacks()

# Per-test bound for e2e tests (pytest-timeout; the default for the rest is in pytest.ini). It
# covers fixture setup: the shared stack's READY wait (`stack` below, 480 s + 60 s)
# plus a disruptive test's recovery wait (up to 600 s) fit in it.
E2E_TIMEOUT_S = 1800


E2E_KEY = "sk-e2e-test-key"
# More client keys, one per test that sets a per-key limit: a key's limit windows outlive a
# user_config change (a config push must not hand a client a fresh minute), so two tests that
# limited the same key would see each other's requests whenever they ran within a minute.
E2E_KEY_2 = "sk-e2e-second-key"
E2E_RPM_KEY = "sk-e2e-requests-limited-key"
E2E_TPM_KEY = "sk-e2e-tokens-limited-key"
LOG_DIR = BUILD_DIR / "test-logs"
# Runs last: it stops the shared stack.
LAST = "test_ctrl_c_shuts_everything_down"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
    # Disruptive tests (they kill replicas, then wait for recovery) run after the others.
    # Tests with a stack of their own run after that: the machine runs one Ray stack at a time.
    own = [i for i in items if i.get_closest_marker("own_stack")]
    last = [i for i in items if i.originalname == LAST and i not in own]
    disruptive = [i for i in items if i.get_closest_marker("disruptive") and i not in last and i not in own]
    rest = [i for i in items if i not in last and i not in disruptive and i not in own]
    items[:] = rest + disruptive + last + own


@pytest.fixture(scope="session")
def rendered_stacks() -> dict[str, render.Rendered]:
    """stack name -> Rendered (config, registered resources, outputs) for every shipped stack."""
    return {s: render.render(s, stand_in_secrets=True) for s in STACKS}


@pytest.fixture(scope="session")
def stack():
    from local.background import background_stack

    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "serve-e2e.log"
    log.write_text("")
    from local.config import PREFILL_ROUTER_ENV
    from local.provider import PROVIDER_KEY
    from serving.spec import FALLBACK_API_KEY_ENV

    with background_stack(
        mode="both",
        api_key=E2E_KEY,
        log_path=log,
        timeout=480,
        extra_keys=(E2E_KEY_2, E2E_RPM_KEY, E2E_TPM_KEY),
        # The P/D prefill tier routed by KV state, so every P/D e2e test runs through the
        # scorer (a stack's opt-in; `make serve` keeps the stacks' default router).
        extra_env={FALLBACK_API_KEY_ENV: PROVIDER_KEY, PREFILL_ROUTER_ENV: "kv-aware"},
    ) as running:
        _SHARED.append(lambda: running.stop() if running.proc.poll() is None else None)
        yield running


@pytest.fixture(scope="session")
def provider(stack):
    """The stand-in external provider (local.provider: plain vLLM serving the tiny model behind a
    proxy that records what it gets), one for the session: the hybrid-routing and the
    tool-calling e2e tests both send to it (each clears its records first)."""
    from local.config import local_target
    from local.provider import running_provider
    from local.tiny_model import ensure_tiny_model

    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        running = held.enter_context(
            running_provider(str(ensure_tiny_model()), LOG_DIR / "provider.log", dict(local_target().engine_env))
        )
        _SHARED.append(held.close)
        yield running


# What the shared-stack tests hold running (the shared stack, the provider beside it), as stops:
# a test with a stack of its own calls them first (the machine runs one Ray stack at a time, and
# the shared stack's HAProxy holds the ports the next one needs). In a full run the last
# shared-stack test has stopped the stack already; in a selection it may not have. Each stop
# does nothing the second time.
_SHARED: list[Callable[[], None]] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture of the item: a module-scoped stack fixture is set up before autouse ones.
    if item.get_closest_marker("own_stack"):
        for stop in _SHARED:
            stop()
