"""Shared fixtures: every stack in stacks/ rendered once per test session under mocks."""

from __future__ import annotations

import pytest

from tools import render, stackfile

STACKS = stackfile.stacks()

# Per-test bound for e2e tests (pytest-timeout; the default for the rest is in pytest.ini). It
# covers fixture setup: the shared stack's READY wait (tests/serving/conftest.py, 480 s + 60 s)
# plus a disruptive test's recovery wait (up to 600 s) fit in it.
E2E_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


@pytest.fixture(scope="session")
def rendered_stacks() -> dict[str, render.Rendered]:
    """stack name -> Rendered (config, registered resources, outputs) for every shipped stack."""
    return {s: render.render(s, stand_in_secrets=True) for s in STACKS}
