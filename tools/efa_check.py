"""`make efa-check STACK=<name>`: prove the EFA fabric between a prefill and a decode node.

What flows through here: the stack file (validated like `make render`) -> its pools' catalog
entries, namespace and worker image -> `infra.k8s.efa_check.manifests` (a headless Service,
a server Job on a prefill node, a client Job on a decode node; each pod asks for all of its
node's EFA interfaces) -> written to `build/<stack>/efa-check/` and validated offline against
the Kubernetes OpenAPI schema of the stack's version (kubernetes-validate, strict).

Stacks whose engine replicas span nodes (TP x PP or DP x TP above one node's GPUs, e.g.
stacks/Pulumi.deepseek-p5.yaml) also get the NCCL check of each such role
(`infra.k8s.nccl_check`, issue 24 item 8): an Indexed Job of two pods on two nodes of that
role's pool, an all-reduce over every GPU of both, which fails unless NCCL used the
aws-ofi-nccl (Libfabric) network; it registers GPU memory with EFA as the engines' NCCL does.

Without `--dry-run` it then runs them on the cluster of the current kubeconfig: `kubectl
apply`, wait for the client Job (and the NCCL Jobs), read both pods' logs (the memlock, device
file and registration checks, `fi_info -p efa` on both sides, one `fi_pingpong` per EFA device
pair), print bandwidth against the catalog's line rate and each NCCL Job's result, delete the
objects, and exit 1 unless every check passed. The deploy workflow runs it after `pulumi up`
with `--image` from `pulumi stack output workerImage`. A stack without EFA pools has nothing
to check: one line, exit 0.

The pods need a node of each pool whose EFA devices are free (two for each NCCL check): a node
that runs a Ray worker has given all of them to it. Run it before the RayService's workers
take the nodes (the first `pulumi up`), with spare nodes (maxSize above what serving uses,
e.g. with the node autoscaler), or after scaling the workers down.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from infra import paths
from infra.k8s import efa_check, nccl_check
from infra.model import sizing
from infra.model.config import ConfigError, StackConfig
from tools import stackfile


def inputs_for(cfg: StackConfig, stack: str, image: str | None, min_fraction: float) -> efa_check.EfaCheckInputs:
    instances = {"prefill": cfg.node_pools.prefill.instance, "decode": cfg.node_pools.decode.instance}
    if image is None:
        image = offline_image(cfg, stack)
    return efa_check.EfaCheckInputs(
        namespace=cfg.namespace, image=image, instances=instances, min_fraction=min_fraction
    )


def offline_image(cfg: StackConfig, stack: str) -> str:
    """The worker image the stack will run, as far as it is known without AWS (account id unknown)."""
    if not cfg.builds_worker_image:
        return cfg.ray_image
    from infra.components.worker_image import IMAGE_DIR, build_args, content_tag

    tag = content_tag(IMAGE_DIR, build_args(cfg.ray_image))
    return f"aws-account-id.dkr.ecr.region.amazonaws.com/pd-inference-{stack}/ray-llm-efa:{tag}"


def schema_validator() -> Callable[..., Any] | None:
    """kubernetes-validate's `validate`, or None in the light environment (`.venv-pulumi`:
    requirements.txt only, issue 24 item 9). Without it the API server validates on apply
    (kubectl's default `--validate=strict`); `make test` validates these objects strictly
    (tests/infra/k8s/test_efa_check.py, test_nccl_check.py)."""
    try:
        import kubernetes_validate
    except ImportError:
        return None
    return kubernetes_validate.validate


def multi_node_roles(cfg: StackConfig) -> list[str]:
    """Engine roles whose replicas span more than one node of an EFA pool (NCCL crosses nodes)."""
    pools = {"prefill": cfg.node_pools.prefill.instance, "decode": cfg.node_pools.decode.instance}
    return [
        role
        for role, spec in cfg.serving.engine_roles().items()
        if pools[role].efa and sizing.nodes_per_replica(spec.gpus_per_replica, pools[role].gpus) > 1
    ]


def nccl_name(role: str) -> str:
    return f"nccl-check-{role}"


def nccl_objects(cfg: StackConfig, image: str) -> dict[str, dict]:
    """File name -> object for the NCCL check of every multi-node role ({} when there is none)."""
    pools = {"prefill": cfg.node_pools.prefill.instance, "decode": cfg.node_pools.decode.instance}
    out: dict[str, dict] = {}
    for role in multi_node_roles(cfg):
        name = nccl_name(role)
        for obj in nccl_check.nccl_check_manifests(
            name=name, namespace=cfg.namespace, image=image, role=role, instance=pools[role]
        ):
            out[f"{obj['kind'].lower()}-{name}.yaml"] = obj
    return out


def write(objects: dict[str, dict], out: Path, kubernetes_version: str, *, validate: bool = True) -> bool:
    """Write each object as YAML; with `validate`, check it against the schema first when the
    validator is installed. True when the objects were validated."""
    check = schema_validator() if validate else None
    out.mkdir(parents=True, exist_ok=True)
    for name, obj in objects.items():
        if check is not None:
            check(obj, kubernetes_version, strict=True)
        (out / name).write_text(yaml.safe_dump(obj, sort_keys=False))
    return check is not None


def _kubectl(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout, check=check)


def _wait(ns: str, job: str, timeout_s: int) -> subprocess.CompletedProcess:
    return _kubectl(
        "-n",
        ns,
        "wait",
        "--for=condition=complete",
        job,
        f"--timeout={timeout_s}s",
        timeout=timeout_s + 60,
        check=False,
    )


def _logs(ns: str, job_name: str) -> str:
    """Every pod's log of a Job (an Indexed Job has several), each line prefixed by its pod."""
    return _kubectl(
        "-n", ns, "logs", "-l", f"job-name={job_name}", "--prefix", "--tail=-1", "--max-log-requests=8", check=False
    ).stdout


def run_on_cluster(inp: efa_check.EfaCheckInputs, out: Path, nccl_jobs: Sequence[str] = ()) -> int:
    ns = inp.namespace
    client = f"{efa_check.NAME}-client"
    try:
        _kubectl("delete", "-f", str(out), "--ignore-not-found", "--wait=true", check=False)
        _kubectl("apply", "-f", str(out))
        waited = _wait(ns, f"job/{client}", inp.timeout_s)
        # Both sides' logs: the server reports its own memlock, device and registration failures.
        log = _kubectl("-n", ns, "logs", f"job/{client}", check=False).stdout
        log += "\n" + _kubectl("-n", ns, "logs", f"job/{efa_check.NAME}-server", check=False).stdout
        report = efa_check.parse_report(log, inp)
        if waited.returncode != 0:
            report.failures.append(f"the client Job did not complete: {waited.stderr.strip()[:200]}")
        for job in nccl_jobs:
            done = _wait(ns, f"job/{job}", nccl_check.JOB_DEADLINE_S)
            if done.returncode != 0:
                tail = "\n".join(_logs(ns, job).strip().splitlines()[-20:])
                report.failures.append(f"NCCL check {job} failed (NCCL over aws-ofi-nccl across two nodes):\n{tail}")
            else:
                print(f"NCCL check {job}: PASS (NCCL used the Libfabric network across two nodes)")
        print(report.text())
        return 0 if report.ok else 1
    finally:
        _kubectl("delete", "-f", str(out), "--ignore-not-found", "--wait=false", check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.efa_check", description=__doc__.splitlines()[0])
    ap.add_argument("--stack", required=True)
    ap.add_argument(
        "--image",
        help="the worker image (default: what the stack file says; the deploy "
        "workflow passes `pulumi stack output workerImage`)",
    )
    ap.add_argument(
        "--min-fraction",
        type=float,
        default=0.5,
        help="pass when the summed bandwidth reaches this share of the catalog's line rate",
    )
    ap.add_argument("--out", type=Path, help="where to write the objects (default build/<stack>/efa-check)")
    ap.add_argument("--dry-run", action="store_true", help="render and validate only; touch no cluster")
    args = ap.parse_args(argv)
    try:
        cfg = stackfile.load_config(args.stack)
    except (stackfile.StackFileError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 1
    pools = (cfg.node_pools.prefill.instance, cfg.node_pools.decode.instance)
    if not all(p.efa for p in pools):
        print(f"{paths.stack_file(args.stack)}: no EFA pools ({pools[0].name}, {pools[1].name}): nothing to check")
        return 0
    try:
        inp = inputs_for(cfg, args.stack, args.image, args.min_fraction)
    except ValueError as e:
        print(f"{paths.stack_file(args.stack)}: {e}", file=sys.stderr)
        return 1
    out = args.out or paths.BUILD_DIR / args.stack / "efa-check"
    nccl = nccl_objects(cfg, inp.image)
    validated = write({**efa_check.manifests(inp), **nccl}, out, cfg.kubernetes_version)
    checked = (
        f"validated against Kubernetes {cfg.kubernetes_version}"
        if validated
        else "not validated offline: no kubernetes-validate here; the API server validates on apply"
    )
    print(
        f"EFA check for {args.stack}: {out} ({checked}); "
        f"{efa_check.devices_expected(inp)} device pairs {pools[0].name} -> {pools[1].name}, "
        f"line rate {efa_check.line_rate_gbps(inp):,.0f} Gbps; image {inp.image}"
    )
    roles = multi_node_roles(cfg)
    if roles:
        print(f"NCCL check across two nodes for the multi-node role(s): {', '.join(roles)}")
    if args.dry_run:
        return 0
    return run_on_cluster(inp, out, [nccl_name(r) for r in roles])


if __name__ == "__main__":
    sys.exit(main())
