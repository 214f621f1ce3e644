"""`make docs`: regenerate the command outputs that the docs show, so none is pasted by hand.

What flows through here: every `docs/*.md` and `README.md` -> each block between
`<!-- generated: <generator> <args> -->` and `<!-- /generated -->` -> the output of that
generator, run in-process on the current stack files -> the file rewritten (`make docs`), or,
with `--check`, the names of the files whose blocks are stale (the test suite runs the check,
so a change that alters an output fails until `make docs` is run and the result committed).

Generators (each prints what the named command prints, or a stated part of it):
- `plan <stack>`: `make plan STACK=<stack>`;
- `costs <stack>...`: the GPU-pool lines of `make render STACK=<stack>` for each stack;
- `diff <a> <b>`: the stack-file part and the resource totals of `make diff A=<a> B=<b>`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from infra.paths import ROOT, stack_file
from infra.plan.planning import format_plan, plan
from tools import diff, render, stackfile

BLOCK = re.compile(r"(<!-- generated: (?P<spec>[^>]+?) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)


def _fenced(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def gen_plan(stack: str) -> str:
    cfg = stackfile.load_offline(*stackfile.read(stack), stack_file(stack)).config  # plans need no secret
    return _fenced(f"Capacity plan: {stack_file(stack)} ({cfg.environment.value})\n{format_plan(plan(cfg))}")


def gen_costs(*stacks: str) -> str:
    parts = []
    for stack in stacks:
        summary = render.summary(render.render(stack, stand_in_secrets=True)).splitlines()
        pools = summary[next(i for i, line in enumerate(summary) if line.startswith("GPU pools")) :]
        parts.append(f"# make render STACK={stack}\n" + "\n".join(pools))
    return _fenced("\n\n".join(parts))


def gen_diff(a: str, b: str) -> str:
    text = diff.format_report(diff.compare(diff.from_stack(a), diff.from_stack(b)))
    lines = text.splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("Resources (matched"))
    return _fenced("\n".join(lines[: cut + 1]))


GENERATORS: dict[str, Callable[..., str]] = {
    "plan": gen_plan,
    "costs": gen_costs,
    "diff": gen_diff,
}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def regenerate(text: str, source: str) -> str:
    def one(m: re.Match[str]) -> str:
        name, *args = m.group("spec").split()
        if name not in GENERATORS:
            raise SystemExit(f"{source}: unknown generator {name!r} (known: {', '.join(GENERATORS)})")
        return m.group(1) + GENERATORS[name](*args) + m.group(4)

    return BLOCK.sub(one, text)


def stale(files: list[Path] | None = None) -> list[str]:
    """The docs whose generated blocks differ from what the generators print now."""
    out = []
    for path in files or doc_files():
        text = path.read_text()
        if BLOCK.search(text) and regenerate(text, path.name) != text:
            out.append(path.relative_to(ROOT).as_posix())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 and name the stale files; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"{name}: generated output is stale; run `make docs` and commit the result", file=sys.stderr)
        return 1 if bad else 0
    for path in doc_files():
        text = path.read_text()
        new = regenerate(text, path.name)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
