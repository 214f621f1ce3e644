"""Shared fixtures: every stack in stacks/ rendered once per test session under mocks."""

from __future__ import annotations

import pytest

from tools import render, stackfile

STACKS = stackfile.stacks()


@pytest.fixture(scope="session")
def rendered_stacks() -> dict[str, render.Rendered]:
    """stack name -> Rendered (config, registered resources, outputs) for every shipped stack."""
    return {s: render.render(s, stand_in_secrets=True) for s in STACKS}
