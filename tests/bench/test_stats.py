"""bench/stats.py on synthetic data: summaries, ratios, KV figures, the table (expected values
worked out by hand from vLLM's definitions, quoted in bench/stats.py)."""

from __future__ import annotations

import math

import pytest

from bench.stats import (
    RequestResult,
    format_table,
    kv_transfer_per_request,
    percentile,
    ratios,
    summarize,
)


# percentile() is numpy.percentile (vLLM's client uses it too): its interpolation is numpy's to
# test, not ours. What is ours is below: no values -> None, q outside 0..100 refused, and the
# pooling and definitions of summarize(), worked out by hand.
def test_percentile_edges():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def req(ttft, itl, prompt=10, ok=True):
    return RequestResult(
        ok=ok, ttft_s=ttft, latency_s=ttft + sum(itl), itl_s=list(itl), prompt_tokens=prompt, output_tokens=len(itl) + 1
    )


def test_summarize_follows_vllm_definitions():
    results = [
        req(0.100, [0.010] * 9),  # 10 tokens, latency 0.19
        req(0.200, [0.020] * 4),  # 5 tokens, latency 0.28
        req(0.300, [0.030, 0.050]),  # 3 tokens, latency 0.38
        RequestResult(ok=False, error="HTTP 503"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s["requests"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["output_tokens"] == 18 and s["input_tokens"] == 30
    assert math.isclose(s["ttft_p50_ms"], 200.0)
    assert math.isclose(s["ttft_p99_ms"], 298.0)  # 200 + 0.98 * 100
    # ITL pools every gap: 9 x 10 ms, 4 x 20 ms, 30 ms, 50 ms -> median of 15 values is the 8th.
    assert math.isclose(s["itl_p50_ms"], 10.0)
    # TPOT per request: (latency - ttft) / (tokens - 1) = 10, 20, 40 ms.
    assert math.isclose(s["tpot_p50_ms"], 20.0)
    assert math.isclose(s["e2el_p50_ms"], 280.0)
    assert math.isclose(s["output_tok_s"], 9.0)
    assert math.isclose(s["req_s"], 1.5)


def test_summarize_with_only_failures():
    s = summarize([RequestResult(ok=False, error="x")] * 3, duration_s=1.0)
    assert s["completed"] == 0 and s["errors"] == 3
    assert s["ttft_p50_ms"] is None and s["itl_p50_ms"] is None and s["tpot_p50_ms"] is None
    assert s["output_tok_s"] == 0.0 and s["req_s"] == 0.0


def test_single_token_requests_have_no_tpot():
    s = summarize([req(0.05, [])], duration_s=1.0)
    assert s["tpot_p50_ms"] is None and s["itl_p50_ms"] is None and s["output_tokens"] == 1


def test_ratios_divide_target_by_baseline():
    a = {
        "ttft_p50_ms": 30.0,
        "ttft_p99_ms": 90.0,
        "itl_p50_ms": 0.0,
        "tpot_p50_ms": 8.0,
        "output_tok_s": 50.0,
        "req_s": 1.0,
    }
    c = {
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 0.0,
        "itl_p50_ms": 5.0,
        "tpot_p50_ms": None,
        "output_tok_s": 200.0,
        "req_s": 4.0,
    }
    r = ratios(a, c)
    assert r == {
        "ttft_p50_ms": 3.0,
        "ttft_p99_ms": None,
        "itl_p50_ms": 0.0,
        "tpot_p50_ms": None,
        "output_tok_s": 0.25,
        "req_s": 0.25,
    }


def test_kv_transfer_per_request():
    delta = {"nixl_bytes": 9_000_000.0, "nixl_transfers": 30.0, "nixl_xfer_s": 0.6, "external_kv_tokens": 3000.0}
    kv = kv_transfer_per_request(delta, requests=30)
    assert kv["bytes_per_request"] == 300_000.0
    assert kv["kv_tokens_per_request"] == 100.0
    assert math.isclose(kv["xfer_ms_per_transfer"], 20.0)
    assert math.isclose(kv["xfer_ms_per_request"], 20.0)
    empty = kv_transfer_per_request({}, requests=0)
    assert empty["bytes_per_request"] is None and empty["xfer_ms_per_transfer"] is None


def test_table_has_a_row_per_target_and_level_and_ratios_only_for_others():
    s1 = summarize([req(0.1, [0.01] * 4)], 1.0)
    s2 = summarize([req(0.05, [0.005] * 4)], 0.5)
    table = format_table({"disaggregated": {1: s1, 4: s1}, "vllm": {1: s2, 4: s2}}, "vllm")
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    pd_row = next(ln for ln in lines if ln.startswith("disaggregated") and ln.split()[1] == "1")
    assert pd_row.split("|")[1].split() == ["2.00", "2.00", "0.50", "0.50"]
    vllm_row = next(ln for ln in lines if ln.startswith("vllm"))
    assert vllm_row.split("|")[1].split() == []


def test_kv_backends_label_the_transfer_with_what_carried_it():
    """make bench labels the KV bytes with the NIXL backend of the config it deployed (UCX locally)."""
    from pathlib import Path

    from bench.stats import kv_backends
    from local.config import render_local_config

    local = render_local_config("both", Path("/tmp/model"), port=8000)
    assert kv_backends(local) == ["UCX"]
    assert kv_backends(render_local_config("aggregated", Path("/tmp/model"), port=8000)) == []
    efa = {
        "applications": [
            {
                "args": {
                    "decode_config": {
                        "engine_kwargs": {
                            "kv_transfer_config": {
                                "kv_connector": "NixlConnector",
                                "kv_connector_extra_config": {"backends": ["LIBFABRIC"]},
                            }
                        }
                    }
                }
            }
        ]
    }
    assert kv_backends(efa) == ["LIBFABRIC"]
    default = {
        "applications": [
            {"args": {"decode_config": {"engine_kwargs": {"kv_transfer_config": {"kv_connector": "NixlConnector"}}}}}
        ]
    }
    assert kv_backends(default) == ["UCX"]  # vLLM's NixlConnector default
