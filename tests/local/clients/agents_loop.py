"""openai-agents' tool loop against one OpenAI base URL: run in .venv-clients by
tests/local/test_clients_e2e.py, which asserts on what this prints.

What flows through here: a base URL, key and model -> an Agent with one function tool
(`get_weather`, arguments from closed sets: the tiny model's weights are random, and only a
bounded value always ends) on the SDK's Chat Completions model (`OpenAIChatCompletionsModel`
over an `AsyncOpenAI` client), the first turn forced to call a tool (`tool_choice="required"`),
the SDK's `reset_tool_choice` lifting that after the call, and the turn that reads the tool's
output asked for text (`tool_choice="none"`: under "auto" the tiny model's random weights
open a tool call they never close, as plain vLLM's do) so that the loop ends on an answer
-> `Runner.run`, then `Runner.run_streamed` -> one `RESULT <json>` line, for each of the two
("run", "streamed"): every request body the SDK sent (an httpx hook), each run of the tool with
its arguments and its output, the run's items and its final output.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from typing import Any, Literal

# The SDK's traces go to OpenAI's servers unless turned off; nothing leaves this machine.
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

PROMPT = "What is the weather in Paris, in celsius?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL (…/v1)")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--check", action="store_true", help="import the client and build the agent only")
    return parser.parse_args(argv)


def forecast(city: str, unit: str) -> str:
    return f"21 degrees {unit} and sunny in {city}"


def _item(item: Any) -> dict[str, Any]:
    raw = item.raw_item
    out: dict[str, Any] = {"type": item.type}
    if item.type == "tool_call_item":
        out.update(name=raw.name, arguments=raw.arguments, call_id=raw.call_id)
    elif item.type == "tool_call_output_item":
        out.update(output=item.output, call_id=raw["call_id"] if isinstance(raw, dict) else raw.call_id)
    elif item.type == "message_output_item":
        from agents import ItemHelpers

        out.update(text=ItemHelpers.text_message_output(item))
    return out


async def run(args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    set_tracing_disabled(True)
    sent: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []

    async def record(request: Any) -> None:  # the openai client's own httpx (httpx2) request
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city.

        Args:
            city: The city.
            unit: The temperature unit.
        """
        answer = forecast(city, unit)
        runs.append({"city": city, "unit": unit, "output": answer})
        return answer

    http = DefaultAsyncHttpxClient(event_hooks={"request": [record]}, timeout=180)
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, http_client=http, max_retries=0)

    class AnswerAfterTheTool(OpenAIChatCompletionsModel):
        """The SDK's Chat Completions model; a turn whose input holds a tool's output answers
        in text (tool_choice "none")."""

        @staticmethod
        def _settings(items: Any, settings: Any) -> Any:
            done = isinstance(items, list) and any(
                isinstance(i, dict) and i.get("type") == "function_call_output" for i in items
            )
            return dataclasses.replace(settings, tool_choice="none") if done else settings

        async def get_response(
            self, system_instructions: Any, input: Any, model_settings: Any, *a: Any, **k: Any
        ) -> Any:
            return await super().get_response(
                system_instructions, input, self._settings(input, model_settings), *a, **k
            )

        def stream_response(self, system_instructions: Any, input: Any, model_settings: Any, *a: Any, **k: Any) -> Any:
            return super().stream_response(system_instructions, input, self._settings(input, model_settings), *a, **k)

    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model=AnswerAfterTheTool(model=args.model, openai_client=client),
        # One call per turn: vLLM bounds the forced array of calls to one item only with parallel
        # calls off (vllm tool_parsers/utils.py); the random weights otherwise never end it.
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=args.max_tokens
        ),
        tools=[get_weather],
        reset_tool_choice=True,  # the SDK's default, named: the turn after the call may answer
    )
    if args.check:
        await http.aclose()
        return {"tools": [t.name for t in agent.tools]}
    try:
        if stream:
            streamed = Runner.run_streamed(agent, PROMPT, max_turns=4)
            async for _ in streamed.stream_events():
                pass
            result: Any = streamed
        else:
            result = await Runner.run(agent, PROMPT, max_turns=4)
    finally:
        await http.aclose()
    final = result.final_output
    return {
        "requests": sent,
        "tool_runs": runs,
        "items": [_item(i) for i in result.new_items],
        "final_output": final,
        "final_output_type": type(final).__name__,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.check:
        result = asyncio.run(run(args, stream=False))
    else:
        result = {"run": asyncio.run(run(args, stream=False)), "streamed": asyncio.run(run(args, stream=True))}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
