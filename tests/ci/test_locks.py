"""The hashed locks: one for every requirements file, none stale, nothing unhashed.

What flows through here: the Makefile's `lock:` recipe (which lock pip-compile writes from
which requirements files) -> each requirements file's requirements (following `-r`) against
its lock's pins, and each lock's lines. A requirement the lock does not satisfy means a
requirements file was edited without `make lock`: `make test` would install the old lock.
pip's hash-checking mode (pip docs, "Secure installs" / `--require-hashes`) refuses a lock in
which any package lacks a hash, so each pin here must carry one.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from infra.paths import ROOT


def _lock_recipe() -> dict[str, list[str]]:
    """lock file -> the requirements files `make lock` compiles it from."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^lock:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "the Makefile has no `lock:` target"
    out = {}
    for line in recipe.group(1).splitlines():
        args = shlex.split(line.strip())
        if "-o" in args:
            i = args.index("-o")
            out[args[i + 1]] = args[i + 2 :]
    return out


LOCKS = _lock_recipe()


def _requirements(path: Path) -> list[Requirement]:
    reqs = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            reqs += _requirements(path.parent / line[3:].strip())
            continue
        reqs.append(Requirement(line))
    return reqs


def _pins(lock: Path) -> dict[str, tuple[Version, int]]:
    """name -> (pinned version, number of hashes)."""
    pins: dict[str, tuple[Version, int]] = {}
    name = None
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            name = canonicalize_name(m.group(1))
            pins[name] = (Version(m.group(2)), 0)
        elif name and line.strip().startswith("--hash=sha256:"):
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
    return pins


def test_every_requirements_file_has_a_lock():
    files = {
        str(p.relative_to(ROOT)) for p in [*ROOT.glob("requirements*.txt"), *ROOT.glob("policies/requirements*.txt")]
    }
    locked = {f for inputs in LOCKS.values() for f in inputs}
    assert files - locked == set()
    assert all((ROOT / lock).is_file() for lock in LOCKS), LOCKS


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_lock_satisfies_its_requirements_files(lock):
    pins = _pins(ROOT / lock)
    stale = []
    for req in (r for f in LOCKS[lock] for r in _requirements(ROOT / f)):
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None or not req.specifier.contains(pinned[0], prereleases=True):
            stale.append(f"{req} (lock: {pinned[0] if pinned else 'absent'})")
    assert stale == [], f"{lock} is stale: run `make lock`"


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_pin_is_hashed_and_no_machine_path_leaks(lock):
    text = (ROOT / lock).read_text()
    assert [n for n, (_, hashes) in _pins(ROOT / lock).items() if hashes == 0] == []
    # Index and wheel-store locations are per machine (pip's configuration supplies them).
    assert not re.search(r"^\s*--(index-url|extra-index-url|find-links|trusted-host)|file://|/opt/|/work/", text, re.M)


def test_make_installs_the_venvs_from_the_locks_with_hashes():
    text = (ROOT / "Makefile").read_text()
    assert "pip install -q --require-hashes -r requirements-dev.lock" in text
    assert "pip install -q --require-hashes -r policies/requirements-checkov.lock" in text
    assert "pip install -q --require-hashes -r requirements-clients.lock" in text
    assert not re.search(r"pip install .*-r [\w/-]+\.txt", text), "an install that bypasses the locks"


def test_serving_pins_transformers_and_declares_its_direct_imports():
    reqs = {canonicalize_name(r.name): r for r in _requirements(ROOT / "requirements-serving.txt")}
    for name in ("transformers", "tokenizers"):
        assert str(reqs[name].specifier).startswith("=="), name
    # Imported by bench/ and tests/ directly (not only through vLLM or Ray).
    assert {"psutil", "numpy"} <= set(reqs)
