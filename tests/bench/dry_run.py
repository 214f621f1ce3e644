"""A bench's local stack, dry: what it would deploy, built and checked without Ray.

What flows through here: the arguments a bench gives background_stack (its `stack_options`)
-> local.background.plan_stack (the command line and environment `python -m local` would get,
parsed, checked and rendered by that command's own code) -> Ray Serve's schema of a Serve
config -> each application built from its import path with its args, as Serve builds it on
deploy (serving.app: our args models, then Ray Serve LLM's own builders) -> the deployments
of each application and their replica bounds. A spec, setting or args problem raises here as
it would fail the bench after minutes of starting Ray; Ray itself is never started.
"""

from __future__ import annotations

import importlib
import os
import types
from dataclasses import dataclass
from typing import Any
from unittest import mock

from local.background import StackPlan, plan_stack

# This machine's own make-serve settings (PD_REPLICAS, PD_FALLBACK_*, ...) stay out of the plan.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PD_")}


@dataclass(frozen=True)
class Replicas:
    """A deployment's replica bounds as Serve reads them (fixed: min == max)."""

    min: int
    max: int
    initial: int | None = None


def plan(options: dict[str, Any]) -> StackPlan:
    """What background_stack(**options) would deploy."""
    return plan_stack(**options, environ=CLEAN_ENV)


def deployments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every application of a Serve config built as Serve builds it on deploy, Ray not started:
    app name -> deployment name -> Serve's Deployment (its class, options, replica config)."""
    import ray
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)
    out: dict[str, dict[str, Any]] = {}
    # Building reads only the default runtime env from Ray; auto-connect off, so a hidden
    # ray.init() fails instead of starting Ray.
    with (
        mock.patch.dict(os.environ, {"RAY_ENABLE_AUTO_CONNECT": "0"}),
        mock.patch.object(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env={})),
    ):
        for app in config["applications"]:
            module, name = app["import_path"].split(":")
            built = getattr(importlib.import_module(module), name)(app["args"])
            out[app["name"]] = _walk(built)
    assert not ray.is_initialized()
    return out


def build(config: dict[str, Any]) -> dict[str, dict[str, Replicas]]:
    """`deployments`, each as its replica bounds: app name -> deployment name -> Replicas."""
    return {app: {name: _replicas(d) for name, d in deps.items()} for app, deps in deployments(config).items()}


def _replicas(d: Any) -> Replicas:
    cfg = d._deployment_config
    auto = cfg.autoscaling_config
    return (
        Replicas(auto.min_replicas, auto.max_replicas, auto.initial_replicas)
        if auto is not None
        else Replicas(cfg.num_replicas, cfg.num_replicas)
    )


def _walk(app: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(a: Any) -> None:
        d = a._bound_deployment
        out[d.name] = d
        for v in d.init_kwargs.values():
            for child in v.values() if isinstance(v, dict) else [v]:
                if hasattr(child, "_bound_deployment"):
                    walk(child)

    walk(app)
    return out


def served(built: dict[str, dict[str, Replicas]], ingress: str) -> dict[str, dict[str, Any]]:
    """The built apps in the shape of Serve's REST view the benches read (observe.serve_apps):
    app -> {"ingress": deployment, "replicas": deployment -> replica ids}."""
    return {
        app: {"ingress": ingress, "replicas": {dep: [f"{dep}#{i}" for i in range(r.max)] for dep, r in deps.items()}}
        for app, deps in built.items()
    }
