"""Target c of `make bench`: vLLM's own OpenAI server, started beside the Ray stack.

What flows through here: the tiny model's directory, its served id, a free port and the
engines' environment -> `python -m vllm.entrypoints.openai.api_server` with local/config.py's
arguments and environment (the same the local engines run with; a caller's extra arguments
after them), its log to a file ->
healthy once `/health` answers 200; interrupted and waited for on the way out.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from infra.paths import ROOT as REPO_ROOT


@contextlib.contextmanager
def vllm_server(
    model_dir: str,
    model_id: str,
    port: int,
    env_extra: dict[str, str],
    log_path: Path,
    extra_args: Sequence[str] = (),
):
    from local.plain_vllm import PLAIN_VLLM_ENV, plain_vllm_argv
    from local.procs import interrupt_and_wait

    env = {**os.environ, **env_extra, **PLAIN_VLLM_ENV}
    cmd = [*plain_vllm_argv(model_dir, model_id, port), *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            yield proc
        finally:
            interrupt_and_wait(proc, 60)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(2)
    raise TimeoutError(f"vLLM server at {url} not healthy after {timeout:.0f}s")
