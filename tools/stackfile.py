"""Reading a stack file the way Pulumi hands it to the program, for offline tools.

What flows through here: `stacks/Pulumi.<stack>.yaml` -> the project's config values with
the `pd-inference:` namespace stripped, and the set of keys stored as secrets. Secret values
are replaced by a placeholder (offline tools never see, or need, the real value). Used by
`tools.render`, `tools.plan`, `tools.newstack` and the tests (`load_config` validates too); `pulumi up` itself reads the file through Pulumi.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra import paths
from infra.config import PROJECT, SECRET_KEYS, ConfigError, StackConfig
from infra.config import load as config_load
from infra.plan.stack import load

# PD_STACKS_DIR points the offline tools at another folder of stack files (the hostile-config
# tests render throwaway files from a temporary folder); messages still say stacks/<file>.
STACKS_DIR = Path(os.environ["PD_STACKS_DIR"]) if os.environ.get("PD_STACKS_DIR") else paths.STACKS_DIR


class StackFileError(Exception):
    """The stack file is missing or is not YAML; one line."""


def secret_placeholder(key: str) -> str:
    return f"placeholder-secret-{key}"


def path_of(stack: str) -> Path:
    return STACKS_DIR / f"Pulumi.{stack}.yaml"


def stacks() -> list[str]:
    """Every stack with a file in stacks/, sorted."""
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in STACKS_DIR.glob("Pulumi.*.yaml"))


def parse(text: str, source: str) -> tuple[dict[str, Any], set[str], dict[str, Any]]:
    """(project values, secret keys, other namespaces' values) from a stack file's text."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise StackFileError(f"{source}: not valid YAML{where}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise StackFileError(f"{source}: expected a mapping with a 'config:' mapping")
    # Anchors and aliases can expand a small file into billions of values (or a cycle): Pulumi
    # refuses such files, and so do the offline tools, before anything walks the values.
    budget, todo = 100_000, [doc]
    while todo:
        node = todo.pop()
        budget -= 1
        if budget < 0:
            raise StackFileError(f"{source}: expands to more than 100000 values (YAML anchors and aliases?)")
        todo.extend(
            [*node.keys(), *node.values()] if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
    values: dict[str, Any] = {}
    secrets: set[str] = set()
    others: dict[str, Any] = {}
    for full_key, value in (doc.get("config") or {}).items():
        ns, sep, key = str(full_key).partition(":")
        if not sep:
            ns, key = PROJECT, ns  # Pulumi reads a bare key as the project's
        if ns != PROJECT:
            others[str(full_key)] = value
            continue
        if isinstance(value, dict) and set(value) == {"secure"}:
            secrets.add(key)
            # An empty ciphertext holds no secret: hand on "" so the config check says it is unset.
            value = secret_placeholder(key) if value["secure"] else ""
        values[key] = value
    return values, secrets, others


def read(stack: str) -> tuple[dict[str, Any], set[str], dict[str, Any]]:
    path = path_of(stack)
    source = paths.stack_file(stack)
    if not path.is_file():
        known = ", ".join(stacks()) or "none"
        raise StackFileError(f"{source}: no such stack file (stacks: {known})")
    return parse(path.read_text(), source)


def validate(parsed: tuple[dict[str, Any], set[str], dict[str, Any]], source: str) -> StackConfig:
    """What `parse`/`read` returned -> validated StackConfig (ConfigError: one line naming the key)."""
    values, secrets, others = parsed
    return load(values, secret_keys=secrets, source=source, region=others.get("aws:region"))


def load_config(stack: str) -> StackConfig:
    """stacks/Pulumi.<stack>.yaml -> validated StackConfig, as `pulumi up` validates it once the
    stack's owner has set its secrets (offline tools hold none: stand-ins, see `load_offline`)."""
    return load_offline(*read(stack), paths.stack_file(stack)).config


# The shipped stack files hold no secrets (Pulumi encrypts them per stack; a placeholder there
# would fail Pulumi's decryption). `load_offline` takes such a file as `pulumi up` would run it
# once its owner has set the secrets the config needs: a stand-in for each, named in the result.
@dataclass
class Offline:
    """A stack's validated config for offline tools, and the secrets stood in for."""

    config: StackConfig
    values: dict[str, Any]
    secrets: set[str]
    stand_ins: tuple[str, ...]


def load_offline(
    values: dict[str, Any], secrets: set[str], others: dict[str, Any], source: str, *, plan_checks: bool = True
) -> Offline:
    """`load()`; for each secret the config needs and the file lacks, retry with a stand-in
    (what `pulumi up` sees after `pulumi config set --secret`). Any other error is raised as
    `load()` raised it. `plan_checks=False`: the config's own checks only (`infra.config.load`),
    for a tool that reads the plan to fix what its checks would refuse."""
    values, secrets, stand_ins = dict(values), set(secrets), []
    loader = load if plan_checks else config_load
    for _ in range(len(SECRET_KEYS) + 1):
        try:
            cfg = loader(values, secret_keys=secrets, source=source, region=others.get("aws:region"))
        except ConfigError as e:
            todo = [k for k in e.missing_secrets if k not in stand_ins]
            if not todo:
                raise
            for key in todo:
                values[key] = secret_placeholder(key)
                secrets.add(key)
                stand_ins.append(key)
            continue
        return Offline(cfg, values, secrets, tuple(stand_ins))
    raise AssertionError("unreachable: each retry adds a stand-in")


def stand_in_note(stand_ins: tuple[str, ...], stack: str) -> str:
    """One line telling the owner which secrets to set before `pulumi up`."""
    cmds = "; ".join(f"pulumi config set --secret {k} <value> --stack {stack}" for k in stand_ins)
    return f"note: rendered with stand-ins for secrets the stack file does not hold yet (before `pulumi up`: {cmds})"


def read_as_deployed(stack: str) -> tuple[dict[str, Any], set[str], dict[str, Any]]:
    """`read(stack)` after its owner set the secrets its config needs (stand-ins for them):
    the config `pulumi up` hands the program once the stack is ready to deploy (the config's
    own checks only: a caller that changes values loads them whole)."""
    values, secrets, others = read(stack)
    loaded = load_offline(values, secrets, others, paths.stack_file(stack), plan_checks=False)
    return loaded.values, loaded.secrets, others
