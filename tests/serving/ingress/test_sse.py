"""serving/ingress/sse.py: OpenAI event streams re-emitted (usage, model id, internals)."""

from __future__ import annotations

import json
import re

from hypothesis import given
from hypothesis import strategies as st

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


# --- the one decoder and encoder ----------------------------------------------------------------
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(_JSON)
def test_an_event_is_written_as_the_standard_library_writes_it_in_utf8(doc):
    """The stream's encoder (msgspec's) writes what json.dumps writes, compact and in UTF-8
    (vLLM's own server writes UTF-8), but for how a float is spelt (1e16 and 0.00001, not
    1e+16 and 1e-05: the same numbers); and reads back what it wrote."""
    import json

    from serving.ingress.sse import encode, parse_event

    text = encode(doc)
    assert json.loads(text) == doc
    assert parse_event(f"data: {text}").doc == doc
    std = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    assert _floats_alike(text) == _floats_alike(std)


def _floats_alike(text: str) -> str:
    """Every float spelt as Python's repr spells it: msgspec writes 1e16, 1e-7 and 0.00001
    where the standard library writes 1e+16, 1e-07 and 1e-05 (the same numbers). Only number
    tokens outside string literals are rewritten, so a difference in a string still shows."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    number = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
    for k in range(0, len(parts), 2):  # even parts lie outside string literals
        parts[k] = number.sub(lambda m: m[0] if m[0].lstrip("-").isdigit() else repr(float(m[0])), parts[k])
    return "".join(parts)


def test_what_msgspec_refuses_reads_and_writes_as_before():
    """An integer past 64 bits, a NaN literal: the standard library's decoder and encoder, so
    no event reads differently than it did."""
    import math

    from serving.ingress.sse import NOT_JSON, encode, parse_event

    assert parse_event('data: {"n":123456789012345678901234567890}').doc == {"n": 123456789012345678901234567890}
    assert math.isnan(parse_event('data: {"x":NaN}').doc["x"])
    assert parse_event("data: {not json").doc is NOT_JSON
    assert parse_event("data: " + "[" * 100_000).doc is NOT_JSON  # past any parser's depth
    assert encode({"n": 2**70}) == '{"n":1180591620717411303424}'
