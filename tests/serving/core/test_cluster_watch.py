"""serving/core/cluster_watch.py: Serve's status is asked for while it is read, and not otherwise.

Each `serve.status()` is a round trip to Serve's controller; every ingress replica and every
decode replica keeps a watch. The poll is faked here (no Ray started).
"""

from __future__ import annotations

import asyncio

from serving.core.cluster_watch import ClusterWatch


class _Watch(ClusterWatch):
    def __init__(self, **kw):
        super().__init__("llm", "Ingress", **kw)
        self.polls = 0

    def poll(self):
        self.polls += 1
        return {"Decode": 1}


def test_an_unread_watch_asks_serve_nothing_and_a_read_wakes_it():
    async def go():
        w = _Watch(period_s=0.02, idle_s=0.2)
        w.start()
        await asyncio.sleep(0.3)
        idle_polls = w.polls  # nobody read it
        assert w.replicas("Decode") is None  # not fresh yet: callers do not guess
        await asyncio.sleep(0.1)
        assert w.replicas("Decode") == 1 and w.polls > idle_polls
        for _ in range(5):  # read while traffic flows: kept fresh
            await asyncio.sleep(0.05)
            assert w.replicas("Decode") == 1
        await asyncio.sleep(1.0)  # no reads for longer than idle_s: the poll stops
        stopped_at = w.polls
        await asyncio.sleep(0.3)
        w.stop()
        return idle_polls, stopped_at, w.polls

    idle, stopped_at, end = asyncio.run(go())
    assert idle == 0
    assert end == stopped_at  # nothing asked while nobody read
