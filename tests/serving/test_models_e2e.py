"""Many models behind one front door, for real: `make serve PD_MODELS=2` on this CPU.

Its own stack (`python -m local --models 2`: the tiny model P/D, a second model
aggregated with the project's own LoRA adapter loaded by Ray Serve LLM from a local S3, one
front door), started after the shared e2e stack has stopped (marker `own_stack`), because the
machine runs one Ray stack at a time; in `make test-long` (marker `long`; CI runs it after
`make test`), since a second stack's start and its tests take about 3.5 minutes. What a user
would notice is asserted, and the designed state behind it: the P/D model still moves its
prompt by KV transfer, the adapter is really applied, and adding a model restarts no replica
of the others while they stream.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import hops
from infra.paths import BUILD_DIR
from local.cluster import deploy, wait_running
from local.config import MODEL_B_ID, MODEL_C_ID, MODEL_ID, render_local_config
from serving.spec import APP_NAME, MODEL_APP_PREFIX, key_id

pytestmark = [pytest.mark.e2e, pytest.mark.own_stack, pytest.mark.long]

KEY = "sk-e2e-models-key"
GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 0}
MESSAGES = [{"role": "user", "content": "Name three colours of the sea."}]


@pytest.fixture(scope="module")
def models_stack():
    # Held by a driver process, as `make bench` holds its stack: the last test ends it as a
    # bench under `timeout` is ended, by SIGTERM to the driver.
    from tests.local.driver import driven_stack

    log = BUILD_DIR / "test-logs" / "serve-models-e2e.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    with driven_stack(
        mode="disaggregated", api_key=KEY, log_path=log, timeout=600, extra_args=["--models", "2"]
    ) as running:
        yield running


def _client(stack, key: str | None = None):
    import openai

    return openai.OpenAI(base_url=stack.urls["models"], api_key=key or KEY, max_retries=0, timeout=120)


def _adapter(stack) -> str:
    return stack.state["adapter"]


def test_models_lists_both_models_and_the_adapter(models_stack):
    ids = [m.id for m in _client(models_stack).models.list().data]
    assert ids == [MODEL_ID, MODEL_B_ID, _adapter(models_stack)]
    assert _adapter(models_stack).startswith(f"{MODEL_B_ID}:")


@pytest.mark.parametrize("stream", [False, True])
def test_each_model_and_the_adapter_answers_with_its_own_id(models_stack, stream):
    client = _client(models_stack)
    for model in (MODEL_ID, MODEL_B_ID, _adapter(models_stack)):
        if not stream:
            resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **GREEDY)
            assert resp.model == model and resp.choices[0].finish_reason in ("stop", "length")
            assert resp.usage is not None and resp.usage.completion_tokens >= 1
            continue
        chunks = list(
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, stream=True, **GREEDY)
        )
        assert chunks and {c.model for c in chunks} == {model}
        assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks)


def test_the_adapter_is_applied(models_stack):
    """Greedy text of the base model and of its adapter differ: the adapter's weights reached
    the engine (a base-model answer under the adapter's name would pass the id check)."""
    client = _client(models_stack)

    def text(model: str) -> str:
        return client.completions.create(model=model, prompt="The sea is", max_tokens=16, **GREEDY).choices[0].text

    base, adapted = text(MODEL_B_ID), text(_adapter(models_stack))
    assert base == text(MODEL_B_ID)  # greedy is repeatable here, so a difference is the adapter's
    assert adapted != base


def test_the_pd_model_still_moves_its_prompt_by_kv_transfer(models_stack):
    """The designed state of the P/D model in the many-model form: its decode engine gets the
    prompt from prefill by KV transfer (vLLM's own count), the aggregated model computes its own."""
    name = "ray_vllm_prompt_tokens_by_source_total"
    urls = [n["metrics_url"] for n in models_stack.nodes]

    def snapshot() -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for url in urls:
            for series, labels, value in hops.parse_prometheus(httpx.get(url, timeout=10).text):
                if series == name:
                    key = (labels.get("model_name", ""), labels.get("source", ""))
                    out[key] = out.get(key, 0.0) + value
        return out

    # Metrics of earlier requests may still be on their way: start from a settled reading.
    before = hops.settled(snapshot)
    prompt = "Disaggregated serving splits prefill and decode across separate engines. " * 6
    n = (
        _client(models_stack)
        .completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, **GREEDY)
        .usage.prompt_tokens
    )
    assert n > 50
    deadline = time.monotonic() + 60
    while True:
        after = snapshot()
        moved = after.get((MODEL_ID, "external_kv_transfer"), 0) - before.get((MODEL_ID, "external_kv_transfer"), 0)
        if moved >= n - 16:
            break
        assert time.monotonic() < deadline, f"no KV transfer for {MODEL_ID}'s prompt of {n} tokens: {after}"
        time.sleep(2)
    assert moved <= n
    assert after.get((MODEL_B_ID, "external_kv_transfer"), 0) == 0


@pytest.mark.parametrize("model", ["gpt-9", f"{MODEL_ID}:tiny-lora", f"{MODEL_B_ID}-x"])
def test_an_unknown_model_is_openais_404(models_stack, model):
    import openai

    with pytest.raises(openai.NotFoundError) as exc:
        _client(models_stack).chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    assert exc.value.code == "model_not_found" and exc.value.body["type"] == "invalid_request_error"


def test_a_key_limited_to_one_model_cannot_use_the_others(models_stack):
    import openai

    limited_key = models_stack.state["limited_key"]
    client = _client(models_stack, limited_key)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=4).model == MODEL_ID
    for model in (MODEL_B_ID, _adapter(models_stack)):
        with pytest.raises(openai.NotFoundError) as exc:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        # the same answer as for a model that does not exist: nothing learnt about the catalogue
        assert exc.value.code == "model_not_found"
        assert exc.value.body["message"] == f"The model '{model}' does not exist or you do not have access to it."


# --- adding a model -------------------------------------------------------------------------------
def _replicas(dashboard_url: str) -> dict[str, tuple[str, int | None]]:
    """{"app/deployment/replica_id": (state, pid)} of every replica Serve runs."""
    apps = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=30).json()["applications"]
    return {
        f"{app}/{dep}/{r['replica_id']}": (r["state"], r.get("pid"))
        for app, details in apps.items()
        for dep, d in (details.get("deployments") or {}).items()
        for r in d.get("replicas") or []
    }


class Streams:
    """Clients streaming to the running models until stopped: every stream must end whole."""

    def __init__(self, stack, models: list[str]):
        self.client = _client(stack)
        self.models = models
        self.done: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(m,), daemon=True) for m in models]

    def _run(self, model: str) -> None:
        while not self._stop.is_set():
            try:
                chunks = list(
                    self.client.chat.completions.create(
                        model=model,
                        messages=MESSAGES,
                        max_tokens=24,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                usage = chunks[-1].usage
                if usage is None or usage.completion_tokens < 1 or {c.model for c in chunks} != {model}:
                    self.failures.append(f"{model}: incomplete stream ({len(chunks)} chunks, usage {usage})")
                else:
                    self.done.append(model)
            except Exception as exc:  # any failure a client would see
                self.failures.append(f"{model}: {exc!r}")

    def __enter__(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def test_adding_a_model_restarts_no_replica_of_the_others_and_cuts_no_stream(models_stack):
    state = models_stack.state
    dashboard = state["dashboard_url"]
    # What the spec renders for three models, with this stack's own settings (PD_MODELS=3).
    config = render_local_config(
        "disaggregated",
        Path(state["model_dir"]),
        port=state["port"],
        models=3,
        lora_path=state["lora_path"],
        key_models={key_id(state["limited_key"]): [MODEL_ID]},
    )
    running = {a["name"]: a for a in state["config"]["applications"]}
    new = {a["name"]: a for a in config["applications"]}
    # The applications of the running models are unchanged in the new config: Serve keeps them.
    assert {n: new[n] for n in running if n != APP_NAME} == {n: a for n, a in running.items() if n != APP_NAME}

    before = _replicas(dashboard)
    assert all(s == "RUNNING" for s, _ in before.values()), before
    with Streams(models_stack, [MODEL_ID, MODEL_B_ID]) as streams:
        time.sleep(3)
        deploy(dashboard, config)
        wait_running(dashboard, list(new), timeout=300, progress=lambda _: None)
        listed = [m.id for m in _client(models_stack).models.list().data]
        time.sleep(3)
    after = _replicas(dashboard)

    assert streams.failures == []
    assert {MODEL_ID, MODEL_B_ID} <= set(streams.done)
    assert listed == [MODEL_ID, MODEL_B_ID, _adapter(models_stack), MODEL_C_ID]
    # Every replica that ran before runs still, the same process; the new model added none
    # (it starts on its first request), and no other replica was started.
    assert after == before
    assert not any(k.startswith(f"{MODEL_APP_PREFIX}{MODEL_C_ID}/") for k in after)


# Last in this module: it stops the module's stack.
def test_a_bench_stopped_by_sigterm_leaves_nothing_and_the_next_start_is_clean(models_stack):
    """A `make bench` under `timeout` gets SIGTERM: its stack stops as on Ctrl-C. Before, Ray's
    HAProxy outlived it holding ports 8404 and 9101, and the next two starts failed with a
    Serve traceback."""
    import signal

    import psutil

    from local import procs as local_procs

    gcs = models_stack.state["gcs_address"]
    assert local_procs.leftover_haproxy() is not None  # the stack's own HAProxy runs
    models_stack.proc.send_signal(signal.SIGTERM)
    models_stack.proc.wait(timeout=300)
    deadline = time.monotonic() + 60
    while True:
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if gcs in " ".join(p.info["cmdline"] or [])]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, f"Ray processes of the stopped stack still alive: {left}"
    assert local_procs.leftover_haproxy() is None  # what made the next start fail
