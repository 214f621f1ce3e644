"""Ports and the one-instance lock of a local run, shared by `make serve`, the tests and the bench.

What flows through here: a port number -> whether it is free, a free one, or an exclusive
lock file under the cache folder that the kernel releases when the holder dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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
