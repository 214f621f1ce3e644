"""`make bench`: the disaggregated app vs the aggregated app vs vLLM's own server, on CPU.

What flows through here: a seeded workload (prompt and output lengths drawn from the
distributions below, prompts as token ids of the tiny model) -> streamed /v1/completions
requests at several concurrency levels to three targets in the same run:
  (a) disaggregated  the P/D app `make serve` runs (Ray Serve LLM, prefill -> NIXL -> decode)
  (b) aggregated     the single-engine app with the same model, in the same Ray cluster
  (c) vllm           `python -m vllm.entrypoints.openai.api_server`, same model, no Ray Serve
-> per-request timings -> bench.stats figures per target and concurrency, ratios a/c and
b/c, and decode's NIXL counters per request -> a table on screen and build/bench/serving.json.

Each concurrency level runs in rounds; each round sends the same requests to every target,
and the order of targets rotates from round to round, so drift in the machine (thermal,
background work) hits all three alike. All three share this machine's cores.
A benchmark prints figures; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.stats import RequestResult, format_table, kv_transfer_per_request, ratios, summarize
from infra.paths import ROOT as REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "build" / "bench" / "serving.json"
TARGETS = ("disaggregated", "aggregated", "vllm")
BASELINE = "vllm"

# The workload: stated here so the report can quote it.
INPUT_LEN = (32, 384)  # prompt tokens, uniform integer
OUTPUT_LEN = (16, 96)  # output tokens, uniform integer (ignore_eos: exactly this many)
LEVELS = {1: 32, 4: 64, 16: 128}  # concurrency -> requests per target
ROUNDS = 4
WARMUP = 4


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(seed: int, n: int, vocab: int, first_id: int) -> list[Request]:
    """n requests; prompts are random token ids above the special tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_in = rng.randint(*INPUT_LEN)
        out.append(Request([rng.randrange(first_id, vocab) for _ in range(n_in)], rng.randint(*OUTPUT_LEN)))
    return out


# --- the client ---------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, key: str | None, model: str, req: Request) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    res = RequestResult(ok=False, prompt_tokens=len(req.prompt))
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", res.prompt_tokens)
                if not msg.get("choices") or not msg["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                chunks += 1
        res.latency_s = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_batch(
    url: str, key: str | None, model: str, reqs: list[Request], concurrency: int
) -> tuple[list[RequestResult], float]:
    """All of `reqs`, at most `concurrency` in flight; returns results and wall time."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:

        async def guarded(r: Request):
            async with sem:
                return await one_request(client, url, key, model, r)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(r) for r in reqs))
        return list(results), time.perf_counter() - t0


# --- decode's metrics ------------------------------------------------------------------------
def _metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_counters(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {
        "nixl_bytes": _metric_sum(text, "ray_vllm_nixl_bytes_transferred_sum"),
        "nixl_transfers": _metric_sum(text, "ray_vllm_nixl_xfer_time_seconds_count"),
        "nixl_xfer_s": _metric_sum(text, "ray_vllm_nixl_xfer_time_seconds_sum"),
        "external_kv_tokens": _metric_sum(
            text, "ray_vllm_prompt_tokens_by_source_total", source="external_kv_transfer"
        ),
    }


def settled_kv_counters(metrics_url: str, quiet_s: float = 12, limit_s: float = 90) -> dict[str, float]:
    """Counters once they stop moving: Ray exports engine metrics every few seconds."""
    now, since, t0 = kv_counters(metrics_url), time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - t0 < limit_s:
        time.sleep(3)
        nxt = kv_counters(metrics_url)
        if nxt != now:
            now, since = nxt, time.monotonic()
    return now


# --- vLLM's own server (target c) --------------------------------------------------------------
@contextlib.contextmanager
def vllm_server(model_dir: str, model_id: str, port: int, env_extra: dict[str, str], log_path: Path):
    from serving.local.config import HOST, MAX_MODEL_LEN
    from serving.local.procs import interrupt_and_wait

    env = {**os.environ, **env_extra, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        model_id,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--host",
        HOST,
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            yield proc
        finally:
            interrupt_and_wait(proc, 60)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(2)
    raise TimeoutError(f"vLLM server at {url} not healthy after {timeout:.0f}s")


# --- the run ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving_bench", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=20260101)
    p.add_argument(
        "--levels",
        default=",".join(f"{c}:{n}" for c, n in LEVELS.items()),
        help="concurrency:requests per target, comma-separated (default %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def _say(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = {int(c): int(n) for c, n in (x.split(":") for x in args.levels.split(","))}
    t0 = time.monotonic()
    say = lambda m: _say(t0, m)  # noqa: E731

    from serving.local import tiny_model
    from serving.local.background import background_stack
    from serving.local.config import HOST, MODEL_ID, local_target
    from serving.local.procs import free_port

    model_dir = str(tiny_model.ensure_tiny_model())
    first_id = len(tiny_model.SPECIAL_TOKENS)
    vocab = tiny_model.ARCHITECTURE["vocab_size"]
    workload = {c: make_workload(args.seed + c, n, vocab, first_id) for c, n in levels.items()}
    warm = make_workload(args.seed - 1, WARMUP, vocab, first_id)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent

    vport = free_port()
    vurl = f"http://{HOST}:{vport}/v1"
    say(f"starting vLLM's OpenAI server (target c) on {vurl} and the local Ray stack (targets a, b)")
    with (
        vllm_server(model_dir, MODEL_ID, vport, dict(local_target().engine_env), logs / "vllm-server.log") as vproc,
        background_stack(mode="both", api_key="sk-bench", log_path=logs / "serve.log") as stack,
    ):
        wait_healthy(f"http://{HOST}:{vport}", vproc)
        urls = {"disaggregated": stack.urls["disaggregated"], "aggregated": stack.urls["aggregated"], "vllm": vurl}
        keys = {"disaggregated": stack.api_key, "aggregated": stack.api_key, "vllm": None}
        decode_metrics = next(n["metrics_url"] for n in stack.nodes if n["label"] == "decode")
        say("all three targets up; warming up")
        for t in TARGETS:
            res, _ = asyncio.run(run_batch(urls[t], keys[t], MODEL_ID, warm, 2))
            bad = [r.error for r in res if not r.ok]
            if bad:
                raise RuntimeError(f"warm-up against {t} failed: {bad[0]}")

        kv_before = settled_kv_counters(decode_metrics)
        results: dict[str, dict[int, list[RequestResult]]] = {t: {} for t in TARGETS}
        durations: dict[str, dict[int, float]] = {t: {} for t in TARGETS}
        for li, (conc, reqs) in enumerate(workload.items()):
            per_round = [reqs[i :: args.rounds] for i in range(args.rounds)]
            for r, batch in enumerate(per_round):
                shift = (r + li) % len(TARGETS)
                order = TARGETS[shift:] + TARGETS[:shift]
                for t in order:
                    res, dur = asyncio.run(run_batch(urls[t], keys[t], MODEL_ID, batch, conc))
                    results[t].setdefault(conc, []).extend(res)
                    durations[t][conc] = durations[t].get(conc, 0.0) + dur
                say(f"concurrency {conc}: round {r + 1}/{args.rounds} done ({' -> '.join(order)})")
        kv_after = settled_kv_counters(decode_metrics)

    summaries = {t: {c: summarize(results[t][c], durations[t][c]) for c in levels} for t in TARGETS}
    kv_delta = {k: kv_after[k] - kv_before[k] for k in kv_after}
    n_pd = sum(int(s["completed"] or 0) for s in summaries["disaggregated"].values())
    kv = kv_transfer_per_request(kv_delta, n_pd)
    report = {
        "workload": {
            "seed": args.seed,
            "endpoint": "/v1/completions (streamed, temperature 0, ignore_eos)",
            "prompt_tokens": f"uniform integer {INPUT_LEN[0]}..{INPUT_LEN[1]} (random token ids)",
            "output_tokens": f"uniform integer {OUTPUT_LEN[0]}..{OUTPUT_LEN[1]}",
            "levels": {str(c): n for c, n in levels.items()},
            "rounds": args.rounds,
            "requests_total": sum(levels.values()) * len(TARGETS),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": {"id": MODEL_ID, "dir": Path(model_dir).name, "dtype": "float32"},
        "targets": {t: {str(c): s for c, s in by.items()} for t, by in summaries.items()},
        "ratios_vs_vllm": {
            t: {str(c): ratios(summaries[t][c], summaries[BASELINE][c]) for c in levels}
            for t in TARGETS
            if t != BASELINE
        },
        "kv_transfer": {"decode_counters_delta": kv_delta, **kv},
        "notes": [
            "ITL follows vLLM's client: one value per streamed chunk. Ray Serve LLM batches "
            "streamed tokens (RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS, 50 ms by default), so "
            "its ITL median is ~0 and TPOT is the comparable per-token figure.",
            "All three targets share this machine's cores; the NIXL workers of the "
            "disaggregated app keep UCX progress threads polling even when idle.",
        ],
        "errors_sample": {t: [r.error for c in levels for r in results[t][c] if not r.ok][:5] for t in TARGETS},
        "wall_s": time.monotonic() - t0,
    }
    args.out.write_text(json.dumps(report, indent=2))

    print()
    print(format_table(summaries, BASELINE))
    print()
    print(
        "KV transfer (decode's NIXL counters over the disaggregated requests): "
        f"{_num(kv['bytes_per_request'], 0)} bytes and {_num(kv['kv_tokens_per_request'], 1)} prompt tokens "
        f"per request; {_num(kv['xfer_ms_per_transfer'], 2)} ms per transfer ({int(kv['transfers'] or 0)} transfers)"
    )
    print("Ratios are target / vllm (TTFT, TPOT: lower is better; tok/s, req/s: higher is better).")
    print(
        "ITL is measured per streamed chunk as vLLM's client does; Ray Serve LLM sends tokens in "
        "batches (every 50 ms by default), so most gaps it shows are 0 and TPOT is the per-token pace."
    )
    print(f"JSON: {args.out}  wall {report['wall_s']:.0f}s")
    return 0


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
