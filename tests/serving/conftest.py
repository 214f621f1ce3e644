"""One local serving stack for the whole e2e session.

`stack` runs `python -m serving.local --mode both` (what `make serve` runs, plus the
aggregated app at /aggregated) on a free port with a known API key, waits for its ready
line, and Ctrl-Cs it at the end. Its log goes to build/test-logs/serve-e2e.log.
"""

from __future__ import annotations

import pytest

from infra.paths import BUILD_DIR

E2E_KEY = "sk-e2e-test-key"
# A second client key (per-key limits), and the key the hybrid tests' stand-in provider accepts.
E2E_KEY_2 = "sk-e2e-second-key"
LOG_DIR = BUILD_DIR / "test-logs"
# Runs last: it stops the shared stack.
LAST = "test_ctrl_c_shuts_everything_down"


def pytest_collection_modifyitems(config, items):
    # Disruptive tests (they kill replicas, then wait for recovery) run after the others.
    # Tests with a stack of their own run after that: the machine runs one Ray stack at a time.
    own = [i for i in items if i.get_closest_marker("own_stack")]
    last = [i for i in items if i.originalname == LAST and i not in own]
    disruptive = [i for i in items if i.get_closest_marker("disruptive") and i not in last and i not in own]
    rest = [i for i in items if i not in last and i not in disruptive and i not in own]
    items[:] = rest + disruptive + last + own


@pytest.fixture(scope="session")
def stack():
    from serving.local.background import background_stack

    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "serve-e2e.log"
    log.write_text("")
    from serving.local.provider import PROVIDER_KEY
    from serving.spec import FALLBACK_API_KEY_ENV

    with background_stack(
        mode="both",
        api_key=E2E_KEY,
        log_path=log,
        timeout=480,
        extra_keys=(E2E_KEY_2,),
        extra_env={FALLBACK_API_KEY_ENV: PROVIDER_KEY},
    ) as running:
        yield running
