"""Real OpenAI clients against the local stack (`make serve`, both apps), each as its users run it.

Four clients, pinned in requirements-clients.lock and installed in their own virtualenv
(.venv-clients, built by `make test-long`), each run as a subprocess from that virtualenv
(tests/local/clients/: one script per client prints one `RESULT <json>` line; aiperf is its own
command line) against ONE stack this module starts (`python -m local --mode both`, the P/D
prefill tier routed by KV state as in every P/D e2e test), with plain vLLM serving the same
tiny model with the same flags beside it (local.provider's vLLM) as the oracle:

- openai-agents: an Agent's tool loop (a forced tool call, the tool run, its message sent
  back, an answer), non-streamed and streamed, on the P/D and the aggregated app;
- langchain-openai: ChatOpenAI's tools, structured output, logprobs, n, stop and batch at
  temperature 0, each answer equal to the same call's answer from plain vLLM;
- lm-eval's `local-completions`: log-likelihoods by echo + logprobs on (context,
  continuation) pairs, equal to plain vLLM's within 1e-3, is-greedy flags the same;
- aiperf: multi-turn chat sessions, streamed, on the P/D app: no error, every turn answered.

The tiny model's weights are random: tool arguments and structured fields come from closed sets
(an enum or a boolean always ends; a free string need not), and every comparison is with plain
vLLM's answer to the same request, never a text written here. Its own stack (marker
`own_stack`: after the shared stack has stopped) in `make test-long` (marker `long`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra.paths import BUILD_DIR, ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.own_stack]

KEY = "sk-e2e-clients-key"
CLIENTS_PY = ROOT / ".venv-clients" / "bin" / "python"
SCRIPTS = Path(__file__).parent / "clients"
LOG_DIR = BUILD_DIR / "test-logs" / "clients"
ROUTES = ("disaggregated", "aggregated")
TOLERANCE = 1e-3  # bench/conformance_compare.py LOGPROB_TOLERANCE: the same bar as make conformance
CLIENT_TIMEOUT_S = 600  # a hung client fails here, not at the test's own bound


@dataclass
class Target:
    name: str
    url: str  # OpenAI base URL (…/v1)
    model: str
    key: str


@dataclass
class Servers:
    ours: dict[str, Target]  # route -> our app
    vllm: Target  # plain vLLM, the same model and flags
    model_dir: Path


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    from local.background import background_stack
    from local.config import PREFILL_ROUTER_ENV, local_target
    from local.provider import EXTERNAL_MODEL, running_provider
    from local.tiny_model import ensure_tiny_model

    if not CLIENTS_PY.exists():
        pytest.fail(
            f"{CLIENTS_PY.relative_to(ROOT)} is missing: `make test-long` builds it from requirements-clients.lock"
        )
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_tiny_model()
    # Plain vLLM starts while the stack does (it runs niced: the stack's start goes first). On
    # the way out the pool waits for its start to end, then `provider_held` stops it.
    with contextlib.ExitStack() as provider_held, ThreadPoolExecutor(1) as pool:
        provider_cm = running_provider(str(model_dir), LOG_DIR / "vllm.log", dict(local_target().engine_env))
        starting = pool.submit(provider_held.enter_context, provider_cm)
        with background_stack(
            mode="both",
            api_key=KEY,
            log_path=LOG_DIR / "stack.log",
            timeout=480,
            extra_env={PREFILL_ROUTER_ENV: "kv-aware"},
        ) as stack:
            provider = starting.result()
            assert provider.vllm_url is not None  # the vLLM backend
            ours = {route: Target(route, stack.urls[route], stack.model, KEY) for route in ROUTES}
            # plain vLLM takes any key (it is started without one)
            yield Servers(ours, Target("vllm", provider.vllm_url, EXTERNAL_MODEL, "sk-none"), model_dir)


def run_client(name: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    """One client command from .venv-clients; its output in build/test-logs/clients/<name>.log.
    Returns stdout; a non-zero exit fails the test with the output's tail."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LANGSMITH_", "LANGCHAIN_"))}
    environ.update({"HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost", **(env or {})})
    proc = subprocess.run(
        argv, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False
    )
    (LOG_DIR / f"{name}.log").write_text(f"$ {' '.join(argv)}\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc.stdout


def run_script(name: str, script: str, *args: str) -> Any:
    out = run_client(name, [str(CLIENTS_PY), str(SCRIPTS / script), *args])
    results = [line[len("RESULT ") :] for line in out.splitlines() if line.startswith("RESULT ")]
    assert results, f"{name} printed no RESULT line:\n{out[-2000:]}"
    return json.loads(results[-1])


def target_args(t: Target) -> list[str]:
    return ["--base-url", t.url, "--api-key", t.key, "--model", t.model]


def validate(instance: Any, schema: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(instance, schema)


# --- openai-agents: the tool loop ---------------------------------------------------------------
@pytest.fixture(scope="module")
def agent_runs(servers) -> dict[str, Any]:
    """route -> the agent's loop, run and streamed (one client process per route)."""
    return {
        route: run_script(f"agents-{route}", "agents_loop.py", *target_args(t)) for route, t in servers.ours.items()
    }


@pytest.mark.parametrize("how", ["run", "streamed"])
@pytest.mark.parametrize("route", ROUTES)
def test_openai_agents_runs_its_tool_loop_to_an_answer(agent_runs, route, how):
    got, stream = agent_runs[route][how], how == "streamed"
    first, second = got["requests"]  # a call, then an answer: two model requests, no more
    assert first["tool_choice"] == "required" and first.get("stream", False) is stream
    (tool,) = first["tools"]
    schema = tool["function"]["parameters"]

    calls = [i for i in got["items"] if i["type"] == "tool_call_item"]
    outputs = [i for i in got["items"] if i["type"] == "tool_call_output_item"]
    assert calls and [c["name"] for c in calls] == ["get_weather"] * len(calls)
    for call in calls:
        validate(json.loads(call["arguments"]), schema)
    # the tool ran once per call, with the arguments the model gave
    assert [{"city": r["city"], "unit": r["unit"]} for r in got["tool_runs"]] == [
        json.loads(c["arguments"]) for c in calls
    ]
    assert [o["call_id"] for o in outputs] == [c["call_id"] for c in calls]

    # what went back to the model: its own calls, then one tool message per call with the output
    messages = second["messages"]
    assistant = next(m for m in messages if m["role"] == "assistant")
    assert [c["id"] for c in assistant["tool_calls"]] == [c["call_id"] for c in calls]
    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [
        (c["call_id"], r["output"]) for c, r in zip(calls, got["tool_runs"], strict=True)
    ]
    assert second.get("tool_choice") != "required"  # reset after the call: the loop may end

    # and an answer ended the run: the last item, the run's final output
    assert got["final_output_type"] == "str"
    assert got["items"][-1] == {"type": "message_output_item", "text": got["final_output"]}


# --- langchain-openai ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def langchain(servers) -> dict[str, Any]:
    """ChatOpenAI's calls against plain vLLM and each of our apps, run once for the module."""
    return {
        t.name: run_script(f"langchain-{t.name}", "langchain_calls.py", *target_args(t))
        for t in (servers.vllm, *servers.ours.values())
    }


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_invoke_answers_as_plain_vllm(langchain, route):
    ours, vllm = langchain[route]["plain"], langchain["vllm"]["plain"]
    assert isinstance(ours["text"], str) and ours["finish_reason"] in ("stop", "length")
    assert ours == vllm


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_bound_tool_required_gets_calls_matching_the_schema(langchain, route):
    ours = langchain[route]["tools"]
    assert ours["invalid_tool_calls"] == [] and ours["tool_calls"]
    for call in ours["tool_calls"]:
        assert call["name"] == "GetWeather" and call["id"]
        validate(call["args"], ours["schema"])

    def calls(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return [(c["name"], c["args"]) for c in result["tool_calls"]]

    assert calls(ours) == calls(langchain["vllm"]["tools"])


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_structured_output_parses_into_the_schema(langchain, route):
    ours = langchain[route]["structured"]
    assert ours["parsing_error"] is None and ours["parsed"] is not None
    assert json.loads(ours["raw"]) == ours["parsed"]
    assert ours["parsed"] == langchain["vllm"]["structured"]["parsed"]


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_logprobs_come_per_token_as_plain_vllms(langchain, route):
    ours, vllm = langchain[route]["logprobs"], langchain["vllm"]["logprobs"]
    entries = ours["content"]
    assert entries and len(entries) == ours["output_tokens"]
    for e in entries:
        assert math.isfinite(e["logprob"]) and e["logprob"] <= 0
        assert len(e["top"]) == 2 and e["top"][0][1] >= e["top"][1][1]
        # temperature 0: the token chosen is the most likely one
        assert e["logprob"] == pytest.approx(e["top"][0][1], abs=1e-6)
    assert ours["text"] == vllm["text"]
    assert [e["token"] for e in entries] == [e["token"] for e in vllm["content"]]
    for a, b in zip(entries, vllm["content"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=TOLERANCE), (a, b)


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_n_2_gives_two_generations(langchain, route):
    texts = langchain[route]["n"]["texts"]
    # sampled with a seed (vLLM refuses n > 1 at temperature 0): two generations, the ones
    # plain vLLM gives for the same seed
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert texts == langchain["vllm"]["n"]["texts"]


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_stop_ends_the_text_before_the_stop_string(langchain, route):
    plain, ours = langchain[route]["plain"]["text"], langchain[route]["stop"]
    stop = ours["stop"]
    assert stop, f"the plain answer {plain!r} has no piece to stop on"
    assert stop in plain and stop not in ours["text"]
    assert ours["text"] == plain[: plain.index(stop)]
    assert ours == langchain["vllm"]["stop"]


@pytest.mark.parametrize("route", ROUTES)
def test_langchain_batch_answers_every_prompt_as_plain_vllm(langchain, route):
    ours, vllm = langchain[route]["batch"], langchain["vllm"]["batch"]
    assert len(ours["texts"]) == len(ours["prompts"]) and all(isinstance(t, str) for t in ours["texts"])
    assert ours["texts"] == vllm["texts"]


# --- lm-eval: log-likelihoods -------------------------------------------------------------------
@pytest.fixture(scope="module")
def loglikelihoods(servers) -> dict[str, Any]:
    args = [a for t in (servers.vllm, *servers.ours.values()) for a in ("--target", t.name, t.url, t.model, t.key)]
    return run_script("lm-eval", "lm_eval_loglik.py", *args, "--tokenizer", str(servers.model_dir))


@pytest.mark.parametrize("mode", ["tokens", "text"])
@pytest.mark.parametrize("route", ROUTES)
def test_lm_eval_log_likelihoods_equal_plain_vllms(loglikelihoods, route, mode):
    """lm-eval's local-completions scores a continuation from the prompt's own logprobs (echo):
    a path that prefills elsewhere must still give the prompt's logprobs as one engine does."""
    ours, vllm = loglikelihoods[route][mode], loglikelihoods["vllm"][mode]
    assert len(ours) == len(vllm) > 0
    for i, ((ll, greedy), (ll_vllm, greedy_vllm)) in enumerate(zip(ours, vllm, strict=True)):
        assert math.isfinite(ll) and ll < 0, (i, ll)
        assert ll == pytest.approx(ll_vllm, abs=TOLERANCE), f"pair {i}: {ll} on {route}, {ll_vllm} on plain vLLM"
        assert greedy == greedy_vllm, f"pair {i}: is_greedy {greedy} on {route}, {greedy_vllm} on plain vLLM"


# --- aiperf: multi-turn sessions ----------------------------------------------------------------
SESSIONS, TURNS, OUTPUT_TOKENS = 6, 3, 8


def test_aiperf_multi_turn_sessions_answer_every_turn(servers, tmp_path):
    target = servers.ours["disaggregated"]
    artifacts = tmp_path / "aiperf"
    # aiperf 0.13 under HF_HUB_OFFLINE looks the tokenizer up in the hub's cache only, never in a
    # directory; given a directory it loads it from there and touches no network.
    run_client(
        "aiperf",
        [
            str(CLIENTS_PY.parent / "aiperf"),
            "profile",
            *("--model", target.model, "--url", target.url.removesuffix("/v1"), "--api-key", target.key),
            *("--endpoint-type", "chat", "--streaming", "--tokenizer", str(servers.model_dir)),
            *("--conversation-num", str(SESSIONS), "--conversation-turn-mean", str(TURNS)),
            *("--conversation-turn-stddev", "0", "--concurrency", "3", "--random-seed", "7"),
            *("--prompt-input-tokens-mean", "48", "--prompt-input-tokens-stddev", "0"),
            *("--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0"),
            # every turn its full answer: EOS from random weights would end one early
            *("--extra-inputs", "ignore_eos:true"),
            *("--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"),
            *("--workers-max", "2", "--record-processors", "1", "--artifact-dir", str(artifacts)),
        ],
        env={"HF_HUB_OFFLINE": ""},
    )
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["was_cancelled"] is False
    assert summary["request_count"]["avg"] == SESSIONS * TURNS

    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    errors = [r["error"] for r in records if r.get("error")]
    assert errors == []
    turns: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        turns.setdefault(r["metadata"]["conversation_id"], {})[r["metadata"]["turn_index"]] = r["metrics"]
    assert len(turns) == SESSIONS and all(sorted(t) == list(range(TURNS)) for t in turns.values())
    for session, by_turn in turns.items():
        for i, metrics in by_turn.items():
            assert metrics["usage_completion_tokens"]["value"] == OUTPUT_TOKENS, (session, i, metrics)
        # each turn carried the conversation so far: the server counted a longer prompt each time
        prompts = [by_turn[i]["usage_prompt_tokens"]["value"] for i in range(TURNS)]
        assert prompts == sorted(set(prompts)), (session, prompts)
