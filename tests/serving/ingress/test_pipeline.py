"""serving/ingress/pipeline.py: every request shape through every step, and the state it leaves.

Driven through the front door with the relay replaced (tests/serving/ingress/test_routing.py's
harness) or through the real deployment class with a fake engine handle
(tests/serving/test_app.py's): no Ray started.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse, StreamingResponse

from serving.core.failures import EngineRefused, Reason, Unservable
from serving.ingress.catalog import ModelNotFound, Models, redact_storage
from serving.ingress.fields import MAX_N, openai_fields, refused_field
from serving.ingress.limits import Decision, KeyLimit, SlidingWindows, estimate_tokens
from serving.ingress.pipeline import MAX_JSON_DEPTH
from tests.serving.ingress.test_routing import _limited, _Request, _routing, _run
from tests.serving.test_app import CHAT, KEY, error_of, make_ingress, make_request, run


# --- limits: reserve what a request may cost, settle exactly once -----------------------------
def test_a_request_without_max_tokens_reserves_what_the_context_leaves():
    body = {"prompt": "abcd" * 25}  # 25 tokens
    assert estimate_tokens(body, context_len=1000) == 25 + 975
    assert estimate_tokens({**body, "n": 3}, context_len=1000) == 25 + 3 * 975
    # a cap bounds it; every prompt of a batch counts, each with its own output
    assert estimate_tokens({"prompt": ["abcd", "abcdabcd"], "max_tokens": 10}) == (1 + 10) + (2 + 10)
    assert estimate_tokens({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1, "n": 2}) == (3 + 2) + (2 + 2)


def test_tool_definitions_and_documents_count_as_prompt():
    plain = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert estimate_tokens({**plain, "tools": tools}) > estimate_tokens(plain) + 10
    assert estimate_tokens({**plain, "documents": [{"text": "x" * 400}]}) >= estimate_tokens(plain) + 100


def test_the_tool_fields_are_served_and_go_to_the_fallback():
    """tools, tool_choice (auto, required, none, a named function) and parallel_tool_calls are
    OpenAI's: accepted for chat, and sent to an external provider as they are."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ("auto", "required", "none", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": [], "tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
        assert refused_field("chat", body) is None
        assert openai_fields("chat", body) == body
    assert refused_field("completions", {"prompt": "x", "tools": tools}) is not None


def test_concurrent_admissions_cannot_spend_a_minute_many_times_over():
    """50 requests at once under 1000 tokens a minute, each of which may cost 300: only the
    ones whose reservations fit are admitted (the defect: all 50 were)."""
    w = SlidingWindows()
    lim = KeyLimit(tokens_per_minute=1000)
    admitted = [w.admit("k", 0.0, lim, estimate_tokens({"prompt": "x" * 40}, context_len=300)).ok for _ in range(50)]
    assert sum(admitted) == 3  # 3 x 300 <= 1000 < 4 x 300


def test_a_request_that_can_never_fit_says_so():
    w = SlidingWindows()
    d = w.admit("k", 0.0, KeyLimit(tokens_per_minute=1000), 4096)
    assert not d.ok and d.limit == "tpm" and "max_tokens" in d.message and "4096" in d.message


OUTCOMES = ("json", "stream", "stream_cut", "engine_400", "unservable", "unservable_fallback", "crash")


def _cluster(outcome: str):
    async def call(body):
        if outcome == "json":
            return JSONResponse({"model": "ours", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}})
        if outcome in ("stream", "stream_cut"):

            async def gen():
                yield 'data: {"model":"ours","choices":[{"text":"a"}],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
                if outcome == "stream":
                    yield 'data: {"model":"ours","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
                    yield "data: [DONE]\n\n"
                else:
                    await asyncio.sleep(30)

            return StreamingResponse(gen(), media_type="text/event-stream")
        if outcome == "engine_400":
            raise EngineRefused(400, "This model's maximum context length is 1024 tokens.")
        if outcome in ("unservable", "unservable_fallback"):
            raise Unservable(Reason.DEADLINE, 1)
        raise RuntimeError("boom")

    return call


@settings(max_examples=60, deadline=None)
@given(outcomes=st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=6))
def test_every_admitted_request_is_settled_exactly_once_whatever_its_fate(outcomes):
    """The state the system returns to: after any sequence of answers, refusals, cut streams,
    fallbacks and failures, each admission's reservation was settled once (never left in the
    window, never twice), and nothing is left in flight."""
    mp = pytest.MonkeyPatch()
    try:
        r, _, _ = _routing(mp, when=("deadline",))
        base_cfg = r.router.fallback.config
        settled: list[tuple] = []
        admitted: list[Decision] = []

        async def admit(kid, model, body, context_len=None, *, budget=True):
            d = Decision(True, ticket=(len(admitted), 1))
            admitted.append(d)
            return d

        r.limiter.admit = admit
        r.limiter.settle = lambda kid, model, decision, used, spend=None: settled.append(decision.ticket)
        for outcome in outcomes:
            fallback = outcome == "unservable_fallback"
            r.router.fallback.config = replace(base_cfg, when=frozenset({"deadline"} if fallback else set()))

            async def go(outcome=outcome):
                stream = outcome.startswith("stream")
                body = {"model": "ours", "prompt": "x", "stream": stream}
                resp = await r.handle(_Request(), body, "completions", _cluster(outcome))
                if isinstance(resp, StreamingResponse):
                    it = resp.body_iterator.__aiter__()
                    if outcome == "stream_cut":
                        await it.__anext__()
                        await it.aclose()  # the client went away
                    else:
                        async for _ in it:
                            pass
                return resp

            asyncio.run(go())
        assert sorted(settled) == sorted(d.ticket for d in admitted)
        assert r.inflight.count() == 0
    finally:
        mp.undo()


def test_an_engine_refusal_leaves_nothing_in_the_window(monkeypatch):
    """Fail closed no more: an over-long prompt answered 400 by the engine under a small TPM
    does not turn the key's next small request into a 429."""
    r, _, _ = _routing(monkeypatch, fallback=False)
    ledger = _limited(r, {"tokens_per_minute": 100})
    resp, _ = _run(r, {"model": "ours", "prompt": "x" * 300, "max_tokens": 10}, _cluster("engine_400"))
    assert resp.status_code == 400
    resp, _ = _run(r, {"model": "ours", "prompt": "x" * 40, "max_tokens": 10}, _cluster("json"))
    assert resp.status_code == 200
    from serving.spec import key_id

    assert ledger.actor.totals(key_id("sk-client"), "ours") == (2, 5)  # 0 for the refused, 5 used


def test_the_reservation_is_sized_from_the_values_the_engine_reads(monkeypatch):
    """n "3" and max_tokens "5.0" are 3 and 5 to vLLM: the reservation was the prompt alone
    (int("5.0") failed, and n fell back to 1); a completion without max_tokens gets vLLM's
    default cap, not nothing."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    r, _, _ = _routing(monkeypatch, fallback=False)
    ledger = _limited(r, {"tokens_per_minute": 100_000})
    prompt = "x" * 40
    default_cap = CompletionRequest.model_fields["max_tokens"].default
    for body, sized in (
        ({"n": "3", "max_tokens": "5.0"}, {"n": 3, "max_tokens": 5}),
        ({"n": 2.0, "max_tokens": True}, {"n": 2, "max_tokens": 1}),
        ({}, {"max_tokens": default_cap}),
    ):
        ledger.calls.clear()
        resp, _ = _run(r, {"model": "ours", "prompt": prompt, **body}, _cluster("json"))
        assert resp.status_code == 200
        reserved = [c[5] for c in ledger.calls if c[0] == "admit"]
        assert reserved == [estimate_tokens({"prompt": prompt, **sized})]


async def _serve(resp, *, leave_after_first_chunk: bool) -> None:
    """Play the response to a client that goes away: before the stream's first chunk is asked
    for, or once the first chunk is on its way (the send never completes)."""
    first_chunk = asyncio.Event()
    if not leave_after_first_chunk:
        first_chunk.set()

    async def receive():
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()
            await asyncio.sleep(3600)
        elif not leave_after_first_chunk:
            await asyncio.sleep(3600)

    await resp({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send)


@pytest.mark.parametrize("leave_after_first_chunk", [False, True], ids=["before-the-stream", "mid-stream"])
def test_a_stream_the_client_leaves_is_settled_once_when_its_answer_ends(monkeypatch, leave_after_first_chunk):
    """Starlette cancels the sending task at a disconnect: a stream whose first chunk was never
    asked for never ran its own settle (its reservation stayed whole for a minute), and one
    suspended at its chunk settled only when the garbage collector closed it."""
    r, _, _ = _routing(monkeypatch, fallback=False)
    settled = []

    async def admit(kid, model, body, context_len=None, *, budget=True):
        return Decision(True, ticket="r-1")

    r.limiter.admit = admit
    r.limiter.settle = lambda kid, model, decision, used, spend=None: settled.append((decision.ticket, used))

    async def go():
        resp = await r.handle(
            _Request(), {"model": "ours", "prompt": "x", "stream": True}, "completions", _cluster("stream_cut")
        )
        assert isinstance(resp, StreamingResponse)
        await _serve(resp, leave_after_first_chunk=leave_after_first_chunk)
        return list(settled)  # as the answer's ASGI call ends, not when the loop shuts down

    # the usage of the first chunk (2 prompt + 1 completion tokens) once it was produced
    assert asyncio.run(go()) == [("r-1", 3 if leave_after_first_chunk else 0)]
    assert settled == [("r-1", 3 if leave_after_first_chunk else 0)]


# --- bounds: body size, n ---------------------------------------------------------------------------
def test_a_body_over_the_bound_is_413_before_it_is_read_whole(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    ingress._door.max_body_bytes = 1000
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    status, err = error_of(run(ingress.chat(make_request(big))))
    assert status == 413 and err["code"] == "request_too_large" and handle.calls == []
    # Announced by Content-Length: refused before a byte of the body is read.
    req = make_request(big)
    req.scope["headers"].append((b"content-length", b"5100"))
    req._receive = None  # reading the body would fail
    status, _ = error_of(run(ingress.chat(req)))
    assert status == 413


def test_n_is_bounded_as_openai_documents(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    assert run(ingress.chat(make_request({**CHAT, "n": MAX_N}))).status_code == 200
    status, err = error_of(run(ingress.chat(make_request({**CHAT, "n": 1000}))))
    assert status == 400 and err["param"] == "n" and len(handle.calls) == 1


@pytest.mark.parametrize("cap", [{"max_tokens": 3}, {"max_completion_tokens": "3"}])
def test_sampling_vllm_refuses_is_refused_before_any_route(monkeypatch, cap):
    """min_tokens over the cap: vLLM refuses it building the sampling (SamplingParams, 0.32:
    "min_tokens must be less than or equal to max_tokens"); the ingress refuses it as vLLM
    does before routing, so the fallback (which gets OpenAI's fields only, no min_tokens)
    never serves it. Within the cap it is served."""
    ingress, handle = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.chat(make_request({**CHAT, **cap, "min_tokens": 4}))))
    assert status == 400 and "min_tokens" in err["message"] and handle.calls == []
    assert run(ingress.chat(make_request({**CHAT, **cap, "min_tokens": 3}))).status_code == 200
    # a completion's cap is vLLM's default 16 when it gives none
    completion = {"model": "tiny", "prompt": "hi"}
    status, _ = error_of(run(ingress.completions(make_request({**completion, "min_tokens": 17}))))
    assert status == 400


def test_a_prompt_truncated_to_nothing_is_refused_before_any_route(monkeypatch):
    """truncate_prompt_tokens 0 leaves no prompt token, whatever the prompt: vLLM's engine
    refuses it ("The decoder prompt cannot be empty"); the fallback, which is not sent vLLM's
    fields, would have served the whole prompt."""
    ingress, handle = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.chat(make_request({**CHAT, "truncate_prompt_tokens": 0}))))
    assert status == 400 and err["param"] == "truncate_prompt_tokens" and handle.calls == []
    assert run(ingress.chat(make_request({**CHAT, "truncate_prompt_tokens": 5}))).status_code == 200


def _nested(depth: int):
    """A JSON array nested `depth` levels deep (itself included)."""
    doc: list = []
    for _ in range(depth - 1):
        doc = [doc]
    return doc


def _errors_logged():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ray.serve").addHandler(handler)
    return records, handler


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,  # the review's body: RecursionError in json.loads
        b'{"a":' * 100_000,
        json.dumps({**CHAT, "chat_template_kwargs": {"x": _nested(MAX_JSON_DEPTH - 1)}}).encode(),
        b'{"model": "tiny", "n": ' + b"1" * 5000 + b"}",  # past Python's int_max_str_digits
    ],
    ids=["100k-arrays", "100k-objects", "parsed-but-too-deep", "5000-digits"],
)
def test_a_body_that_does_not_parse_or_nests_too_deep_is_a_400_and_no_traceback(monkeypatch, raw):
    """The defect: a body of 100,000 `[` was a 500 with a traceback in the log (json.loads
    raises RecursionError, not JSONDecodeError). Plain vLLM answers each of these 400 (FastAPI
    0.136 routing.py: any exception parsing the body is "There was an error parsing the body")."""
    ingress, handle = make_ingress(monkeypatch)
    records, handler = _errors_logged()
    try:
        status, err = error_of(run(ingress.chat(make_request(raw))))
    finally:
        logging.getLogger("ray.serve").removeHandler(handler)
    assert status == 400 and err["code"] == "invalid_json" and handle.calls == []
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info]


def test_a_body_nested_as_deep_as_the_bound_is_served(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    # the body (1), chat_template_kwargs (2), then arrays down to the bound
    body = {**CHAT, "chat_template_kwargs": {"x": _nested(MAX_JSON_DEPTH - 2)}}
    assert run(ingress.chat(make_request(body))).status_code == 200 and len(handle.calls) == 1


def test_tokenize_and_detokenize_take_only_their_fields(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    req = make_request({"model": "tiny", "prompt": "hi", "priority": 5}, path="/tokenize")
    status, err = error_of(run(ingress.tokenize(req)))
    assert status == 400 and err["param"] == "priority" and handle.calls == []
    req = make_request({"model": "tiny", "tokens": [1], "vllm_xargs": {}}, path="/detokenize")
    status, err = error_of(run(ingress.detokenize(req)))
    assert status == 400 and err["param"] == "vllm_xargs"


def test_the_provider_never_sees_the_usage_stats_the_cluster_gets():
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    cluster = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert openai_fields("completions", cluster)["stream_options"] == {"include_usage": True}


# --- adapters -------------------------------------------------------------------------------------
class _Ingress:
    def __init__(self):
        self._model_cards = {"tiny": type("Card", (), {"metadata": {"max_request_context_length": 1024}})()}
        self._lora_paths = {"tiny": "s3://bucket/adapters"}
        self._default_serve_handles = {"tiny": type("H", (), {"deployment_name": "Decode"})()}
        self.configured = []

    def _get_configured_serve_handle(self, model):
        self.configured.append(model)
        return model


def test_an_adapter_must_exist_in_storage_before_any_engine_sees_it():
    listed = []

    def adapters(path, base):
        listed.append(path)
        return [f"{base}:support"]

    models = Models(_Ingress(), list_adapters=adapters)

    async def go(model):
        return await models.resolve(model)

    route = asyncio.run(go("tiny:support"))
    assert route.base == "tiny" and route.context_len == 1024 and route.engine == "Decode"
    for bad in ("tiny:", "tiny:nope", "other:support"):
        with pytest.raises(ModelNotFound):
            asyncio.run(go(bad))
    # the listing was read at most twice (cached, and once more for a name it lacked)
    assert 1 <= len(listed) <= 3


def test_an_empty_adapter_name_is_openais_404_not_a_500(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.chat(make_request({**CHAT, "model": "tiny:"}))))
    assert status == 404 and err["code"] == "model_not_found" and handle.calls == []


def test_no_answer_names_where_adapters_are_stored():
    text = "Adapter 'x' not found at s3://acme-models/adapters/x (NoSuchKey)"
    assert "s3://" not in redact_storage(text) and "acme" not in redact_storage(text)


# --- the operational surface: /health, /ping, /version ---------------------------------------------
def test_health_follows_the_engines_and_needs_no_key(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    door = ingress._door

    async def running(up):
        return {"Decode": up}

    for up, status in ((1, 200), (0, 503)):
        door.router.running = lambda up=up: running(up)
        door.models._ingress._default_serve_handles["tiny"].deployment_name = "Decode"
        assert run(ingress.health()).status_code == status
        assert run(ingress.ping()).status_code == status
    assert json.loads(run(ingress.version()).body)["version"]


def test_the_responses_api_is_a_clear_404(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.responses(make_request(CHAT, path="/v1/responses"))))
    assert status == 404 and "/v1/chat/completions" in err["message"]
    assert error_of(run(ingress.responses(make_request(CHAT, key="wrong"))))[0] == 401


def test_the_key_is_read_once_per_request(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    seen = []
    real = ingress._door.auth.key_id
    ingress._door.auth.key_id = lambda req: seen.append(1) or real(req)
    assert run(ingress.chat(make_request(CHAT))).status_code == 200
    assert seen == [1] and KEY


# --- tenants: each key's prefix-cache salt, budgets in money --------------------------------------
def _salted(monkeypatch, **kw):
    from serving.ingress.tenancy import CacheSalts

    r, meter, calls = _routing(monkeypatch, **kw)
    r.front.salts = CacheSalts(("sk-client", "sk-other"))
    return r, meter, calls


def _seen_cluster(seen):
    async def call(body):
        seen.append(body)
        return JSONResponse(
            {"model": body["model"], "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5}}
        )

    return call


def test_each_keys_requests_carry_its_own_cache_salt_to_the_cluster():
    from serving.spec import key_id

    mp = pytest.MonkeyPatch()
    try:
        r, _, _ = _salted(mp, fallback=False)
        seen: list[dict] = []
        streamed: list[dict] = []
        r.relay.continuable = lambda endpoint, fields, context_len=None: streamed.append(dict(fields))
        for key, body in (
            ("sk-client", {"prompt": "x"}),
            ("sk-client", {"prompt": "x"}),
            ("sk-other", {"prompt": "x"}),
            ("sk-client", {"prompt": "x", "cache_salt": "conversation-1"}),
            ("sk-client", {"prompt": "x", "stream": True}),
        ):
            _run(r, body, _seen_cluster(seen), key=key)
        salts = [b.get("cache_salt") for b in seen]
        own = r.front.salts.salt(key_id("sk-client"), True, {}, None)
        assert salts[0] == salts[1] == salts[4] == own
        assert salts[2] not in (None, own)  # another key, another cache
        assert salts[3] not in (None, own, "conversation-1")  # the client's narrows its key's
        # A stream's record (its continuation's fields) carries the same salt as the request.
        assert [f["cache_salt"] for f in streamed] == [own]
        # With isolation off every key shares the cache: only a client's own salt goes on.
        r.limiter.config = replace(r.limiter.config, cache_isolation="shared")
        seen.clear()
        _run(r, {"prompt": "x"}, _seen_cluster(seen))
        _run(r, {"prompt": "x", "cache_salt": "mine"}, _seen_cluster(seen))
        assert "cache_salt" not in seen[0] and seen[1]["cache_salt"] == "mine"
    finally:
        mp.undo()


def test_the_fallback_never_gets_a_cache_salt_and_a_bad_client_salt_is_a_400(monkeypatch):
    r, _, calls = _salted(monkeypatch, when=("deadline",))

    async def unservable(body):
        raise Unservable(Reason.DEADLINE, 1)

    resp, _ = _run(r, {"model": "ours", "prompt": "x", "cache_salt": "mine"}, unservable)
    assert resp.status_code == 200 and "cache_salt" not in json.loads(calls[0].content)
    seen: list[dict] = []
    resp, _ = _run(r, {"model": "ours", "prompt": "x", "cache_salt": "a/b"}, _seen_cluster(seen))
    error = json.loads(resp.body)["error"]
    assert resp.status_code == 400 and error["param"] == "cache_salt" and seen == []


def test_the_fallback_is_sent_the_values_the_engine_read_not_the_clients_lax_spelling(monkeypatch):
    """vLLM reads "12" and 12.0 as the integer 12 and "true" as true; OpenAI's API refuses a
    number sent as a string. A body the cluster would serve goes to the fallback as the
    cluster's engine read it, with the strings left as strings."""
    r, _, calls = _salted(monkeypatch, when=("deadline",))

    async def unservable(body):
        raise Unservable(Reason.DEADLINE, 1)

    body = {"model": "ours", "prompt": "x", "max_tokens": "12", "n": 2.0, "echo": "true", "stop": "7"}
    resp, _ = _run(r, body, unservable)
    sent = json.loads(calls[0].content)
    assert resp.status_code == 200
    assert (sent["max_tokens"], sent["n"], sent["echo"], sent["stop"]) == (12, 2, True, "7")
    assert type(sent["n"]) is int and type(sent["max_tokens"]) is int


def _budgeted(monkeypatch, when_exceeded="refuse", **kw):
    """The door with sk-client's budget of $0.001 a month; a cluster answer (2 prompt, 5
    output tokens) costs $0.0007 at $0.0001 per prompt token and per output token."""
    from serving.ingress.costs import Costs
    from serving.spec import key_id

    r, meter, calls = _routing(monkeypatch, **kw)
    kid = key_id("sk-client")
    budget = {"usd": 0.001, "period": "month", "when_exceeded": when_exceeded}
    ledger = _limited(r, {"keys": {kid: {"budget": budget}}})
    price = {"prefill_usd_per_token": 1e-4, "decode_usd_per_token": 1e-4, "disaggregated": False}
    r.router.costs = Costs.from_user_config({"ours": price, "cheap": price}, None)
    return r, meter, calls, ledger, kid


def test_a_key_past_its_budget_gets_a_429_naming_it_with_retry_after_at_the_periods_end(monkeypatch):
    import time

    from serving.ingress.windows import MONTH, period_bounds

    r, meter, _, ledger, kid = _budgeted(monkeypatch)
    seen: list[dict] = []
    first, second = (_run(r, {"model": "ours", "prompt": "x"}, _seen_cluster(seen))[0] for _ in range(2))
    assert first.status_code == second.status_code == 200  # $0.0007, then $0.0014: admitted under it
    refused, _ = _run(r, {"model": "ours", "prompt": "x"}, _seen_cluster(seen))
    error = json.loads(refused.body)["error"]
    assert refused.status_code == 429 and error["code"] == "budget_exceeded" and "monthly budget" in error["message"]
    end = period_bounds(MONTH, time.time())[1]
    assert abs(int(refused.headers["retry-after"]) - (end - time.time())) <= 2
    assert len(seen) == 2 and meter.limited == [(kid, "ours", "budget")]
    assert ledger.actor.spend(kid)["month"]["usd"] == pytest.approx(0.0014)
    # Other keys are not touched by sk-client's budget.
    assert _run(r, {"model": "ours", "prompt": "x"}, _seen_cluster(seen), key="sk-other")[0].status_code == 200


def test_a_key_past_its_budget_overflows_to_the_cheaper_model_its_budget_names(monkeypatch):
    r, meter, _, _, kid = _budgeted(monkeypatch, when_exceeded="cheap")
    seen: list[dict] = []
    statuses = [_run(r, {"model": "ours", "prompt": "x"}, _seen_cluster(seen))[0].status_code for _ in range(4)]
    assert statuses == [200] * 4
    assert [b["model"] for b in seen] == ["ours", "ours", "cheap", "cheap"]
    assert meter.overflows == [(kid, "ours", "cheap")] * 2 and meter.limited == []


def test_a_key_past_its_budget_overflows_to_the_fallback_when_its_budget_says_so(monkeypatch):
    r, meter, calls, _, _ = _budgeted(monkeypatch, when_exceeded="fallback")
    seen: list[dict] = []
    answers = [_run(r, {"model": "ours", "prompt": "x"}, _seen_cluster(seen))[0] for _ in range(3)]
    assert [a.headers["x-served-by"] for a in answers] == ["cluster", "cluster", "fallback"]
    assert len(seen) == 2 and len(calls) == 1 and meter.fallbacks == [("budget", "ok")]
