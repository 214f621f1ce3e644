"""`make bench` (part): how long the local decode role takes to scale out, and back in.

What flows through here: a fresh local stack (`python -m local`, the disaggregated
app, decode autoscaling 1-2 as `make serve` runs it) -> `local.decode_autoscale`: 24
concurrent streamed completions until a second decode replica RUNS, then idle until one is
left -> the scale-out delay (and when Serve decided), the scale-in delay, request outcomes
-> a few lines on screen and build/bench/decode-autoscale.json. A benchmark prints figures; it does
not pass or fail. On this CPU the scale-out time is mostly a vLLM engine starting.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench import BENCH_DIR

DEFAULT_OUT = BENCH_DIR / "decode-autoscale.json"


def stack_options() -> dict[str, Any]:
    """background_stack's arguments: the disaggregated app as `make serve` runs it (decode
    autoscaled 1-2; tests/bench/test_decode_autoscale.py builds what it deploys, without Ray)."""
    return {"mode": "disaggregated", "api_key": "sk-bench"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_autoscale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--clients", type=int, default=24)
    args = ap.parse_args(argv)

    from local.background import background_stack
    from local.decode_autoscale import measure_decode_scaling

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with background_stack(**stack_options(), log_path=args.out.parent / "decode-autoscale-serve.log") as stack:
        run = measure_decode_scaling(
            stack.state["dashboard_url"], stack.urls["disaggregated"], stack.api_key, stack.model, clients=args.clients
        )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        **run.as_dict(),
    }
    args.out.write_text(json.dumps(result, indent=2))

    def s(v: float | None) -> str:
        return "did not happen" if v is None else f"{v:.1f} s"

    print(f"Decode autoscaling, local stack, {args.clients} concurrent streams (target 8 ongoing per replica):")
    print(f"  scale-out: {s(run.scale_out_s)} to a 2nd replica RUNNING (Serve decided after {s(run.decision_s)})")
    print(f"  scale-in:  {s(run.scale_in_s)} after the load stopped, back to 1 replica")
    print(f"  requests:  {run.requests_ok} ok, {run.requests_failed} failed")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
