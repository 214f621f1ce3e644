"""bench/conformance_bodies.py: the generated bodies cover every field the ingress allows, are
the same for the same seed, and are ones vLLM's own request models read (or refuse as a
client's bad value, which the harness then compares as a refusal)."""

from __future__ import annotations

import json

from pydantic import ValidationError
from vllm.exceptions import VLLMValidationError

from bench.conformance_bodies import allowed_without_strategy, generate
from serving.ingress.fields import ALLOWED


def test_every_field_the_ingress_allows_is_drawn():
    assert allowed_without_strategy() == {"chat": set(), "completions": set()}


def test_the_same_seed_draws_the_same_bodies_and_another_seed_others():
    a, b, c = generate(60, 11), generate(60, 11), generate(60, 12)
    assert [x.key() for x in a] == [x.key() for x in b]
    assert [x.key() for x in a] != [x.key() for x in c]
    assert len({x.key() for x in a}) == len(a) == 60


def test_the_bodies_are_what_clients_send_and_mostly_what_vllm_reads():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    cases = generate(300, 5)
    models = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
    read = 0
    for case in cases:
        json.dumps(case.body)  # a JSON body
        assert set(case.body) <= ALLOWED[case.endpoint], case.body
        try:
            models[case.endpoint].model_validate(case.body)
            read += 1
        except (ValidationError, VLLMValidationError):
            pass
    assert read >= 0.6 * len(cases)  # most are valid; the rest test refusals
    assert sum(bool(c.body.get("stream")) for c in cases) >= 0.3 * len(cases)
    # the value classes: a count as a string and as a float, a null, a list of prompts
    dumped = [json.dumps(c.body) for c in cases]
    assert any('"max_tokens": "' in d for d in dumped) and any('"max_tokens": null' in d for d in dumped)
    assert any(isinstance(c.body.get("prompt"), list) for c in cases)
