"""Ports, signals, leftovers and the one-instance lock of a local run, shared by `make serve`,
the tests and the benches.

What flows through here: a port number -> whether it is free, a free one, or an exclusive
lock file under the cache folder that the kernel releases when the holder dies; SIGTERM and
SIGHUP -> the same clean stop as Ctrl-C (`stop_on_signals`); the HAProxy processes Ray Serve
starts for a local stack in its HAProxy data plane -> stopped with the stack, and a leftover
one (its parent gone: a run killed before it could clean up) named in one line at the next
start instead of a Serve traceback (`leftover_haproxy`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import signal
import socket
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from local.config import HOST


# --- one instance per port -------------------------------------------------------------
class AlreadyRunning(RuntimeError):
    pass


def _cache_dir() -> Path:
    from local.tiny_model import default_cache_dir

    return default_cache_dir()


@contextlib.contextmanager
def instance_lock(port: int, lock_dir: Path | None = None) -> Iterator[Path]:
    """Hold `<cache>/serve-<port>.lock` for the life of the run; refuse a second one.

    flock is released by the kernel when the process dies, so a crashed run never leaves
    a stale lock behind.
    """
    lock_dir = lock_dir or _cache_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / f"serve-{port}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown pid"
            raise AlreadyRunning(
                f"a local serving stack is already running on port {port} ({holder}); "
                "stop it with Ctrl-C in its terminal, or pick another port: make serve PORT=8001"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# Where free_port looks: above Ray's worker ports (`ray start --max-worker-port`, 19999 by
# default) and below Linux's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by
# default). A port the kernel hands out for `bind(0)` is an ephemeral one, the range every
# Ray, gRPC and vLLM process of the stack also draws from while it starts, so a port picked
# that way and bound seconds later (the Serve port, which HAProxy binds once Serve is up)
# could be taken by then: "cannot bind socket (Address already in use)", 2026-12-06.
FREE_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, outside the ranges the stack's own processes bind at random, and not
    one this process has handed out before (it may not be bound yet)."""
    for port in random.sample(FREE_PORTS, 200):
        if port in _handed_out or port_in_use(port):
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} after 200 tries")


def interrupt_and_wait(proc: subprocess.Popen, timeout: float = 60) -> int:
    """Stop a child as Ctrl-C would (SIGINT), then SIGKILL after `timeout`; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# --- signals ----------------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (a `timeout`, a closed terminal) stop the run as Ctrl-C does, so the
    cleanup of every `finally` runs (the main thread only; elsewhere nothing changes)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, *STOP_SIGNALS)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# --- Ray Serve's HAProxy (the haproxy data plane) -----------------------------------------------
# Ray 2.60 starts `haproxy -db -f /tmp/haproxy-serve/<node id>/haproxy.cfg` per node from its
# HAProxyManager actor (ray/serve/_private/haproxy.py, RAY_SERVE_HAPROXY_CONFIG_FILE_LOC); the
# process outlives an actor that is killed, and holds the stats (8404) and exporter (9101) ports.
HAPROXY_DIR = "/tmp/haproxy-serve/"
HAPROXY_PORTS = (8404, 9101)


def _haproxies() -> list[Any]:
    import psutil

    out = []
    for proc in psutil.process_iter(["name", "cmdline", "ppid"]):
        cmd = proc.info.get("cmdline") or []
        if proc.info.get("name", "").startswith("haproxy") and any(HAPROXY_DIR in a for a in cmd):
            out.append(proc)
    return out


def leftover_haproxy() -> str | None:
    """One line naming a Serve HAProxy that is already running (of an earlier stack whose
    parent is gone, or of another stack), or a process holding one of HAProxy's ports; None
    when a new stack can take them."""
    import psutil

    for proc in _haproxies():
        cfg = next((a for a in proc.info["cmdline"] if HAPROXY_DIR in a), "")
        parent = proc.info.get("ppid")
        orphan = parent in (0, 1) or not psutil.pid_exists(parent)
        whose = "an earlier local stack, its parent gone" if orphan else "another local stack"
        return (
            f"a HAProxy of {whose} is running (pid {proc.pid}, {cfg}) and holds ports "
            f"{', '.join(map(str, HAPROXY_PORTS))}: stop it (`kill {proc.pid}`) and start again"
        )
    for port in HAPROXY_PORTS:
        if port_in_use(port, "0.0.0.0"):
            return (
                f"port {port} (HAProxy's in the haproxy data plane) is in use by another process: "
                "free it, or run with PD_DATA_PLANE=ray-proxy"
            )
    return None


def stop_haproxy(node_ids: Iterable[str]) -> list[int]:
    """Stop the HAProxy processes of these Ray nodes (what Ray leaves when its actors are
    killed at shutdown); the pids stopped."""
    import psutil

    ids = [f"{HAPROXY_DIR}{n}/" for n in node_ids]
    mine = [p for p in _haproxies() if any(i in a for a in p.info["cmdline"] for i in ids)]
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(mine, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [p.pid for p in mine]
