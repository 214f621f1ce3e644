"""`make render`'s picture of what `pulumi up` creates holds every component of the render.

What flows through here: each shipped stack rendered the way `make render` does it
(`tools.render.write` into a temporary build dir) -> its resources.json and manifests, read
here on their own terms (top-level components, managed node groups, Helm releases, the
RayService's groups, the Serve applications, the fallback provider) -> the diagram.svg written
beside them, read as XML: every such component must name a box in the picture, each node group's
box must show its instance type and sizes, each Ray group must be drawn inside the node group
its node selector lands on, and the request's path must run clients -> front door -> head ->
decode -> prefill, the KV cache back, and to the provider only when one is configured.
"""

from __future__ import annotations

import asyncio
import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from infra.paths import ROOT
from tools import diagram, render, stackfile
from tools.rendered import Rendered

SVG = "{http://www.w3.org/2000/svg}"
STACKS = sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))
PROVIDER = "https://api.provider.example/v1"


@pytest.fixture(autouse=True)
def _loop():
    # Pulumi's mock runtime wants a current event loop; asyncio.run() elsewhere leaves none.
    asyncio.set_event_loop(asyncio.new_event_loop())


def _render(stack: str, out: Path, parsed=None) -> Path:
    rendered = (
        render.render_parsed(stack, parsed, stand_in_secrets=True)
        if parsed
        else render.render(stack, stand_in_secrets=True)
    )
    render.write(rendered, out)
    return out


class Picture:
    """diagram.svg as boxes (data-resources -> rect, text) and arrows (data-step -> from, to)."""

    def __init__(self, path: Path):
        self.root = ET.parse(path).getroot()
        self.boxes = []
        for g in self.root.iter(f"{SVG}g"):
            if "box" in (g.get("class") or "").split():
                rect = g.find(f"{SVG}rect")
                texts = [t.text or "" for t in g.findall(f"{SVG}text")]
                x, y, w, h = (float(rect.get(a)) for a in ("x", "y", "width", "height"))
                names = (g.get("data-resources") or "").split()
                self.boxes.append({"names": names, "key": g.get("data-key"), "rect": (x, y, w, h), "text": texts})
        self.edges = [
            (int(g.get("data-step")), g.get("data-from"), g.get("data-to"))
            for g in self.root.iter(f"{SVG}g")
            if g.get("data-step")
        ]

    def box(self, name: str) -> dict:
        found = [b for b in self.boxes if name in b["names"]]
        assert found, f"no box in the picture stands for {name!r}"
        return found[0]

    def keyed(self, key: str) -> dict:
        (found,) = [b for b in self.boxes if b["key"] == key]
        return found


def _components(out: Path) -> dict[str, str]:
    """What a reader of the render calls the stack's components, name -> what it is."""
    resources = json.loads((out / "resources.json").read_text())
    found = {r["name"]: "top-level component" for r in resources if r["parent"] is None}
    found |= {r["name"]: "node group" for r in resources if r["type"] == "eks:index:ManagedNodeGroup"}
    found |= {r["name"]: "Helm release" for r in resources if r["type"] == "kubernetes:helm.sh/v4:Chart"}
    for path in (out / "manifests").glob("rayservice-*.yaml"):
        rs = yaml.safe_load(path.read_text())
        name, rc = rs["metadata"]["name"], rs["spec"]["rayClusterConfig"]
        found[f"ray/{name}/head"] = "Ray head group"
        found |= {f"ray/{name}/{g['groupName']}": "Ray worker group" for g in rc["workerGroupSpecs"]}
        serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
        found |= {f"app/{a['name']}": "Serve application" for a in serve["applications"]}
    return found


@pytest.fixture(scope="module")
def rendered_stacks(tmp_path_factory) -> dict[str, Path]:
    asyncio.set_event_loop(asyncio.new_event_loop())
    return {s: _render(s, tmp_path_factory.mktemp(s)) for s in STACKS}


@pytest.mark.parametrize("stack", STACKS)
def test_every_component_of_the_render_is_in_its_picture(rendered_stacks, stack):
    out = rendered_stacks[stack]
    pic = Picture(out / diagram.FILE)
    drawn = {n for b in pic.boxes for n in b["names"]}
    components = _components(out)
    missing = {n: what for n, what in components.items() if n not in drawn}
    assert not missing, f"{stack}: drawn nowhere: {missing}"
    for name in components:
        assert any(t.strip() for t in pic.box(name)["text"]), f"{stack}: the box of {name} says nothing"


@pytest.mark.parametrize("stack", STACKS)
def test_each_node_group_shows_its_instance_type_and_sizes_and_holds_its_ray_groups(rendered_stacks, stack):
    out = rendered_stacks[stack]
    pic = Picture(out / diagram.FILE)
    resources = json.loads((out / "resources.json").read_text())
    groups = [r for r in resources if r["type"] == "eks:index:ManagedNodeGroup"]
    for ng in groups:
        inp, text = ng["inputs"], " ".join(pic.box(ng["name"])["text"])
        assert inp["instanceTypes"][0] in text
        sc = inp["scalingConfig"]
        assert f"{sc['minSize']}-{sc['maxSize']} nodes, desired {sc['desiredSize']}" in text
    (path,) = (out / "manifests").glob("rayservice-*.yaml")
    rs = yaml.safe_load(path.read_text())
    rc = rs["spec"]["rayClusterConfig"]
    pods = [("head", rc["headGroupSpec"]), *((g["groupName"], g) for g in rc["workerGroupSpecs"])]
    for group, spec in pods:
        selector = spec["template"]["spec"]["nodeSelector"]
        (ng,) = [
            n
            for n in groups
            if all(
                v in n["inputs"]["instanceTypes"]
                if k == "node.kubernetes.io/instance-type"
                else (n["inputs"].get("labels") or {}).get(k) == v
                for k, v in selector.items()
            )
        ]
        x, y, w, h = pic.box(ng["name"])["rect"]
        gx, gy, gw, gh = pic.box(f"ray/{rs['metadata']['name']}/{group}")["rect"]
        assert x < gx and gx + gw < x + w and y < gy and gy + gh < y + h, f"{stack}: {group} drawn outside {ng['name']}"


def test_the_request_path_runs_through_the_front_door_head_decode_and_prefill(rendered_stacks):
    pic = Picture(rendered_stacks["prod"] / diagram.FILE)
    steps = {(s, a, b) for s, a, b in pic.edges}
    assert {(1, "clients", "front"), (2, "front", "head")} <= steps
    assert (3, "head", "group/decode") in steps
    assert {(4, "group/decode", "group/prefill"), (5, "group/prefill", "group/decode")} <= steps
    assert not [e for e in pic.edges if e[0] == 6], "prod has no fallback: no arrow to a provider"
    front = " ".join(pic.keyed("front")["text"])
    assert "internal NLB" in front and "10.0.0.0/8" in front  # prod's serviceExposure and serviceAllowedCidrs
    assert "ClusterIP" in " ".join(Picture(rendered_stacks["dev"] / diagram.FILE).keyed("front")["text"])


def test_the_platform_stack_routes_each_model_to_its_own_engines(rendered_stacks):
    pic = Picture(rendered_stacks["platform"] / diagram.FILE)
    entries = sorted(b for s, a, b in pic.edges if s == 3)
    assert entries == ["group/decode", "group/general"]  # P/D llama on decode, aggregated qwen on general


def test_a_fallback_provider_is_drawn_with_its_arrow_when_the_stack_configures_one(tmp_path):
    values, secrets, others = stackfile.read("prod")
    values = copy.deepcopy(values)
    values["serving"] = {**values["serving"], "fallback": {"baseUrl": PROVIDER, "model": "provider/llama"}}
    values["fallbackApiKey"] = "sk-stand-in"
    out = _render("prod", tmp_path, (values, secrets | {"fallbackApiKey"}, others))
    pic = Picture(out / diagram.FILE)
    assert (6, "head", "provider") in set(pic.edges)
    assert "api.provider.example" in " ".join(pic.keyed("provider")["text"])


def test_a_changed_stack_file_changes_the_picture(tmp_path, rendered_stacks):
    values, secrets, others = stackfile.read("prod")
    values = copy.deepcopy(values)
    values["nodePools"]["decode"]["maxSize"] += 2
    out = _render("prod", tmp_path, (values, secrets, others))
    text = " ".join(Picture(out / diagram.FILE).box("gpu-decode-ng")["text"])
    assert f"-{values['nodePools']['decode']['maxSize']} nodes" in text
    assert (out / diagram.FILE).read_text() != (rendered_stacks["prod"] / diagram.FILE).read_text()


def test_the_picture_does_not_depend_on_the_order_resources_were_registered(rendered_stacks):
    r = diagram.load(rendered_stacks["prod"], "prod")
    shuffled = Rendered("prod", list(reversed(r.resources)), dict(reversed(list(r.manifests.items()))))
    assert diagram.draw(shuffled) == (rendered_stacks["prod"] / diagram.FILE).read_text()


def test_make_render_writes_the_picture_and_says_so(tmp_path, capsys):
    assert render.main(["--stack", "dev", "--stand-in-secrets", "--out", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / diagram.FILE}" in capsys.readouterr().out
    title = ET.parse(tmp_path / diagram.FILE).getroot().find(f"{SVG}title").text
    assert title.startswith("stack dev: what `pulumi up` creates")
