"""serving.model.tools / reasoning / chatTemplate: vLLM's OpenAI-layer flags on every engine role.

What flows through here: a model's tools, reasoning and chat template keys -> ServingSpec ->
each engine role's LLMConfig, then Ray Serve LLM 2.60's own split of engine_kwargs into
vLLM's FrontendArgs and AsyncEngineArgs (`VLLMEngineConfig.from_llm_config`), and vLLM's
own check of the serve arguments (`validate_parsed_serve_args`), both installed.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from serving.spec import ServingSpec, Target
from serving.spec.tools import REPO_ROOT

GPU = Target(accelerator_type="L40S")
CPU = Target(engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
TEMPLATE = "local/chat_templates/tiny-tools.jinja"
MODEL = {"id": "qwen", "source": "Qwen/Qwen3-8B"}
TOOLS = {"tools": {"parser": "hermes"}, "reasoning": {"parser": "qwen3"}, "chatTemplate": TEMPLATE}
FLAGS = ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser", "chat_template")


def _spec(mode: str = "disaggregated", **model) -> ServingSpec:
    return ServingSpec.model_validate({"model": {**MODEL, **model}, "mode": mode})


def _configs(spec: ServingSpec, target: Target = GPU) -> dict[str, dict]:
    args = spec.app_args(target)
    if "llm_configs" in args:
        return {"decode": args["llm_configs"][0]}
    return {"prefill": args["prefill_config"], "decode": args["decode_config"]}


def _error(**model) -> str:
    with pytest.raises(ValidationError) as e:
        _spec(**model)
    err = e.value.errors()[0]
    return ".".join(str(p) for p in err["loc"]) + ": " + str(err["msg"])


def test_pd_renders_the_same_flags_on_prefill_and_decode():
    """Prefill preprocesses the client's chat request too (tool_choice checks, the template):
    both roles carry the flags, identical."""
    configs = _configs(_spec(**TOOLS))
    assert set(configs) == {"prefill", "decode"}
    for cfg in configs.values():
        ek = cfg["engine_kwargs"]
        assert ek["tool_call_parser"] == "hermes"
        assert ek["enable_auto_tool_choice"] is True
        assert ek["reasoning_parser"] == "qwen3"
        assert ek["chat_template"] == (REPO_ROOT / TEMPLATE).read_text()
    prefill, decode = (configs[r]["engine_kwargs"] for r in ("prefill", "decode"))
    assert {k: prefill[k] for k in FLAGS} == {k: decode[k] for k in FLAGS}


def test_aggregated_renders_the_flags_on_its_one_engine():
    configs = _configs(_spec("aggregated", **TOOLS))
    assert list(configs) == ["decode"]
    assert configs["decode"]["engine_kwargs"]["tool_call_parser"] == "hermes"


def test_without_the_keys_nothing_is_rendered():
    for cfg in _configs(_spec()).values():
        assert not set(FLAGS) & set(cfg["engine_kwargs"])


def test_auto_choice_false_leaves_auto_off():
    """Required and named tool choice need only the parser; auto needs the switch too."""
    ek = _configs(_spec(tools={"parser": "hermes", "autoChoice": False}))["decode"]["engine_kwargs"]
    assert ek["tool_call_parser"] == "hermes" and "enable_auto_tool_choice" not in ek


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_ray_sends_the_flags_to_vllms_openai_layer(mode):
    """Ray Serve LLM 2.60 splits engine_kwargs by vLLM's FrontendArgs fields: the flags go to
    the OpenAI layer (the installed Ray and vLLM), and vLLM's serve-argument checks pass."""
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig
    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs, validate_parsed_serve_args

    for cfg in _configs(_spec(mode, **TOOLS), CPU).values():
        engine = VLLMEngineConfig.from_llm_config(LLMConfig.model_validate(cfg))
        # reasoning_parser is an engine argument (structured outputs read it too); Ray hands
        # the OpenAI layer both sets in one namespace (vllm_engine.py init_app_state).
        frontend_flags = [k for k in FLAGS if k != "reasoning_parser"]
        assert {k: engine.frontend_kwargs[k] for k in frontend_flags} == {
            k: cfg["engine_kwargs"][k] for k in frontend_flags
        }
        assert engine.engine_kwargs["reasoning_parser"] == "qwen3"
        frontend = FrontendArgs(**engine.frontend_kwargs)
        args = AsyncEngineArgs(model=MODEL["source"], **engine.engine_kwargs)
        validate_parsed_serve_args(argparse.Namespace(**(dataclasses.asdict(frontend) | vars(args))))


@pytest.mark.parametrize(
    ("model", "where", "says"),
    [
        ({"tools": {"parser": "Hermes!"}}, "model.tools.parser", "is not a parser name"),
        ({"tools": {}}, "model.tools.parser", "Field required"),
        ({"tools": {"parser": "hermes", "auto": True}}, "model.tools.auto", "Extra inputs"),
        ({"reasoning": {"parser": "r 1"}}, "model.reasoning.parser", "is not a parser name"),
        ({"chatTemplate": "/etc/passwd.jinja"}, "model.chatTemplate", "relative to the repository root"),
        ({"chatTemplate": "../x.jinja"}, "model.chatTemplate", "relative to the repository root"),
        ({"chatTemplate": "local/none.jinja"}, "model.chatTemplate", "no such file"),
        ({"chatTemplate": "README.md"}, "model.chatTemplate", "is not a .jinja file"),
    ],
)
def test_bad_values_name_their_key(model, where, says):
    msg = _error(**model)
    assert msg.startswith(where) and says in msg, msg


@pytest.mark.parametrize(
    "kwarg",
    [
        "tool_call_parser",
        "enable_auto_tool_choice",
        "reasoning_parser",
        "chat_template",
        "tool_parser_plugin",
        "reasoning_parser_plugin",
    ],
)
def test_engine_kwargs_may_not_set_them_beside_the_spec(kwarg):
    with pytest.raises(ValidationError, match=rf"{kwarg} set by the spec itself .*model\.tools"):
        ServingSpec.model_validate({"model": MODEL, "engineKwargs": {kwarg: "x"}})


def test_each_model_of_the_many_model_form_has_its_own():
    spec = ServingSpec.model_validate(
        {
            "models": [
                {"model": {**MODEL, "tools": {"parser": "hermes"}}},
                {"model": {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct"}, "mode": "aggregated"},
            ]
        }
    )
    first, second = spec.served
    assert _configs(first)["decode"]["engine_kwargs"]["tool_call_parser"] == "hermes"
    assert "tool_call_parser" not in _configs(second)["decode"]["engine_kwargs"]


def test_the_rendered_reasoning_parser_splits_reasoning_from_the_answer():
    """At the parser seam: vLLM's OpenAI layer builds the parser from the name the spec renders
    (ReasoningParserManager.get_reasoning_parser, vllm 0.32 reasoning/__init__.py) and reads
    `reasoning` and `content` out of the text (reasoning/basic_parsers.py extract_reasoning).
    The tiny tokenizer gets the think tokens a reasoning model's tokenizer has."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager

    from local.tiny_model import ensure_tiny_model

    name = _configs(_spec(**TOOLS))["decode"]["engine_kwargs"]["reasoning_parser"]
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "2+2?"}])
    assert parser.extract_reasoning("<think>add two and two</think>four", request) == ("add two and two", "four")
