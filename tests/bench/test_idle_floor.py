"""bench/idle_floor.py's wait for the bare cluster: READY, a child that ends first, one that
hangs (the real cluster's start and metering run in every `make bench`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import idle_floor


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_ready_after_other_lines():
    child = _child(f"print('starting'); print('more'); print({idle_floor.READY!r}, flush=True)")
    idle_floor._wait_ready(child)
    child.wait(10)


def test_a_child_that_ends_before_ready_is_an_error():
    child = _child("import sys; print('boom'); sys.exit(3)")
    with pytest.raises(RuntimeError, match="did not start"):
        idle_floor._wait_ready(child)
    assert child.wait(10) == 3


def test_a_child_that_hangs_is_an_error_at_the_deadline(monkeypatch):
    monkeypatch.setattr(idle_floor, "START_TIMEOUT_S", 0.5)
    child = _child("import time; print('starting', flush=True); time.sleep(30)")
    try:
        with pytest.raises(RuntimeError, match="did not start within"):
            idle_floor._wait_ready(child)
    finally:
        child.kill()
        child.wait()
