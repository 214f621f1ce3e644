"""Hybrid routing for real: the shared local stack, and vLLM's own server as the external provider.

The provider (local.provider) is plain vLLM serving the tiny model under another
name, behind a proxy that records every request it gets and accepts only the provider key.
Each phase hands the `llm` app's ingress a new user_config (a lightweight Serve update: no
engine restarts) and puts the original back at the end. The kill test runs after every
non-disruptive test and waits for the engines to be back before it returns.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import signal
import time

import httpx
import pytest

from bench import hops
from bench.sse import Streamed, stream_request
from local.cluster import set_ingress_user_config
from local.provider import EXTERNAL_MODEL, PROVIDER_KEY
from serving.spec import INGRESS_DEPLOYMENT, key_id
from tests.conftest import E2E_KEY, E2E_KEY_2, E2E_RPM_KEY

pytestmark = pytest.mark.e2e
APP = "llm"
KILL_WINDOW_S = float(os.environ.get("PD_HYBRID_KILL_WINDOW_S", "60"))


def set_user_config(stack, user_config: dict, timeout: float = 120) -> None:
    """PUT the stack's own config with the ingress's user_config replaced; wait until applied."""
    set_ingress_user_config(stack.state["dashboard_url"], stack.state["config"], APP, user_config, timeout)


def base_user_config(stack) -> dict:
    app = next(a for a in stack.state["config"]["applications"] if a["name"] == APP)
    return next(d["user_config"] for d in app["deployments"] if d["name"] == INGRESS_DEPLOYMENT)


def with_fallback(stack, provider, **over) -> dict:
    cfg = copy.deepcopy(base_user_config(stack))
    cfg["fallback"] = {
        "base_url": provider.url,
        "models": {stack.model: EXTERNAL_MODEL},
        "when": ["unavailable", "overloaded", "deadline"],
        "overflow_at": 64,
        "first_token_timeout_s": 30,
        "timeout_s": 120,
        "connect_timeout_s": 5,
        "retries": 2,
        "api_key_env": "PD_FALLBACK_API_KEY",
        **over,
    }
    return cfg


@pytest.fixture(scope="module")
def restore(stack):
    yield
    set_user_config(stack, base_user_config(stack))


def _metrics(stack) -> str:
    head = next(n for n in stack.nodes if n["label"] == "head")
    return httpx.get(head["metrics_url"], timeout=10).text


def usage_totals(stack, kid: str, destination: str) -> dict[str, float]:
    samples = hops.parse_prometheus(_metrics(stack))
    want = {"key": kid, "destination": destination, "application": APP}
    out = {}
    for name in ("pd_usage_requests", "pd_usage_prompt_tokens", "pd_usage_completion_tokens"):
        out[name] = sum(
            value
            for series, labels, value in samples
            if series in (f"ray_{name}", f"ray_{name}_total") and all(labels.get(k) == v for k, v in want.items())
        )
    return out


def settled_usage(stack, kid, destination, expect_requests: float, limit_s: float = 60) -> dict[str, float]:
    """Ray exports metrics every few seconds: read until the request count arrives."""
    deadline = time.monotonic() + limit_s
    while True:
        now = usage_totals(stack, kid, destination)
        if now["pd_usage_requests"] >= expect_requests or time.monotonic() > deadline:
            time.sleep(6)  # one more export period, for the token counters of the last request
            return usage_totals(stack, kid, destination)
        time.sleep(2)


def _openai(stack, key=E2E_KEY):
    from openai import OpenAI

    return OpenAI(base_url=stack.urls["disaggregated"], api_key=key, max_retries=0, timeout=120)


def test_streams_through_the_fallback_in_openai_format_and_usage_is_metered(stack, provider, restore):
    # A first-token deadline no engine can meet: every stream goes to the provider.
    set_user_config(stack, with_fallback(stack, provider, when=["deadline"], first_token_timeout_s=0.001))
    kid = key_id(E2E_KEY)
    before = usage_totals(stack, kid, "fallback")
    provider.clear()
    client = _openai(stack)
    prompt, completion, n = 0, 0, 0
    with client.chat.completions.with_streaming_response.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as raw:
        assert raw.headers["x-served-by"] == "fallback"
        chunks = list(raw.parse())
    assert {c.model for c in chunks} == {stack.model}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage and usage.completion_tokens == 12
    prompt, completion, n = prompt + usage.prompt_tokens, completion + usage.completion_tokens, n + 1

    # A client that did not ask for usage does not get the usage event; it is still counted.
    with client.completions.with_streaming_response.create(
        model=stack.model,
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as raw:
        assert raw.headers["x-served-by"] == "fallback"
        chunks = list(raw.parse())
    assert all(c.usage is None for c in chunks) and {c.model for c in chunks} == {stack.model}
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    n += 1
    completion += 7
    sent = [r.body for r in provider.records]
    assert [b["model"] for b in sent] == [EXTERNAL_MODEL, EXTERNAL_MODEL]
    assert all(b["stream_options"]["include_usage"] is True for b in sent)
    # The provider's own count of the second prompt, asked directly.
    p2 = httpx.post(
        f"{provider.vllm_url}/completions",
        json={"model": EXTERNAL_MODEL, "prompt": "Once upon a time", "max_tokens": 1},
        timeout=60,
    ).json()
    prompt += p2["usage"]["prompt_tokens"]

    after = settled_usage(stack, kid, "fallback", before["pd_usage_requests"] + n)
    assert after["pd_usage_requests"] - before["pd_usage_requests"] == n
    assert after["pd_usage_prompt_tokens"] - before["pd_usage_prompt_tokens"] == prompt
    assert after["pd_usage_completion_tokens"] - before["pd_usage_completion_tokens"] == completion


def test_cluster_answers_are_marked_and_metered_too(stack, provider, restore):
    set_user_config(stack, with_fallback(stack, provider))
    kid = key_id(E2E_KEY)
    before = usage_totals(stack, kid, "cluster")
    provider.clear()
    r = httpx.post(
        f"{stack.urls['disaggregated']}/completions",
        headers={"Authorization": f"Bearer {E2E_KEY}"},
        json={"model": stack.model, "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-served-by"] == "cluster"
    assert provider.records == []
    u = r.json()["usage"]
    after = settled_usage(stack, kid, "cluster", before["pd_usage_requests"] + 1)
    assert after["pd_usage_prompt_tokens"] - before["pd_usage_prompt_tokens"] == u["prompt_tokens"]
    assert after["pd_usage_completion_tokens"] - before["pd_usage_completion_tokens"] == u["completion_tokens"]


def test_429_per_key_with_retry_after(stack, provider, restore):
    cfg = with_fallback(stack, provider)
    cfg["limits"] = {**cfg["limits"], "keys": {key_id(E2E_RPM_KEY): {"requests_per_minute": 3, "tokens_per_minute": 0}}}
    set_user_config(stack, cfg)
    url = f"{stack.urls['disaggregated']}/completions"
    body = {"model": stack.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0}

    def post(key):
        return httpx.post(url, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=120)

    codes = [post(E2E_RPM_KEY).status_code for _ in range(3)]
    refused = post(E2E_RPM_KEY)
    assert codes == [200, 200, 200]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    # Another key is not affected.
    assert post(E2E_KEY).status_code == 200
    deadline = time.monotonic() + 30
    while not any(
        "pd_rate_limited" in name and key_id(E2E_RPM_KEY) in labels.values()
        for name, labels, _ in hops.parse_prometheus(_metrics(stack))
    ):
        assert time.monotonic() < deadline, "pd_rate_limited_requests never showed the refused key"
        time.sleep(2)


def _burst(stack, n: int, max_tokens: int = 24) -> list[Streamed]:
    url = f"{stack.urls['disaggregated']}/completions"
    body = {
        "model": stack.model,
        "prompt": "Tell me a story about a cat",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }

    async def go():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {E2E_KEY}"}, timeout=180) as c:
            return await asyncio.gather(*(stream_request(c, url, body) for _ in range(n)))

    return asyncio.run(go())


def test_overflow_under_a_burst_sends_what_is_over_overflow_at_to_the_fallback(stack, provider, restore):
    # overflowAt 2 with one decode replica: at most 2 of a burst's requests are the cluster's.
    set_user_config(stack, with_fallback(stack, provider, when=["overloaded"], overflow_at=2))
    unloaded = [_burst(stack, 1)[0] for _ in range(5)]
    assert [r.served_by for r in unloaded] == ["cluster"] * 5, "one request at a time is under overflowAt"
    results = _burst(stack, 10)
    assert all(r.ok for r in results), [(r.kind, r.error) for r in results if not r.ok]
    served = [r.served_by for r in results]
    assert set(served) == {"cluster", "fallback"}, served
    assert served.count("cluster") <= 2 + 1, served  # overflowAt per decode replica, plus a racing one
    # What the overflow does to the cluster's own TTFT is a speed figure: `make bench`'s hybrid
    # scenario (bench/hybrid.py) measures it against the unloaded TTFT.


def test_provider_failure_gives_our_error_with_the_reason(stack, provider, restore):
    set_user_config(stack, with_fallback(stack, provider, when=["deadline"], first_token_timeout_s=0.001))
    provider.fail_with = 500
    try:
        r = httpx.post(
            f"{stack.urls['disaggregated']}/completions",
            headers={"Authorization": f"Bearer {E2E_KEY}"},
            json={"model": stack.model, "prompt": "Hi", "max_tokens": 2, "stream": True},
            timeout=120,
        )
    finally:
        provider.fail_with = None
    err = r.json()["error"]
    # A deadline that the fallback cannot rescue either is a 504 (503 for the other reasons).
    assert r.status_code == 504 and r.headers["x-served-by"] == "fallback"
    assert "deadline" in err["message"] and "provider internal detail" not in err["message"]
    assert err["code"] == "fallback_failed"


def test_no_client_key_ever_reached_the_provider(stack, provider, restore):
    """Every request the provider gets, whichever client key, path and shape sent it. Streams
    only: the deadline rule (a first-token budget no engine meets) applies to streams."""
    set_user_config(stack, with_fallback(stack, provider, when=["deadline"], first_token_timeout_s=0.001))
    provider.clear()
    url = stack.urls["disaggregated"]
    for key in (E2E_KEY, E2E_KEY_2):
        for path, body in (
            ("/completions", {"prompt": "Hi", "stream": True}),
            ("/completions", {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}),
            ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
        ):
            r = httpx.post(
                url + path,
                headers={"Authorization": f"Bearer {key}"},
                json={"model": stack.model, "max_tokens": 2, **body},
                timeout=120,
            )
            assert r.status_code == 200 and r.headers["x-served-by"] == "fallback", (path, body, r.text[:200])
    assert len(provider.records) >= 6, "the provider did not get every fallback request"
    for rec in provider.records:
        dump = repr(rec.headers) + repr(rec.body)
        assert E2E_KEY not in dump and E2E_KEY_2 not in dump
        assert rec.headers["authorization"] == f"Bearer {PROVIDER_KEY}"
        # Only what our client sets (plus what HTTP itself adds).
        assert set(rec.headers) <= {
            "authorization",
            "user-agent",
            "accept",
            "content-type",
            "content-length",
            "host",
            "accept-encoding",
            "connection",
        }, rec.headers


def _engine_pids(app: str) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(["cmdline", "name"]):
        title = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if re.search(rf"ServeReplica:{app}:(Prefill|Decode)\b", title):
            pids.append(p.pid)
    return pids


@pytest.mark.disruptive
def test_with_every_engine_killed_every_request_is_answered_and_the_fallback_takes_over(stack, provider, restore):
    set_user_config(stack, with_fallback(stack, provider))
    pids = _engine_pids(APP)
    assert len(pids) >= 2, "no Prefill/Decode replica processes found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    url = f"{stack.urls['disaggregated']}/completions"
    results: list[tuple[float, int, str | None, str]] = []  # (sent, status, x-served-by, body head)

    async def one(client, i):
        body = {
            "model": stack.model,
            "prompt": f"request {i}",
            "max_tokens": 8,
            "temperature": 0,
            "stream": bool(i % 2),
        }
        sent = time.monotonic()
        r = await client.post(url, json=body)
        results.append((sent, r.status_code, r.headers.get("x-served-by"), r.text[:200]))

    async def load():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {E2E_KEY}"}, timeout=120) as c:
            i = 0
            while time.monotonic() - killed_at < KILL_WINDOW_S:
                await asyncio.gather(one(c, i), one(c, i + 1))
                i += 2

    asyncio.run(load())
    bad = [r for r in results if r[1] != 200]
    assert not bad, bad[:3]
    # The first requests after the kill cannot reach an engine (a vLLM engine restarts in tens
    # of seconds on this CPU): the fallback served them. Later ones may be the cluster's again.
    first = sorted(results)[:2]
    assert [served for _, _, served, _ in first] == ["fallback", "fallback"], first
    assert {served for _, _, served, _ in results} <= {"fallback", "cluster"}

    # Restore health before returning: Serve restarts the replicas; wait for a cluster answer.
    set_user_config(stack, base_user_config(stack))
    deadline = time.monotonic() + 300
    while True:
        try:
            r = httpx.post(
                url,
                headers={"Authorization": f"Bearer {E2E_KEY}"},
                json={"model": stack.model, "prompt": "back?", "max_tokens": 2},
                timeout=60,
            )
            if r.status_code == 200 and r.headers.get("x-served-by") == "cluster":
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the engines did not come back within 5 minutes"
        time.sleep(3)
