"""`python -m tools.model --stack <env> --model <hf id or s3 path>` (`make model`): add a model
to a stack file, validated, planned and rendered, with the diff and the rollout it causes.

What flows through here: stacks/Pulumi.<env>.yaml (tools.stackfile) and the new model's source
-> the stack's `serving` with one more `serving.models` entry (a one-model stack is moved to
the many-model form first: its model keys become the first entry) -> the changed values are
validated (infra.config: one line naming the model and key on error), rendered under
Pulumi's mocks before and after (tools.render.render_parsed) and compared (tools.diff):
the report, the rollout KubeRay 1.7 will do (infra/k8s/upgrades.py: an in-place Serve update
when only serveConfigV2 changes) and the capacity plan per model and pool. With --write the
stack file's `serving:` block is replaced (the rest of the file, comments included, is kept;
comments inside `serving:` are not). Exit 0 with the report, 1 with one line on error.

    python -m tools.model --stack platform --model mistralai/Mistral-7B-Instruct-v0.3 --pool decode=general
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from typing import Any

import yaml

from infra.config import PROJECT, ConfigError
from infra.paths import stack_file
from infra.plan.model_plans import format_stack_plan
from serving.spec import ModelEntry
from serving.spec.models import PER_MODEL_KEYS
from tools import diff, render, stackfile

_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class ModelError(Exception):
    """The model cannot be added; one line."""


def default_id(source: str) -> str:
    """The served id a source suggests: its last path component, lowercased."""
    last = source.rstrip("/").rsplit("/", 1)[-1]
    return _ID_CHARS.sub("-", last).strip("-.").lower()[:128] or "model"


def as_many(serving: dict[str, Any]) -> dict[str, Any]:
    """A `serving` value in the many-model form (a one-model value's model keys become entry 0)."""
    if "models" in serving:
        return copy.deepcopy(serving)
    shared = {k: copy.deepcopy(v) for k, v in serving.items() if k not in PER_MODEL_KEYS}
    first = {k: copy.deepcopy(v) for k, v in serving.items() if k in PER_MODEL_KEYS}
    return {"models": [first], **shared}


def new_entry(source: str, model_id: str, mode: str, pools: dict[str, str], max_model_len: int | None) -> dict:
    """The stack-file entry of the new model (camelCase keys, only what differs from defaults)."""
    model: dict[str, Any] = {"id": model_id, "source": source}
    if max_model_len:
        model["maxModelLen"] = max_model_len
    entry: dict[str, Any] = {"model": model, "mode": mode}
    if pools:
        entry["pools"] = dict(pools)
    ModelEntry.model_validate(entry)  # a bad id or source is refused here, naming the key
    return entry


def added(
    parsed: tuple[dict[str, Any], set[str], dict[str, Any]], entry: dict[str, Any]
) -> tuple[dict[str, Any], set[str], dict[str, Any]]:
    """The parsed stack with `entry` appended to serving.models."""
    values, secrets, others = parsed
    serving = values.get("serving")
    if not isinstance(serving, dict):
        raise ModelError("serving: the stack file has no serving mapping to add a model to")
    many = as_many(serving)
    if not isinstance(many["models"], list):
        raise ModelError("serving.models: expected a list")
    ids = [m.get("model", {}).get("id") for m in many["models"] if isinstance(m, dict)]
    if entry["model"]["id"] in ids:
        raise ModelError(f"serving.models: a model with id {entry['model']['id']!r} is already served")
    many["models"].append(entry)
    return {**values, "serving": many}, set(secrets), dict(others)


def replace_serving_block(text: str, serving: dict[str, Any]) -> str:
    """The stack file's text with its `pd-inference:serving:` block replaced by `serving`."""
    lines = text.splitlines(keepends=True)
    head = re.compile(rf"^(\s*)(?:{re.escape(PROJECT)}:)?serving:\s*(#.*)?$")
    for i, line in enumerate(lines):
        m = head.match(line.rstrip("\n"))
        if not m:
            continue
        indent = len(m.group(1))
        end = i + 1
        while end < len(lines):
            nxt = lines[end]
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            end += 1
        body = yaml.safe_dump(serving, sort_keys=False, default_flow_style=False)
        pad = " " * (indent + 2)
        block = "".join(pad + b + "\n" for b in body.splitlines())
        return "".join(lines[: i + 1]) + block + "".join(lines[end:])
    raise ModelError("serving: no `pd-inference:serving:` block found in the stack file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", required=True, help="stack name: stacks/Pulumi.<stack>.yaml")
    ap.add_argument("--model", required=True, help="Hugging Face repo id (org/name) or s3://bucket/prefix")
    ap.add_argument("--id", help="served model id (default: the source's last path component, lowercased)")
    ap.add_argument("--mode", choices=("aggregated", "disaggregated"), default="aggregated")
    ap.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="ROLE=POOL",
        help="run ROLE (prefill, decode; the aggregated engine is decode) on the nodePools entry POOL",
    )
    ap.add_argument("--max-model-len", type=int, help="serving.models[].model.maxModelLen (default: the spec's)")
    ap.add_argument("--write", action="store_true", help="write the stack file (default: show what would change)")
    args = ap.parse_args(argv)
    source = stack_file(args.stack)
    try:
        pools = dict(p.split("=", 1) for p in args.pool if "=" in p)
        if len(pools) != len(args.pool):
            raise ModelError("--pool: expected ROLE=POOL")
        entry = new_entry(args.model, args.id or default_id(args.model), args.mode, pools, args.max_model_len)
        before = stackfile.read(args.stack)
        after = added(before, entry)
        rendered_a = render.render_parsed(args.stack, before, stand_in_secrets=True)
        rendered_b = render.render_parsed(args.stack, after, stand_in_secrets=True)
    except (ModelError, stackfile.StackFileError, render.RenderError, ConfigError) as e:
        print(f"{source}: {e}" if not str(e).startswith(source) else e, file=sys.stderr)
        return 1
    except ValueError as e:  # pydantic's error for a bad id/source, as one line
        print(f"{source}: serving.models[+]: {str(e).splitlines()[-2].strip()}", file=sys.stderr)
        return 1
    side_a = diff.Side(f"{args.stack} (now)", args.stack, None, rendered_a.result.resources)
    side_b = diff.Side(f"{args.stack} (+ {entry['model']['id']})", args.stack, None, rendered_b.result.resources)
    report = diff.compare(side_a, side_b)
    print(f"Adding {entry['model']['id']} ({args.model}, {args.mode}) to {source}")
    print(diff.format_report(report))
    print()
    print(format_stack_plan(rendered_b.config))
    if args.write:
        path = stackfile.path_of(args.stack)
        path.write_text(replace_serving_block(path.read_text(), after[0]["serving"]))
        print(f"wrote {source}")
    else:
        print(f"(not written: add --write, or WRITE=1 with make model, to change {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
