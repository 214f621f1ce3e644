"""Program speed: what a `make render` (one evaluation of the Pulumi program) costs, per stack.

What flows through here: every stack in stacks/ -> the real program under the mock runtime,
repeated -> wall times, beside a baseline run in the same process of a one-resource Pulumi
program under the same mocks (the runtime's fixed cost) -> a table and ratios, plus the
resources each stack registers, and a cold `python -m tools.render` per stack beside a cold
import of the Pulumi SDKs. Figures, not a test: nothing here passes or fails.

    python -m bench.program [--repeat 5] [--json build/bench/program.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import BENCH_DIR
from infra.paths import ROOT
from tools import mock_runtime, render, stackfile

BASELINE_PROGRAM = """
import pulumi, pulumi_aws as aws
bucket = aws.s3.Bucket("baseline")
pulumi.export("bucket", bucket.bucket)
"""


def _timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _cold(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t


def measure(repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        baseline_path = Path(tmp) / "__main__.py"
        baseline_path.write_text(BASELINE_PROGRAM)
        mock_runtime.run("baseline", {}, program=baseline_path)  # warm imports once
        baseline = _timed(lambda: mock_runtime.run("baseline", {}, program=baseline_path), repeat)
        cold_import = _cold([sys.executable, "-c", "import pulumi, pulumi_aws, pulumi_eks, pulumi_kubernetes"])
        stacks = {}
        for stack in stackfile.stacks():
            rendered = render.render(stack, stand_in_secrets=True)  # warm
            times = _timed(lambda s=stack: render.render(s, stand_in_secrets=True).manifests(), repeat)
            with tempfile.TemporaryDirectory() as out:
                cold = _cold(
                    [sys.executable, "-m", "tools.render", "--stack", stack, "--out", out, "--stand-in-secrets"]
                )
            stacks[stack] = {
                "resources": len(rendered.result.resources),
                "manifests": len(rendered.manifests()),
                "median_s": statistics.median(times),
                "min_s": min(times),
                "ratio_vs_baseline": statistics.median(times) / statistics.median(baseline),
                "cold_render_s": cold,
                "cold_ratio_vs_import": cold / cold_import,
            }
    return {
        "repeat": repeat,
        "baseline_median_s": statistics.median(baseline),
        "cold_import_s": cold_import,
        "stacks": stacks,
    }


def table(result: dict) -> str:
    lines = [
        f"Pulumi program under mocks, {result['repeat']} runs each (median); baseline: one-resource program "
        f"{result['baseline_median_s'] * 1000:.1f} ms; cold SDK import {result['cold_import_s']:.2f} s",
        f"{'stack':10s} {'resources':>9s} {'manifests':>9s} {'median ms':>10s} {'x baseline':>10s} {'cold render s':>14s} {'x import':>9s}",
    ]
    for name, s in result["stacks"].items():
        lines.append(
            f"{name:10s} {s['resources']:9d} {s['manifests']:9d} {s['median_s'] * 1000:10.1f} "
            f"{s['ratio_vs_baseline']:10.1f} {s['cold_render_s']:14.2f} {s['cold_ratio_vs_import']:9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.program", description="Time the Pulumi program per stack.")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=BENCH_DIR / "program.json")
    args = ap.parse_args(argv)
    result = measure(max(1, args.repeat))
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
