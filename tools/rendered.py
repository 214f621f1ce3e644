"""What `make render` wrote for one stack, read back and indexed: the reader `tools.diagram` draws from.

What flows through here: `build/<stack>/resources.json` (every resource the program registered
under the mock engine: type, name, parent, inputs) and `build/<stack>/manifests/*.yaml` ->
`Rendered` (lookups by type, parent, id and Kubernetes kind) -> and out of the RayService's
Serve config: the engines (model, role, parallelism, the Ray group label they are placed by,
the KV transfer backends), the ingress app and its replicas, the fallback provider's host.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

INSTANCE_TYPE = "node.kubernetes.io/instance-type"
MNG = "eks:index:ManagedNodeGroup"


@dataclass
class Rendered:
    """What `make render` wrote for one stack, indexed."""

    stack: str
    resources: list[dict[str, Any]]
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Registration order can vary between runs; the picture must not.
        self.resources = sorted(self.resources, key=lambda r: (r["type"], r["name"]))

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["type"] == type_]

    def children(self, name: str | None) -> list[dict[str, Any]]:
        return [r for r in self.resources if name and r["parent"] == name]

    def top(self) -> list[dict[str, Any]]:
        return [r for r in self.resources if r["parent"] is None]

    def by_id(self, rid: str) -> dict[str, Any] | None:
        # Under the mock engine a resource's id is "<name>-id" (tools.mock_runtime).
        return next((r for r in self.resources if f"{r['name']}-id" == rid), None)

    def owner_of(self, type_: str) -> dict[str, Any] | None:
        """The top-level component under which a resource of `type_` is registered."""
        found = next(iter(self.of_type(type_)), None)
        while found and found["parent"]:
            found = next((r for r in self.resources if r["name"] == found["parent"]), None)
        return found

    def one(self, type_: str) -> dict[str, Any] | None:
        return next(iter(self.of_type(type_)), None)

    def node_group(self, selector: dict[str, str]) -> str | None:
        """The managed node group whose nodes a pod with this node selector lands on."""
        for ng in self.of_type(MNG):
            if matches(selector, ng["inputs"].get("labels") or {}, ng["inputs"].get("instanceTypes") or []):
                return str(ng["name"])
        return None

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests.values() if m.get("kind") == kind]


def load(out: Path, stack: str) -> Rendered:
    """The render `tools.render` wrote into `out`."""
    resources = json.loads((out / "resources.json").read_text())
    manifests = {p.name: yaml.safe_load(p.read_text()) for p in sorted((out / "manifests").glob("*.yaml"))}
    return Rendered(stack, resources, manifests)


def walk(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v)


def count(n: Any, what: str) -> str:
    return f"{n} {what}" + ("s" if what == "GPU" and str(n) != "1" else "")


def matches(selector: dict[str, str], labels: dict[str, str], instance_types: list[str]) -> bool:
    return bool(selector) and all(
        v in instance_types if k == INSTANCE_TYPE else labels.get(k) == v for k, v in selector.items()
    )


@dataclass(frozen=True)
class Engine:
    app: str
    model: str
    role: str  # prefill, decode or aggregated
    parallel: str
    selector: tuple[tuple[str, str], ...]
    kv_backends: str


def engines(serve: dict[str, Any]) -> list[Engine]:
    out = []
    for app in serve.get("applications", []):
        args = app.get("args") or {}
        configs = [(k.removesuffix("_config"), args[k]) for k in ("decode_config", "prefill_config") if k in args]
        configs += [("aggregated", c) for c in args.get("llm_configs") or []]
        for role, c in configs:
            kw = c.get("engine_kwargs") or {}
            kv = kw.get("kv_transfer_config") or {}
            tp, pp = kw.get("tensor_parallel_size", 1), kw.get("pipeline_parallel_size", 1)
            parallel = f"vLLM TP {tp}" + (f" x PP {pp}" if pp > 1 else "")
            if kv.get("kv_role"):
                parallel += f", KV {kv['kv_role'].removeprefix('kv_')}"
            selectors = (c.get("deployment_config") or {}).get("placement_group_bundle_label_selector") or [{}]
            backends = ", ".join((kv.get("kv_connector_extra_config") or {}).get("backends") or [])
            model = (c.get("model_loading_config") or {}).get("model_id") or app.get("name", "")
            out.append(
                Engine(app.get("name", ""), model, role, parallel, tuple(sorted(selectors[0].items())), backends)
            )
    return out


def fallback_host(serve: dict[str, Any]) -> str | None:
    for d in walk(serve):
        user = d.get("user_config")
        fb = user.get("fallback") if isinstance(user, dict) else None
        if isinstance(fb, dict) and fb.get("base_url"):
            return urlparse(fb["base_url"]).netloc or fb["base_url"]
    return None


def ingress(serve: dict[str, Any]) -> tuple[str, str]:
    """The ingress app's name and its replica range."""
    for app in serve.get("applications", []):
        cfg = (app.get("args") or {}).get("ingress_deployment_config")
        if cfg is not None:
            auto = cfg.get("autoscaling_config") or {}
            lo, hi = auto.get("min_replicas", cfg.get("num_replicas", 1)), auto.get("max_replicas", 1)
            return app.get("name", ""), f"{lo}-{hi}" if lo != hi else f"{lo}"
    return "", "1"
