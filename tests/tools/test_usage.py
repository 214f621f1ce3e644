"""tools/usage.py (`make usage`): per key and UTC day from Prometheus' HTTP API, asked of a
stand-in Prometheus that answers the recorded vectors of each query."""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from serving.core import metrics as m
from tools import usage

A, B = "k-aaaaaaaaaaaa", "k-bbbbbbbbbbbb"
# 2026-12-07 18:00 UTC: today so far is 18 hours.
NOW = datetime(2026, 12, 7, 18, tzinfo=UTC).timestamp()
YESTERDAY_END = datetime(2026, 12, 7, tzinfo=UTC).timestamp()


def _sample(value, **labels):
    return {"metric": labels, "value": [0, str(value)]}


# What Prometheus holds, as (counter, time asked) -> its vector: today, key A on the cluster
# and the fallback, key B on the cluster; yesterday, key A only.
TODAY = {
    m.USAGE_REQUESTS.prometheus: [
        _sample(10, key=A, destination="cluster"),
        _sample(2, key=A, destination="fallback"),
        _sample(4, key=B, destination="cluster"),
    ],
    m.USAGE_PROMPT_TOKENS.prometheus: [
        _sample(8000, key=A, destination="cluster"),
        _sample(500, key=A, destination="fallback"),
        _sample(1000, key=B, destination="cluster"),
    ],
    m.USAGE_COMPLETION_TOKENS.prometheus: [
        _sample(2000, key=A, destination="cluster"),
        _sample(100, key=A, destination="fallback"),
        _sample(400, key=B, destination="cluster"),
    ],
    m.USAGE_CACHED_TOKENS.prometheus: [_sample(2000, key=A, destination="cluster")],
    m.USAGE_COST.prometheus: [
        _sample(0.006, key=A, destination="cluster", phase="prefill"),
        _sample(0.008, key=A, destination="cluster", phase="decode"),
        _sample(0.0015, key=A, destination="fallback", phase="prefill"),
        _sample(0.0006, key=A, destination="fallback", phase="decode"),
        _sample(0.001, key=B, destination="cluster", phase="prefill"),
        _sample(0.0016, key=B, destination="cluster", phase="decode"),
    ],
}
YESTERDAY = {
    m.USAGE_REQUESTS.prometheus: [_sample(3, key=A, destination="cluster")],
    m.USAGE_PROMPT_TOKENS.prometheus: [_sample(300, key=A, destination="cluster")],
    m.USAGE_COMPLETION_TOKENS.prometheus: [_sample(30, key=A, destination="cluster")],
    m.USAGE_COST.prometheus: [_sample(0.0003, key=A, destination="cluster", phase="prefill")],
}


class _Prometheus(BaseHTTPRequestHandler):
    asked: ClassVar[list[tuple[str, float]]] = []

    def do_GET(self):
        q = parse_qs(urlsplit(self.path).query)
        promql, at = q["query"][0], float(q["time"][0])
        self.asked.append((promql, at))
        counter = re.search(r"increase\((\w+)", promql)[1]
        window = int(re.search(r"\[(\d+)s\]", promql)[1])
        held = {NOW: (TODAY, 18 * 3600), YESTERDAY_END: (YESTERDAY, 86400)}.get(at)
        vector = held[0].get(counter, []) if held is not None and window == held[1] else []
        if 'key="' in promql:
            key = re.search(r'key="([^"]+)"', promql)[1]
            vector = [s for s in vector if s["metric"]["key"] == key]
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": vector}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def prometheus():
    _Prometheus.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_each_key_and_day_gets_its_tokens_cluster_cost_by_phase_provider_cost_and_cache_hit_share(prometheus):
    rows = usage.report(usage.prometheus_query(prometheus), NOW, 2)
    assert [(r.day, r.key) for r in rows] == [("2026-12-06", A), ("2026-12-07", A), ("2026-12-07", B)]
    a = rows[1]
    assert (a.total("requests"), a.total("prompt"), a.total("completion")) == (12, 8500, 2100)
    assert (a.cluster_prefill_usd, a.cluster_decode_usd) == (0.006, 0.008)
    assert a.provider_usd == pytest.approx(0.0021)
    assert a.cache_hit_share == pytest.approx(0.25)  # 2000 of the cluster's 8000 prompt tokens
    assert rows[2].cache_hit_share == 0.0 and rows[2].provider_usd == 0.0
    # Each day asked at its end (today: now), over the day so far.
    assert {at for _, at in _Prometheus.asked} == {YESTERDAY_END, NOW}


def test_the_table_names_every_key_and_day_and_one_key_is_asked_for_alone(prometheus, capsys):
    assert usage.main(["--prometheus", prometheus, "--days", "2", "--key", B], now=NOW) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["day", "key", "requests"]
    # requests, prompt, completion, cache hit, cluster $ prefill and decode, provider $
    assert out[1].split() == ["2026-12-07", B, "4", "1000", "400", "0.0%", "0.0010", "0.0016", "0.0000"]
    assert len(out) == 2
    assert all(f'key="{B}"' in q for q, _ in _Prometheus.asked)
    assert A not in "\n".join(out)


def test_a_prometheus_that_does_not_answer_is_one_clear_error(capsys):
    assert usage.main(["--prometheus", "http://127.0.0.1:9", "--days", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("make usage: Prometheus at http://127.0.0.1:9 did not answer") and "Traceback" not in err


def test_a_key_that_is_not_a_key_id_is_refused_before_any_query(capsys):
    with pytest.raises(SystemExit):
        usage.main(["--key", 'k-x"} or vector(1'])
    assert "is not a key id" in capsys.readouterr().err
