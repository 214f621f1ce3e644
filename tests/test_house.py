"""The house's structure: which part may import which, and no import circle.

What flows through here: every module of the project (read as text, nothing imported) -> its
imports of project modules (module level and inside functions alike: a lazy import is still a
dependency) -> the rules of docs/architecture.md ("The code"): serving/ ships alone (never
infra/, local/, tools/, bench/); the spec is pure (its own parts only); the two serving wings
(ingress, engines) meet only in serving/core and serving/app.py; below-above order inside
infra (sizing < config < plan); no circle anywhere; and modules and functions a reader can hold.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from infra.paths import ROOT

PACKAGES = ("serving", "infra", "local", "tools", "bench", "policies")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    modules["__main__"] = ROOT / "__main__.py"
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: no dependency at run time
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                # `from pkg import submodule` depends on the submodule, not on the package's face
                targets = [s for s in subs if s in modules] or [node.module]
            for t in targets:
                if t.split(".")[0] in PACKAGES and t in modules and t != name:
                    graph[name].add(t)
    return graph


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_serving_ships_alone_and_its_wings_meet_only_in_core_and_app():
    graph = _graph()
    problems = []
    for src, dsts in graph.items():
        for dst in dsts:
            if _under(src, "serving") and not _under(dst, "serving"):
                problems.append(f"{src} -> {dst}: serving/ ships alone")
            if _under(src, "serving.spec") and not _under(dst, "serving.spec"):
                problems.append(f"{src} -> {dst}: the spec imports its own parts only")
            if _under(src, "serving.core") and not any(
                _under(dst, p) for p in ("serving.core", "serving.spec", "serving.ray_internals")
            ):
                problems.append(f"{src} -> {dst}: core is below both wings")
            for a, b in (("serving.ingress", "serving.engines"), ("serving.engines", "serving.ingress")):
                if _under(src, a) and _under(dst, b):
                    problems.append(f"{src} -> {dst}: the wings meet in serving/core and serving/app.py only")
            if _under(dst, "local") and not _under(src, "local") and not _under(src, "bench"):
                problems.append(f"{src} -> {dst}: local/ is the dev stack, used by benches and tests only")
    assert not problems, "\n".join(sorted(problems))


def test_no_import_circle():
    graph = _graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])
    assert not circles, "\n".join(circles)


def test_the_rules_can_fail():
    """The walker sees lazy imports too (an import inside a function is a dependency)."""
    graph = _graph()
    assert "serving.ingress.server" in graph["serving.app"]
    assert any(_under(d, "serving.spec") for d in graph["serving.ingress.pipeline"] | graph["serving.ingress.server"])


def _sizes() -> tuple[list[tuple[str, int]], list[tuple[str, str, int]]]:
    """(module, lines) and (module, function, lines) of the project's code (tests aside)."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts]
    modules, functions = [], []
    for path in [*files, ROOT / "__main__.py"]:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        modules.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                functions.append((name, node.name, node.end_lineno - node.lineno + 1))
    return modules, functions


def test_modules_and_functions_a_reader_can_hold():
    """Modules of at most 500 lines and functions of at most 80 (a benchmark's: 600 and 120)."""
    modules, functions = _sizes()
    assert len(modules) > 100 and any(n > 60 for _, _, n in functions)  # the walk sees the code

    def bench(path: str) -> bool:
        return path.startswith("bench/")

    too_long = [f"{m}: {n} lines" for m, n in modules if n > (600 if bench(m) else 500)]
    too_long += [f"{m} {f}: {n} lines" for m, f, n in functions if n > (120 if bench(m) else 80)]
    assert not too_long, "\n".join(too_long)
