"""langchain-openai's ChatOpenAI against one OpenAI base URL: run in .venv-clients by
tests/local/test_clients_e2e.py, which asserts on what this prints and compares it with the
same calls to plain vLLM.

What flows through here: a base URL, key and model -> ChatOpenAI at temperature 0 on the Chat
Completions API, called as LangChain users call it:
  plain       invoke
  tools       bind_tools(tool_choice="required"): the tool calls LangChain parsed
  structured  with_structured_output(method="json_schema", include_raw=True): the parsed object
  logprobs    logprobs=True, top_logprobs=2: each token's entry from response_metadata
  n           n=2 through generate: every generation's text
  stop        invoke with stop=[a piece of the plain answer]: the text, and the stop string
  batch       batch of several prompts
-> one `RESULT <json>` line with each call's observations (arguments from closed sets only:
the tiny model's weights are random, and only a bounded value always ends).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Literal

PROMPT = "Write one sentence about the sea."
TOOL_PROMPT = "What is the weather in Paris, in celsius?"
BATCH = ["Name a colour.", "Count to three.", "Say hello to the sea.", "Describe a boat."]
MAX_TOKENS = 24
TOOL_MAX_TOKENS = 96


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL (…/v1)")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--check", action="store_true", help="import the client and build the model only")
    return parser.parse_args(argv)


def _schemas() -> tuple[Any, Any]:
    from pydantic import BaseModel, ConfigDict

    class GetWeather(BaseModel):
        """The weather in a city."""

        model_config = ConfigDict(extra="forbid")
        city: Literal["Paris", "Tokyo", "Lima"]
        unit: Literal["celsius", "fahrenheit"]

    class SeaReport(BaseModel):
        """A report on the sea."""

        model_config = ConfigDict(extra="forbid")
        colour: Literal["blue", "green", "grey"]
        calm: bool

    return GetWeather, SeaReport


def _stop_string(text: str) -> str | None:
    """A piece of the plain answer from its middle: with it as a stop string, the same greedy
    answer must end right before its first occurrence."""
    middle = text[len(text) // 2 :]
    for i in range(len(middle) - 2):
        piece = middle[i : i + 3]
        # no edge whitespace, no stand-in for an incomplete UTF-8 sequence (random weights
        # emit bytes that decode to nothing whole)
        if piece.strip() == piece and "\ufffd" not in piece:
            return piece
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    get_weather, sea_report = _schemas()

    def chat(**kw: Any) -> Any:
        settings: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
        return ChatOpenAI(
            model=args.model,
            base_url=args.base_url,
            api_key=args.api_key,
            max_retries=0,
            timeout=180,
            use_responses_api=False,
            **settings,
        )

    llm = chat()
    if args.check:
        return {"model": llm.model_name}
    out: dict[str, Any] = {}
    plain = llm.invoke(PROMPT)
    out["plain"] = {"text": plain.content, "finish_reason": plain.response_metadata.get("finish_reason")}

    # One call: under `required` vLLM constrains the output to a JSON array of calls, bounded to
    # one item only when parallel calls are off (vllm tool_parsers/utils.py); the tiny model's
    # random weights otherwise add items until max_tokens, and no call completes.
    bound = chat(max_tokens=TOOL_MAX_TOKENS).bind_tools(
        [get_weather], tool_choice="required", parallel_tool_calls=False
    )
    tooled = bound.invoke(TOOL_PROMPT)
    out["tools"] = {
        "tool_calls": [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in tooled.tool_calls],
        "invalid_tool_calls": [dict(c) for c in tooled.invalid_tool_calls],
        "schema": get_weather.model_json_schema(),
    }

    structured = (
        chat(max_tokens=TOOL_MAX_TOKENS)
        .with_structured_output(sea_report, method="json_schema", include_raw=True)
        .invoke("Report on the sea.")
    )
    parsed = structured["parsed"]
    out["structured"] = {
        "parsed": parsed.model_dump() if parsed is not None else None,
        "parsing_error": repr(structured["parsing_error"]) if structured["parsing_error"] else None,
        "raw": structured["raw"].content,
    }

    scored = chat(logprobs=True, top_logprobs=2).invoke(PROMPT)
    out["logprobs"] = {
        "text": scored.content,
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "top": [[t["token"], t["logprob"]] for t in e["top_logprobs"]],
            }
            for e in (scored.response_metadata.get("logprobs") or {}).get("content") or []
        ],
        "output_tokens": (scored.usage_metadata or {}).get("output_tokens"),
    }

    # vLLM refuses n > 1 with greedy sampling ("n must be 1 when using greedy sampling"):
    # two sampled generations, reproducible by their seed.
    generated = chat(n=2, temperature=0.8, seed=7).generate([[HumanMessage(PROMPT)]])
    out["n"] = {"texts": [g.text for g in generated.generations[0]]}

    stop = _stop_string(plain.content)
    stopped = llm.invoke(PROMPT, stop=[stop]) if stop else None
    out["stop"] = {"stop": stop, "text": stopped.content if stopped is not None else None}

    out["batch"] = {"prompts": BATCH, "texts": [m.content for m in llm.batch(BATCH)]}
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("RESULT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
