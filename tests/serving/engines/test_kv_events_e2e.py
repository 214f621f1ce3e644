"""vLLM's KV cache events on this machine's CPU platform: what a KV-aware prefill router would
index (docs/kv-aware-routing.md, issue 39), run instead of read.

A plain vLLM server (the image's version, the local engines' arguments, the tiny model) with
prefix caching and `--kv-events-config` publishing over ZMQ, as Ray 2.60's
`configure_kv_events_for_kv_routing` sets it for a KV-aware deployment (publisher zmq, a PUB
endpoint and a replay endpoint). The contract, from vLLM 0.32's source
(vllm/distributed/kv_events.py `ZmqEventPublisher`, vllm/v1/core/block_pool.py):
  - each full block a prompt fills is published as `BlockStored` with that block's token ids
    and block size, each block chained to the one before by `parent_block_hash`;
  - frames are (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`);
  - the same prompt again stores no block: its blocks are found in the prefix cache;
  - the replay socket sends every buffered batch from a sequence number on, then END_SEQ.
And what the KV-aware prefill router (serving/engines/kv_router.py) builds on: Dynamo's
selection core (ai-dynamo-runtime's `SelectionService`, which Ray's KVTokenTracker owns),
registered with that server's endpoints after the prompt was cached, catches up through the
replay socket and scores the prompt's full blocks on that worker and none on another.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 300  # two full blocks of vLLM's CPU default (128) and a partial third


def _batches(sub, kv_batch, until_s: float) -> list[tuple[int, object]]:
    """(sequence number, KVEventBatch) received until `until_s` passes with nothing new."""
    import msgspec

    decoder = msgspec.msgpack.Decoder(type=kv_batch)
    got = []
    deadline = time.monotonic() + until_s
    while time.monotonic() < deadline:
        if sub.poll(200):
            _topic, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            deadline = time.monotonic() + until_s
    return got


def test_a_prompts_full_blocks_are_published_replayed_and_indexed(tmp_path):
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from bench.plain_vllm import vllm_server, wait_healthy
    from local.config import HOST, MODEL_ID, local_target
    from local.procs import free_port
    from local.tiny_model import ensure_tiny_model

    port, pub_port, replay_port = free_port(), free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # Bound on every interface, as Ray writes it (`tcp://*:<port>`): vLLM binds an endpoint
        # with a wildcard and connects to any other (kv_events.py `_is_bind_endpoint`).
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    extra = ["--enable-prefix-caching", "--kv-events-config", json.dumps(events_config)]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{HOST}:{pub_port}")
    root = f"http://{HOST}:{port}"
    prompt = [10 + (7 * i) % 400 for i in range(PROMPT_TOKENS)]
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        with vllm_server(
            str(ensure_tiny_model()),
            MODEL_ID,
            port,
            dict(local_target().engine_env),
            tmp_path / "vllm.log",
            extra_args=extra,
        ) as proc:
            wait_healthy(root, proc)
            _batches(sub, KVEventBatch, 1.0)  # whatever start-up published
            assert httpx.post(f"{root}/v1/completions", json=body, timeout=120).status_code == 200
            first = _batches(sub, KVEventBatch, 3.0)
            stored = [ev for _, b in first for ev in b.events if isinstance(ev, BlockStored)]
            assert stored, f"no BlockStored event for a {PROMPT_TOKENS}-token prompt: {first}"
            size = stored[0].block_size
            assert size > 0 and PROMPT_TOKENS // size >= 1, size
            blocks = [(h, ev) for ev in stored for h in ev.block_hashes]
            tokens = [t for ev in stored for t in ev.token_ids]
            # Every full block of the prompt (the partial last one is not stored), in order.
            assert len(blocks) == PROMPT_TOKENS // size
            assert tokens == prompt[: len(blocks) * size]
            assert stored[0].parent_block_hash is None
            for ev_before, ev in itertools.pairwise(stored):
                assert ev.parent_block_hash == ev_before.block_hashes[-1]

            # The same prompt again: its blocks are in the prefix cache, none stored anew.
            assert httpx.post(f"{root}/v1/completions", json=body, timeout=120).status_code == 200
            again = _batches(sub, KVEventBatch, 3.0)
            restored = {h for _, b in again for ev in b.events if isinstance(ev, BlockStored) for h in ev.block_hashes}
            assert not restored & {h for h, _ in blocks}, "a cached block was published as stored again"

            # A subscriber that missed them asks the replay socket from the first sequence number.
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"tcp://{HOST}:{replay_port}")
            start = first[0][0]
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            replayed = []
            while dealer.poll(5000):
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == ZmqEventPublisher.END_SEQ:
                    break
                replayed.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch)))
            else:
                raise AssertionError("the replay socket sent no END_SEQ")
            assert [(s, b.events) for s, b in replayed[: len(first)]] == [(s, b.events) for s, b in first]
            dealer.close(0)

            other = [11 + (13 * i) % 397 for i in range(PROMPT_TOKENS)]
            scores = asyncio.run(_dynamo_scores(root, pub_port, replay_port, size, prompt, other))
            full = PROMPT_TOKENS // size
            assert scores["cached"] == {1: full, 2: 0}, scores
            assert scores["other"] == {1: full, 2: 0}, scores  # sent after registering: live events
            assert scores["unseen"] == {1: 0, 2: 0}, scores
            assert scores["chosen"] == 1, scores
    finally:
        sub.close(0)


async def _dynamo_scores(root: str, pub_port: int, replay_port: int, block_size: int, cached, other) -> dict:
    """Dynamo's overlap scores (full blocks per worker) for the cached prompt, a prompt sent after
    registering, and one never sent; worker 1 is the server, worker 2 an endpoint nobody serves.
    The fields are the ones Ray's KVTokenTracker registers (kv_token_tracker.py `_upsert_worker`)."""
    from dynamo.llm import SelectionService

    from local.config import HOST, MODEL_ID
    from local.procs import free_port

    svc = SelectionService(indexer_threads=1)
    for worker, pub, replay in ((1, pub_port, replay_port), (2, free_port(), free_port())):
        await svc.upsert_worker(
            {
                "worker_id": worker,
                "model_name": MODEL_ID,
                "tenant_id": "default",
                "endpoint": f"ray://worker-{worker}",
                "block_size": block_size,
                "max_num_batched_tokens": 4096,
                "data_parallel_start_rank": 0,
                "data_parallel_size": 1,
                "kv_events_endpoints": {0: f"tcp://{HOST}:{pub}"},
                "replay_endpoint": f"tcp://{HOST}:{replay}",
            }
        )

    async def overlap(tokens) -> dict[int, int]:
        got = await svc.overlap_scores({"model_name": MODEL_ID, "tenant_id": "default", "token_ids": tokens})
        return {w["worker_id"]: w["device_blocks"] for w in got["workers"]}

    # A new prompt's events reach the listener with a sequence number past the one it expects:
    # it asks the replay socket for what it missed (the cached prompt's blocks).
    body = {"model": MODEL_ID, "prompt": other, "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as client:
        assert (await client.post(f"{root}/v1/completions", json=body)).status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        scores = {"cached": await overlap(cached), "other": await overlap(other)}
        if scores["cached"].get(1) and scores["other"].get(1):
            break
        await asyncio.sleep(0.2)
    scores["unseen"] = await overlap([3 + (5 * i) % 389 for i in range(len(cached))])
    chosen = await svc.select(
        {
            "model_name": MODEL_ID,
            "tenant_id": "default",
            "selection_id": "t",
            "token_ids": cached,
            "allowed_worker_ids": [1, 2],
        }
    )
    scores["chosen"] = chosen["worker_id"]
    svc.shutdown()
    return scores
