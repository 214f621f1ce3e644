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

And the pictures of what `pulumi up` creates (`DIAGRAMS`: docs/img/stack-<stack>.svg for the
dev and prod stacks, which README.md and docs/architecture.md show): each is the
`diagram.svg` that `make render STACK=<stack>` writes, so a change to the program or a stack
file changes the picture, and a picture not regenerated fails `--check`.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from infra.paths import ROOT, stack_file
from infra.plan.planning import format_plan, plan
from tools import diagram, diff, render, stackfile

DIAGRAMS = ("dev", "prod")  # the stacks whose pictures the docs show
BLOCK = re.compile(r"(<!-- generated: (?P<spec>[^>]+?) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)


def _fenced(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def gen_plan(stack: str) -> str:
    cfg = stackfile.load_offline(*stackfile.read(stack), stack_file(stack)).config  # plans need no secret
    return _fenced(f"Capacity plan: {stack_file(stack)} ({cfg.environment.value})\n{format_plan(plan(cfg))}")


@functools.cache
def _rendered(stack: str) -> render.Rendered:
    return render.render(stack, stand_in_secrets=True)


def gen_costs(*stacks: str) -> str:
    parts = []
    for stack in stacks:
        summary = render.summary(_rendered(stack)).splitlines()
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


def gen_diagram(stack: str) -> str:
    """The diagram.svg that `make render STACK=<stack>` writes, byte for byte."""
    with tempfile.TemporaryDirectory() as tmp:
        render.write(_rendered(stack), Path(tmp))
        return (Path(tmp) / diagram.FILE).read_text()


def diagram_files() -> dict[Path, str]:
    """docs/img/stack-<stack>.svg -> its stack."""
    return {ROOT / "docs" / "img" / f"stack-{stack}.svg": stack for stack in DIAGRAMS}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def regenerate(text: str, source: str) -> str:
    def one(m: re.Match[str]) -> str:
        name, *args = m.group("spec").split()
        if name not in GENERATORS:
            raise SystemExit(f"{source}: unknown generator {name!r} (known: {', '.join(GENERATORS)})")
        return m.group(1) + GENERATORS[name](*args) + m.group(4)

    return BLOCK.sub(one, text)


def stale(files: list[Path] | None = None, diagrams: dict[Path, str] | None = None) -> list[str]:
    """The docs whose generated blocks differ from what the generators print now, and the
    diagrams (all of them when no files are named) that are missing or differ."""
    out = []
    for path in doc_files() if files is None else files:
        text = path.read_text()
        if BLOCK.search(text) and regenerate(text, path.name) != text:
            out.append(path.relative_to(ROOT).as_posix())
    if diagrams is None:
        diagrams = diagram_files() if files is None else {}
    for path, stack in diagrams.items():
        if not path.is_file() or path.read_text() != gen_diagram(stack):
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
    for path, stack in diagram_files().items():
        svg = gen_diagram(stack)
        if not path.is_file() or path.read_text() != svg:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(svg)
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
