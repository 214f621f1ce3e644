"""Every repository path and every `make` target that README.md and docs/ name exists.

What flows through here: README.md and docs/**/*.md -> the repository paths they name (in
`code spans`, fenced blocks, Markdown links and `python -m <module>`; a path counts as ours
when its first part is a top-level entry of this repository, so upstream sources such as
`ray-operator/controllers/ray/common/pod.go` are left alone) and the `make <target>` commands
they show -> each path must exist in the tree, each target must be a rule of the Makefile.
A doc that names a renamed or deleted file, or a target that went away, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.paths import ROOT
from tools.docs import doc_files

# Paths a doc may name that are not in the tree, each with why.
NOT_IN_THE_TREE = {
    "build": "make render / bench / chaos write it (gitignored)",
    ".cache": "make test's tool downloads (gitignored)",
    ".venv": "made by make venv",
    ".venv-checkov": "made by make test",
    ".venv-clients": "made by make test-long",
    "policies/venv": "the policy pack's virtualenv, made by the user (docs/guardrails.md)",
    "stacks/Pulumi.team-x.yaml": "what `make stack NAME=team-x` writes (an example)",
    "stacks/Pulumi.team-search.yaml": "what `python -m tools.newstack team-search` writes (an example)",
    "stacks/Pulumi.x.yaml": "the file name in an example error message",
    # Upstream paths whose first part happens to be one of our folders (docs/verification.md):
    "templates/daemonset.yaml": "aws/eks-charts stable/aws-efa-k8s-device-plugin",
    "templates/al2023": "awslabs/amazon-eks-ami",
}
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|…")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATHISH = re.compile(
    r"(?<![\w./-])((?:\.?[\w<>-]+/)+[\w.<>-]*|[\w-]+\.(?:py|md|yaml|yml|txt|json|toml|ini|cjs|in))(?![\w/])"
)
MODULE = re.compile(r"python3? -m ([a-z_][\w.]*)")
MAKE = re.compile(r"(?<![\w-])make\s+((?:-\S+\s+)*)([a-z][\w-]*)(?![\w=-])")


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.name != ".git"} | {".github", "build", ".cache"}


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([a-z][\w-]*)\s*:(?!=)", text, flags=re.M)}


def _code_texts(text: str) -> list[str]:
    return [m.group(1) for m in FENCE.finditer(text)] + [m.group(1) for m in CODE_SPAN.finditer(FENCE.sub("", text))]


def _repo_paths(text: str, folder: Path, top: set[str]) -> set[str]:
    """The repository paths named in `text`, a doc in `folder`."""
    found: set[str] = set()
    for chunk in _code_texts(text):
        for m in PATHISH.finditer(chunk):
            found.add(m.group(1))
        # `python -m a.b`: the module a/b.py, or the package a/b/ (its __main__.py).
        for m in MODULE.finditer(chunk):
            base = m.group(1).rstrip(".").replace(".", "/")
            found.add(base if (ROOT / base).is_dir() else base + ".py")
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            # A link is relative to the doc's folder.
            found.add((folder / target).resolve().relative_to(ROOT).as_posix())
    out = set()
    for path in found:
        path = path.rstrip(".,:;").removeprefix("./")
        first = path.split("/", 1)[0]
        if first not in top or PLACEHOLDER.search(path) or path in (".", ""):
            continue
        out.add(path.rstrip("/"))
    return out


def _missing(path: str) -> bool:
    if any(path == k or path.startswith(k + "/") for k in NOT_IN_THE_TREE):
        return False
    return not (ROOT / path).exists()


DOCS = doc_files()


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_repository_path_a_doc_names_exists(doc):
    missing = sorted(p for p in _repo_paths(doc.read_text(), doc.parent, _top_level()) if _missing(p))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_make_target_a_doc_names_exists(doc):
    targets = _make_targets()
    named = {m.group(2) for chunk in _code_texts(doc.read_text()) for m in MAKE.finditer(chunk)}
    assert not named - targets, (
        f"{doc.relative_to(ROOT)} names make targets the Makefile lacks: {sorted(named - targets)}"
    )


# --- the checks bite ------------------------------------------------------------------------------
def test_a_renamed_module_and_a_removed_target_are_caught():
    text = "See `local/aggregator.py`, [scaling](scaling.md), `python -m bench.scaling` and run `make bench-warp`.\n"
    paths = _repo_paths(text, ROOT / "docs", _top_level())
    assert {p for p in paths if _missing(p)} == {"local/aggregator.py", "bench/scaling.py"}
    assert "docs/scaling.md" in paths  # the link, resolved from docs/
    named = {m.group(2) for chunk in _code_texts(text) for m in MAKE.finditer(chunk)}
    assert named - _make_targets() == {"bench-warp"}
