"""serving/ingress/errors.py: the one mapping from an exception to the client's answer.

vLLM's request models validate some fields in their own validators and raise vLLM's client
errors (vllm/exceptions.py VLLMValidationError), which pydantic passes through instead of
wrapping them in a ValidationError; plain vLLM answers those 400 naming the parameter
(vllm 0.32 entrypoints/serve/exception_handling/error_response.py). The ingress, which
validates with the same models, answered 500 (found by make conformance).
"""

from __future__ import annotations

import json

import pytest

from serving.ingress.errors import answer_for


def _refusal_of(endpoint: str, body: dict):
    from serving.ingress.pipeline import _adapter, _request_type

    with pytest.raises(Exception) as caught:
        _adapter(_request_type(endpoint)).validate_python(body)
    return answer_for(caught.value)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
            "tool_choice",
        ),
    ],
)
def test_a_bad_value_vllms_own_validators_refuse_is_a_400_naming_it(endpoint, body, param):
    resp = _refusal_of(endpoint, body)
    assert resp.status_code == 400
    err = json.loads(resp.body)["error"]
    assert err["param"] == param and param in err["message"]


def test_vllms_not_found_is_a_404_and_a_server_error_stays_a_500():
    from vllm.exceptions import VLLMNotFoundError, VLLMServerError

    assert answer_for(VLLMNotFoundError("no such model")).status_code == 404
    assert answer_for(VLLMServerError("engine dead")).status_code == 500
