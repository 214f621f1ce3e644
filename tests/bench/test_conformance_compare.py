"""bench/conformance_compare.py: two answers compared as a client reads them.

Hand-built answers in vLLM 0.32's OpenAI format (chat_completion/serving.py and
completion/serving.py: ids, `created`, chunked deltas, a usage event, [DONE]); each test
changes one thing a client would notice, or one thing it would not.
"""

from __future__ import annotations

import json

from bench.conformance_compare import Answer, answer_of, differences


def _chat(content="hello world", *, rid="chatcmpl-1", finish="stop", usage=(5, 2), calls=None, logprob=-0.5):
    msg = {"role": "assistant", "content": content}
    if calls is not None:
        msg["tool_calls"] = calls
    doc = {
        "id": rid,
        "object": "chat.completion",
        "created": 1,
        "model": "tiny-llama",
        "choices": [
            {
                "index": 0,
                "message": msg,
                "finish_reason": finish,
                "logprobs": {"content": [{"token": "hello", "logprob": logprob, "top_logprobs": []}]},
            }
        ],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
        "kv_transfer_params": None,
    }
    return Answer(200, doc=doc, text=json.dumps(doc))


def _stream(pieces, *, rid="cmpl-1", ids=None, done=1, usage=True):
    events = []
    for i, p in enumerate(pieces):
        events.append(
            {
                "id": (ids or [rid] * len(pieces))[i],
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "text": p, "finish_reason": "length" if i == len(pieces) - 1 else None}],
            }
        )
    if usage:
        events.append(
            {
                "id": rid,
                "object": "text_completion",
                "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)},
            }
        )
    raw = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n" * done
    return answer_of(200, "text/event-stream", raw)


def test_the_same_answer_from_two_servers_has_no_difference():
    assert differences(_chat(), _chat(rid="chatcmpl-other")) == []


def test_a_different_text_finish_or_usage_is_a_difference():
    assert any("content" in d for d in differences(_chat(), _chat("hello there")))
    assert any("finish_reason" in d for d in differences(_chat(), _chat(finish="length")))
    assert any("usage" in d for d in differences(_chat(), _chat(usage=(5, 3))))


def test_logprobs_agree_within_the_tolerance_only():
    assert differences(_chat(logprob=-0.5), _chat(logprob=-0.5004)) == []
    assert differences(_chat(logprob=-0.5), _chat(logprob=-0.51)) != []


def test_tool_calls_compare_by_name_and_parsed_arguments_not_by_id():
    def call(cid, args):
        return [{"id": cid, "type": "function", "function": {"name": "f", "arguments": args}}]

    assert differences(_chat(calls=call("a", '{"x": 1}')), _chat(calls=call("b", '{ "x":1 }'))) == []
    assert differences(_chat(calls=call("a", '{"x": 1}')), _chat(calls=call("a", '{"x": 2}'))) != []


def test_a_stream_is_compared_joined_whatever_its_chunking():
    assert differences(_stream(["he", "llo"]), _stream(["hel", "lo"], rid="cmpl-2")) == []
    assert any("text" in d for d in differences(_stream(["he", "llo"]), _stream(["he", "llx"])))


def test_two_ids_in_one_stream_two_dones_or_no_usage_are_differences():
    assert any("one_id" in d for d in differences(_stream(["a", "b"]), _stream(["a", "b"], ids=["x", "y"])))
    assert any("done" in d for d in differences(_stream(["a", "b"]), _stream(["a", "b"], done=2)))
    assert any("usage" in d for d in differences(_stream(["a", "b"]), _stream(["a", "b"], usage=False)))


def test_two_refusals_with_one_status_are_the_same_answer_and_a_refusal_is_not_an_answer():
    bad = answer_of(400, "application/json", json.dumps({"error": {"message": "ours", "code": 400}}))
    theirs = answer_of(400, "application/json", json.dumps({"object": "error", "message": "theirs"}))
    assert differences(theirs, bad) == []
    assert differences(_chat(), bad) == ["status: 200 != 400"]


def test_engine_internal_fields_in_our_answer_are_a_difference():
    ours = _chat()
    ours.doc["kv_transfer_params"] = {"remote_host": "10.0.0.1"}
    assert any("internal" in d for d in differences(_chat(), ours))


def _sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_a_refusal_as_a_status_or_as_a_stream_of_its_one_error_event_is_one_answer():
    """Plain vLLM refuses a streamed prompt its engine rejects inside the stream (a 200, one
    error event, [DONE]); P/D knows it before the first byte and answers the status."""
    err = {"error": {"message": "The decoder prompt cannot be empty", "type": "BadRequestError", "code": 400}}
    in_stream = answer_of(200, "text/event-stream", _sse(err))
    as_status = answer_of(400, "application/json", json.dumps(err))
    assert differences(in_stream, as_status) == []
    # another code, a stream that says more than its error, or a server error are answers apart
    assert differences(in_stream, answer_of(404, "application/json", json.dumps(err))) != []
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    assert differences(answer_of(200, "text/event-stream", _sse(chunk, err)), as_status) != []
    server_err = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    assert differences(answer_of(200, "text/event-stream", _sse(server_err)), answer_of(500, "", "")) != []


def test_no_answer_says_what_the_transport_said():
    from bench.conformance_compare import Answer

    diffs = differences(answer_of(200, "application/json", "{}"), Answer(599, text="ReadTimeout: timed out"))
    assert diffs == ["status: 200 != 599 (ReadTimeout: timed out)"]
