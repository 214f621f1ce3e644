"""bench/chaos_streams.py: the scale-in config and the stream verdicts (no stack started)."""

from __future__ import annotations

from pathlib import Path

from bench import chaos_streams as cs
from bench.sse import Streamed
from local.config import render_local_config


def _streamed(*, ok: bool = True, tokens: int = cs.TOKENS, text: str = "a", status: int = 200) -> Streamed:
    s = Streamed(start=0.0, status=status, done=ok, text=text)
    s.usage = {"completion_tokens": tokens}
    if not ok and status == 200:
        s.error_event = {"error": {"message": "cut"}}
    return s


def test_scale_in_changes_only_decode_and_only_its_replica_count():
    config = render_local_config("both", Path("/tmp/model"), port=8000, decode_replicas=2)
    scaled = cs._with_decode_replicas(config, 1)
    assert scaled != config and config == render_local_config(
        "both", Path("/tmp/model"), port=8000, decode_replicas=2
    )  # not mutated
    for old, new in zip(config["applications"], scaled["applications"], strict=True):
        old_decode = (old.get("args") or {}).get("decode_config")
        if not old_decode:
            assert old == new
            continue
        dep = new["args"]["decode_config"]["deployment_config"]
        counts = dep.get("autoscaling_config") or {
            "min_replicas": dep["num_replicas"],
            "max_replicas": dep["num_replicas"],
        }
        assert counts["min_replicas"] == counts["max_replicas"] == 1
        new["args"]["decode_config"] = old_decode
        assert old == new


def test_a_cut_or_short_stream_fails_the_verdict():
    good = [_streamed() for _ in range(cs.STREAMS)]
    res = {"faulted": cs._summary(good, "a")}
    assert all(cs.verdicts({"migrate-decode": res}).values())
    for bad in (_streamed(ok=False), _streamed(tokens=cs.TOKENS - 1), _streamed(status=503)):
        res = {"faulted": cs._summary([*good[1:], bad], "a")}
        assert not any(cs.verdicts({"migrate-decode": res}).values()), bad
    assert cs._summary([_streamed(text="b"), _streamed()], "a")["same_text_as_reference"] == 1
