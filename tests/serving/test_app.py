"""serving/app.py and serving/ingress/server.py: the front door's auth and error shapes (unit), then the running app (e2e).

The unit tests drive `AuthenticatedIngress` (serving/ingress/server.py) directly with a fake engine handle: no Ray
cluster. The e2e tests use the official `openai` client against the shared local cluster
(tests/conftest.py), where the disaggregated app runs at / and the aggregated app
with the same model at /aggregated.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.requests import Request

from bench import hops
from serving.app import build_app
from serving.ingress.errors import error_response
from serving.ingress.server import AuthenticatedIngress
from serving.spec import parse_api_keys

MODEL = "tiny"
KEY = "sk-unit-1"


# --- a fake decode deployment handle ------------------------------------------------------
class FakeMethod:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def remote(self, body, raw_request_info):
        self.owner.calls.append((self.name, body, raw_request_info))
        return self.owner.stream(self.name, body)


class FakeHandle:
    """Stands in for the decode deployment: yields one response, or raises."""

    def __init__(self, outcome=None):
        self.calls = []
        self.outcome = outcome

    def options(self, **_):
        return self

    def __getattr__(self, name):
        if name in ("chat", "completions", "embeddings", "tokenize"):
            return FakeMethod(self, name)
        raise AttributeError(name)

    async def stream(self, name, body):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        if self.outcome is not None:
            yield self.outcome
            return
        from ray.serve.llm.openai_api_models import ChatCompletionResponse, CompletionResponse

        if name == "chat":
            yield ChatCompletionResponse.model_validate(
                {
                    "id": "chatcmpl-1",
                    "created": 0,
                    "model": body.model,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )
        else:
            yield CompletionResponse.model_validate(
                {
                    "id": "cmpl-1",
                    "created": 0,
                    "model": body.model,
                    "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )


def model_card():
    from ray.llm._internal.serve.core.configs.openai_api_models import ModelCard

    return ModelCard(id=MODEL, object="model", owned_by="test", permission=[], metadata={})


def make_ingress(monkeypatch, *, keys: str | None = KEY, mode: str = "api-key", outcome=None):
    if keys is None:
        monkeypatch.delenv("TEST_PD_KEYS", raising=False)
    else:
        monkeypatch.setenv("TEST_PD_KEYS", keys)
    handle = FakeHandle(outcome)
    ingress = AuthenticatedIngress({MODEL: handle}, {MODEL: model_card()}, auth_mode=mode, api_keys_env="TEST_PD_KEYS")
    return ingress, handle


def make_request(
    body: bytes | dict | None = None,
    *,
    key: str | None = KEY,
    path="/v1/chat/completions",
    method="POST",
    auth_header: str | None = None,
) -> Request:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json")]
    if auth_header is not None:
        headers.append((b"authorization", auth_header.encode()))
    elif key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body or b"", "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    return Request(scope, receive)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def run(coro):
    return asyncio.run(coro)


def error_of(resp) -> tuple[int, dict]:
    body = json.loads(resp.body)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return resp.status_code, body["error"]


# --- unit: auth ---------------------------------------------------------------------------
def test_valid_key_reaches_the_engine(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    resp = run(ingress.chat(make_request(CHAT)))
    assert resp.status_code == 200
    assert json.loads(resp.body)["choices"][0]["message"]["content"] == "hi"
    assert [c[0] for c in handle.calls] == ["chat"]


def test_any_of_several_keys_is_accepted(monkeypatch):
    ingress, _ = make_ingress(monkeypatch, keys=" sk-a , sk-b,,")
    assert run(ingress.chat(make_request(CHAT, key="sk-b"))).status_code == 200
    assert run(ingress.chat(make_request(CHAT, key="sk-a"))).status_code == 200


@pytest.mark.parametrize(
    "header, message",
    [
        (None, "Missing API key"),
        ("Bearer ", "Missing API key"),
        ("Basic c2stdW5pdC0x", "Missing API key"),
        ("Bearer sk-wrong", "Incorrect API key"),
        ("Bearer sk-unit-1x", "Incorrect API key"),
    ],
)
def test_missing_or_wrong_key_is_401_before_the_engine(monkeypatch, header, message):
    ingress, handle = make_ingress(monkeypatch)
    req = make_request(CHAT, key=None, auth_header=header)
    status, err = error_of(run(ingress.chat(req)))
    assert status == 401 and message in err["message"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert handle.calls == []


def test_auth_runs_before_the_body_is_parsed(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    status, _ = error_of(run(ingress.chat(make_request(b"{not json", key=None))))
    assert status == 401


def test_api_key_mode_without_keys_refuses_everything(monkeypatch):
    ingress, handle = make_ingress(monkeypatch, keys=None)
    for key in (None, "", "anything"):
        status, _ = error_of(run(ingress.chat(make_request(CHAT, key=key))))
        assert status == 401
    status, _ = error_of(run(ingress.models(make_request(method="GET", path="/v1/models", key="x"))))
    assert status == 401
    assert handle.calls == []


def test_blank_key_list_counts_as_no_keys(monkeypatch):
    ingress, _ = make_ingress(monkeypatch, keys=" , ,")
    assert run(ingress.chat(make_request(CHAT, key=""))).status_code == 401


def test_disabled_auth_serves_without_a_key(monkeypatch):
    ingress, _ = make_ingress(monkeypatch, keys=None, mode="disabled")
    assert run(ingress.chat(make_request(CHAT, key=None))).status_code == 200


def test_unknown_auth_mode_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="auth mode 'open'"):
        make_ingress(monkeypatch, mode="open")


def test_models_endpoints_are_gated_and_answer(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    listed = run(ingress.models(make_request(method="GET", path="/v1/models")))
    assert [m.id for m in listed.data] == [MODEL]
    card = run(ingress.model_data(MODEL, make_request(method="GET", path=f"/v1/models/{MODEL}")))
    assert card.id == MODEL
    status, err = error_of(run(ingress.model_data("nope", make_request(method="GET"))))
    assert status == 404 and err["code"] == "model_not_found" and "'nope'" in err["message"]
    status, _ = error_of(run(ingress.model_data(MODEL, make_request(method="GET", key="bad"))))
    assert status == 401


def test_parse_api_keys():
    assert parse_api_keys(None) == ()
    assert parse_api_keys("a, b ,,c") == ("a", "b", "c")


# --- unit: error shapes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{bad json", "could not parse the JSON body"),
        (b"", "could not parse the JSON body"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_malformed_json_is_400_invalid_json(monkeypatch, body, fragment):
    ingress, handle = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.chat(make_request(body))))
    assert status == 400 and fragment in err["message"]
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    assert handle.calls == []


def test_invalid_body_is_400_naming_the_parameter(monkeypatch):
    ingress, _ = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.chat(make_request({"model": MODEL}))))
    assert status == 400 and err["param"] == "messages" and "messages" in err["message"]
    status, err = error_of(
        run(ingress.completions(make_request({"model": MODEL, "prompt": "x", "max_tokens": "many"})))
    )
    assert status == 400 and err["param"] == "max_tokens"


def test_unknown_model_is_404_model_not_found(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    status, err = error_of(run(ingress.chat(make_request({**CHAT, "model": "gpt-9"}))))
    assert status == 404 and err["code"] == "model_not_found" and "gpt-9" in err["message"]
    assert handle.calls == []


def test_backpressure_is_503_with_retry_after(monkeypatch):
    from ray.serve.exceptions import BackPressureError

    ingress, _ = make_ingress(monkeypatch, outcome=BackPressureError(num_queued_requests=9, max_queued_requests=8))
    resp = run(ingress.chat(make_request(CHAT)))
    status, err = error_of(resp)
    assert status == 503 and err["type"] == "server_error" and err["code"] == "overloaded"
    assert resp.headers["retry-after"] == "1"


def test_engine_error_response_keeps_its_status_and_message(monkeypatch):
    from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo
    from ray.serve.llm.openai_api_models import ErrorResponse

    too_long = ErrorResponse(
        error=ErrorInfo(message="prompt is longer than 512 tokens", type="BadRequestError", code=400)
    )
    ingress, _ = make_ingress(monkeypatch, outcome=too_long)
    status, err = error_of(run(ingress.completions(make_request({"model": MODEL, "prompt": "x"}))))
    assert status == 400 and err["message"] == "prompt is longer than 512 tokens"


def test_unexpected_failure_is_500_without_internals(monkeypatch):
    ingress, _ = make_ingress(monkeypatch, outcome=RuntimeError("secret stack detail"))
    status, err = error_of(run(ingress.chat(make_request(CHAT))))
    assert status == 500 and err["type"] == "server_error" and "secret" not in err["message"]


def test_error_response_shape():
    resp = error_response(404, "nope", param="model")
    assert json.loads(resp.body) == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }


# --- unit: build_app's argument checks (they fail before Ray is touched) ---------------------
def test_build_app_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match=r"args\.mode 'hybrid'"):
        build_app({"mode": "hybrid"})


def test_build_app_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys in args for mode 'aggregated': prefill_config"):
        build_app({"mode": "aggregated", "llm_configs": [], "prefill_config": {}})


def test_build_app_rejects_an_unknown_auth_mode():
    with pytest.raises(ValueError, match=r"args\.auth\.mode 'open'"):
        build_app({"mode": "aggregated", "llm_configs": [], "auth": {"mode": "open"}})


# --- e2e: the running apps through the openai client -----------------------------------------


def _client(url: str, key: str | None):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=key or "none", max_retries=0, timeout=120)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPT_MESSAGES = [{"role": "user", "content": "Write a haiku about autumn leaves falling on a quiet river."}]


@pytest.mark.e2e
def test_chat_non_streaming_and_streaming_agree(stack):
    client = _client(stack.urls["disaggregated"], stack.api_key)
    full = client.chat.completions.create(model=stack.model, messages=PROMPT_MESSAGES, max_tokens=24, **GREEDY)
    assert full.object == "chat.completion" and full.model == stack.model
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 10
    text = full.choices[0].message.content
    assert text
    chunks = list(
        client.chat.completions.create(
            model=stack.model, messages=PROMPT_MESSAGES, max_tokens=24, stream=True, **GREEDY
        )
    )
    assert len(chunks) > 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.e2e
def test_completions_non_streaming_and_streaming_agree(stack):
    client = _client(stack.urls["disaggregated"], stack.api_key)
    full = client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=20, **GREEDY)
    assert full.object == "text_completion" and full.usage.completion_tokens == 20
    chunks = list(
        client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=20, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


@pytest.mark.e2e
def test_disaggregated_output_equals_aggregated_output(stack):
    """Greedy decoding from KV computed by prefill == greedy decoding computed locally."""
    pd = _client(stack.urls["disaggregated"], stack.api_key)
    agg = _client(stack.urls["aggregated"], stack.api_key)
    for messages in (PROMPT_MESSAGES, [{"role": "user", "content": "Tell me a story about a robot and a fox. " * 8}]):
        a = pd.chat.completions.create(model=stack.model, messages=messages, max_tokens=32, **GREEDY)
        b = agg.chat.completions.create(model=stack.model, messages=messages, max_tokens=32, **GREEDY)
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        assert a.choices[0].message.content == b.choices[0].message.content
    for prompt in ("Numbers: 0 1 2 3", "Explain how a transformer attends to earlier tokens."):
        a = pd.completions.create(model=stack.model, prompt=prompt, max_tokens=32, **GREEDY)
        b = agg.completions.create(model=stack.model, prompt=prompt, max_tokens=32, **GREEDY)
        assert a.choices[0].text == b.choices[0].text
        sa = "".join(
            c.choices[0].text
            for c in pd.completions.create(model=stack.model, prompt=prompt, max_tokens=32, stream=True, **GREEDY)
        )
        assert sa == b.choices[0].text


@pytest.mark.e2e
def test_models_lists_the_served_model(stack):
    client = _client(stack.urls["disaggregated"], stack.api_key)
    assert [m.id for m in client.models.list().data] == [stack.model]
    assert client.models.retrieve(stack.model).id == stack.model


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the series `name` whose labels include `labels` (prometheus_client's parser)."""
    return hops.metric_total(
        hops.parse_prometheus(text), name, lambda got: all(got.get(k) == v for k, v in labels.items())
    )


def _scrape(stack, label: str) -> str:
    (node,) = [n for n in stack.nodes if n["label"] == label]
    return httpx.get(node["metrics_url"], timeout=10).text


@pytest.mark.e2e
def test_decode_receives_the_prompt_by_kv_transfer(stack):
    """Decode's vLLM counts the prompt's tokens as arriving by KV transfer, and NIXL moved bytes."""
    name = "ray_vllm_prompt_tokens_by_source_total"

    def snapshot():
        d, p = _scrape(stack, "decode"), _scrape(stack, "prefill")
        return {
            "decode_external": _metric(d, name, source="external_kv_transfer"),
            "prefill_local": _metric(p, name, source="local_compute"),
            "nixl_bytes": _metric(d, "ray_vllm_nixl_bytes_transferred_sum"),
            "nixl_transfers": _metric(d, "ray_vllm_nixl_xfer_time_seconds_count"),
        }

    # Metrics of earlier requests may still be on their way: start from a settled reading.
    before = hops.settled(snapshot)
    client = _client(stack.urls["disaggregated"], stack.api_key)
    prompt = "Disaggregated serving splits prefill and decode across separate engines. " * 6
    resp = client.completions.create(model=stack.model, prompt=prompt, max_tokens=4, **GREEDY)
    n = resp.usage.prompt_tokens
    assert n > 50
    # Ray exports engine metrics every few seconds: wait for this request to show.
    deadline = time.monotonic() + 60
    while True:
        after = snapshot()
        delta = {k: after[k] - before[k] for k in after}
        if delta["decode_external"] >= n - 16 and delta["prefill_local"] >= n and delta["nixl_bytes"] > 0:
            break
        assert time.monotonic() < deadline, f"metrics did not show the KV transfer: {delta}, prompt {n}"
        time.sleep(2)
    assert n - 16 <= delta["decode_external"] <= n
    assert delta["nixl_transfers"] >= 1


@pytest.mark.e2e
def test_malformed_request_gets_a_json_400_and_serving_continues(stack):
    url = stack.urls["disaggregated"]
    headers = {"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"}
    r = httpx.post(f"{url}/chat/completions", content=b'{"model": "tiny-llama", "messages": [', headers=headers)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_json"
    r = httpx.post(f"{url}/chat/completions", json={"model": stack.model, "messages": "hi"}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    client = _client(url, stack.api_key)
    ok = client.chat.completions.create(model=stack.model, messages=PROMPT_MESSAGES, max_tokens=4, **GREEDY)
    assert ok.usage.completion_tokens == 4


@pytest.mark.e2e
def test_n_greater_than_one_under_pd_answers_every_choice(stack):
    """n > 1 prefills on decode by design (vLLM's parallel sampling shares one
    kv_transfer_params between the children): every choice still comes back, and nothing
    internal in the answer."""
    url = stack.urls["disaggregated"]
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    body = {"model": stack.model, "messages": PROMPT_MESSAGES, "max_tokens": 4, "n": 2, "temperature": 0.8}
    r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert sorted(c["index"] for c in doc["choices"]) == [0, 1]
    assert "kv_transfer_params" not in doc


@pytest.mark.e2e
def test_a_client_cannot_hand_the_engines_kv_transfer_params(stack):
    """Before 2026-12-01 this was a 500 (Ray's prepare_prefill_request asserts it empty), and
    on the local-prefill path decode answered with its NIXL engine id, host and port."""
    url = stack.urls["disaggregated"]
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    steer = {"do_remote_decode": True}
    for path, body in (
        ("chat/completions", {"model": stack.model, "messages": PROMPT_MESSAGES, "max_tokens": 4}),
        ("completions", {"model": stack.model, "prompt": "hello", "max_tokens": 4}),
    ):
        for stream in (False, True):
            r = httpx.post(
                f"{url}/{path}", json={**body, "stream": stream, "kv_transfer_params": steer}, headers=headers
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "kv_transfer_params" and "remote" not in r.text


@pytest.mark.e2e
@pytest.mark.parametrize("app", ["disaggregated", "aggregated"])
def test_request_without_a_valid_key_gets_401(stack, app):
    import openai

    url = stack.urls[app]
    r = httpx.post(f"{url}/chat/completions", json={"model": stack.model, "messages": PROMPT_MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError) as exc:
        _client(url, "sk-not-the-key").chat.completions.create(model=stack.model, messages=PROMPT_MESSAGES)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    assert httpx.get(f"{url}/models").status_code == 401


@pytest.mark.e2e
def test_unknown_model_gets_a_json_404(stack):
    import openai

    client = _client(stack.urls["disaggregated"], stack.api_key)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-99", messages=PROMPT_MESSAGES)
    assert exc.value.status_code == 404 and exc.value.code == "model_not_found"
    assert exc.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-99")


@pytest.mark.e2e
def test_health_route_stays_open(stack):
    base = stack.urls["disaggregated"].rsplit("/v1", 1)[0]
    assert httpx.get(f"{base}/-/healthz").status_code == 200


# --- vLLM's push connector gets Ray's NIXL backend ---------------------------------------------
def test_ray_registers_its_nixl_backend_for_the_pull_connector_only():
    """Ray 2.60 (engines/vllm/kv_transfer/factory.py BUILTIN_BACKENDS) maps only "NixlConnector"
    to its NIXL backend; the path serving.app registers for "NixlPushConnector" is that class."""
    import importlib

    from ray.llm._internal.serve.engines.vllm.kv_transfer import factory

    from serving.app import PUSH_CONNECTOR, RAY_NIXL_BACKEND

    assert factory.BUILTIN_BACKENDS["NixlConnector"] == RAY_NIXL_BACKEND
    assert PUSH_CONNECTOR not in factory.BUILTIN_BACKENDS
    module, cls = RAY_NIXL_BACKEND.split(":")
    assert getattr(importlib.import_module(module), cls).__name__ == "NixlConnectorBackend"


def test_push_connector_is_found_in_rendered_args():
    from serving.app import PUSH_CONNECTOR, _kv_connectors
    from serving.spec import ServingSpec, Target
    from serving.spec.offload import OffloadTier

    spec = ServingSpec.model_validate(
        {
            "model": {"id": "m", "source": "a/b"},
            "prefill": {"tensorParallelSize": 2, "pipelineParallelSize": 2},
            "kvTransfer": {"connector": PUSH_CONNECTOR},
        }
    )
    assert _kv_connectors(spec.app_args(Target(accelerator_type="H100"))) == {PUSH_CONNECTOR}
    pull = ServingSpec.model_validate({"model": {"id": "m", "source": "a/b"}})
    assert PUSH_CONNECTOR not in _kv_connectors(pull.app_args(Target(accelerator_type="H100")))
    # A KV offload tier nests it under MultiConnector: Ray 2.60 still needs its backend.
    tiered = Target(accelerator_type="H100", role_kv_offload={"prefill": OffloadTier(cpu_bytes=1 << 30)})
    assert PUSH_CONNECTOR in _kv_connectors(spec.app_args(tiered))


# --- unit: fields a client may send (serving/ingress/fields.py) -----------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("kv_transfer_params", {"do_remote_decode": True}),
        ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 5600}),
        ("ec_transfer_params", {"do_remote_decode": True}),
        ("vllm_xargs", {"kv_transfer_params": {"do_remote_decode": True}}),
        ("request_id", "someone-elses-id"),
        ("priority", -100),
        ("chat_template", "{{ raise('x') }}"),
        ("store", True),
        ("metadata", {"a": "b"}),
        ("no_such_field", 1),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_field_we_did_not_choose_is_a_400_naming_it_and_never_reaches_the_engine(
    monkeypatch, field, value, endpoint, stream
):
    ingress, handle = make_ingress(monkeypatch)
    body = CHAT if endpoint == "chat" else {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    resp = run(
        getattr(ingress, endpoint)(make_request({**body, "stream": stream, field: value}, path=f"/v1/{endpoint}"))
    )
    status, err = error_of(resp)
    assert status == 400 and err["param"] == field and f"'{field}'" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert handle.calls == []


def test_the_fields_we_chose_pass_and_reach_the_engine(monkeypatch):
    ingress, handle = make_ingress(monkeypatch)
    chosen = {"top_k": 5, "min_p": 0.1, "ignore_eos": True, "seed": 3, "stop": ["\n"], "user": "u-1"}
    resp = run(ingress.chat(make_request({**CHAT, **chosen})))
    assert resp.status_code == 200
    sent = handle.calls[0][1]
    assert sent.top_k == 5 and sent.ignore_eos and sent.seed == 3


def test_every_internal_field_of_vllms_request_models_is_refused():
    """The engine-internal fields are read from vLLM's own request models (the installed
    vLLM, 0.32 here; the cluster's 0.29 has a subset of them): any field of those models
    that steers transfer, identity or scheduling must not be on an allow-list."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    from serving.ingress.fields import ALLOWED, INTERNAL

    for cls, endpoint in ((ChatCompletionRequest, "chat"), (CompletionRequest, "completions")):
        fields = set(cls.model_fields)
        steering = {f for f in fields if f.endswith("_transfer_params") or f in ("vllm_xargs", "request_id")}
        assert steering, "vLLM's request model changed shape: review serving/ingress/fields.py"
        assert steering <= INTERNAL
        assert not (ALLOWED[endpoint] & INTERNAL)
        # Everything we allow is a field vLLM parses (a typo would let nothing through).
        assert ALLOWED[endpoint] <= fields, sorted(ALLOWED[endpoint] - fields)


# --- unit: the other endpoints --------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["embeddings", "score", "transcriptions"])
def test_endpoints_the_stack_does_not_serve_are_refused_after_auth(monkeypatch, endpoint):
    ingress, handle = make_ingress(monkeypatch)
    status, err = error_of(run(getattr(ingress, endpoint)(make_request({"model": MODEL, "input": "x"}))))
    assert status == 404 and err["code"] == "endpoint_not_served"
    status, _ = error_of(run(getattr(ingress, endpoint)(make_request({"model": MODEL}, key="wrong"))))
    assert status == 401
    assert handle.calls == []


def test_tokenize_is_behind_the_keys_request_limit(monkeypatch):
    from serving.ingress.limits import Decision

    ingress, handle = make_ingress(monkeypatch)
    asked = []

    async def refuse(kid, model, body, context_len=None, *, budget=True):
        asked.append((kid, model, body))
        return Decision(False, 9, "rpm", "Rate limit reached: 1 requests per minute for this API key.")

    ingress._door.limiter.admit = refuse
    resp = run(ingress.tokenize(make_request({"model": MODEL, "prompt": "hello"}, path="/tokenize")))
    status, err = error_of(resp)
    assert status == 429 and resp.headers["retry-after"] == "9" and err["code"] == "rate_limit_exceeded"
    assert len(asked) == 1 and handle.calls == []


def test_a_non_streamed_answer_never_carries_engine_coordinates(monkeypatch):
    from ray.serve.llm.openai_api_models import ChatCompletionResponse

    answer = ChatCompletionResponse.model_validate(
        {
            "id": "chatcmpl-1",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": {"remote_host": "10.0.0.7", "remote_port": 5600, "remote_engine_id": "e"},
        }
    )
    ingress, _ = make_ingress(monkeypatch, outcome=answer)
    resp = run(ingress.chat(make_request(CHAT)))
    assert resp.status_code == 200
    assert b"remote_host" not in resp.body and "kv_transfer_params" not in json.loads(resp.body)


# --- the route table as FastAPI serves it ------------------------------------------------------------
def test_every_route_takes_the_request_fastapi_hands_it(monkeypatch):
    """The routes are Ray's table plus ours (serving/ingress/server.py endpoint_map), served by
    FastAPI: each handler's signature must be one FastAPI fills from the HTTP request (a
    parameter typed otherwise becomes a required query parameter, and every call a 400)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving.ingress.server import endpoint_map

    ingress, _ = make_ingress(monkeypatch)

    async def running():
        return {"Decode": 1}

    ingress._door.router.running = running
    app = FastAPI()
    for name, route in endpoint_map().items():
        route(app)(getattr(ingress, name))
    client = TestClient(app)
    auth = {"authorization": f"Bearer {KEY}"}
    assert client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=auth).status_code == 200
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/v1/models/tiny", headers=auth).status_code == 200
    assert client.post("/v1/embeddings", json={}, headers=auth).status_code == 404
    assert client.post("/v1/responses", json={}, headers=auth).status_code == 404
    assert client.get("/version").status_code == 200
    assert client.get("/health").status_code in (200, 503)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 401


@pytest.mark.e2e
def test_the_replica_count_the_watches_read_is_the_one_serve_status_gives(stack):
    """serving.core.cluster_watch counts RUNNING replicas in the controller's details instead of
    validating them as serve.status() does; on the live stack's details (the dashboard serves
    the same controller call) both give the same counts, for every deployment of both apps."""
    from ray.serve.schema import ServeInstanceDetails

    from serving.core.cluster_watch import running_replicas

    details = httpx.get(f"{stack.state['dashboard_url']}/api/serve/applications/", timeout=30).json()
    ours = running_replicas(details, "llm")
    status = ServeInstanceDetails(**details)._get_status()
    theirs = {
        f"{app_name}/{name}": d.replica_states.get("RUNNING", 0)
        for app_name, app in status.applications.items()
        for name, d in app.deployments.items()
    }
    assert {k: v for k, v in ours.items() if "/" in k} == theirs
    assert any(k.startswith("llm/Decode") and v >= 1 for k, v in theirs.items()), theirs
