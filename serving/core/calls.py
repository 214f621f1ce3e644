"""A Serve handle call and what comes back: the helpers every hop uses around one.

What flows through here: the response stream of one `handle.method.remote(...)` call (a Serve
DeploymentResponseGenerator, or a plain async generator in tests) -> whether a replica took it
(`assigned`), how to stop it (`cancel_call`, `aclose_quietly`), its first item (`first_item`:
Ray Serve LLM batches chunks into lists), whether an item is an engine's server or client
error (Ray's ErrorResponse, or vLLM's in-stream `data: {"error": ...}` event), the
OpenAI-style error event a stream that already sent bytes ends with, and the eager first
chunk of a batched stream (`eager_batches`). Background tasks are held until they finish
(`in_background`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any


async def assigned(stream: Any) -> None:
    """Returns once Serve's router has given the call to a replica (Ray 2.60
    DeploymentResponseGenerator._fetch_future_result_async, see ray_internals); streams
    without that step count as assigned."""
    fetch = getattr(stream, "_fetch_future_result_async", None)
    if fetch is not None:
        await fetch()


def cancel_call(stream: Any) -> None:
    """Stop a downstream call: Serve's response streams have cancel() (the replica then
    cancels the request, and vLLM aborts it); a plain async generator is closed."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
    elif hasattr(stream, "aclose"):
        in_background(aclose_quietly(stream))


def first_item(item: Any) -> Any:
    return item[0] if isinstance(item, list) and item else item


_background: set[asyncio.Future[Any]] = set()  # keeps fire-and-forget tasks alive until they finish


def in_background(aw: Awaitable[Any]) -> None:
    """Run `aw` on the current loop without awaiting it (closing a stream or a client), held
    until it finishes: asyncio keeps only weak references to tasks."""
    task = asyncio.ensure_future(aw)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def aclose_quietly(gen: Any) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):  # closing a failed stream must not raise
            await close()


def sse_error_doc(message: str, code: int | str, type_: str = "server_error") -> dict[str, Any]:
    """The JSON of an OpenAI-style error event."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def sse_error(message: str, code: int | str, type_: str = "server_error", *, done: bool = True) -> str:
    """An OpenAI-style error event for a stream that already sent bytes, plus [DONE] (unless
    `done` is False: the stream already sent it)."""
    return f"data: {json.dumps(sse_error_doc(message, code, type_))}\n\n" + ("data: [DONE]\n\n" if done else "")


def is_client_error(item: Any) -> bool:
    """Ray's ErrorResponse with a 4xx code: the engine refused the request itself (a bad
    parameter, a prompt over the context): the client's answer, never a fault of the tier."""
    from serving import ray_internals as ri

    return isinstance(item, ri.ErrorResponse) and 400 <= (item.error.code or 500) < 500


def client_error_response(exc: BaseException) -> Any:
    """Ray's ErrorResponse for an exception that carries a 4xx `status_code` (fastapi's
    HTTPException: Ray's LoRA loader raises 404 for an adapter it cannot find; Ray's
    OpenAIHTTPException), as an engine answers a request it refuses; None for any other."""
    from serving import ray_internals as ri

    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or not 400 <= status < 500:
        return None
    message = getattr(exc, "message", None) or getattr(exc, "detail", None) or type(exc).__name__
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return ri.ErrorResponse.model_validate({"error": {"message": str(message), "type": kind, "code": status}})


def is_server_error(item: Any) -> bool:
    """An engine answer that is a server-side failure: Ray's ErrorResponse object, or (in a
    stream) vLLM's in-stream error event, `data: {"error": {...}}` (vLLM's
    OpenAIServing.create_streaming_error_response), with a 5xx code (none: 500)."""
    from serving import ray_internals as ri

    if isinstance(item, ri.ErrorResponse):
        return (item.error.code or 500) >= 500
    code = sse_error_code(item)
    return code is not None and code >= 500


def sse_error_code(item: Any) -> int | None:
    """The code of an SSE error event (`data: {"error": ...}`), else None."""
    if isinstance(item, bytes):
        item = item.decode(errors="replace")
    if not isinstance(item, str) or '"error"' not in item[:64]:
        return None
    for line in item.split("\n"):
        if not line.startswith("data:"):
            continue
        try:
            msg = json.loads(line[5:])
        except ValueError:
            continue
        code = _error_code(msg)
        if code is not None:
            return code
    return None


def server_error_in(packet: str, docs: Iterable[Any]) -> bool:
    """`is_server_error(packet)` for a packet whose events' JSON (`docs`) is decoded already."""
    if '"error"' not in packet[:64]:
        return False
    for doc in docs:
        code = _error_code(doc)
        if code is not None:
            return code >= 500
    return False


def _error_code(msg: Any) -> int | None:
    if isinstance(msg, dict) and isinstance(msg.get("error"), dict):
        code = msg["error"].get("code")
        return code if isinstance(code, int) else 500
    return None


async def eager_batches(
    stream: AsyncIterator[Any], interval_ms: float | None, busy: Callable[[], bool] | None = None
) -> AsyncGenerator[list[Any], None]:
    """[first item] as soon as it exists, then lists of items every `interval_ms` (Ray Serve
    LLM's Batcher; 0 or None: each item alone). The engines batch their tokens this way
    (serving/engines/streaming.py), and so does the fallback relay.

    With `busy`, batching follows the load: each item goes at once while `busy()` is false
    (a client then sees the engine's own inter-token latency), and a batch collects for
    `interval_ms` after its first item only while it is true (fewer, larger objects when the
    process's CPU is what limits the stream)."""
    from serving.ray_internals import Batcher

    it = stream.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return
    yield [first]
    if busy is not None and interval_ms:
        async for batch in _batches_while_busy(it, interval_ms / 1000, busy):
            yield batch
        return
    rest: Batcher[Any] = Batcher(it, interval_ms=interval_ms)
    async for batch in rest.stream():
        yield list(batch)


async def _batches_while_busy(
    it: AsyncIterator[Any], interval_s: float, busy: Callable[[], bool]
) -> AsyncGenerator[list[Any], None]:
    """The items of `it`, each batch started by the next item and held `interval_s` for more
    only while busy(); a reader task drains `it` meanwhile, as Ray's Batcher does."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    async def read() -> None:
        try:
            async for item in it:
                queue.put_nowait(item)
        finally:
            queue.put_nowait(end)

    reader = asyncio.ensure_future(read())
    try:
        while True:
            item = await queue.get()
            if item is end:
                break
            if busy():
                await asyncio.sleep(interval_s)
            batch = [item]
            while not queue.empty():
                more = queue.get_nowait()
                if more is end:
                    yield batch
                    reader.result()
                    return
                batch.append(more)
            yield batch
        reader.result()  # the engine stream's own error, if it ended with one
    finally:
        if not reader.done():
            reader.cancel()
