"""Offline render: what a stack would put into AWS and the cluster, without credentials.

What flows through here: `stacks/Pulumi.<stack>.yaml` (secret values replaced by
placeholders) -> the real program under Pulumi's mock runtime (`tools.mock_runtime`) ->
`DIR/resources.json` (every registered resource: type, name, parent, inputs),
`DIR/manifests/` (one YAML file per Kubernetes object the stack declares; each Helm release
as its chart, version, repository and values), `DIR/diagram.svg` (the picture of them,
`tools.diagram`) and a summary on stdout (resources by type, GPUs and EFA interfaces per
pool, cost, the capacity plan).

    python -m tools.render --stack prod [--out DIR] [--stand-in-secrets]   # DIR: build/<stack>

A bad stack file exits 1 with the same one line `pulumi up` prints. So does a stack that
lacks a secret its config needs, unless --stand-in-secrets (`make render`, CI) renders it
with a stand-in and a note naming the `pulumi config set --secret` command to run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import yaml

from infra.config import ConfigError, StackConfig
from infra.paths import BUILD_DIR, stack_file
from infra.plan import planning as planner
from infra.plan.model_plans import format_stack_plan
from tools import creation_order, diagram, mock_runtime, stackfile

HELM_CHART = "kubernetes:helm.sh/v4:Chart"
K8S_PROVIDER = "pulumi:providers:kubernetes"
MNG = "eks:index:ManagedNodeGroup"


class RenderError(Exception):
    """A user mistake in the stack file: one line, exit 1."""


@dataclass
class Rendered:
    stack: str
    config: StackConfig
    result: mock_runtime.RunResult
    stand_ins: tuple[str, ...] = ()  # secrets the stack file lacks, rendered with stand-ins

    def manifests(self) -> dict[str, dict[str, Any]]:
        """File name -> object, for every Kubernetes object and Helm release the stack declares."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.result.resources:
            if r.type == HELM_CHART:
                doc = {
                    "helmRelease": r.name,
                    "chart": r.inputs.get("chart"),
                    "version": r.inputs.get("version"),
                    "repository": (r.inputs.get("repositoryOpts") or {}).get("repo"),
                    "namespace": r.inputs.get("namespace"),
                    "values": r.inputs.get("values") or {},
                }
                out[f"helm-{r.name}.yaml"] = doc
            elif r.type.startswith("kubernetes:") and r.type != K8S_PROVIDER:
                obj = {k: v for k, v in r.inputs.items() if k not in ("name",)}
                kind = obj.get("kind") or r.type.rsplit(":", 1)[-1]
                meta = obj.get("metadata") or {}
                ns = meta.get("namespace")
                fname = f"{kind.lower()}-{ns + '-' if ns else ''}{meta.get('name', r.name)}.yaml"
                out[fname] = obj
        return out


def render(stack: str, *, stand_in_secrets: bool = False) -> Rendered:
    """Run the program for `stack` under mocks; RenderError for a bad stack file. With
    `stand_in_secrets`, a secret the config needs and the file lacks gets a stand-in."""
    try:
        parsed = stackfile.read(stack)
    except stackfile.StackFileError as e:
        raise RenderError(str(e)) from None
    return render_parsed(stack, parsed, stand_in_secrets=stand_in_secrets)


def render_parsed(
    stack: str, parsed: tuple[dict[str, Any], set[str], dict[str, Any]], *, stand_in_secrets: bool = False
) -> Rendered:
    """`render` of a stack file's parsed values (`stackfile.parse`/`read`), e.g. a stack file
    as `make model` would change it, before it is written."""
    values, secrets, others = parsed
    try:
        if stand_in_secrets:
            loaded = stackfile.load_offline(values, secrets, others, stack_file(stack))
        else:
            cfg = stackfile.validate((values, secrets, others), stack_file(stack))
            loaded = stackfile.Offline(cfg, values, secrets, ())
    except (stackfile.StackFileError, ConfigError) as e:
        raise RenderError(str(e)) from None
    try:
        result = mock_runtime.run(stack, loaded.values, loaded.secrets, others)
    except pulumi.RunError as e:  # the program's own config check (same message as above)
        raise RenderError(str(e)) from None
    return Rendered(stack, loaded.config, result, loaded.stand_ins)


def write(rendered: Rendered, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    (out / "manifests").mkdir(parents=True)
    (out / "resources.json").write_text(
        json.dumps([r.as_json() for r in rendered.result.resources], indent=2, sort_keys=True) + "\n"
    )
    for fname, obj in sorted(rendered.manifests().items()):
        (out / "manifests" / fname).write_text(yaml.safe_dump(obj, sort_keys=False))
    diagram.write(out, rendered.stack)  # the picture, read back from the two just written
    # The fabric checks the deploy workflow runs after `pulumi up` (not Pulumi resources): one
    # per P/D model's EFA pool pair, one NCCL check per EFA pool whose replicas span nodes.
    from tools import efa_check

    cfg = rendered.config
    image = efa_check.offline_image(cfg, rendered.stack)
    objects = efa_check.objects_for(cfg, efa_check.inputs_for(cfg, rendered.stack, image, 0.5), image)
    if objects:
        efa_check.write(objects, out / "efa-check", cfg.kubernetes_version)


def pool_summary(rendered: Rendered) -> list[dict[str, Any]]:
    """Per GPU pool: type, sizes, GPUs/EFA per node and in total at max size, cost per hour."""
    rows = []
    for role, pool in rendered.config.node_pools:
        f = planner.pool_figures(pool)
        rows.append(
            {
                "pool": role,
                "instanceType": f.instance_type,
                "capacityType": f.capacity_type,
                "nodes": f"{f.min_size}/{f.desired_size}/{f.max_size}",
                "gpusPerNode": f.gpus_per_node,
                "efaPerNode": f.efa_per_node,
                "gpusAtMax": f.gpus_max,
                "efaAtMax": f.efa_max,
                "usdPerHourDesired": round(f.usd_per_hour_desired, 2),
                "usdPerHourMax": round(f.usd_per_hour_max, 2),
            }
        )
    return rows


def summary(rendered: Rendered) -> str:
    counts = Counter(r.type for r in rendered.result.resources)
    lines = [f"stack {rendered.stack}: {sum(counts.values())} resources"]
    for type_, n in sorted(counts.items()):
        lines.append(f"  {n:3d}  {type_}")
    lines.append(_image_line(rendered))
    lines.append("GPU pools (nodes min/desired/max; totals at max size):")
    for row in pool_summary(rendered):
        lines.append(
            f"  {row['pool']:8s} {row['instanceType']:14s} {row['capacityType']:14s} nodes {row['nodes']:8s} "
            f"GPUs/node {row['gpusPerNode']}  EFA/node {row['efaPerNode']:2d}  "
            f"GPUs {row['gpusAtMax']:3d}  EFA {row['efaAtMax']:3d}  ${row['usdPerHourDesired']:.2f}/h desired, "
            f"${row['usdPerHourMax']:.2f}/h max"
        )
    # Totals from unrounded prices: summing the rounded per-pool figures drifts by cents.
    pools = [planner.pool_figures(p) for _, p in rendered.config.node_pools]
    total_desired = sum(p.usd_per_hour_desired for p in pools)
    total_max = sum(p.usd_per_hour_max for p in pools)
    lines.append(
        f"  GPU node cost: ${total_desired:,.2f}/h at desired size, ${total_max:,.2f}/h at max "
        f"(indicative on-demand list prices; spot and capacity blocks differ)"
    )
    return "\n".join(lines)


def _image_line(rendered: Rendered) -> str:
    """What the Ray pods run; a built image's tag is its content hash, so a new tag = a rebuild."""
    built = rendered.result.of_type("docker-build:index:Image")
    backend = next(iter(rendered.config.node_pools))[1].instance.nixl_backend.value
    if built:
        (tag,) = built[0].inputs["tags"]
        return (
            f"Worker image: built from images/ray-llm-efa FROM {rendered.config.ray_image}, tag "
            f"{tag.rsplit(':', 1)[-1]} (changes only when the image would rebuild); KV transfer: NIXL {backend}"
        )
    return f"Worker image: {rendered.config.ray_image} (not built); KV transfer: NIXL {backend}"


def _plan_text(cfg: StackConfig) -> str:
    return format_stack_plan(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.render", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", required=True, help="stack name: stacks/Pulumi.<stack>.yaml")
    ap.add_argument("--out", type=Path, help="output directory (default build/<stack>)")
    ap.add_argument(
        "--stand-in-secrets",
        action="store_true",
        help="render a stack that lacks a secret its config needs, with a stand-in (and say which to set)",
    )
    args = ap.parse_args(argv)
    try:
        rendered = render(args.stack, stand_in_secrets=args.stand_in_secrets)
    except RenderError as e:
        print(e, file=sys.stderr)
        return 1
    out = args.out or BUILD_DIR / args.stack
    write(rendered, out)
    print(summary(rendered))
    print(_plan_text(rendered.config))
    # The order a first `pulumi up` takes (what waits for what): tools/creation_order.py.
    print(creation_order.format_waves(creation_order.graph(rendered.result)))
    if rendered.stand_ins:
        print(stackfile.stand_in_note(rendered.stand_ins, rendered.stack))
    print(f"wrote {out / 'resources.json'} and {len(rendered.manifests())} manifests in {out / 'manifests'}")
    print(f"wrote {out / diagram.FILE}: what `pulumi up` creates, drawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
