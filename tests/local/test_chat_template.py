"""The tiny model's tool-calling template (local/chat_templates/tiny-tools.jinja) and its parser.

What flows through here: a conversation (with and without tools) -> the template, rendered by
transformers as vLLM renders chat templates -> the prompt; an assistant's call as the template
writes it -> vLLM's hermes tool parser (installed) -> the call. Without tools the prompt is
exactly the model's own (local/tiny_model.py CHAT_TEMPLATE), so everything that does not
send tools runs on the same prompts as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.paths import ROOT
from local import config as local_config
from local import tiny_model

TEMPLATE = (ROOT / local_config.LOCAL_CHAT_TEMPLATE).read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story about a robot."},
        {"role": "assistant", "content": "Once upon a time"},
        {"role": "user", "content": "Go on."},
    ],
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.ensure_tiny_model())


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_it_renders_the_models_own_prompt(tokenizer, conversation, add_generation_prompt):
    def render(template: str) -> str:
        return tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    assert render(TEMPLATE) == render(tiny_model.CHAT_TEMPLATE)


def test_with_tools_the_prompt_lists_them_and_replays_calls_and_results(tokenizer):
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = tokenizer.apply_chat_template(
        conversation, tools=[WEATHER], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n") and json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_vllm_reads_it_as_a_string_content_template():
    """vLLM passes message content as a plain string to a template that does not loop over
    content parts (renderers/hf.py `_detect_content_format`), as to the model's own."""
    from vllm.renderers.hf import _detect_content_format

    assert _detect_content_format(TEMPLATE, default="openai") == "string"
    assert _detect_content_format(tiny_model.CHAT_TEMPLATE, default="openai") == "string"


def test_the_hermes_parser_reads_a_call_in_the_templates_format(tokenizer):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(local_config.LOCAL_TOOL_PARSER)(tokenizer)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
    out = parser.extract_tool_calls(
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', request
    )
    assert out.tools_called and out.content == "Let me look."
    call = out.tool_calls[0].function
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_the_local_model_has_its_parser_on_every_engine(mode):
    cfg = local_config.render_local_config(mode, Path("/tmp/model"), port=8000)
    args = cfg["applications"][0]["args"]
    engines = args["llm_configs"] if "llm_configs" in args else [args["prefill_config"], args["decode_config"]]
    for engine in engines:
        ek = engine["engine_kwargs"]
        assert ek["tool_call_parser"] == "hermes" and ek["enable_auto_tool_choice"] is True
        assert ek["chat_template"] == TEMPLATE


def test_local_json_has_no_optional_whitespace_on_every_engine_and_the_plain_server():
    """The tiny model's greedy decode repeats a newline wherever a JSON grammar allows
    whitespace (seen with xgrammar on its weights): structured outputs without it end."""
    cfg = local_config.render_local_config("disaggregated", Path("/tmp/model"), port=8000)
    args = cfg["applications"][0]["args"]
    for engine in (args["prefill_config"], args["decode_config"]):
        assert engine["engine_kwargs"]["structured_outputs_config"] == local_config.LOCAL_STRUCTURED_OUTPUTS


def test_the_plain_vllm_server_has_the_same_tool_calling():
    """The stand-in provider and the bench's plain vLLM: the same parser, template and JSON
    settings as the stack's engines, parsed and checked by vLLM's own serve arguments."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from local.plain_vllm import plain_vllm_argv

    argv = plain_vllm_argv("/tmp/model", "m", 8000)[3:]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("hermes", True)
    assert Path(args.chat_template).read_text() == TEMPLATE
    assert args.structured_outputs_config.disable_any_whitespace is True
