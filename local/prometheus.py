"""A Prometheus server for the local stack (`make serve SIGNALS=1`), scraping it as the cloud's does.

What flows through here: the local Ray nodes (their metrics endpoints and role labels, from
local.cluster) -> a Prometheus config that scrapes each endpoint every SCRAPE_S and
gives its series `role=<the node's label>` (the label the cloud's PodMonitor gives the Ray
pods' series, infra/k8s/monitoring.py ROLE) -> Prometheus (Debian's 2.42 binary, unpacked by
the Makefile into .cache/, or one on PATH) listening on 127.0.0.1 -> its URL, given to the
Ray cluster as RAY_PROMETHEUS_HOST before it starts, so that the Serve controller's per-role
autoscaling policies (serving/engines/autoscaling.py) read vLLM's engine metrics through Ray's
PrometheusQueryMixin exactly as in the cloud.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from infra.k8s.monitoring import ROLE as ROLE_LABEL
from infra.paths import ROOT

SCRAPE_S = 2
CACHED_BINARY = ROOT / ".cache" / "prometheus" / "usr" / "bin" / "prometheus"
PROMETHEUS_HOST_ENV = "RAY_PROMETHEUS_HOST"


class PrometheusMissing(RuntimeError):
    pass


def binary() -> Path:
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    if CACHED_BINARY.exists():
        return CACHED_BINARY
    raise PrometheusMissing(
        f"no prometheus binary on PATH or at {CACHED_BINARY.relative_to(ROOT)}: run `make serve SIGNALS=1`, "
        "which unpacks Debian's prometheus package there"
    )


def scrape_config(nodes: Iterable[Mapping[str, Any]]) -> str:
    """prometheus.yml: one static target per node, labelled with its role (JSON is YAML)."""
    import json
    from urllib.parse import urlsplit

    targets = []
    for n in nodes:
        url = urlsplit(n["metrics_url"])
        targets.append({"targets": [url.netloc], "labels": {ROLE_LABEL: str(n["label"])}})
    doc = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "ray", "metrics_path": "/metrics", "static_configs": targets}],
    }
    return json.dumps(doc, indent=2)


class LocalPrometheus:
    """One Prometheus process for the life of the local stack."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.port, self.host = port, host
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        exe = binary()
        self._dir = tempfile.TemporaryDirectory(prefix="pd-prometheus-")
        cfg = Path(self._dir.name) / "prometheus.yml"
        cfg.write_text(scrape_config(nodes))
        self._proc = subprocess.Popen(
            [
                str(exe),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={Path(self._dir.name) / 'data'}",
                "--storage.tsdb.retention.time=2h",
                f"--web.listen-address={self.host}:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(Path(self._dir.name) / "prometheus.log").open("wb"),
        )

    def ready(self, timeout: float = 30) -> bool:
        import time

        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._proc is not None and self._proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
