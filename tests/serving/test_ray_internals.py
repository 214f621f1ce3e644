"""serving/ray_internals.py against the installed Ray (2.60): every internal it re-exports and
every private hook the serving code relies on is there, with the shape the code uses."""

from __future__ import annotations

import inspect

import pytest

from serving import ray_internals as ri


def test_every_re_export_resolves():
    for name in ri.__all__:
        assert getattr(ri, name) is not None, name


def test_every_hook_exists_on_this_ray():
    ri.check_hooks()


def test_a_missing_hook_fails_loudly_naming_it(monkeypatch):
    monkeypatch.setattr(ri, "HOOKS", (*ri.HOOKS, ("ray.serve.llm.deployment:LLMServer", "_renamed_upstream")))
    with pytest.raises(RuntimeError, match=r"LLMServer\._renamed_upstream"):
        ri.check_hooks()


def test_the_hooks_take_what_the_serving_code_passes():
    from ray.serve.handle import DeploymentResponseGenerator
    from ray.serve.llm.deployment import LLMServer

    assert list(inspect.signature(LLMServer._batch_output_stream).parameters) == ["self", "generator"]
    assert list(inspect.signature(DeploymentResponseGenerator._fetch_future_result_async).parameters)[:1] == ["self"]
