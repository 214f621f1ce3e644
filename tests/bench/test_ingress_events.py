"""`make bench-ingress` (bench/ingress_events.py) runs no Ray: its whole command, at a tiny size,
is the dry run: the ingress built from the spec's resilience values (and with migrations off)
streams every event of both endpoints and the report is printed."""

from __future__ import annotations

import pytest

from bench import ingress_events


@pytest.mark.parametrize("extra", [[], ["--migrations", "0"]])
def test_the_command_runs_end_to_end_at_a_tiny_size(capsys, extra):
    assert ingress_events.main(["--events", "6", "--batch", "2", "--streams", "1", "--rounds", "1", *extra]) == 0
    out = capsys.readouterr().out
    assert "6 JSON events a stream in batches of 2" in out
    assert "chat" in out and "completions" in out
    assert ("migrations on" in out) == (not extra)
