"""A local stack held by a driver process, as `make bench` holds one: for the e2e tests that end
it the way a bench is ended (a signal to the driver), not by Ctrl-C to `python -m local`.

What flows through here: background_stack's keyword arguments -> a `python -c` driver that
enters background_stack with them and prints one `UP <json>` line (the stack's port and state)
-> a RunningStack whose `proc` is the driver: `stop()` interrupts the driver, which stops the
stack as a bench interrupted by Ctrl-C does; a test may send it SIGTERM instead.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from infra.paths import ROOT
from local.background import RunningStack
from local.procs import interrupt_and_wait

_DRIVER = """\
import json, sys, time
from pathlib import Path
from local.background import background_stack
kwargs = json.loads(sys.argv[1])
kwargs["log_path"] = Path(kwargs["log_path"]) if kwargs.get("log_path") else None
with background_stack(**kwargs) as s:
    print("UP " + json.dumps({"port": s.port, "state": s.state, "ready_line": s.ready_line}), flush=True)
    time.sleep(24 * 3600)
"""


@contextlib.contextmanager
def driven_stack(**kwargs: Any) -> Iterator[RunningStack]:
    """background_stack(**kwargs) in a driver process; the driver is stopped (if still running)
    on exit. `log_path` may be a Path; the other arguments must be JSON values."""
    if kwargs.get("log_path") is not None:
        kwargs["log_path"] = str(kwargs["log_path"])
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, json.dumps(kwargs)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout is not None  # stdout=PIPE
        line = driver.stdout.readline()
        if not line.startswith("UP "):
            raise RuntimeError(f"the driven stack did not come up (exit {driver.wait(timeout=120)}): {line!r}")
        up = json.loads(line[3:])
        yield RunningStack(proc=driver, port=up["port"], state=up["state"], ready_line=up["ready_line"], output=[])
    finally:
        interrupt_and_wait(driver, 180)  # SIGINT as Ctrl-C, SIGKILL after 180 s; nothing if it ended
