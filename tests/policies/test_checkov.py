"""An outside scanner over what each stack puts into the cluster: checkov, offline.

What flows through here: every shipped stack's `Rendered.manifests()` written as YAML, plus
the RayService's head and worker pod templates written as plain Pods (checkov has no checks
for a RayService; shown as Pods, its pod-level checks apply to them) -> `checkov -d DIR
--framework kubernetes --skip-download --compact --quiet -o json` with the checks listed in
policies/checkov-skips.yaml skipped -> zero failed checks. A second run without the skips
proves every listed skip is still needed.

checkov lives in its own virtualenv (.venv-checkov, built by `make test`; PD_CHECKOV names
another binary): it pins packaging<24, pulumi needs packaging>=26.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.paths import ROOT
from tests.conftest import STACKS

CHECKOV = Path(os.environ.get("PD_CHECKOV") or ROOT / ".venv-checkov" / "bin" / "checkov")
SKIPS_FILE = ROOT / "policies" / "checkov-skips.yaml"


def skips() -> dict[str, str]:
    doc = yaml.safe_load(SKIPS_FILE.read_text())
    out: dict[str, str] = {}
    for entry in doc["skips"]:
        assert set(entry) == {"id", "reason"}, entry
        assert entry["id"] not in out, f"{entry['id']} listed twice"
        out[entry["id"]] = entry["reason"]
    return out


def ray_pods(manifests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """file name -> a Pod per Ray head and worker group of every RayService."""
    pods: dict[str, dict[str, Any]] = {}
    for obj in manifests.values():
        if obj.get("kind") != "RayService":
            continue
        meta = obj["metadata"]
        cluster = obj["spec"]["rayClusterConfig"]
        groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
        for group, spec in groups:
            template = spec["template"]
            name = f"{meta['name']}-{group}"
            pods[f"pod-{meta['namespace']}-{name}.yaml"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": meta["namespace"],
                    "labels": dict((template.get("metadata") or {}).get("labels") or {}),
                },
                "spec": template["spec"],
            }
    return pods


def checkov(directory: Path, skip: list[str]) -> dict[str, Any]:
    if not CHECKOV.is_file():
        pytest.fail(f"checkov not found at {CHECKOV}: run `make test` (it builds .venv-checkov) or set PD_CHECKOV")
    cmd = [
        str(CHECKOV),
        "-d",
        str(directory),
        "--framework",
        "kubernetes",
        "--skip-download",
        "--compact",
        "--quiet",
        "-o",
        "json",
    ]
    if skip:
        cmd += ["--skip-check", ",".join(skip)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=directory)
    assert proc.returncode in (0, 1), f"checkov failed to run ({proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    assert [r["check_type"] for r in reports] == ["kubernetes"], proc.stdout[:2000]
    result = reports[0]
    assert result["summary"]["parsing_errors"] == 0
    assert (proc.returncode == 0) == (result["summary"]["failed"] == 0)
    return result


@pytest.fixture(scope="module")
def scan_dirs(rendered_stacks, tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for stack, rendered in rendered_stacks.items():
        d = tmp_path_factory.mktemp(f"checkov-{stack}")
        manifests = rendered.manifests()
        for fname, obj in {**manifests, **ray_pods(manifests)}.items():
            (d / fname).write_text(yaml.safe_dump(obj, sort_keys=False))
        dirs[stack] = d
    return dirs


def test_skip_file_gives_a_reason_for_each_check() -> None:
    listed = skips()
    assert listed, "an empty skip list belongs deleted, not checked in"
    for check, reason in listed.items():
        assert check.startswith(("CKV_K8S_", "CKV2_K8S_")), check
        assert len(reason.split()) >= 12, f"{check}: say why it is skipped"


def test_ray_pods_are_shown_to_checkov(rendered_stacks) -> None:
    for stack, rendered in rendered_stacks.items():
        pods = ray_pods(rendered.manifests())
        groups = {p["metadata"]["name"].rsplit("-", 1)[-1] for p in pods.values()}
        # The head and one worker group per pool a model runs on (one-model stacks: its roles).
        serving = rendered.config.serving
        assert groups == {"head", *(m.pool_of(r) for m in serving.served for r in m.engine_roles())}, stack


@pytest.mark.parametrize("stack", STACKS)
def test_checkov_finds_nothing_beyond_the_listed_skips(stack: str, scan_dirs) -> None:
    result = checkov(scan_dirs[stack], sorted(skips()))
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in result["results"]["failed_checks"]]
    assert failed == []
    # It scanned every object: the built-in ones and the Ray pods.
    objects = [p for p in scan_dirs[stack].glob("*.yaml") if "kind" in yaml.safe_load(p.read_text())]
    assert result["summary"]["resource_count"] == len(objects)
    assert result["summary"]["passed"] > 0


def test_every_skip_is_still_needed(scan_dirs) -> None:
    failing: set[str] = set()
    for stack in STACKS:
        result = checkov(scan_dirs[stack], [])
        failing |= {c["check_id"] for c in result["results"]["failed_checks"]}
    assert sorted(set(skips()) - failing) == [], "skipped checks that no longer fail: remove them"
    assert failing <= set(skips())
