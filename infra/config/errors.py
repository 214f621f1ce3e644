"""The one-line error of a stack file: `ConfigError`, and pydantic's errors turned into it."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

# Joins the cross-field errors inside one pydantic ValueError; `one_line` splits them again.
CROSS_SEP = " @@ "


class ConfigError(Exception):
    """A stack file is wrong; the message is one line naming the file and the key.

    `missing_secrets`: the secrets among the problems that the config needs and the file lacks
    (offline tools may stand in for them and check again).
    """

    def __init__(self, message: str, missing_secrets: tuple[str, ...] = ()):
        super().__init__(message)
        self.missing_secrets = missing_secrets


def missing_secret(key: str, why: str, example: str) -> tuple[str, str]:
    """The cross-field error for a secret the stack needs but does not hold: names the command."""
    return key, f"{why} but no {key} secret is set (pulumi config set --secret {key} {example})"


_MISSING_SECRET = re.compile(r"but no (\w+) secret is set \(pulumi config set --secret")


def cross_field(errors: list[tuple[str, str]]) -> ValueError:
    """The (key, message) pairs of the cross-field checks as one ValueError for pydantic."""
    return ValueError(CROSS_SEP.join(f"@{key}@ {msg}" for key, msg in errors))


def cross_line(source: str, errors: list[tuple[str, str]]) -> str:
    """(key, message) pairs of cross-field checks as one line naming the file, the first first."""
    (key, msg), *more = errors
    line = f"{source}: {key}: {msg}"
    if more:
        line += f" (and {len(more)} more: " + "; ".join(f"{k}: {v}" for k, v in more) + ")"
    return line


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and p.startswith("\0"):  # a note on the part before it: "[1] (id)"
            parts.append(f" {p[1:]}")
        elif isinstance(p, int):
            parts.append(f"[{p}]")
        elif parts:
            parts.append(f".{p}")
        else:
            parts.append(str(p))
    return "".join(parts)


def _model_id(data: Any, loc: tuple[Any, ...]) -> str | None:
    """The model id of the `serving.models[i]` entry an error's location points into, if any."""
    if len(loc) < 3 or loc[:2] != ("serving", "models") or not isinstance(loc[2], int) or not isinstance(data, dict):
        return None
    try:
        model_id = data["serving"]["models"][loc[2]]["model"]["id"]
    except (KeyError, IndexError, TypeError):
        return None
    return model_id if isinstance(model_id, str) else None


def one_line(source: str, err: ValidationError, data: Any = None) -> str:
    """The first error of `err` as one line naming the file and the key (with `data`, the
    stack's values, a `serving.models[i]` key also names that entry's model id)."""
    e = err.errors(include_url=False)[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))
    model_id = _model_id(data, loc)
    if model_id is not None:
        loc = (*loc[:3], f"\0({model_id})", *loc[3:])
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if msg.startswith("@"):  # cross-field checks name their own keys; all of them, on one line
        found = [re.match(r"^@([^@]+)@ (.*)$", part, flags=re.S) for part in msg.split(CROSS_SEP)]
        return cross_line(source, [(m.group(1), m.group(2)) for m in found if m])
    key = _loc(loc) or "(top level)"
    if e["type"] == "extra_forbidden":
        return f"{source}: {key}: unknown key (check the spelling against docs/configuration.md)"
    if e["type"] == "missing":
        return f"{source}: {key}: required key is missing"
    if e["type"] == "enum":
        return f"{source}: {key}: {e['input']!r} is not allowed ({msg.replace('Input should be ', 'expected ')})"
    if "input" in e and not isinstance(e["input"], (dict, list)) and repr(e["input"]) not in msg:
        return f"{source}: {key}: {e['input']!r}: {msg}"
    return f"{source}: {key}: {msg}"


def missing_secrets(err: ValidationError) -> tuple[str, ...]:
    """The secrets that the cross-field errors of `err` say the stack lacks, in their order."""
    parts = str(err.errors(include_url=False)[0]["msg"]).split(CROSS_SEP)
    return tuple(m.group(1) for m in map(_MISSING_SECRET.search, parts) if m)
