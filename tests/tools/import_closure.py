"""The Pulumi program's import closure, read from the source (test helper; nothing runs).

What flows through here: `__main__.py` -> the code the program can run while it loads,
followed through the project's own modules -> the third-party top-level import names that
code imports -> (in the test) the distributions that provide them, compared with the names
`requirements.lock` pins.

Which code counts (the rule):
- The module-level statements of every project module reached (class bodies, decorators and
  default values included: Python runs them on import), except under `if TYPE_CHECKING:`.
- A function's body, when code that counts refers to the function by name (a call, a
  decorator, a value in a table: any load of the name, directly or as `module.name`, through
  any re-export). A class that counts counts whole: every method (instances' method calls
  cannot be followed statically, so all are assumed called).
- Imports in code that counts count, wherever they sit (module level or inside a function),
  and the project modules they import are reached, with the `__init__.py` of every package
  on their dotted path (Python runs those first). `importlib.import_module("literal")` is an
  import of that name; a computed name is reported.
So a function-level import of Ray in a serving module the program imports for its constants
does not count until the program's code refers to that function; the moment it does, it
counts. What a name lookup by string (`getattr(mod, "f")`) calls is not seen: the light-env
render of every shipped stack (test_light_env.py) runs the program and catches that.
Names in the standard library (`sys.stdlib_module_names`) need no distribution.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Closure:
    """What the walk found. `modules`: project module -> the module that first reached it;
    `third_party`: top-level import name -> (project module, line) of its first import;
    `defs`: (module, name) of every function or class whose body counts; `unreadable`:
    dynamic imports whose name is not a literal."""

    modules: dict[str, str | None] = field(default_factory=dict)
    third_party: dict[str, tuple[str, int]] = field(default_factory=dict)
    defs: set[tuple[str, str]] = field(default_factory=set)
    unreadable: list[str] = field(default_factory=list)

    def chain(self, module: str) -> list[str]:
        """`__main__` -> ... -> module, through the first importer of each."""
        out = [module]
        while (parent := self.modules.get(out[-1])) is not None:
            out.append(parent)
        return out[::-1]


@dataclass
class _Module:
    name: str
    is_package: bool
    tree: ast.Module
    defs: dict[str, ast.AST]  # top-level function or class name -> its node
    bindings: dict[str, tuple[str, str | None]]  # name bound by an import -> (module, attribute)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(roots: list[ast.AST], *, skip_function_bodies: bool) -> Iterator[ast.AST]:
    """The nodes under `roots` that run: not under `if TYPE_CHECKING:`, nor function
    annotations (this project's modules use postponed annotations); with
    `skip_function_bodies`, not inside a function's body (module-level code only)."""
    todo = list(roots)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, FUNCTION):
            a = node.args
            todo.extend([*node.decorator_list, *a.defaults, *(d for d in a.kw_defaults if d is not None)])
            if not skip_function_bodies:
                todo.extend(node.body)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _absolute(module: _Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _bindings(module: _Module) -> None:
    """Every name an import binds anywhere in the module (one table per module: the
    project's modules do not rebind an imported name to something else)."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    module.bindings[a.asname] = (a.name, None)
                else:
                    top = a.name.split(".")[0]
                    module.bindings[top] = (top, None)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for a in node.names:
                if a.name != "*":
                    module.bindings[a.asname or a.name] = (base, a.name)


def _chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"] when it is a plain chain of names, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *parts[::-1]]
    return None


class _Walker:
    def __init__(self, root: Path, source_of: Callable[[str, Path], str] | None) -> None:
        self.root = root
        self.source_of = source_of
        self.project = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
        self.loaded: dict[str, _Module | None] = {}
        self.closure = Closure()
        self.todo: list[tuple[_Module, list[ast.AST], bool]] = []

    def module(self, dotted: str) -> _Module | None:
        """The project module of that name, parsed once; None when it is not one."""
        if dotted not in self.loaded:
            base = self.root.joinpath(*dotted.split("."))
            path, is_package = (base / "__init__.py", True) if (base / "__init__.py").is_file() else (None, False)
            if path is None and base.with_suffix(".py").is_file() and dotted.split(".")[0] in self.project:
                path = base.with_suffix(".py")
            if path is None:
                self.loaded[dotted] = None
            else:
                text = self.source_of(dotted, path) if self.source_of else path.read_text()
                self.loaded[dotted] = self.parse(dotted, text, is_package)
        return self.loaded[dotted]

    @staticmethod
    def parse(dotted: str, text: str, is_package: bool) -> _Module:
        tree = ast.parse(text)
        defs = {n.name: n for n in tree.body if isinstance(n, (*FUNCTION, ast.ClassDef))}
        m = _Module(dotted, is_package, tree, defs, {})
        _bindings(m)
        return m

    def reach(self, dotted: str, by: str) -> None:
        """Import `dotted` (from module `by`): its packages' __init__ first, then itself."""
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            m = self.module(name)
            if m is None or name in self.closure.modules:
                continue
            self.closure.modules[name] = by
            self.todo.append((m, list(m.tree.body), True))

    def count_def(self, module: _Module, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> None:
        """The body of `name` as `module` sees it counts: its own def, or where its import leads."""
        key = (module.name, name)
        if key in self.closure.defs or key in seen:
            return
        if name in module.defs:
            self.closure.defs.add(key)
            self.todo.append((module, [module.defs[name]], False))
        elif name in module.bindings:
            target, attr = module.bindings[name]
            if attr is not None and self.module(f"{target}.{attr}") is None and (m := self.module(target)):
                self.count_def(m, attr, seen | {key})

    def resolve(self, module: _Module, parts: list[str]) -> None:
        """A reference `parts[0].parts[1]...` in `module`: count the function or class it names."""
        head, rest = parts[0], parts[1:]
        if head in module.defs or head not in module.bindings:
            if head in module.defs:
                self.count_def(module, head)
            return
        target, attr = module.bindings[head]
        dotted = target if attr is None else f"{target}.{attr}"
        if attr is not None and self.module(dotted) is None:
            self.count_def(module, head)  # an imported function or class
            return
        while rest and self.module(f"{dotted}.{rest[0]}") is not None:
            dotted, rest = f"{dotted}.{rest[0]}", rest[1:]
        if rest and (m := self.module(dotted)):
            self.count_def(m, rest[0])

    def imports(self, module: _Module, node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            return [base, *(f"{base}.{a.name}" for a in node.names if a.name != "*")]
        func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
        if getattr(func, "attr", getattr(func, "id", None)) == "import_module":
            arg = node.args[0] if node.args else None  # type: ignore[attr-defined]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                return [arg.value]
            self.closure.unreadable.append(f"{module.name}:{node.lineno}: import_module of a computed name")  # type: ignore[attr-defined]
        return []

    def run(self, entry: Path) -> Closure:
        self.closure.modules["__main__"] = None
        main = self.parse("__main__", entry.read_text(), False)
        self.todo.append((main, list(main.tree.body), True))
        while self.todo:
            module, roots, module_level = self.todo.pop()
            for node in _nodes(roots, skip_function_bodies=module_level):
                for name in self.imports(module, node):
                    top = name.split(".")[0]
                    if top in self.project:
                        self.reach(name, module.name)
                    elif top and top not in sys.stdlib_module_names and top != "__future__":
                        self.closure.third_party.setdefault(top, (module.name, getattr(node, "lineno", 0)))
                loads = isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load)
                if loads and (parts := _chain(node)) is not None:
                    self.resolve(module, parts)
        return self.closure


def walk(root: Path, entry: str = "__main__.py", source_of: Callable[[str, Path], str] | None = None) -> Closure:
    """The closure of `entry` (a file under `root`). `source_of(module, path)` reads a project
    module's source; the tests pass one that changes a module's text without touching the file."""
    return _Walker(root, source_of).run(root / entry)
