"""serving/ingress/sse.py: OpenAI event streams re-emitted (usage, model id, internals)."""

from __future__ import annotations

import json

from serving.ingress.sse import SseRewriter, estimated_usage


def test_a_client_that_asked_for_usage_gets_it():
    r = SseRewriter(model="ours", keep_usage_event=True)
    out = r.feed('data: {"model":"m","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3}}\n\ndata: [DO')
    out += r.feed("NE]\n\n")
    assert json.loads(out[0][6:])["usage"]["completion_tokens"] == 3 and out[1] == "data: [DONE]\n\n"
    assert r.usage.completion_tokens == 3 and r.done


def test_engine_coordinates_in_a_stream_never_reach_the_client():
    r = SseRewriter(model=None, keep_usage_event=True)
    out = r.feed(
        'data: {"model":"m","choices":[{"text":"a","finish_reason":"stop"}],'
        '"kv_transfer_params":{"remote_host":"10.0.0.7","remote_port":5600}}\n\n'
    )
    assert "remote_host" not in out[0] and "kv_transfer_params" not in out[0]


def test_a_stream_without_usage_is_counted_from_its_text():
    r = SseRewriter(model=None, keep_usage_event=False)
    r.feed('data: {"choices":[{"delta":{"content":"abcdefgh"}}]}\n\ndata: {"choices":[{"delta":{"content":"ij"}}]}\n\n')
    # 10 characters at 4 a token, rounded up (the estimate serving.ingress.limits reserves by).
    assert estimated_usage(r).completion_tokens == 3 and not r.usage.seen
