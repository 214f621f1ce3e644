"""Stack-to-stack comparison: what B has that A does not, by key path.

What flows through here: two stack names -> each stack file's values (`tools.stackfile`,
secrets as <secret>) and each stack's registered resources (`tools.render.render`, the real
program under mocks) -> one report: the stack files' differences, then the Kubernetes
manifests' and the other resources' differences, each resource matched by (type, name).
With --rendered the two sides are directories written by `python -m tools.render --out`
(CI renders a pull request's base and head that way), and there is no stack-file section.

    python -m tools.diff staging prod
    python -m tools.diff --rendered base/build/dev build/dev --markdown --title dev

Report lines: `+` only B has it, `-` only A has it, `~` A's value -> B's value. Identical
resources are counted, not listed; a change that repeats in many resources (the environment
tag on every AWS resource) is listed once. The stack's own name is written `<stack>` where
the program derives a name from it (`pd-inference-<stack>`, the stack tag, URNs), so two
stacks that differ only in name compare equal. Exit 0 with a report, 1 with one line on error.

Why a walk of our own instead of DeepDiff: the walk (`changes`, ~45 lines) is what decides
the report's lines, and each of its rules would be an adapter over DeepDiff's report: one
line per leaf of an added subtree, A's key order, a list of plain values reported as items
added or dropped (not index by index), and JSON/YAML held in strings (IAM policies,
serveConfigV2) compared as documents. Everything else here (stack-name normalization,
matching resources, grouping a change repeated across resources) is ours either way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.config import PROJECT
from infra.k8s import upgrades
from infra.paths import stack_file
from tools import mock_runtime, render, stackfile

SECRET = "<secret>"
STACK_TAG = f"{PROJECT}/stack"
# A change repeated in at least this many resources is listed once, above them.
COMMON_MIN = 3
# Lines per resource before the rest is counted instead (a runaway diff stays bounded).
MAX_LINES_PER_RESOURCE = 200
MAX_VALUE_CHARS = 90


class DiffError(Exception):
    """A stack or directory that cannot be compared; one line."""


@dataclass(frozen=True)
class Change:
    op: str  # "+" only in B, "-" only in A, "~" changed
    path: str
    a: Any = None
    b: Any = None

    def line(self) -> str:
        if self.op == "+":
            return f"+ {self.path}: {fmt(self.b)}"
        if self.op == "-":
            return f"- {self.path}: {fmt(self.a)}"
        return f"~ {self.path}: {fmt(self.a)} -> {fmt(self.b)}"


@dataclass
class Side:
    """One side of the comparison: its label, stack-file values (or None) and resources."""

    label: str
    stack: str
    values: dict[str, Any] | None
    resources: list[mock_runtime.Registered]


@dataclass
class ResourceDiff:
    key: tuple[str, str]
    label: str  # "type name", with the manifest file for Kubernetes objects
    changes: list[Change] = field(default_factory=list)


@dataclass
class Report:
    a: Side
    b: Side
    config: list[Change] | None
    only_a: list[str]
    only_b: list[str]
    changed: list[ResourceDiff]
    common: list[tuple[Change, int]]
    only_common: int  # resources whose every change is one of `common`
    identical: Counter
    upgrades: list[str] = field(default_factory=list)  # what KubeRay does with each changed RayService

    @property
    def empty(self) -> bool:
        return not (self.config or self.only_a or self.only_b or self.changed or self.common)


# --- values -----------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """A value on one line: strings bare (quoted when empty or padded), the rest as JSON."""
    if isinstance(value, str) and value and value.strip() == value and "\n" not in value:
        text = value
    else:
        text = json.dumps(value, sort_keys=False, default=str)
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[: MAX_VALUE_CHARS - 1]}… ({len(text)} chars)"
    return text


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    key = str(key)
    if "." in key or " " in key:  # annotation keys and the like keep their dots readable
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _structured(text: str) -> Any:
    """A string holding a JSON or YAML document (IAM policies, serveConfigV2), parsed; else None."""
    stripped = text.strip()
    if stripped[:1] in "{[":
        try:
            return json.loads(stripped)
        except ValueError:
            pass
    if "\n" in stripped and ":" in stripped:
        try:
            doc = yaml.safe_load(stripped)
        except yaml.YAMLError:
            return None
        if isinstance(doc, (dict, list)):
            return doc
    return None


def _leaves(op: str, path: str, value: Any) -> list[Change]:
    """An added or removed subtree as one change per leaf, so every line names a key path."""
    if isinstance(value, dict) and value:
        out: list[Change] = []
        for k, v in value.items():
            out.extend(_leaves(op, _join(path, k), v))
        return out
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        out = []
        for i, v in enumerate(value):
            out.extend(_leaves(op, _join(path, i), v))
        return out
    return [Change(op, path, a=value) if op == "-" else Change(op, path, b=value)]


def changes(a: Any, b: Any, path: str = "") -> list[Change]:
    """Every difference between two JSON-like values, by key path (A's key order first)."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[Change] = []
        for k in list(a) + [k for k in b if k not in a]:
            p = _join(path, k)
            if k not in b:
                out.extend(_leaves("-", p, a[k]))
            elif k not in a:
                out.extend(_leaves("+", p, b[k]))
            else:
                out.extend(changes(a[k], b[k], p))
        return out
    if isinstance(a, list) and isinstance(b, list) and any(isinstance(v, (dict, list)) for v in a + b):
        out = []
        for i in range(max(len(a), len(b))):
            p = _join(path, i)
            if i >= len(b):
                out.extend(_leaves("-", p, a[i]))
            elif i >= len(a):
                out.extend(_leaves("+", p, b[i]))
            else:
                out.extend(changes(a[i], b[i], p))
        return out
    if isinstance(a, list) and isinstance(b, list):
        # Lists of plain values: name the items one side added or dropped, if that is all.
        dropped = [v for v in a if v not in b]
        added = [v for v in b if v not in a]
        if not (dropped and added) and sorted(map(str, a)) != sorted(map(str, b)):
            return [Change("-", f"{path}[]", a=v) for v in dropped] + [Change("+", f"{path}[]", b=v) for v in added]
    if isinstance(a, str) and isinstance(b, str):
        sa, sb = _structured(a), _structured(b)
        if sa is not None and sb is not None:
            return changes(sa, sb, path)
    return [Change("~", path or "(value)", a, b)]


def normalize(value: Any, stack: str) -> Any:
    """`value` with the names the program derives from the stack's name written as <stack>."""
    derived = re.compile(rf"(?<![A-Za-z0-9]){re.escape(PROJECT)}-{re.escape(stack)}(?![A-Za-z0-9])")
    urn = f"urn:pulumi:{stack}::"

    def walk(v: Any, key: Any = None) -> Any:
        if isinstance(v, dict):
            return {k: walk(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            if key == STACK_TAG and v == stack:
                return "<stack>"
            return derived.sub(f"{PROJECT}-<stack>", v.replace(urn, "urn:pulumi:<stack>::"))
        return v

    return walk(value)


# --- the two sides ----------------------------------------------------------------------
def _stack_values(stack: str) -> dict[str, Any]:
    """A stack file's values under their full keys' bare names, secrets as <secret>."""
    try:
        values, secrets, others = stackfile.read(stack)
    except stackfile.StackFileError as e:
        raise DiffError(str(e)) from None
    out = {k: (SECRET if k in secrets else v) for k, v in values.items()}
    for k, v in others.items():  # other namespaces (aws:region) keep their prefix
        out[k] = SECRET if isinstance(v, dict) and set(v) == {"secure"} else v
    return out


def from_stack(stack: str) -> Side:
    values = _stack_values(stack)
    try:
        rendered = render.render(stack, stand_in_secrets=True)
    except render.RenderError as e:
        raise DiffError(str(e)) from None
    return Side(stack, stack, values, rendered.result.resources)


def from_rendered(directory: Path, *, allow_missing: bool = False) -> Side:
    """A side from `DIR/resources.json` as `tools.render.write` leaves it."""
    path = Path(directory) / "resources.json"
    if not path.is_file():
        if allow_missing:
            return Side(f"{directory} (none)", "", None, [])
        raise DiffError(f"{path}: no such file (render with python -m tools.render --out {directory})")
    try:
        rows = json.loads(path.read_text())
        resources = [
            mock_runtime.Registered(r["type"], r["name"], r.get("parent"), r.get("inputs") or {}) for r in rows
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise DiffError(f"{path}: not a resources.json written by tools.render ({e})") from None
    # build/<stack>: the directory's name is the stack's, which is what its names derive from.
    return Side(str(directory), Path(directory).name, None, resources)


# --- the comparison ---------------------------------------------------------------------
def _by_key(side: Side) -> dict[tuple[str, str], mock_runtime.Registered]:
    return {(r.type, r.name): r for r in side.resources}


def _manifest_of(r: mock_runtime.Registered) -> tuple[str, dict[str, Any]] | None:
    """(file name, object) of a Kubernetes object or Helm release, as `make render` writes it."""
    one = render.Rendered("", None, mock_runtime.RunResult(resources=[r])).manifests()  # type: ignore[arg-type]
    return next(iter(one.items()), None)


def _body(r: mock_runtime.Registered, stack: str) -> tuple[str, Any]:
    manifest = _manifest_of(r)
    if manifest:
        fname, obj = manifest
        return f"{r.type} {r.name} (manifests/{fname})", normalize(obj, stack)
    return f"{r.type} {r.name}", normalize(r.inputs, stack)


def _sig(c: Change) -> tuple[str, str, str, str]:
    return c.op, c.path, json.dumps(c.a, sort_keys=True, default=str), json.dumps(c.b, sort_keys=True, default=str)


def compare(a: Side, b: Side) -> Report:
    ra, rb = _by_key(a), _by_key(b)
    config = changes(a.values, b.values) if a.values is not None and b.values is not None else None
    only_a = [f"{t} {n}" for (t, n) in sorted(ra) if (t, n) not in rb]
    only_b = [f"{t} {n}" for (t, n) in sorted(rb) if (t, n) not in ra]
    changed: list[ResourceDiff] = []
    identical: Counter = Counter()
    for key, res_a in ra.items():
        if key not in rb:
            continue
        label, body_a = _body(res_a, a.stack)
        _, body_b = _body(rb[key], b.stack)
        found = changes(body_a, body_b)
        if found:
            changed.append(ResourceDiff(key, label, found))
        else:
            identical[key[0]] += 1
    # A change repeated across many resources is one fact; say it once.
    counts: Counter = Counter()
    first: dict[tuple, Change] = {}
    for rd in changed:
        for sig in {_sig(c) for c in rd.changes}:
            counts[sig] += 1
            first.setdefault(sig, next(c for c in rd.changes if _sig(c) == sig))
    common = [(first[sig], n) for sig, n in counts.most_common() if n >= COMMON_MIN]
    common_set = {_sig(c) for c, _ in common}
    kept: list[ResourceDiff] = []
    only_common = 0
    for rd in changed:
        rest = [c for c in rd.changes if _sig(c) not in common_set]
        if rest:
            kept.append(ResourceDiff(rd.key, rd.label, rest))
        else:
            only_common += 1
    # Kubernetes objects first (what a service owner reads), then the rest, each by type.
    kept.sort(key=lambda rd: (not rd.key[0].startswith("kubernetes:"), rd.key))
    return Report(a, b, config, only_a, only_b, kept, common, only_common, identical, _upgrades(ra, rb))


def _upgrades(ra: dict, rb: dict) -> list[str]:
    """For each RayService in both sides: in-place Serve update, or a new Ray cluster and its cost."""
    lines = []
    for key, res_a in ra.items():
        if key not in rb:
            continue
        ma, mb = _manifest_of(res_a), _manifest_of(rb[key])
        if not (ma and mb and ma[1].get("kind") == "RayService"):
            continue
        verdict = upgrades.classify(ma[1], mb[1])
        if verdict.kind != "none":
            lines.append(verdict.line((mb[1].get("metadata") or {}).get("name", key[1])))
    return lines


# --- the report -------------------------------------------------------------------------
def _short_type(t: str) -> str:
    # aws:ec2/vpc:Vpc -> aws:Vpc; the package stays, so eks:Cluster and pd-inference:Cluster differ.
    return f"{t.split(':', 1)[0]}:{t.rsplit(':', 1)[-1]}"


def format_report(report: Report) -> str:
    a, b = report.a, report.b
    lines = [f"Differences from {a.label} (A) to {b.label} (B): + only in B, - only in A, ~ A -> B"]
    if report.config is not None:
        lines.append("")
        lines.append(f"Stack files ({stack_file(a.stack)} -> {stack_file(b.stack)}; secrets shown as {SECRET}):")
        lines.extend(f"  {c.line()}" for c in report.config)
        if not report.config:
            lines.append("  identical values")
    n_same = sum(report.identical.values())
    n_changed = len(report.changed) + report.only_common
    if report.upgrades:
        lines.append("")
        lines.append("Rollout (KubeRay 1.7 rules):")
        lines.extend(f"  {u}" for u in report.upgrades)
    lines.append("")
    lines.append(
        f"Resources (matched by type and name): {len(a.resources)} in A, {len(b.resources)} in B; "
        f"{n_changed} changed, {len(report.only_b)} only in B, {len(report.only_a)} only in A, {n_same} identical"
    )
    if report.common:
        lines.append("  The same change in several resources (listed once):")
        for c, n in report.common:
            lines.append(f"    {c.line()}   [{n} resources]")
        if report.only_common:
            lines.append(f"    ({report.only_common} resources differ by these changes only)")
    for rd in report.changed:
        lines.append(f"  ~ {rd.label}")
        shown = rd.changes[:MAX_LINES_PER_RESOURCE]
        lines.extend(f"      {c.line()}" for c in shown)
        if len(rd.changes) > len(shown):
            lines.append(f"      ... and {len(rd.changes) - len(shown)} more changes")
    lines.extend(f"  + {r}" for r in report.only_b)
    lines.extend(f"  - {r}" for r in report.only_a)
    if n_same:
        by_type = ", ".join(f"{n} {_short_type(t)}" for t, n in sorted(report.identical.items()))
        lines.append(f"  = {n_same} identical resources ({by_type})")
    if report.empty:
        lines.append("No differences.")
    return "\n".join(lines)


def format_markdown(report: Report, title: str) -> str:
    """The report for a pull request: a heading, a one-line verdict, the report folded."""
    if report.empty:
        return f"### {title}: no changes\n"
    n = len(report.changed) + report.only_common
    verdict = f"{n} changed, {len(report.only_b)} added, {len(report.only_a)} removed"
    rollout = "".join(f"- {u}\n" for u in report.upgrades)
    fence = "~~~"  # the report never contains it; ``` could appear inside values
    return (
        f"### {title}: {verdict}\n\n{rollout}{chr(10) if rollout else ''}<details><summary>Resource and manifest differences</summary>\n\n"
        f"{fence}diff\n{format_report(report)}\n{fence}\n\n</details>\n"
    )


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.diff", description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="stack name (stacks/Pulumi.<a>.yaml), or a rendered directory with --rendered")
    ap.add_argument("b", help="the stack or directory compared with A")
    ap.add_argument("--rendered", action="store_true", help="A and B are directories written by tools.render --out")
    ap.add_argument("--allow-missing", action="store_true", help="with --rendered: a missing A is a new stack")
    ap.add_argument("--markdown", action="store_true", help="a pull-request summary instead of plain text")
    ap.add_argument("--title", help="heading of the markdown summary (default: A vs B)")
    ap.add_argument("--labels", nargs=2, metavar=("A_LABEL", "B_LABEL"), help="names for A and B in the report")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        if args.rendered:
            side_a = from_rendered(Path(args.a), allow_missing=args.allow_missing)
            side_b = from_rendered(Path(args.b))
        else:
            side_a, side_b = from_stack(args.a), from_stack(args.b)
        if args.labels:
            side_a.label, side_b.label = args.labels
        report = compare(side_a, side_b)
    except DiffError as e:
        print(e, file=sys.stderr)
        return 1
    if args.markdown:
        print(format_markdown(report, args.title or f"{args.a} vs {args.b}"), end="")
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
