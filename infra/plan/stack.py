"""A stack file's values, loaded and checked whole: what `pulumi up`, the offline tools and the
tests load a stack through.

What flows through here: a stack's bare config values -> `infra.config.load` (every key and
every cross-field check of the config itself, one line naming the file and the key) -> the
checks that read the capacity plan, which assume those passed: the Ray head sized for the
planned request rate (`infra.sizing.head.head_errors` at `planning.stack_head`), and each
model's decode replica streaming its planned tokens within its API side's CPU
(`infra.sizing.streaming.streaming_errors` at `Plan.streaming`) ->
`StackConfig`, or `ConfigError` naming the file and the key, before anything is created.
The config never imports the plan (the plan reads the config), so this check lives above both.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from infra import config
from infra.config.errors import cross_line
from infra.config.pools import rekey
from infra.plan.planning import model_view, plan, stack_head
from infra.sizing.head import head_errors
from infra.sizing.streaming import StreamingSizing, replica_cpus, streaming_errors


def streaming(cfg: config.StackConfig) -> dict[str, StreamingSizing | None]:
    """Model id -> its decode replica's API-side sizing (None: its roofline is unknown)."""
    return {spec.model.id: plan(model_view(cfg, spec)).streaming for spec in cfg.serving.served}


def stack_replica_cpus(cfg: config.StackConfig) -> dict[str, dict[str, int]]:
    """Model id -> engine role -> the CPUs its replica actor asks for, where not Ray's default
    (serving.spec.Target.replica_cpus, through the RayService)."""
    return {model: cpus for model, s in streaming(cfg).items() if (cpus := replica_cpus(s))}


def plan_errors(cfg: config.StackConfig) -> list[tuple[str, str]]:
    """(key, message) of each check that reads the plan: the head's sizing at the planned rate
    and each model's streaming ceiling (none while a model's shape, and so its roofline, is
    unknown)."""
    h = stack_head(cfg)
    errors = [] if h is None else head_errors(h)
    for i, s in enumerate(streaming(cfg).values()):
        errors += [] if s is None else rekey(cfg, i, streaming_errors(s))
    return errors


def load(
    values: Mapping[str, Any],
    *,
    secret_keys: Collection[str] = (),
    source: str,
    region: str | None = None,
) -> config.StackConfig:
    """`infra.config.load`, then the plan's checks; a one-line ConfigError on the first failure."""
    cfg = config.load(values, secret_keys=secret_keys, source=source, region=region)
    errors = plan_errors(cfg)
    if errors:
        raise config.ConfigError(cross_line(source, errors))
    return cfg
