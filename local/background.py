"""`make serve` as a subprocess for the tests and the bench: start, wait for READY, stop.

What flows through here: a mode, a port and an API key -> `python -m local` started
with a state file -> once it prints READY, its URLs, key and node metrics endpoints (read
from the state file) -> Ctrl-C (SIGINT) on exit, as a person would stop it. `plan_stack`
takes the same arguments and starts nothing: the Serve config and Ray environment that
command would deploy, for the benches' dry runs (tests/bench).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.paths import ROOT
from local.procs import free_port, interrupt_and_wait, stop_on_signals
from serving.spec import API_KEYS_ENV


# --- running the command in the background (tests, make bench) ------------------------------
@dataclass
class RunningStack:
    """A `python -m local` subprocess that has printed its ready line."""

    proc: Any
    port: int
    state: dict[str, Any]
    ready_line: str
    output: list[str]

    @property
    def urls(self) -> dict[str, str]:
        return self.state["urls"]

    @property
    def api_key(self) -> str | None:
        return self.state["api_key"]

    @property
    def model(self) -> str:
        return self.state["model"]

    @property
    def nodes(self) -> list[dict[str, Any]]:
        return self.state["nodes"]

    def stop(self, timeout: float = 120) -> int:
        """Ctrl-C, as a person would; wait for Ray to go down. Returns the exit status."""
        return interrupt_and_wait(self.proc, timeout)


def _command(
    mode: str,
    port: int,
    state_file: Path,
    timeout: float,
    api_key: str | None,
    extra_keys: tuple[str, ...],
    extra_args: Sequence[str],
    extra_env: Mapping[str, str] | None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """`python -m local` with these options, and its environment (`environ`, by default this
    process's, plus `extra_env`)."""
    env = {**(os.environ if environ is None else environ), **(extra_env or {})}
    cmd = [sys.executable, "-m", "local", "--port", str(port), "--mode", mode]
    cmd += ["--state-file", str(state_file), "--timeout", str(timeout), *extra_args]
    if api_key:
        env[API_KEYS_ENV] = ",".join([api_key, *extra_keys])
    else:
        env.pop(API_KEYS_ENV, None)
        cmd.append("--no-auth")
    return cmd, env


@dataclass
class StackPlan:
    """What `python -m local` would deploy for a background_stack call, built without starting it."""

    argv: list[str]
    config: dict[str, Any]  # the Serve config PUT to the dashboard
    ray_env: dict[str, str]  # what the Ray nodes start with (ServingSpec.ray_env)


def plan_stack(
    *,
    mode: str = "both",
    port: int = 8000,
    api_key: str | None = "sk-local-test",
    extra_env: Mapping[str, str] | None = None,
    extra_keys: tuple[str, ...] = (),
    extra_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    model_dir: Path = Path("/models/plan"),
) -> StackPlan:
    """background_stack's arguments -> the same command line and environment -> `python -m
    local`'s own parsing, settings checks and render (local/__main__.py), with nothing started:
    a bad setting or spec raises here as it would there. `environ` stands for this process's
    environment (tests pass a clean one)."""
    from local.__main__ import mode_problem, parse_args, render_config
    from local.config import LocalConfigError, data_plane_env, hybrid_from_env, models_problem
    from local.ray_pd import ray_env_for

    cmd, env = _command(mode, port, Path("state.json"), 600, api_key, extra_keys, extra_args, extra_env, environ)
    args = parse_args(cmd[3:], environ=env)
    problem = models_problem(args.models, args.mode) or mode_problem(args)
    if problem:
        raise LocalConfigError(problem)
    if args.models > 1:
        raise LocalConfigError("a plan of the many-model form needs its local S3 (not planned here)")
    config = render_config(args, model_dir, hybrid_from_env(dict(env)), {})
    return StackPlan(argv=cmd, config=config, ray_env=ray_env_for(args.mode, data_plane_env(args.data_plane)))


@contextlib.contextmanager
def background_stack(
    *,
    mode: str = "both",
    port: int | None = None,
    api_key: str | None = "sk-local-test",
    log_path: Path | None = None,
    timeout: float = 600,
    extra_env: Mapping[str, str] | None = None,
    extra_keys: tuple[str, ...] = (),
    extra_args: Sequence[str] = (),
) -> Iterator[RunningStack]:
    """Start `python -m local` in a subprocess, yield once it is ready, stop it after.

    extra_env: added to the command's environment (Ray and its workers inherit it).
    extra_keys: accepted besides `api_key` (the stack's own key stays the first).
    extra_args: more command-line options (e.g. ["--decode-replicas", "2"]).
    """
    import subprocess
    import tempfile
    import threading

    port = port or free_port()
    tmp = Path(tempfile.mkdtemp(prefix="pd-serve-"))
    state_file = tmp / "state.json"
    cmd, env = _command(mode, port, state_file, timeout, api_key, extra_keys, extra_args, extra_env)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    output: list[str] = []
    ready = threading.Event()
    # Written by the pump thread for the life of the process; closed in the finally below.
    log = open(log_path or tmp / "serve.log", "a", buffering=1)  # noqa: SIM115

    def pump() -> None:
        # Keep draining the pipe for the life of the process, or it would block on writes.
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            output.append(line)
            log.write(line)
            if line.startswith("READY"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    running = RunningStack(proc=proc, port=port, state={}, ready_line="", output=output)
    # A bench or a test stopped by SIGTERM or SIGHUP (a `timeout` around `make bench`) stops
    # its stack as on Ctrl-C: nothing it started is left behind.
    signals = contextlib.ExitStack()
    signals.enter_context(stop_on_signals())
    try:
        if not ready.wait(timeout + 60) or proc.poll() is not None or not state_file.exists():
            tail = "".join(output[-60:])
            raise RuntimeError(f"`{' '.join(cmd)}` did not become ready (exit {proc.poll()}):\n{tail}")
        running.state = json.loads(state_file.read_text())
        running.ready_line = next(line for line in output if line.startswith("READY"))
        yield running
    finally:
        running.stop()
        log.close()
        signals.close()
