"""The eager first chunk: the first token is not held back by Ray Serve LLM's stream batcher."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from ray.llm._internal.serve.core.server import llm_server as ray_llm_server
from ray.serve.llm.deployment import LLMServer

from serving.engines.streaming import EagerFirstChunkMixin, EagerLLMServer, eager_batches
from serving.spec import FIRST_CHUNK_KEY


def _run(coro):
    # A private loop: asyncio.run() would leave the main thread without an event loop, and
    # later tests (Pulumi's mocks) ask for one.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _engine(release: asyncio.Event, items: list[str]):
    yield items[0]
    await release.wait()
    for item in items[1:]:
        yield item


def test_first_chunk_leaves_before_the_interval_and_nothing_is_lost():
    async def scenario():
        release = asyncio.Event()
        items = ["a", "b", "c", "d"]
        stream = eager_batches(_engine(release, items), interval_ms=10_000)
        # With Ray's batcher alone this would wait the whole 10 s interval.
        first = await asyncio.wait_for(stream.__anext__(), timeout=2)
        release.set()
        rest = [x async for batch in stream for x in batch]
        return first, rest

    first, rest = _run(scenario())
    assert first == ["a"]
    assert rest == ["b", "c", "d"]


def test_rest_is_batched_at_the_interval():
    async def engine():
        for i in range(20):
            yield i

    async def scenario():
        return [batch async for batch in eager_batches(engine(), interval_ms=50)]

    batches = _run(scenario())
    assert batches[0] == [0]
    # The other 19 are ready at once, so the batcher sends them together.
    assert [x for b in batches[1:] for x in b] == list(range(1, 20))
    assert len(batches) == 2


def test_empty_stream_yields_nothing():
    async def engine():
        return
        yield  # pragma: no cover

    async def scenario():
        return [b async for b in eager_batches(engine(), interval_ms=50)]

    assert _run(scenario()) == []


def test_errors_from_the_engine_reach_the_caller():
    async def engine():
        yield 1
        yield 2
        raise RuntimeError("engine died")

    async def scenario():
        out = []
        try:
            async for b in eager_batches(engine(), interval_ms=5):
                out.extend(b)
        except RuntimeError as exc:
            return out, str(exc)
        return out, None

    out, err = _run(scenario())
    assert err == "engine died" and out[0] == 1


def test_the_hook_the_mixin_overrides_exists_in_ray():
    """Ray 2.60 `ray/llm/_internal/serve/core/server/llm_server.py`: LLMServer batches a
    stream in `_batch_output_stream(self, generator)`, with the interval from
    `_get_batch_interval_ms()`. If Ray renames either, the mixin would silently stop
    working: this test fails instead."""
    internal = ray_llm_server.LLMServer
    assert list(inspect.signature(internal._batch_output_stream).parameters) == ["self", "generator"]
    assert "stream" in inspect.signature(internal._get_batch_interval_ms).parameters
    assert issubclass(EagerLLMServer, LLMServer)
    assert EagerLLMServer._batch_output_stream is EagerFirstChunkMixin._batch_output_stream


class _FakeRayServer:
    """Stands in for Ray's LLMServer: records that its own batcher was used."""

    def __init__(self, first_chunk: str):
        self._llm_config = type("Cfg", (), {"experimental_configs": {FIRST_CHUNK_KEY: first_chunk}})()

    def _get_batch_interval_ms(self, stream: bool = True):
        return 10_000

    def _batch_output_stream(self, generator):
        return "ray's batcher"


class _Server(EagerFirstChunkMixin, _FakeRayServer):
    pass


def test_spec_chooses_eager_or_rays_batcher():
    async def engine():
        yield "a"

    assert _Server("batched")._batch_output_stream(engine()) == "ray's batcher"
    eager = _Server("eager")._batch_output_stream(engine())
    assert _run(eager.__anext__()) == ["a"]


def test_the_config_attribute_the_mixin_reads_exists_in_ray():
    """Ray 2.60 LLMServer keeps its LLMConfig as `self._llm_config` (read by
    `_get_batch_interval_ms` for experimental_configs)."""
    src = inspect.getsource(ray_llm_server.LLMServer._get_batch_interval_ms)
    assert "self._llm_config.experimental_configs" in src


async def _paced(n: int, step_s: float):
    """An engine that produces one token per step."""
    for i in range(n):
        await asyncio.sleep(step_s)
        yield i


def test_below_the_busy_threshold_each_step_goes_at_once():
    """A client measures the engine's inter-token latency, not one burst per interval: with
    the interval always on, aiperf read ITL p50 0.0 ms on the local stack."""

    async def scenario():
        return [b async for b in eager_batches(_paced(6, 0.01), interval_ms=200, busy=lambda: False)]

    assert _run(scenario()) == [[i] for i in range(6)]


def test_while_busy_a_batch_collects_for_the_interval():
    async def scenario():
        return [b async for b in eager_batches(_paced(12, 0.01), interval_ms=60, busy=lambda: True)]

    batches = _run(scenario())
    assert batches[0] == [0] and [x for b in batches for x in b] == list(range(12))
    assert len(batches) <= 4 and max(len(b) for b in batches) >= 3  # several steps per object


def test_batching_switches_with_the_load_mid_stream_and_errors_still_reach_the_caller():
    load = {"busy": False}

    async def engine():
        for i in range(4):
            await asyncio.sleep(0.01)
            yield i
        await asyncio.sleep(0.02)  # the 4th token has gone out alone
        load["busy"] = True
        for i in range(4, 10):
            await asyncio.sleep(0.005)
            yield i
        raise RuntimeError("engine died")

    async def scenario():
        out = []
        try:
            async for b in eager_batches(engine(), interval_ms=40, busy=lambda: load["busy"]):
                out.append(b)
        except RuntimeError as exc:
            return out, str(exc)
        return out, None

    batches, err = _run(scenario())
    assert err == "engine died"
    assert batches[:4] == [[0], [1], [2], [3]]
    assert len(batches) < 10 and [x for b in batches for x in b] == list(range(10))


def _pd_decode_server():
    from serving.engines.pd_server import ResilientPDDecodeServer

    server = object.__new__(ResilientPDDecodeServer)
    server._open_requests = 0
    return server


@pytest.mark.parametrize("make", [lambda: object.__new__(EagerLLMServer), _pd_decode_server], ids=["aggregated", "pd"])
def test_the_replica_batches_only_from_the_configured_number_of_open_streams(make):
    """Both engine classes: the P/D decode replica counted its streams in its own request
    counter (a method of the same name) and never batched (make bench-goodput: 1.03 tokens
    per chunk on P/D's decode against 10.7 on the aggregated app under the same load)."""
    from serving.spec import BATCH_FROM_STREAMS_KEY

    server = make()
    server._llm_config = type("C", (), {"experimental_configs": {BATCH_FROM_STREAMS_KEY: 2}})()
    server._get_batch_interval_ms = lambda: 30

    async def scenario():
        one = server._batch_output_stream(_paced(5, 0.01))
        alone = [b async for b in one]  # one stream open: below 2
        a = server._batch_output_stream(_paced(8, 0.01))
        b = server._batch_output_stream(_paced(8, 0.01))

        async def drain(s):
            return [x async for x in s]

        both = await asyncio.gather(drain(a), drain(b))
        return alone, both, server._open_streams

    alone, both, left = _run(scenario())
    assert alone == [[i] for i in range(5)]
    assert all(len(batches) < 8 for batches in both)  # two open: batched
    assert left == 0
    assert getattr(server, "_open_requests", 0) == 0  # P/D's request count is not the streams' count
