"""The replica counting `make bench`'s decode-autoscale figures rely on (no Ray started).

Shape of Serve's REST status (Ray 2.60 dashboard `GET /api/serve/applications/`):
applications -> <app> -> deployments -> <name> -> replicas[] with `state`.
"""

from __future__ import annotations

import httpx
import pytest

from local import decode_autoscale


def _status(replica_states):
    return {
        "applications": {
            "llm": {
                "deployments": {
                    "OpenAiIngress": {"replicas": [{"state": "RUNNING"}]},
                    "PDDecodeServer:tiny-llama": {"replicas": [{"state": s} for s in replica_states]},
                    "PDPrefillServer:tiny-llama": {"replicas": [{"state": "RUNNING"}]},
                }
            }
        }
    }


@pytest.mark.parametrize(
    ("states", "counts"),
    [(["RUNNING"], (1, 1)), (["RUNNING", "STARTING"], (1, 2)), (["RUNNING", "RUNNING"], (2, 2))],
)
def test_decode_replicas_counts_running_and_all(monkeypatch, states, counts):
    body = _status(states)
    monkeypatch.setattr(
        httpx, "get", lambda url, timeout: httpx.Response(200, json=body, request=httpx.Request("GET", url))
    )
    assert decode_autoscale.decode_replicas("http://127.0.0.1:1") == counts


def test_no_decode_deployment_is_an_error(monkeypatch):
    body = {"applications": {"llm": {"deployments": {"LLMServer:x": {"replicas": []}}}}}
    monkeypatch.setattr(
        httpx, "get", lambda url, timeout: httpx.Response(200, json=body, request=httpx.Request("GET", url))
    )
    with pytest.raises(RuntimeError, match="expected one decode deployment"):
        decode_autoscale.decode_replicas("http://127.0.0.1:1")
