"""The front door's request shapes on the running local stack (the shared e2e stack).

Each test sends what a client may send and checks both the answer and the state the stack is
left in: a list of prompts answered as each alone and prefilled on decode by design; a request
error only the engine sees returned to the client and never counted against the prefill
circuit (the stack still prefills remotely afterwards); a key's token window left as it was
after an engine refusal; a streamed echo that keeps its prompt; an empty adapter name and a
64 MB body refused before any engine; vLLM's operational routes answered without a key.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from bench import hops
from serving.core.metrics import PREFILL_PATH
from serving.spec import key_id
from tests.conftest import E2E_KEY, E2E_TPM_KEY
from tests.serving.ingress.test_routing_e2e import base_user_config, set_user_config

pytestmark = pytest.mark.e2e

# About 300 tokens of the tiny model's tokenizer (its context is 1024): long beside "Hello there".
LONG = " ".join(f"word{i % 50}" for i in range(64))


@pytest.fixture(scope="module")
def restore(stack):
    yield
    set_user_config(stack, base_user_config(stack))


def _post(stack, path, body, key=E2E_KEY, **kw):
    return httpx.post(
        f"{stack.urls['disaggregated']}{path}", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=180, **kw
    )


def _paths(stack) -> dict[tuple[str, str], float]:
    """pd_prefill_path by (path, reason), summed over the decode replicas."""
    out: dict[tuple[str, str], float] = {}
    for node in stack.nodes:
        for name, labels, value in hops.parse_prometheus(httpx.get(node["metrics_url"], timeout=20).text):
            if name == PREFILL_PATH.prometheus and labels.get("application") == "llm":
                key = (labels.get("path", ""), labels.get("reason", ""))
                out[key] = out.get(key, 0.0) + value
    return out


def _paths_after(stack, before, want: dict[tuple[str, str], float], limit_s: float = 60):
    """Ray exports metrics every few seconds: read until the expected increments arrive."""
    deadline = time.monotonic() + limit_s
    while True:
        now = _paths(stack)
        delta = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in set(now) | set(before)}
        if all(delta.get(k, 0.0) >= v for k, v in want.items()) or time.monotonic() > deadline:
            return delta
        time.sleep(2)


def test_a_list_of_prompts_is_answered_as_each_alone_and_prefilled_on_decode_by_design(stack):
    prompts = ["Hello there", LONG]
    alone = []
    for p in prompts:
        r = _post(stack, "/completions", {"model": stack.model, "prompt": p, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        alone.append(r.json()["choices"][0]["text"])
    before = _paths(stack)
    r = _post(stack, "/completions", {"model": stack.model, "prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == alone
    delta = _paths_after(stack, before, {("local", "prompt_batch"): 1})
    assert delta.get(("local", "prompt_batch")) == 1  # one request, prefilled on decode by design
    assert delta.get(("local", "replica_died"), 0) == 0 and delta.get(("remote_retry", ""), 0) == 0


def test_request_errors_only_the_engine_sees_are_the_clients_and_leave_p_d_on(stack):
    """top_k -5 passes our allow-list and vLLM's request model, and vLLM's sampling params
    refuse it: a 400, on prefill first. Five of them: no retry, no local prefill, and the next
    good request is still prefilled remotely (the circuit never opened)."""
    before = _paths(stack)
    bad = {"model": stack.model, "prompt": "Hi", "max_tokens": 4, "top_k": -5}
    for _ in range(5):
        r = _post(stack, "/completions", bad)
        assert r.status_code == 400, r.text
        assert "top_k" in r.json()["error"]["message"]
    good = _post(stack, "/completions", {"model": stack.model, "prompt": "Hi", "max_tokens": 4})
    assert good.status_code == 200
    delta = _paths_after(stack, before, {("remote", ""): 1})
    assert delta.get(("remote", ""), 0) >= 1
    assert not {k: v for k, v in delta.items() if k[0] != "remote" and v}, delta


def test_an_engine_refusal_leaves_the_keys_token_window_as_it_was(stack, restore):
    """Fail closed no more: the reservation of a request the engine refuses is settled to 0,
    so the key's next request fits its tokens per minute."""
    cfg = json.loads(json.dumps(base_user_config(stack)))
    cfg["limits"] = {
        **cfg["limits"],
        "keys": {key_id(E2E_TPM_KEY): {"requests_per_minute": 0, "tokens_per_minute": 600}},
    }
    set_user_config(stack, cfg)
    bad = {"model": stack.model, "prompt": "Hi", "max_tokens": 500, "top_k": -5}  # reserves 501 of 600
    assert _post(stack, "/completions", bad, key=E2E_TPM_KEY).status_code == 400
    small = {"model": stack.model, "prompt": "Hi", "max_tokens": 200}  # 201 more: over 600 had 501 stayed
    r = _post(stack, "/completions", small, key=E2E_TPM_KEY)
    assert r.status_code == 200, r.text


def test_a_streamed_echo_keeps_its_prompt(stack):
    body = {"model": stack.model, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "echo": True}
    whole = _post(stack, "/completions", body).json()["choices"][0]["text"]
    text = ""
    with httpx.stream(
        "POST",
        f"{stack.urls['disaggregated']}/completions",
        headers={"Authorization": f"Bearer {E2E_KEY}"},
        json={**body, "stream": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
    assert whole.startswith("Once upon a time") and text == whole


def test_an_empty_adapter_name_and_a_64_mb_body_are_refused_before_any_engine(stack):
    r = _post(stack, "/chat/completions", {"model": f"{stack.model}:", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    big = b'{"model": "%s", "prompt": "' % stack.model.encode() + b"x" * (64 << 20) + b'"}'
    r = httpx.post(
        f"{stack.urls['disaggregated']}/completions",
        headers={"Authorization": f"Bearer {E2E_KEY}", "Content-Type": "application/json"},
        content=big,
        timeout=180,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # and the stack serves on
    assert _post(stack, "/completions", {"model": stack.model, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_vllms_operational_routes_answer_without_a_key(stack):
    base = stack.urls["disaggregated"].rsplit("/v1", 1)[0]
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{base}/ping", timeout=30).status_code == 200
    assert httpx.get(f"{base}/version", timeout=30).json()["version"]
    r = httpx.post(f"{base}/v1/responses", headers={"Authorization": f"Bearer {E2E_KEY}"}, json={}, timeout=30)
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
