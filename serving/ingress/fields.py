"""What a client may put in a request body: one registry, every field with a meaning we chose.

What flows through here: the parsed JSON body of /v1/chat/completions, /v1/completions,
/tokenize or /detokenize, before anything else reads it -> None (every top-level field is
one we serve) or the 400 to send, naming the first field that is not; then the request as
vLLM's model validated it -> None (every bounded field within its bound, `BOUNDS`) or the
400 naming the field.
Each field of the registry says which endpoints take it, whether OpenAI documents it (only
those go to the external fallback: the vLLM extensions mean nothing to another provider,
and some providers refuse them), and what a continuation of a cut stream does with it
(serving/ingress/migration.py derives its classes from here): carried on unchanged,
recomputed, already applied, or a reason the stream cannot be continued.

Why an allow-list: vLLM's request models accept unknown fields (pydantic `extra="allow"`,
vLLM 0.29 and 0.32) and several documented fields that steer the engine's internals:
  * kv_transfer_params / ec_transfer_params: the P/D handshake. A client's value made Ray's
    `prepare_prefill_request` assert (a 500), and on the local-prefill path went to the
    decode engine as is: `do_remote_decode` made it pin KV blocks and answer with its engine
    id, host, port and block ids; `do_remote_prefill` with a client-chosen `remote_host`
    made it connect there (vLLM 0.32 nixl pull_scheduler.request_finished).
  * vllm_xargs: merged into SamplingParams.extra_args, where kv_transfer_params live.
  * request_id, priority, session_id: the engine's request identity, scheduling order and
    session state; the server sets them, not the client.
  * prompt_embeds, mm_payload, media_io_kwargs, mm_processor_kwargs, chat_template: raw
    tensors, multimodal internals and a client-supplied Jinja template.
Everything not in the registry is refused too, so a new field in a new vLLM release is
closed until someone decides what it means here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serving.core.prompts import prompt_count

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "chat", "completions", "tokenize", "detokenize"
GENERATE = frozenset({CHAT, COMPLETIONS})

# OpenAI documents `n` up to 128 (API reference, Chat Completions "Create"); vLLM takes up to
# 16384 children per request, each a full sequence: bounded here, and counted by limits.
MAX_N = 128
# The bounds this server adds to vLLM's own, on the values as the engine reads them: after
# pydantic's lax coercion of vLLM's request models, which turns "200", " 200 ", "200.0",
# 200.0 and "2_00" into 200 and true into 1 (vLLM 0.32 ChatCompletionRequest and
# CompletionRequest: `n: int | None`), so a bound on the JSON value alone misses them. A value
# vLLM refuses (2.5, "1e2", "abc") is refused by its model, as vLLM refuses it.
BOUNDS: dict[str, int] = {"n": MAX_N}


class Continuation(str, enum.Enum):
    """What a continuation of a cut stream does with a field the client set."""

    CARRIED = "carried"  # sent on unchanged: it steers the sampling of every token
    RECOMPUTED = "recomputed"  # what is left of it (max_tokens), or set by the continuation
    APPLIED = "applied"  # it shaped the prompt (whose token ids the continuation sends)
    BLOCKS = "blocks"  # set, it makes the request not continuable (see `blocks`)
    NONE = "none"  # tokenize/detokenize: nothing is ever continued


def _set(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {})


def _nonzero(v: Any) -> bool:
    """A number other than 0 as vLLM's model reads it (lax: "0.5" is 0.5); what is no number
    is refused by the engine itself."""
    try:
        return v is not None and not isinstance(v, bool) and float(v) != 0
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Field:
    """One request field a client may send."""

    name: str
    endpoints: frozenset[str]
    openai: bool  # OpenAI documents it (platform.openai.com API reference): the fallback gets it
    continuation: Continuation
    # (when its value makes the request not continuable, why): every BLOCKS field has one, and
    # a field of another class may too (a list of prompts is APPLIED, and blocks).
    blocks: tuple[Callable[[Any], bool], str] | None = None


def _f(name: str, endpoints: frozenset[str] | str, openai: bool, cont: Continuation, blocks: Any = None) -> Field:
    eps = frozenset({endpoints}) if isinstance(endpoints, str) else endpoints
    return Field(name, eps, openai, cont, blocks)


C, R, A, B = Continuation.CARRIED, Continuation.RECOMPUTED, Continuation.APPLIED, Continuation.BLOCKS
# OpenAI's documented fields this server implements (Chat Completions and legacy Completions
# "Create"), then vLLM's sampling and templating extensions we offer (vLLM docs, "Extra
# parameters" of the OpenAI-compatible server): they change what is generated, never where
# or how it runs.
FIELDS: tuple[Field, ...] = (
    _f("model", GENERATE, True, C),
    _f("messages", CHAT, True, A),
    # Several prompts are several answers in one stream (choices by index): not continued.
    _f("prompt", COMPLETIONS, True, A, (lambda v: prompt_count(v) > 1, "several prompts")),
    # vLLM applies these to the generated tokens only (vllm/v1/sample/ops/penalties.py): a
    # continuation's engine sees the kept tokens as prompt, so its answer would differ.
    _f("frequency_penalty", GENERATE, True, B, (lambda v: _nonzero(v), "penalties on generated tokens")),
    _f("presence_penalty", GENERATE, True, B, (lambda v: _nonzero(v), "penalties on generated tokens")),
    _f("logit_bias", GENERATE, True, C),
    _f("seed", GENERATE, True, C),
    _f("stop", GENERATE, True, C),
    _f("temperature", GENERATE, True, C),
    _f("top_p", GENERATE, True, C),
    _f("user", GENERATE, True, C),
    _f("stream_options", GENERATE, True, C),
    _f("max_tokens", GENERATE, True, R),
    _f("max_completion_tokens", CHAT, True, R),
    _f("stream", GENERATE, True, R),
    _f("n", GENERATE, True, B, (lambda v: v not in (None, 1), "n > 1")),
    # Completions' `logprobs: 0` asks for each token's own logprob: set unless null or false.
    _f("logprobs", GENERATE, True, B, (lambda v: v is not None and v is not False, "logprobs")),
    _f("top_logprobs", CHAT, True, B, (_set, "logprobs")),
    _f("tools", CHAT, True, B, (_set, "tools")),
    _f("tool_choice", CHAT, True, B, (lambda v: v not in (None, "none"), "tools")),
    _f(
        "response_format",
        CHAT,
        True,
        B,
        (lambda v: isinstance(v, Mapping) and v.get("type") not in (None, "text"), "structured output"),
    ),
    _f("suffix", COMPLETIONS, True, B, (_set, "suffix")),
    # A streamed echo with the token ids a continuation needs comes back without its prompt
    # text (vLLM blanks the echoed prompt when return_token_ids is set), so echo is never
    # traded for continuability.
    _f("echo", COMPLETIONS, True, B, (_set, "echo")),
    # Only shape output when tools are given; tools make the request not continuable.
    _f("parallel_tool_calls", CHAT, True, A),
    _f("reasoning_effort", CHAT, True, A),
    # vLLM's extensions
    _f("top_k", GENERATE, False, C),
    _f("min_p", GENERATE, False, C),
    _f("repetition_penalty", GENERATE, False, C),
    _f("stop_token_ids", GENERATE, False, C),
    _f("ignore_eos", GENERATE, False, C),
    _f("skip_special_tokens", GENERATE, False, C),
    _f("spaces_between_special_tokens", GENERATE, False, C),
    _f("include_stop_str_in_output", GENERATE, False, C),
    _f("bad_words", GENERATE, False, C),
    # Narrows the key's own salt (serving/ingress/tenancy.py); the continuation carries the result.
    _f("cache_salt", GENERATE, False, C),
    _f("min_tokens", GENERATE, False, R),
    _f("return_token_ids", GENERATE, False, R),
    _f("structured_outputs", GENERATE, False, B, (_set, "structured output")),
    _f("truncate_prompt_tokens", GENERATE, False, A),
    _f("add_special_tokens", GENERATE | {TOKENIZE}, False, A),
    _f("chat_template_kwargs", CHAT, False, A),
    _f("add_generation_prompt", CHAT, False, A),
    _f("continue_final_message", CHAT, False, A),
    _f("documents", CHAT, False, A),
    # Only shapes output with a reasoning parser; reasoning in the stream stops migration.
    _f("include_reasoning", CHAT, False, A),
    _f("echo", CHAT, False, B, (_set, "echo")),
    # vLLM's /tokenize and /detokenize as Ray's ingress types them (TokenizeCompletionRequest,
    # DetokenizeRequest): nothing generated, nothing continued.
    _f("model", frozenset({TOKENIZE, DETOKENIZE}), False, Continuation.NONE),
    _f("prompt", TOKENIZE, False, Continuation.NONE),
    _f("return_token_strs", TOKENIZE, False, Continuation.NONE),
    _f("tokens", DETOKENIZE, False, Continuation.NONE),
)

# Fields that reach the engine's internals: named apart so the message says why.
INTERNAL = frozenset(
    {
        "kv_transfer_params",
        "ec_transfer_params",
        "vllm_xargs",
        "request_id",
        "priority",
        "session_id",
        "prompt_embeds",
        "mm_payload",
        "return_mm_kwargs",
        "media_io_kwargs",
        "mm_processor_kwargs",
        "chat_template",
        "routed_experts_prompt_start",
    }
)


def _names(endpoint: str, keep: Callable[[Field], bool] = lambda f: True) -> frozenset[str]:
    return frozenset(f.name for f in FIELDS if endpoint in f.endpoints and keep(f))


ALLOWED = {e: _names(e) for e in (CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE)}
OPENAI = {e: _names(e, lambda f: f.openai) for e in GENERATE}
# The part of `stream_options` OpenAI documents: the provider never sees vLLM's
# continuous_usage_stats, which the ingress adds to the cluster's copy of a stream.
OPENAI_STREAM_OPTIONS = frozenset({"include_usage"})


def continuation_class(cls: Continuation) -> frozenset[str]:
    """The names (any generating endpoint) a continuation treats as `cls`."""
    return frozenset(f.name for f in FIELDS if f.continuation is cls and f.endpoints & GENERATE)


def blocking_rules(endpoint: str) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """Field name -> (when set it blocks a continuation, why), for `endpoint`."""
    return {f.name: f.blocks for f in FIELDS if endpoint in f.endpoints and f.blocks is not None}


def refused_field(endpoint: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` this server does not take, else None
    (the bounds are checked on the validated request: `out_of_bounds`)."""
    allowed = ALLOWED[endpoint]
    for name in body:
        if name in allowed:
            continue
        if name in INTERNAL:
            return name, f"'{name}' is set by the server and cannot be sent in a request."
        return name, f"Unsupported parameter: '{name}' is not supported by this server."
    return None


def out_of_bounds(typed: Any) -> tuple[str, str] | None:
    """(field, message) for the first field of the validated request `typed` (vLLM's model)
    over its bound in `BOUNDS`, in OpenAI's words for that error, else None."""
    for name, most in BOUNDS.items():
        value = getattr(typed, name, None)
        if isinstance(value, int) and value > most:
            return (
                name,
                f"Invalid '{name}': integer above maximum value. Expected a value <= {most}, but got {value} instead.",
            )
    return None


# A client's `cache_salt` as vLLM 0.32 accepts one (vllm/entrypoints/generate/base/protocol.py
# `validate_cache_salt`): a non-empty string of at most 128 characters without '@', '/', '\\'
# or NUL. The ingress never sends it on as it came: it narrows the key's own salt
# (serving/ingress/tenancy.py), so it is checked here, where the client's value is still seen.
CACHE_SALT_MAX_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def cache_salt_problem(body: Mapping[str, Any]) -> str | None:
    """The 400 message for the body's `cache_salt` where vLLM would refuse it, else None."""
    if "cache_salt" not in body or body["cache_salt"] is None:
        return None
    salt = body["cache_salt"]
    if not isinstance(salt, str) or not salt:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(salt) > CACHE_SALT_MAX_CHARS or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        return (
            f"Parameter 'cache_salt' must be at most {CACHE_SALT_MAX_CHARS} characters and must "
            "not contain '@', '/', '\\\\', or NUL."
        )
    return None


# The scalar types a validated request may read a client's lax value as (`"12"`, `12.0`).
_READ_AS = (bool, int, float)


def as_read(body: Mapping[str, Any], typed: Any) -> dict[str, Any]:
    """`body` with each scalar field as the validated request `typed` (vLLM's model, lax) read
    it: `"12"` and `12.0` are 12, `"true"` is True. What the cluster's engine served is what an
    external OpenAI-compatible API is sent; OpenAI refuses a number given as a string. Read
    from the model's fields themselves, as `limits.engine_view` does (a chat request's
    max_tokens warns when read as an attribute)."""
    read = getattr(typed, "__dict__", {})
    out = dict(body)
    for name, value in body.items():
        got = read.get(name)
        if isinstance(value, str | int | float) and isinstance(got, _READ_AS) and type(got) is not type(value):
            out[name] = got
    return out


def openai_fields(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `body` that OpenAI documents, for an external OpenAI-compatible API."""
    keep = OPENAI[endpoint]
    out = {k: v for k, v in body.items() if k in keep}
    opts = out.get("stream_options")
    if isinstance(opts, Mapping):
        out["stream_options"] = {k: v for k, v in opts.items() if k in OPENAI_STREAM_OPTIONS}
    return out
