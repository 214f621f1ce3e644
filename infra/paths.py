"""Where things are in the repository: the one place that knows the tree's root.

What flows through here: nothing but constants. The program (the serving zip), the offline
tools (stack files, render output) and the local serving run all take paths from here.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STACKS_DIR = ROOT / "stacks"
SERVING_DIR = ROOT / "serving"
BUILD_DIR = ROOT / "build"
CACHE_DIR = ROOT / ".cache"


def stack_file(stack: str) -> str:
    """A stack file's path as messages name it: relative to the repository root."""
    return f"stacks/Pulumi.{stack}.yaml"
