"""What a client may put in a chat or completion body: every field has a meaning we chose.

What flows through here: the parsed JSON body of /v1/chat/completions or /v1/completions,
before anything else reads it -> None (every top-level field is one we serve) or the
400 to send, naming the first field that is not.

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
Everything else that is not on the lists below (OpenAI's documented fields this server
implements, and the vLLM sampling extensions we chose to offer) is refused too, so a new
field in a new vLLM release is closed until someone decides what it means here.

The external fallback gets only OpenAI's documented fields (`openai_fields`): the vLLM
extensions mean nothing to another provider, and some providers refuse them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# OpenAI's documented request fields that this server implements (platform.openai.com API
# reference: Chat Completions "Create", legacy Completions "Create").
OPENAI_CHAT = frozenset(
    {
        "model",
        "messages",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "n",
        "parallel_tool_calls",
        "presence_penalty",
        "reasoning_effort",
        "response_format",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
    }
)
OPENAI_COMPLETIONS = frozenset(
    {
        "model",
        "prompt",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    }
)
# vLLM's sampling and templating extensions we offer (vLLM docs, "Extra parameters" of the
# OpenAI-compatible server): they change what is generated, never where or how it runs.
VLLM_SAMPLING = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "bad_words",
        "truncate_prompt_tokens",
        "structured_outputs",
        "add_special_tokens",
        "cache_salt",
        "return_token_ids",
    }
)
VLLM_CHAT = frozenset(
    {
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "echo",
        "documents",
        "include_reasoning",
    }
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
ALLOWED = {
    "chat": OPENAI_CHAT | VLLM_SAMPLING | VLLM_CHAT,
    "completions": OPENAI_COMPLETIONS | VLLM_SAMPLING,
}
OPENAI = {"chat": OPENAI_CHAT, "completions": OPENAI_COMPLETIONS}


def refused_field(endpoint: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` this server does not take, else None."""
    allowed = ALLOWED[endpoint]
    for name in body:
        if name in allowed:
            continue
        if name in INTERNAL:
            return name, f"'{name}' is set by the server and cannot be sent in a request."
        return name, f"Unsupported parameter: '{name}' is not supported by this server."
    return None


def openai_fields(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `body` that OpenAI documents, for an external OpenAI-compatible API."""
    keep = OPENAI[endpoint]
    return {k: v for k, v in body.items() if k in keep}
