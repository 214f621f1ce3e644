"""The bridge to vLLM's benchmark client: its command line and its per-request results."""

from __future__ import annotations

import json

import pytest

from bench.serving_bench import INPUT_LEN, OUTPUT_LEN, length_shape, load_for
from bench.vllm_load import Load, cli_args, to_results


def test_random_workload_maps_to_vllm_flags_and_parses_with_vllms_parser():
    from vllm.benchmarks import serve as vllm_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load = load_for("http://127.0.0.1:8000/aggregated/v1", "sk-x", "tiny", "/models/tiny", 12, 4, 7)
    parser = FlexibleArgumentParser()
    vllm_serve.add_cli_args(parser)
    args = parser.parse_args(cli_args(load))
    assert args.base_url == "http://127.0.0.1:8000/aggregated" and args.endpoint == "/v1/completions"
    assert args.num_prompts == 12 and args.max_concurrency == 4 and args.seed == 7
    assert args.ignore_eos and args.save_detailed and args.temperature == 0
    assert args.header == ["Authorization=Bearer sk-x"]
    ratios = json.loads(args.random_range_ratio)
    # vLLM draws len * (1 - r) .. len * (1 + r): the bench's ranges come back out.
    for (lo, hi), n, r in (
        (INPUT_LEN, args.random_input_len, ratios["input"]),
        (OUTPUT_LEN, args.random_output_len, ratios["output"]),
    ):
        assert n * (1 - r) == pytest.approx(lo, abs=1) and n * (1 + r) == pytest.approx(hi, abs=1)


def test_prefix_workload_flags():
    load = Load(
        base_url="http://h",
        model="m",
        tokenizer="/t",
        num_prompts=8,
        concurrency=2,
        seed=1,
        dataset="prefix_repetition",
        prefix_len=512,
        suffix_len=32,
        num_prefixes=4,
        output_len=16,
    )
    args = cli_args(load)
    assert args[args.index("--prefix-repetition-prefix-len") + 1] == "512"
    assert args[args.index("--prefix-repetition-num-prefixes") + 1] == "4"
    with pytest.raises(ValueError, match="dataset"):
        cli_args(
            Load(
                base_url="http://h", model="m", tokenizer="/t", num_prompts=1, concurrency=1, seed=1, dataset="sharegpt"
            )
        )


def test_length_shape_is_the_centre_and_relative_half_width():
    assert length_shape(32, 384) == (208, pytest.approx(176 / 208))


def test_detailed_results_become_request_results():
    raw = {
        "ttfts": [0.01, 0.02, 0.0],
        "itls": [[0.001, 0.002], [0.003], []],
        "latencies": [0.1, 0.2, 0.0],
        "input_lens": [10, 20, 30],
        "output_lens": [3, 2, 0],
        "errors": ["", "", "HTTP 500"],
    }
    res = to_results(raw)
    assert [r.ok for r in res] == [True, True, False]
    assert res[0].itl_s == [0.001, 0.002] and res[1].prompt_tokens == 20
    assert res[2].error == "HTTP 500"
