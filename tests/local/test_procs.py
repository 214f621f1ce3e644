"""local/procs.py: a stopped run leaves nothing behind, and a leftover is named at the next start.

A stand-in `haproxy` (a shell script of that name, with Ray Serve's config path on its
command line, as Ray 2.60's HAProxyManager starts the real one) plays the process a killed
`make bench` left holding HAProxy's ports: no Ray started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from local import procs


def _fake_haproxy(tmp_path: Path, node: str) -> subprocess.Popen:
    exe = tmp_path / "haproxy"
    exe.write_text("#!/bin/sh\ntrap 'kill $!; exit 0' TERM\nsleep 120 &\nwait\n")
    exe.chmod(0o755)
    proc = subprocess.Popen([str(exe), "-db", "-f", f"{procs.HAPROXY_DIR}{node}/haproxy.cfg"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(p.pid == proc.pid for p in procs._haproxies()):
            return proc
        time.sleep(0.05)
    raise AssertionError("the stand-in haproxy did not show up")


def test_a_running_serve_haproxy_is_named_at_the_next_start_and_stopped_with_its_nodes(tmp_path, monkeypatch):
    proc = _fake_haproxy(tmp_path, "abc123")
    # Only the stand-in: a shared e2e stack may be running its own HAProxy beside this test.
    real = procs._haproxies
    monkeypatch.setattr(procs, "_haproxies", lambda: [p for p in real() if p.pid == proc.pid])
    monkeypatch.setattr(procs, "port_in_use", lambda port, host: False)
    try:
        line = procs.leftover_haproxy()
        assert line is not None and f"pid {proc.pid}" in line and "8404" in line and "kill" in line
        # Another node's HAProxy is left alone; its own node's is stopped.
        assert procs.stop_haproxy(["other"]) == [] and proc.poll() is None
        assert procs.stop_haproxy(["abc123"]) == [proc.pid]
        proc.wait(timeout=10)
        assert procs.leftover_haproxy() is None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_and_sighup_stop_a_run_as_ctrl_c_does(tmp_path):
    """A bench or make serve under `timeout` (SIGTERM) or a closed terminal (SIGHUP) runs its
    cleanup: the `finally` of the run executes before the process ends."""
    marker = tmp_path / "cleaned"
    code = (
        "import sys, time\n"
        "from local.procs import stop_on_signals\n"
        "with stop_on_signals():\n"
        "    try:\n"
        "        print('up', flush=True); time.sleep(60)\n"
        "    except KeyboardInterrupt:\n"
        f"        open({str(marker)!r}, 'w').write('yes')\n"
    )
    for sig in (signal.SIGTERM, signal.SIGHUP):
        marker.unlink(missing_ok=True)
        child = subprocess.Popen(
            [sys.executable, "-c", code], cwd=Path(procs.__file__).parents[1], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        os.kill(child.pid, sig)
        assert child.wait(timeout=30) == 0
        assert marker.read_text() == "yes", sig
    assert psutil.Process().is_running()


def test_free_ports_are_outside_the_ranges_the_stack_binds_at_random_and_never_repeat():
    """The kernel's ephemeral range (what bind(0) and every Ray, gRPC and vLLM process draw
    from) and Ray's worker ports (`ray start` defaults, 10002-19999) stay clear: a port picked
    there could be taken before the stack binds it."""
    from ray.scripts.scripts import start

    defaults = {p.name: p.default for p in start.params}
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [procs.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not low <= port <= high, port
        assert not defaults["min_worker_port"] <= port <= defaults["max_worker_port"], port


def test_a_free_port_skips_one_in_use(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((procs.HOST, 0))
        busy = taken.getsockname()[1]
        taken.listen()
        fresh = next(p for p in procs.FREE_PORTS if not procs.port_in_use(p) and p not in procs._handed_out)
        monkeypatch.setattr(procs.random, "sample", lambda population, k: [busy, fresh])
        assert procs.free_port() == fresh
