"""The hand mirrors of upstream code (tests/upstream.py) cannot drift from the pins.

What flows through here: the MIRRORS of tests/upstream.py and tests/upstream_network.py (per
public function: repository, paths, the tag or commit it was read from, and the project pin
it was checked against) -> the pins as they
are now in infra/versions.py and requirements.txt. A pin that moved without its
mirrors being re-read (and MIRRORS updated) fails, naming the mirror and what to re-read.
"""

from __future__ import annotations

import inspect
import re

import pytest

from infra import versions
from infra.paths import ROOT
from tests import upstream, upstream_network

MODULES = (upstream, upstream_network)
_REF = re.compile(r"^(([A-Za-z][A-Za-z-]*-)?v?\d+(\.\d+)*([.-][0-9A-Za-z.]+)?|[0-9a-f]{12,40})$")


def _public_functions(module) -> set[str]:
    return {
        name
        for name, obj in vars(module).items()
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not name.startswith("_")
    }


def _mirrors() -> dict[str, upstream.Mirror]:
    return {name: m for module in MODULES for name, m in module.MIRRORS.items()}


def _requirement(package: str) -> str | None:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.match(rf"^{re.escape(package)}==(\S+)", line.strip(), flags=re.I)
        if m:
            return m.group(1)
    return None


def pin_value(where: str) -> str | None:
    """The current value of a pin: `requirements.txt:<package>` or an attribute path of versions."""
    if where.startswith("requirements.txt:"):
        return _requirement(where.split(":", 1)[1])
    obj: object = versions
    for part in where.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return str(obj)


def drift() -> list[str]:
    """One line per mirror whose pin moved since it was read."""
    problems = []
    for name, m in sorted(_mirrors().items()):
        if m.pin is None:
            continue
        where, read_at = m.pin
        now = pin_value(where)
        if now != read_at:
            problems.append(
                f"{name}: {where} is {now!r}, the mirror was read for {read_at!r}: re-read {m.repo} "
                f"{', '.join(m.paths)} at the new release and update the MIRRORS of tests/upstream.py or tests/upstream_network.py"
            )
    return problems


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_mirror_names_where_it_was_read(module) -> None:
    missing = _public_functions(module) - set(module.MIRRORS)
    assert not missing, f"mirrors without a recorded source: {sorted(missing)}"
    assert not set(module.MIRRORS) - _public_functions(module), "MIRRORS names functions that do not exist"
    for name, m in module.MIRRORS.items():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", m.repo), name
        assert m.paths and all(m.paths), name
        assert _REF.match(m.ref), f"{name}: {m.ref!r} is neither a tag nor a commit"


def test_every_pin_resolves() -> None:
    for name, m in _mirrors().items():
        if m.pin is not None:
            assert pin_value(m.pin[0]) is not None, f"{name}: {m.pin[0]} names no pin"


def test_no_pin_moved_without_its_mirrors() -> None:
    assert drift() == []


@pytest.mark.parametrize(
    "attr,moved",
    [
        ("KUBERAY_OPERATOR", versions.HelmChart("kuberay-operator", "1.8.0", versions.KUBERAY_OPERATOR.repo)),
        (
            "EFA_DEVICE_PLUGIN",
            versions.HelmChart("aws-efa-k8s-device-plugin", "v0.5.31", versions.EFA_DEVICE_PLUGIN.repo),
        ),
        ("AMI_RELEASE_VERSION", "1.35.6-20260801"),
    ],
)
def test_a_moved_pin_fails_the_check(monkeypatch, attr: str, moved: object) -> None:
    monkeypatch.setattr(versions, attr, moved)
    lines = drift()
    assert lines and all(attr in line for line in lines), lines
