"""Which stacks a change touches, and which stacks deploy in which environment, for CI.

What flows through here: the paths a pull request changes (`git diff --name-only`) and the
stack files in stacks/ -> the stacks to preview, as a GitHub Actions matrix
(`[{"stack": ..., "region": ...}]`); or an environment name -> every stack whose
`environment` is that (the deploy workflow updates dev stacks on merge, staging and prod
stacks behind their GitHub environments' approvals).

    python -m tools.affected --changed changed.txt     # pull request: stacks to preview
    python -m tools.affected --environment prod        # merge: prod stacks to update

A stack is affected when its own file changes, or when anything every stack runs changes:
the program (infra/, serving/ but not local/, __main__.py, Pulumi.yaml), its dependencies
(requirements*.txt) or the policy pack every preview and update applies (policies/).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from infra.paths import stack_file
from tools import stackfile

# What `pulumi up` runs or ships; local/ (the local-only serving code), tools/, bench/ and tests/
# are outside it.
SHARED_DIRS = ("infra/", "serving/", "policies/")
SHARED_FILES = re.compile(r"^(__main__\.py|Pulumi\.yaml|requirements[\w.-]*\.txt)$")
STACK_FILE = re.compile(r"^stacks/Pulumi\.([^/]+)\.yaml$")


class AffectedError(Exception):
    """A stack file CI cannot use; one line."""


def affected(changed: Iterable[str], stacks: Iterable[str]) -> list[str]:
    """The stacks (of `stacks`) that the changed paths touch, sorted."""
    stacks = sorted(stacks)
    hit: set[str] = set()
    for path in (p.strip() for p in changed):
        if not path:
            continue
        if path.startswith(SHARED_DIRS) or SHARED_FILES.match(path):
            return stacks
        m = STACK_FILE.match(path)
        if m and m.group(1) in stacks:  # a deleted stack has nothing left to preview
            hit.add(m.group(1))
    return sorted(hit)


def _row(stack: str) -> dict[str, str]:
    try:
        values, _, others = stackfile.read(stack)
    except stackfile.StackFileError as e:
        raise AffectedError(str(e)) from None
    region = others.get("aws:region")
    if not isinstance(region, str) or not region:
        raise AffectedError(
            f"{stack_file(stack)}: aws:region: required key is missing (CI needs it for AWS credentials)"
        )
    return {"stack": stack, "region": region, "environment": str(values.get("environment", ""))}


def matrix(stacks: Iterable[str]) -> list[dict[str, str]]:
    return [_row(s) for s in stacks]


def in_environment(environment: str) -> list[str]:
    return [s for s in stackfile.stacks() if _row(s)["environment"] == environment]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.affected", description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--changed", type=Path, help="file of changed paths, one per line ('-': stdin)")
    group.add_argument("--environment", help="every stack whose environment is this (dev, staging, prod)")
    args = ap.parse_args(argv)
    try:
        if args.changed is not None:
            text = sys.stdin.read() if str(args.changed) == "-" else args.changed.read_text()
            rows = matrix(affected(text.splitlines(), stackfile.stacks()))
        else:
            rows = matrix(in_environment(args.environment))
    except (AffectedError, OSError) as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps(rows, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
