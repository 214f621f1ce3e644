"""`make serve`'s start time, cold and warm, as `make bench` takes it before its load.

What flows through here: `make serve` (the disaggregated app) started in the background, once
with an empty model cache (cold: the tiny model is built) and once with the cache warm ->
its own `READY in <s>s` line and its `[<s>s] <step>` progress lines -> seconds to READY and
the steps, for build/bench/serving.json (`start_times`) and docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def start_options(cache_dir: str | None) -> dict[str, Any]:
    """background_stack's arguments for a timed `make serve`; cold: `cache_dir`, an empty model cache."""
    return {
        "mode": "disaggregated",
        "api_key": "sk-bench",
        "extra_env": {"PD_CACHE_DIR": cache_dir} if cache_dir else {},
    }


_READY = re.compile(r"^READY in (\d+(?:\.\d+)?)s")
_STEP = re.compile(r"^\[\s*(\d+(?:\.\d+)?)s\] (.*)$")


def start_time(cold: bool, log_dir: Path) -> dict[str, Any]:
    """`make serve` (disaggregated) once, timed by its own READY line; cold: an empty model cache."""
    from local.background import background_stack

    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="pd-cold-")) if cold else None
        log = log_dir / f"serve-{'cold' if cold else 'warm'}.log"
        with background_stack(**start_options(cache), log_path=log) as running:
            ready = _READY.match(running.ready_line)
            steps = [m.groups() for line in running.output if (m := _STEP.match(line.strip()))]
    return {
        "ready_s": float(ready.group(1)) if ready else None,
        "steps": [{"at_s": float(at), "step": what} for at, what in steps],
    }


def start_times(args: argparse.Namespace, logs: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """A cold and a warm `make serve` timed (none with --no-start-times)."""
    starts: dict[str, Any] = {}
    if not args.no_start_times:
        for kind in ("cold", "warm"):
            say(f"timing a {kind} `make serve` (disaggregated)")
            starts[kind] = start_time(kind == "cold", logs)
            say(f"{kind} start: READY in {starts[kind]['ready_s']}s")
    return starts


def save_start_times(out: Path, starts: dict[str, Any]) -> None:
    """--start-times-only: the figures added to an existing --out file."""
    report = json.loads(out.read_text()) if out.is_file() else {}
    report["start_times"] = {
        **starts,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": list(os.getloadavg()),
    }
    out.write_text(json.dumps(report, indent=2))
