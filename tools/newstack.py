"""Self-service: a new stack file from the documented template, checked before it is kept.

What flows through here: a stack NAME and a few choices (model, region, environment) ->
`templates/new-stack.yaml` filled in -> parsed as Pulumi would hand it to the program
(`tools.stackfile.parse`) -> the decode replica's targetOngoingRequests lowered to what its API
side can stream where the default plans more (`infra.sizing.streaming`, make plan's Stream
line) -> validated (`infra.plan.stack.load`: the config and the plan's checks) -> written to
`stacks/Pulumi.<NAME>.yaml` (never over an existing file) -> rendered under mocks
(`tools.render.render`) -> the render summary (GPU pools and their cost) on stdout.

    python -m tools.newstack team-x [--model Qwen/Qwen2.5-0.5B-Instruct] [--region us-west-2]

A bad NAME, an existing stack, or choices the config rejects exit 1 with one line and leave
no file behind.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from string import Template
from typing import Any

from infra import versions
from infra.config import ConfigError, Environment
from infra.paths import ROOT, stack_file
from infra.plan.stack import streaming
from infra.sizing.streaming import below_plan
from serving.spec import RoleSpec
from tools import render, stackfile

TEMPLATE = ROOT / "templates" / "new-stack.yaml"
DEFAULT_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_REGION = "us-east-2"
# The decode replica's targetOngoingRequests unless its API side cannot stream that (the
# serving spec's default, one copy).
DEFAULT_DECODE_TARGET = int(RoleSpec.model_fields["target_ongoing_requests"].default)
# The platform team's admin role, as in the shipped stacks.
DEFAULT_ADMIN_ROLE = "arn:aws:iam::123456789012:role/platform-admin"
# Lowercase letters, digits and single hyphens, 3 to 24 characters: the stack name becomes
# part of the cluster's, node groups' and KMS alias's names (`pd-inference-<NAME>-prefill`
# must stay within EKS's 63 characters) and of Kubernetes-style labels.
_NAME = re.compile(r"^[a-z](?:[a-z0-9]|-(?!-)){1,22}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")


class NewStackError(Exception):
    """Why no stack file was written; one line."""


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise NewStackError(
            f"NAME {name!r}: use 3 to 24 lowercase letters, digits and single hyphens, "
            f"starting with a letter and not ending with a hyphen (e.g. team-search)"
        )
    return name


def text_for(
    name: str,
    *,
    model: str = DEFAULT_MODEL,
    region: str = DEFAULT_REGION,
    environment: str = Environment.DEV.value,
    owner: str = "its owning team",
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    decode_target: int | None = None,
) -> str:
    """The new stack file's text: the template with these choices filled in (`decode_target`:
    the decode replica's targetOngoingRequests as `decode_target_for` lowered it; None: the
    default)."""
    check_name(name)
    if not _REGION.match(region):
        raise NewStackError(f"--region {region!r} is not an AWS region name (e.g. us-east-2)")
    if "\n" in owner or ":" in owner or "#" in owner:
        raise NewStackError(f"--owner {owner!r}: one line of plain text, without ':' or '#'")
    return Template(TEMPLATE.read_text()).substitute(
        name=name,
        environment=environment,
        owner=owner,
        region=region,
        kubernetes_version=versions.DEFAULT_KUBERNETES_VERSION,
        ami_release_version=versions.AMI_RELEASE_VERSION,
        admin_role_arn=DEFAULT_ADMIN_ROLE,
        # The served name: the repo's last part, lowercased (Qwen2.5-1.5B-Instruct -> qwen2.5-1.5b-instruct).
        model_id=model.rstrip("/").rsplit("/", 1)[-1].lower(),
        model_source=model,
        max_model_len=max_model_len,
        decode_target=decode_target or DEFAULT_DECODE_TARGET,
        decode_target_why=(
            "the serving spec's default"
            if decode_target is None
            else "the most its API side streams on this instance type: make plan's Stream line"
        ),
    )


def planned_text(name: str, source: str, **choices: Any) -> str:
    """What `make stack` writes: `text_for`, with the decode target `decode_target_for` finds
    where the default plans more than the decode replica streams."""
    text = text_for(name, **choices)
    if (target := decode_target_for(text, source)) is not None:
        text = text_for(name, decode_target=target, **choices)
    return text


def decode_target_for(text: str, source: str) -> int | None:
    """The largest decode targetOngoingRequests whose planned tokens the decode replica's API
    side streams, where the file's own plans more (None: it fits, or its roofline is unknown,
    or nothing fits and the load names why)."""
    cfg = stackfile.load_offline(*stackfile.parse(text, source), source, plan_checks=False).config
    s = next(iter(streaming(cfg).values()))
    return s.fitting_target if s is not None and below_plan(s) else None


def create(name: str, **choices: Any) -> tuple[Path, render.Rendered]:
    """Write stacks/Pulumi.<name>.yaml after validating it; render it. NewStackError on any failure."""
    check_name(name)
    path = stackfile.path_of(name)
    source = stack_file(name)
    if path.exists():
        raise NewStackError(f"{source} already exists; edit it, or choose another NAME")
    try:
        text = planned_text(name, source, **choices)
        # A new stack holds no secret yet (its owner sets them with `pulumi config set --secret`).
        stackfile.load_offline(*stackfile.parse(text, source), source)
    except ConfigError as e:
        raise NewStackError(str(e)) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("x") as f:  # "x": a file that appeared meanwhile is not overwritten
            f.write(text)
    except FileExistsError:
        raise NewStackError(f"{source} already exists; edit it, or choose another NAME") from None
    try:
        rendered = render.render(name, stand_in_secrets=True)
    except render.RenderError as e:
        path.unlink()  # a stack that does not render is not left behind
        raise NewStackError(str(e)) from None
    return path, rendered


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.newstack", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", metavar="NAME", help="the stack (environment) name: stacks/Pulumi.<NAME>.yaml")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"Hugging Face repo id to serve (default {DEFAULT_MODEL})")
    ap.add_argument(
        "--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="context length (default %(default)s)"
    )
    ap.add_argument("--region", default=DEFAULT_REGION, help="AWS region (default %(default)s)")
    ap.add_argument(
        "--environment",
        default=Environment.DEV.value,
        choices=[e.value for e in Environment],
        help="policy class: dev (default), staging or prod; decides who approves deploys",
    )
    ap.add_argument("--owner", default="its owning team", help="team named in the file's header")
    args = ap.parse_args(argv)
    try:
        path, rendered = create(
            args.name,
            model=args.model,
            region=args.region,
            environment=args.environment,
            owner=args.owner,
            max_model_len=args.max_model_len,
        )
    except NewStackError as e:
        print(e, file=sys.stderr)
        return 1
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"wrote {rel}: valid, and renders {len(rendered.result.resources)} resources")
    print(render.summary(rendered))
    if (target := rendered.config.serving.decode.target_ongoing_requests) < DEFAULT_DECODE_TARGET:
        print(
            f"decode targetOngoingRequests {target:g} (default {DEFAULT_DECODE_TARGET}): the most its replica's "
            "API side streams on this instance type (make plan's Stream line)"
        )
    print(
        f"next: pulumi stack init <org>/{args.name}; pulumi config set --secret apiKeys <key1,key2> "
        f"--stack {args.name} (replaces the placeholder); commit {rel} and open a pull request: "
        f"CI previews it, merging deploys it (GitHub environment {args.environment})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
