"""The serving spec's tool calling and reasoning for one model: `serving.model.tools`,
`serving.model.reasoning` and `serving.model.chatTemplate`.

What flows through here: those keys of a model -> validated pydantic models -> the vLLM OpenAI
server arguments they stand for (`engine_kwargs()`), which serving/spec/render.py adds to the
model's engine kwargs on EVERY engine role (prefill and decode under P/D, the one engine
aggregated). pydantic and the standard library only.

How the arguments reach vLLM: Ray Serve LLM 2.60 sends each engine kwarg that names a field
of vLLM's `FrontendArgs` to the OpenAI layer it starts in the engine's replica
(ray/llm/_internal/serve/engines/vllm/vllm_models.py `from_llm_config`, then
vllm_engine.py `init_app_state`); `tool_call_parser`, `enable_auto_tool_choice` and
`chat_template` are such fields (vllm/entrypoints/launchers/cli_args.py, 0.29 and 0.32).
`reasoning_parser` is an engine argument (vLLM's structured outputs read it too), and Ray
hands the OpenAI layer the engine and frontend arguments in one namespace.

Why both P/D roles: Ray's P/D decode server sends prefill a deep copy of the client's chat
request, clamped to one token (kv_transfer/base.py `prepare_prefill_request`), and prefill's
vLLM runs the whole chat preprocessing on it: it refuses `tool_choice` auto/required/named
without its own parser flags (vllm/renderers/online_renderer.py: the 400s a client saw), and
renders the prompt with its own chat template; decode pulls the KV of that prompt, and with
`pd_tokenize_once` reuses its token ids. A role without the flags answers 400, one with
another template computes KV for another prompt. The parsers themselves shape only decode's
answer (prefill's one token is dropped), but the same flags on both keep the two prompts one.

Which parser names exist is not known here: infra/config checks them against the names both
vLLMs register (infra/vllm_options.py `parser_problem`), naming the key and the stack file.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import field_validator

from serving.spec.base import SpecModel

# The repository: a chat template file is named relative to it, as stack files are.
REPO_ROOT = Path(__file__).resolve().parents[2]
# A parser name as vLLM registers them (letters, digits, "_", "-").
_PARSER = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_TEMPLATE_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]*\.jinja$")
# Larger than any template a model ships; the template goes inline into the Serve config.
MAX_TEMPLATE_BYTES = 64 << 10


def _parser_name(v: str) -> str:
    if not _PARSER.match(v):
        raise ValueError(f"{v!r} is not a parser name (lowercase letters, digits, '_' and '-')")
    return v


class ToolsSpec(SpecModel):
    """Tool calling (`tools`/`tool_choice` in chat requests), parsed by vLLM's `parser`.

    With a parser, `tool_choice` "required" and a named function are enforced by vLLM's
    structured outputs (the answer is a call matching the tool's schema); "auto" needs
    `autoChoice` too: then the model decides, and the parser finds its calls in the text.
    """

    # vLLM's --tool-call-parser: the format the model writes calls in (hermes, llama3_json, ...).
    parser: str
    # vLLM's --enable-auto-tool-choice: tool_choice "auto" (OpenAI's default when tools are given).
    auto_choice: bool = True

    @field_validator("parser")
    @classmethod
    def _name(cls, v: str) -> str:
        return _parser_name(v)

    def engine_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {"tool_call_parser": self.parser}
        if self.auto_choice:
            kwargs["enable_auto_tool_choice"] = True
        return kwargs


class ReasoningSpec(SpecModel):
    """The model's reasoning, split out of the answer into `reasoning` by vLLM's `parser`."""

    # vLLM's --reasoning-parser (deepseek_r1, qwen3, ...).
    parser: str

    @field_validator("parser")
    @classmethod
    def _name(cls, v: str) -> str:
        return _parser_name(v)

    def engine_kwargs(self) -> dict[str, object]:
        return {"reasoning_parser": self.parser}


def chat_template_path(v: str) -> str:
    """A chat template's path (`serving.model.chatTemplate`): a .jinja file in this
    repository, named relative to its root, as stack files name it."""
    if not _TEMPLATE_PATH.match(v) or ".." in v.split("/"):
        raise ValueError(f"{v!r} is not a .jinja file path relative to the repository root")
    f = REPO_ROOT / v
    if not f.is_file():
        raise ValueError(f"{v!r}: no such file in the repository")
    if f.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{v!r} is larger than {MAX_TEMPLATE_BYTES >> 10} KiB")
    return v


def chat_template_kwargs(path: str) -> dict[str, object]:
    """The template replacing the model's own, inline (vLLM's load_chat_template takes a
    template's text as well as a path), so the engines need no file."""
    return {"chat_template": (REPO_ROOT / path).read_text()}
