"""local/provider.py: the stand-in provider's paced backend, read by OpenAI's own client.

The paced backend is what `make bench`'s hybrid scenario measures against by default, so its
answers must be what a real provider sends (the `openai` client parses them), arrive no
sooner than its pace says, and be refused without the provider key, as a real one would.
"""

from __future__ import annotations

import time

import openai
import pytest

from local.provider import EXTERNAL_MODEL, PROVIDER_KEY, Backend, Pace, running_provider

PACE = Pace(ttft_s=0.2, tokens_per_s=100.0)


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    log = tmp_path_factory.mktemp("provider") / "provider.log"
    with running_provider("unused", log, backend=Backend.PACED, pace=PACE, timeout=30) as a:
        yield a


def _client(provider, key=PROVIDER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=provider.url, api_key=key, max_retries=0, timeout=30)


def test_streamed_completion_is_paced_and_metered(provider):
    provider.clear()
    t0 = time.monotonic()
    stream = _client(provider).completions.create(
        model=EXTERNAL_MODEL,
        prompt="one two three four",
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage, first_at = [], None, None
    for chunk in stream:
        if chunk.choices:
            first_at = first_at or time.monotonic() - t0
            texts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    elapsed = time.monotonic() - t0
    assert len(texts) == 10 and all(texts)
    assert first_at is not None and first_at >= PACE.ttft_s
    assert elapsed >= PACE.ttft_s + 9 / PACE.tokens_per_s
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, 10)
    assert provider.records[-1].body["model"] == EXTERNAL_MODEL


def test_chat_streamed_and_not(provider):
    c = _client(provider)
    msgs = [{"role": "user", "content": "say hi"}]
    whole = c.chat.completions.create(model=EXTERNAL_MODEL, messages=msgs, max_tokens=5)
    assert whole.choices[0].message.content and len(whole.choices[0].message.content.split()) == 5
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    parts = [
        ch.choices[0].delta.content
        for ch in c.chat.completions.create(model=EXTERNAL_MODEL, messages=msgs, max_tokens=3, stream=True)
        if ch.choices
    ]
    assert "".join(p or "" for p in parts) == whole.choices[0].message.content.rsplit(" ", 2)[0]
    assert whole.choices[0].finish_reason == "length"


def test_a_wrong_key_is_refused_and_recorded(provider):
    provider.clear()
    with pytest.raises(openai.AuthenticationError):
        _client(provider, key="sk-client-key").completions.create(model=EXTERNAL_MODEL, prompt="x", max_tokens=1)
    assert provider.records[-1].headers["authorization"] == "Bearer sk-client-key"
