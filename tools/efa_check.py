"""`make efa-check STACK=<name>`: prove the EFA fabric between each P/D model's prefill and decode pools.

What flows through here: the stack file (validated like `make render`) -> the pool pairs to
check (`efa_pairs`: the prefill pool and the decode pool of every disaggregated model whose
pools both have EFA, each pair once however many models share it) -> their catalog entries,
the namespace and the worker image -> `infra.k8s.efa_check.manifests` per pair (a headless
Service, a server Job on a node of the prefill pool, a client Job on a node of the decode
pool; each pod asks for all of its node's EFA interfaces; named `efa-check` for the pools
named prefill and decode, `efa-check-<prefill pool>-<decode pool>` otherwise) -> written to
`build/<stack>/efa-check/` and validated offline against the Kubernetes OpenAPI schema of the
stack's version (kubernetes-validate, strict).

Every EFA pool on which some model's engine replicas span nodes (TP x PP or DP x TP above one
node's GPUs, e.g. stacks/Pulumi.deepseek-p5.yaml; aggregated models included) also gets the
NCCL check (`infra.k8s.nccl_check`), once per pool: an Indexed Job of two
pods on two nodes of that pool, an all-reduce over every GPU of both, which fails unless NCCL
used the aws-ofi-nccl (Libfabric) network; it registers GPU memory with EFA as the engines'
NCCL does.

Without `--dry-run` it then runs them on the cluster of the current kubeconfig: `kubectl
apply`, wait for each pair's client Job (and the NCCL Jobs), read both pods' logs (the
memlock, device file and registration checks, `fi_info -p efa` on both sides, one
`fi_pingpong` per EFA device pair), print each pair's bandwidth against the catalog's line
rate and each NCCL Job's result, delete the objects, and exit 1 unless every check passed. The
deploy workflow runs it after `pulumi up` with `--image` from `pulumi stack output
workerImage`. A stack with neither (no P/D model on EFA pools, no replica spanning EFA nodes)
has nothing to check: one line naming its pools, exit 0.

The pods need a node of each pool whose EFA devices are free (two for each NCCL check): a node
that runs a Ray worker has given all of them to it. Run it before the RayService's workers
take the nodes (the first `pulumi up`), with spare nodes (maxSize above what serving uses,
e.g. with the node autoscaler), or after scaling the workers down. A pool in several pairs
serves their pods one after another unless it has a free node for each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra import paths
from infra.config import ConfigError, StackConfig
from infra.config.pools import placements
from infra.k8s import efa_check, nccl_check
from infra.sizing import nodes as sizing
from serving.spec import Mode
from tools import stackfile


@dataclass(frozen=True)
class PoolPair:
    """The prefill pool and the decode pool of one or more P/D models: one fabric check."""

    prefill: str
    decode: str
    models: tuple[str, ...]  # the model ids whose KV cache crosses it


@dataclass(frozen=True)
class SpanningPool:
    """An EFA pool on which some engine replicas span nodes: one NCCL check."""

    pool: str
    roles: tuple[str, ...]  # "<model id> <role>" of each role whose replicas span its nodes


def efa_pairs(cfg: StackConfig) -> list[PoolPair]:
    """The pools of every disaggregated model whose prefill and decode pools both have EFA
    (the KV cache crosses between them), each pair once, in the stack file's order. A pair
    used in both directions is checked once: fi_pingpong sends both ways."""
    pairs: dict[frozenset[str], PoolPair] = {}
    for spec in cfg.serving.served:
        if spec.mode is not Mode.DISAGGREGATED:
            continue
        pre, dec = spec.pool_of("prefill"), spec.pool_of("decode")
        if not (cfg.node_pools[pre].instance.efa and cfg.node_pools[dec].instance.efa):
            continue
        key = frozenset((pre, dec))
        seen = pairs.get(key) or PoolPair(pre, dec, ())
        pairs[key] = PoolPair(seen.prefill, seen.decode, (*seen.models, spec.model.id))
    return list(pairs.values())


def spanning_pools(cfg: StackConfig) -> list[SpanningPool]:
    """EFA pools on which some model's engine replicas span more than one node (NCCL crosses
    nodes), each once with the roles that do, in the stack file's order."""
    pools: dict[str, list[str]] = {}
    for p in placements(cfg):
        inst = cfg.node_pools[p.pool].instance
        if inst.efa and sizing.nodes_per_replica(p.role_spec.gpus_per_replica, inst.gpus) > 1:
            pools.setdefault(p.pool, []).append(f"{p.spec.model.id} {p.role}")
    return [SpanningPool(pool, tuple(roles)) for pool, roles in pools.items()]


def inputs_for(cfg: StackConfig, stack: str, image: str | None, min_fraction: float) -> list[efa_check.EfaCheckInputs]:
    """One fabric check per pool pair (`efa_pairs`); [] when no P/D model runs on EFA pools."""
    pairs = efa_pairs(cfg)
    if image is None:
        image = offline_image(cfg, stack)
    names = efa_check.check_names([(p.prefill, p.decode) for p in pairs])
    return [
        efa_check.EfaCheckInputs(
            namespace=cfg.namespace,
            image=image,
            instances={"prefill": cfg.node_pools[p.prefill].instance, "decode": cfg.node_pools[p.decode].instance},
            min_fraction=min_fraction,
            pools={"prefill": p.prefill, "decode": p.decode},
            name=names[(p.prefill, p.decode)],
        )
        for p in pairs
    ]


def offline_image(cfg: StackConfig, stack: str) -> str:
    """The worker image the stack will run, as far as it is known without AWS (account id unknown)."""
    if not cfg.builds_worker_image:
        return cfg.ray_image
    from infra.components.worker_image import IMAGE_DIR, build_args, content_tag

    tag = content_tag(IMAGE_DIR, build_args(cfg.ray_image))
    return f"aws-account-id.dkr.ecr.region.amazonaws.com/pd-inference-{stack}/ray-llm-efa:{tag}"


def schema_validator() -> Callable[..., Any] | None:
    """kubernetes-validate's `validate`, or None in the light environment (`.venv-pulumi`:
    requirements.lock only). Without it the API server validates on apply
    (kubectl's default `--validate=strict`); `make test` validates these objects strictly
    (tests/infra/k8s/test_efa_check.py, test_nccl_check.py)."""
    try:
        import kubernetes_validate
    except ImportError:
        return None
    return kubernetes_validate.validate


def nccl_name(pool: str) -> str:
    return f"nccl-check-{pool}"


def nccl_objects(cfg: StackConfig, image: str) -> dict[str, dict]:
    """File name -> object for the NCCL check of every spanning pool ({} when there is none)."""
    out: dict[str, dict] = {}
    for span in spanning_pools(cfg):
        name = nccl_name(span.pool)
        for obj in nccl_check.nccl_check_manifests(
            name=name,
            namespace=cfg.namespace,
            image=image,
            role=span.pool,
            instance=cfg.node_pools[span.pool].instance,
        ):
            out[f"{obj['kind'].lower()}-{name}.yaml"] = obj
    return out


def objects_for(cfg: StackConfig, checks: Sequence[efa_check.EfaCheckInputs], image: str) -> dict[str, dict]:
    """File name -> object: every pair's fabric check and every spanning pool's NCCL check."""
    out: dict[str, dict] = {}
    for inp in checks:
        out.update(efa_check.manifests(inp))
    return {**out, **nccl_objects(cfg, image)}


def write(objects: dict[str, dict], out: Path, kubernetes_version: str, *, validate: bool = True) -> bool:
    """Write each object as YAML, after removing the checks' files of an earlier run that this
    one does not write (`kubectl apply -f <out>` applies the whole folder, and pool pairs are
    named after their pools); with `validate`, check each object against the schema first when
    the validator is installed. True when the objects were validated."""
    check = schema_validator() if validate else None
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.yaml"):
        ours = f"-{efa_check.NAME}" in old.name or "-nccl-check-" in old.name
        if ours and old.name not in objects:
            old.unlink()
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


def run_on_cluster(
    namespace: str, checks: Sequence[efa_check.EfaCheckInputs], out: Path, nccl_jobs: Sequence[str] = ()
) -> int:
    """Apply everything under `out`, read each pair's report and each NCCL Job's verdict, delete
    it all; 0 when every check passed."""
    ns, ok = namespace, True
    try:
        _kubectl("delete", "-f", str(out), "--ignore-not-found", "--wait=true", check=False)
        _kubectl("apply", "-f", str(out))
        for inp in checks:
            client = f"{inp.name}-client"
            waited = _wait(ns, f"job/{client}", inp.timeout_s)
            # Both sides' logs: the server reports its own memlock, device and registration failures.
            log = _kubectl("-n", ns, "logs", f"job/{client}", check=False).stdout
            log += "\n" + _kubectl("-n", ns, "logs", f"job/{inp.name}-server", check=False).stdout
            report = efa_check.parse_report(log, inp)
            if waited.returncode != 0:
                report.failures.append(f"the client Job did not complete: {waited.stderr.strip()[:200]}")
            print(f"{inp.name}: pool {inp.pools['prefill']} -> pool {inp.pools['decode']}")
            print(report.text())
            ok = ok and report.ok
        for job in nccl_jobs:
            if _wait(ns, f"job/{job}", nccl_check.JOB_DEADLINE_S).returncode != 0:
                tail = "\n".join(_logs(ns, job).strip().splitlines()[-20:])
                print(f"NCCL check {job} failed (NCCL over aws-ofi-nccl across two nodes):\n{tail}")
                ok = False
            else:
                print(f"NCCL check {job}: PASS (NCCL used the Libfabric network across two nodes)")
        return 0 if ok else 1
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
    spans = spanning_pools(cfg)
    image = args.image or offline_image(cfg, args.stack)
    try:
        checks = inputs_for(cfg, args.stack, image, args.min_fraction)
    except ValueError as e:
        print(f"{paths.stack_file(args.stack)}: {e}", file=sys.stderr)
        return 1
    if not checks and not spans:
        print(f"{paths.stack_file(args.stack)}: {nothing_to_check(cfg)}")
        return 0
    out = args.out or paths.BUILD_DIR / args.stack / "efa-check"
    validated = write(objects_for(cfg, checks, image), out, cfg.kubernetes_version)
    checked = (
        f"validated against Kubernetes {cfg.kubernetes_version}"
        if validated
        else "not validated offline: no kubernetes-validate here; the API server validates on apply"
    )
    print(f"EFA check for {args.stack}: {out} ({checked}); image {image}")
    for pair, inp in zip(efa_pairs(cfg), checks, strict=True):
        print(
            f"  {inp.name}: pool {pair.prefill} ({inp.instances['prefill'].name}) -> pool {pair.decode} "
            f"({inp.instances['decode'].name}), {efa_check.devices_expected(inp)} device pairs, "
            f"line rate {efa_check.line_rate_gbps(inp):,.0f} Gbps; KV of {', '.join(pair.models)}"
        )
    if spans:
        print("NCCL check across two nodes of each pool where replicas span nodes:")
        for span in spans:
            print(f"  {nccl_name(span.pool)}: pool {span.pool} ({', '.join(span.roles)})")
    if args.dry_run:
        return 0
    return run_on_cluster(cfg.namespace, checks, out, [nccl_name(s.pool) for s in spans])


def nothing_to_check(cfg: StackConfig) -> str:
    """The one line for a stack without EFA pairs or spanning replicas, naming its pools."""
    pools = ", ".join(
        f"{name} {pool.instance.name}{'' if pool.instance.efa else ' (no EFA)'}" for name, pool in cfg.node_pools
    )
    return f"no P/D model on EFA pools, no replica spanning EFA nodes (pools: {pools}): nothing to check"


if __name__ == "__main__":
    sys.exit(main())
