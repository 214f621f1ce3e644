"""The client-seen gaps between streamed chunks, on synthetic arrival series."""

from __future__ import annotations

from itertools import pairwise

import pytest

from bench import gaps
from bench.stats import RequestResult


def stream(arrived: list[float]) -> RequestResult:
    """A request whose chunks arrived at these seconds after it was sent, as vLLM's client
    records it: the first as the TTFT, the rest as gaps from the one before."""
    itl = [b - a for a, b in pairwise(arrived)]
    return RequestResult(ok=True, ttft_s=arrived[0], latency_s=arrived[-1], itl_s=itl, output_tokens=len(arrived))


def test_arrivals_rebuild_the_series_the_client_saw():
    seen = [0.5, 0.55, 0.6, 1.0]
    assert gaps.arrivals(stream(seen)) == pytest.approx(seen)
    assert gaps.arrivals(RequestResult(ok=False)) == []


def test_an_even_stream_puts_about_a_tenth_in_the_tail():
    # 101 chunks, one every 10 ms after a 0.3 s first chunk: 10 of the 100 later chunks sit
    # in the last 10% of the span (plus the boundary one).
    seen = [0.3 + 0.01 * i for i in range(101)]
    held, counted = gaps.tail_count(seen)
    assert counted == 100
    assert held in (10, 11)
    s = gaps.summary([stream(seen)])
    assert s["gap_p50_ms"] == pytest.approx(10.0)
    assert s["gap_p99_ms"] == pytest.approx(10.0)
    assert s["tail_share"] == pytest.approx(held / 100)


def test_a_held_stream_puts_nearly_everything_in_the_tail():
    # The probe of issue 27: first chunk at 0.6 s, the other 899 in a burst at about 7 s.
    seen = [0.6] + [7.0 + 1e-5 * i for i in range(899)]
    s = gaps.summary([stream(seen)])
    assert s["tail_share"] == pytest.approx(1.0)
    assert s["gap_p50_ms"] < 1.0  # the burst: gaps of microseconds
    assert s["gap_p99_ms"] < 1.0  # one long gap in 899 is not the 99th percentile
    assert s["chunks"] == 900


def test_pooling_over_streams_and_short_streams():
    even = [0.1 * i + 0.1 for i in range(21)]  # 20 later chunks, 2 or 3 in the tail
    held = [0.1] + [2.0] * 20  # all 20 later chunks at the end
    short = [0.2, 0.3]  # no span: left out of the tail share, kept in the gaps
    s = gaps.summary([stream(even), stream(held), stream(short)])
    even_tail, _ = gaps.tail_count(even)
    assert s["tail_share"] == pytest.approx((even_tail + 20) / 40)
    assert s["streams"] == 3 and s["chunks"] == 21 + 21 + 2
    assert gaps.tail_count(short) == (0, 0)


def test_no_streams():
    s = gaps.summary([RequestResult(ok=False, error="x")])
    assert s == {"streams": 0, "chunks": 0, "gap_p50_ms": None, "gap_p99_ms": None, "tail_share": None}
    assert "| vllm | 1 | 0 | 0 | - | - | - |" in gaps.format_markdown({"vllm": {"1": s}})
