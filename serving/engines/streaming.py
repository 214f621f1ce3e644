"""Stream batching that does not hold back the first token.

What flows through here: the engine's async stream of OpenAI chunks inside an engine
replica -> the first chunk at once, then the rest in batches every
`experimental_configs.stream_batching_interval_ms` -> Ray Serve's streaming handle -> the
ingress -> the client.

Why: Ray Serve LLM 2.60 batches streamed chunks so each Ray object carries several tokens
(`LLMServer._batch_output_stream`, `ray/llm/_internal/serve/utils/batcher.py`), and its
batcher waits a whole interval before it yields anything, the first token included. With
the default 50 ms that is up to 50 ms of extra time to first token on every request;
with batching off (0 ms) every token becomes its own Ray object and output throughput fell
by a third at 16 concurrent streams on this project's CPU stack (docs/performance.md).
Sending the first chunk alone and batching the rest keeps both. And batching follows the
load (`streaming.batchFromStreams`): below that many open streams a replica sends each engine
step's tokens at once, so a client measures the engine's inter-token latency, not one burst
every interval (aiperf read ITL p50 0.0 ms on the local stack with the interval always on);
at or above it, the replica batches, where its CPU per streamed object is what limits it.

The mixin overrides one method of Ray's server class (`_batch_output_stream`, Ray 2.60);
serving.ray_internals.check_hooks refuses to build the application when it is gone, and
tests/serving/engines/test_streaming.py pins its signature.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.serve.llm.deployment import LLMServer

from serving.core.calls import eager_batches
from serving.spec import BATCH_FROM_STREAMS, BATCH_FROM_STREAMS_KEY, FIRST_CHUNK_KEY, FirstChunk


class EagerFirstChunkMixin:
    """Put first in the bases of an LLMServer subclass (aggregated or P/D decode).

    The spec's `streaming.firstChunk` arrives in the LLMConfig's experimental_configs;
    `batched` hands the stream back to Ray's own batcher.
    """

    # Provided by Ray's LLMServer, which the mixin is combined with.
    _llm_config: Any
    _get_batch_interval_ms: Any

    _open_streams: int = 0  # this replica's streams being batched now (the instance's own once set)

    def _batch_output_stream(self, generator: AsyncIterator[Any]) -> AsyncIterator[Any]:
        configs = self._llm_config.experimental_configs
        if configs.get(FIRST_CHUNK_KEY) == FirstChunk.BATCHED.value:
            return super()._batch_output_stream(generator)  # type: ignore[misc]
        threshold = int(configs.get(BATCH_FROM_STREAMS_KEY, BATCH_FROM_STREAMS))
        return self._stream_counted(
            eager_batches(generator, self._get_batch_interval_ms(), lambda: self._busy(threshold))
        )

    def _busy(self, threshold: int) -> bool:
        return self._open_streams >= threshold

    # A name of its own: P/D decode's class counts its requests in a `_counted` of its own,
    # which took this one's place, so a P/D decode replica never batched.
    async def _stream_counted(self, batches: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
        self._open_streams += 1
        try:
            async for batch in batches:
                yield batch
        finally:
            self._open_streams -= 1


class EagerLLMServer(EagerFirstChunkMixin, LLMServer):
    """Ray Serve LLM's server with the first streamed chunk sent at once (aggregated mode)."""
