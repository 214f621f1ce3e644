"""The picture of what `pulumi up` creates for a stack, drawn from what `make render` wrote.

What flows through here: `build/<stack>/resources.json` (every resource the program registers
under the mock engine: type, name, parent, inputs) and `build/<stack>/manifests/` (the
Kubernetes objects and Helm releases) -> a scene: the VPC and what sits in it, the EKS
cluster, one column per managed node group (instance type, sizes, GPUs and EFA per node)
holding the RayService's groups that their node selectors put there (the head; the engine
workers, with the Serve engines whose placement selects them), the Helm releases on the nodes
their values schedule them to (the observability stack in a box of its own), the front door
(the Serve Service: an NLB or a ClusterIP), the external fallback provider when the ingress is
given one, the AWS services beside the VPC, and the request's path as numbered arrows -> an
SVG (`tools.diagram_svg`): `build/<stack>/diagram.svg` (`make render`) and the docs' copies in
docs/img/ (`make docs`; a stale one fails `python -m tools.docs --check`).

Nothing is drawn from a list kept here: the boxes come from the resource types and the
manifests, every top-level component, node group, Helm release, Ray group and Serve
application of the render names the box it is drawn in (`data-resources`), and a component
this module has no place for gets a box of its own.

    python -m tools.diagram build/prod [--stack prod]   # writes build/prod/diagram.svg
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tools import rendered
from tools.diagram_svg import LANE, Box, Edge, svg
from tools.rendered import MNG, Engine, Rendered, load

CHART = "kubernetes:helm.sh/v4:Chart"
RAYSERVICE = "kubernetes:ray.io/v1:RayService"
MONITORING = "kubernetes:monitoring.coreos.com/v1:"
GPU_TAINT = "nvidia.com/gpu"
CA_TEMPLATE = "k8s.io/cluster-autoscaler/node-template/resources/"
PER_NODE = (("nvidia.com/gpu", "GPU"), ("vpc.amazonaws.com/efa", "EFA"))
FILE = "diagram.svg"


def _per_pod(template: dict[str, Any]) -> str:
    limits: dict[str, Any] = {}
    for c in template.get("spec", {}).get("containers", []):
        limits.update((c.get("resources") or {}).get("limits") or {})
    parts = [rendered.count(limits[k], n) for k, n in PER_NODE if k in limits]
    return " + ".join(parts or [f"{limits.get('cpu', '?')} CPUs"]) + " per pod"


# --- the boxes ----------------------------------------------------------------------------------
def _pool_box(r: Rendered, ng: dict[str, Any], cluster_owner: str | None) -> Box:
    inp = ng["inputs"]
    sc = inp.get("scalingConfig") or {}
    tags = inp.get("tags") or {}
    per_node = [rendered.count(tags[CA_TEMPLATE + k], n) for k, n in PER_NODE if CA_TEMPLATE + k in tags]
    zones = sorted({(r.by_id(s) or {}).get("inputs", {}).get("availabilityZone", "") for s in inp.get("subnetIds", [])})
    where = [", ".join(z for z in zones if z) or f"{len(inp.get('subnetIds') or [])} subnet(s)"]
    if any(s["type"] == "aws:ec2/placementGroup:PlacementGroup" for s in r.children(ng["parent"])):
        where.append("cluster placement group")
    taints = [t["key"] for t in inp.get("taints") or []]
    role = (inp.get("labels") or {}).get("pd-inference/role") or ng["name"]
    capacity = str(inp.get("capacityType", "")).lower().replace("_", "-")
    lines = [
        f"{', '.join(inp.get('instanceTypes') or [])} {capacity}".strip(),
        f"{sc.get('minSize')}-{sc.get('maxSize')} nodes, desired {sc.get('desiredSize')}"
        + (f"; {' + '.join(per_node)} per node" if per_node else ""),
        "; ".join(where) + (f"; taint {', '.join(taints)}" if taints else ""),
    ]
    own = (ng["parent"],) if ng["parent"] and ng["parent"] != cluster_owner else ()
    gpu = bool(inp.get("gpu")) or GPU_TAINT in taints
    return Box(f"{role} nodes", lines, kind="gpu" if gpu else "nodes", resources=(*own, ng["name"]), key=ng["name"])


def _head_box(rs: dict[str, Any], serve: dict[str, Any], service: str) -> Box:
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    env = {e.get("name"): e.get("value") for c in head["template"]["spec"]["containers"] for e in c.get("env") or []}
    front = "HAProxy" if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Serve proxy"
    app, replicas = rendered.ingress(serve)
    port = (serve.get("http_options") or {}).get("port", 8000)
    lines = [
        f"{front} on :{port}, Serve controller",
        f"OpenAI ingress x{replicas}: keys, limits, routing",
        f"no engines; {_per_pod(head['template'])}",
    ]
    name = rs["metadata"]["name"]
    resources = (service, f"ray/{name}/head", *([f"app/{app}"] if app else []))
    return Box(f"Ray head ({name})", lines, kind="ray", resources=resources, key="head")


def _group_box(rs: dict[str, Any], group: dict[str, Any], engines: list[Engine]) -> Box:
    name = group["groupName"]
    hosts = group.get("numOfHosts") or 1
    lines = [f"{e.model} {e.role}: {e.parallel}" for e in engines]
    lo, hi = group.get("minReplicas", 0), group.get("maxReplicas", 0)
    lines.append(
        (f"{lo}-{hi} pods" if lo != hi else f"{lo} pod" + ("s" if lo != 1 else ""))
        + (f" ({hosts} hosts per replica)" if hosts > 1 else "")
        + f", {_per_pod(group['template'])}"
    )
    apps = sorted({f"app/{e.app}" for e in engines})
    return Box(f"Ray workers: {name}", lines, kind="ray", resources=(f"ray/{rs['metadata']['name']}/{name}", *apps))


def _front_door(rs: dict[str, Any], service: str) -> Box:
    svc = rs["spec"].get("serveService") or {}
    spec, meta = svc.get("spec") or {}, svc.get("metadata") or {}
    ports = ", ".join(f"TCP {p.get('port')}" for p in spec.get("ports") or [])
    if spec.get("type") == "LoadBalancer":
        internal = (meta.get("annotations") or {}).get("service.beta.kubernetes.io/aws-load-balancer-internal")
        kind = "internal NLB" if internal == "true" else "NLB"
        lines = [f"{ports} from {', '.join(spec.get('loadBalancerSourceRanges') or ['anywhere'])}"]
    else:
        kind = f"{spec.get('type', 'ClusterIP')} Service"
        lines = [f"{ports}, for clients in the cluster"]
    title = f"front door: {kind} {meta.get('name', '')}"
    return Box(title, lines, kind="front", resources=(service,), key="front", fill=False)


def _chart_placement(r: Rendered, chart: dict[str, Any]) -> str | None:
    """The node group a release's pods are scheduled to (its values' node selectors): "" for none
    found, None for every GPU node (no selector, the GPU taint tolerated)."""
    values = chart["inputs"].get("values") or {}
    for d in rendered.walk(values):
        if isinstance(d.get("nodeSelector"), dict) and (ng := r.node_group(d["nodeSelector"])):
            return ng
    tolerations = [t for d in rendered.walk(values) for t in d.get("tolerations") or [] if isinstance(t, dict)]
    return None if any(t.get("key") == GPU_TAINT for t in tolerations) else ""


def _release_line(chart: dict[str, Any]) -> str:
    return f"{chart['inputs'].get('chart')} {chart['inputs'].get('version')}"


def _list_box(title: str, charts: list[dict[str, Any]], kind: str, extra: tuple[str, ...] = ()) -> Box:
    names = sorted({c["parent"] for c in charts if c["parent"]} | {c["name"] for c in charts})
    return Box(title, [_release_line(c) for c in charts] + list(extra), kind=kind, resources=tuple(names))


def _observability_lines(r: Rendered) -> tuple[str, ...]:
    """What the stack gives the observability stack to run (what, not how many: the picture
    changes with the program's shape, not with each alert added)."""
    parts = [
        what
        for kinds, what in (
            (("PrometheusRule",), "alert rules"),
            (("ServiceMonitor", "PodMonitor"), "scrape monitors"),
        )
        if any(r.kinds(k) for k in kinds)
    ]
    if any("grafana_dashboard" in (m["metadata"].get("labels") or {}) for m in r.kinds("ConfigMap")):
        parts.append("Grafana dashboards")
    return (", ".join(parts),) if parts else ()


@dataclass
class _Placed:
    """The boxes of the cluster, as they are built."""

    pools: dict[str, Box]
    head_pool: str = ""
    group_pool: dict[str, str] = field(default_factory=dict)
    groups: dict[str, Box] = field(default_factory=dict)
    engine_group: dict[Engine, str] = field(default_factory=dict)


def _ray_boxes(r: Rendered, placed: _Placed, serve: dict[str, Any], engines: list[Engine], service: str) -> None:
    rs = r.kinds("RayService")[0]
    rc = rs["spec"]["rayClusterConfig"]

    def pool_for(template: dict[str, Any]) -> str:
        return r.node_group(template["spec"].get("nodeSelector") or {}) or placed.head_pool

    placed.head_pool = pool_for(rc["headGroupSpec"]["template"]) or next(iter(placed.pools), "")
    placed.pools[placed.head_pool].children.append(_head_box(rs, serve, service))
    for g in rc.get("workerGroupSpecs") or []:
        mine = [e for e in engines if rendered.matches(dict(e.selector), g.get("labels") or {}, [])]
        box = _group_box(rs, g, mine)
        box.key = f"group/{g['groupName']}"
        pool = pool_for(g["template"])
        placed.pools[pool].children.append(box)
        placed.group_pool[g["groupName"]] = pool
        placed.groups[g["groupName"]] = box
        placed.engine_group.update((e, g["groupName"]) for e in mine)


def _release_boxes(r: Rendered, placed: _Placed) -> None:
    obs_owner = r.owner_of(MONITORING + "PrometheusRule")
    by_pool: dict[str, list[dict[str, Any]]] = {}
    observability: list[dict[str, Any]] = []
    everywhere: list[dict[str, Any]] = []
    for chart in r.of_type(CHART):
        where = _chart_placement(r, chart)
        if where is None:
            everywhere.append(chart)
        elif obs_owner and chart["parent"] == obs_owner["name"]:
            observability.append(chart)
        else:
            by_pool.setdefault(where or placed.head_pool, []).append(chart)
    for pool, charts in by_pool.items():
        placed.pools[pool].children.append(_list_box("cluster add-ons", charts, "addon"))
    if observability:
        box = _list_box("observability", observability, "obs", _observability_lines(r))
        placed.pools[placed.head_pool].children.append(box)
    for box in placed.pools.values():
        if box.kind == "gpu" and everywhere:
            box.children.append(_list_box("on every GPU node", everywhere, "addon"))


def _entry_groups(engines: list[Engine], placed: _Placed) -> list[str]:
    """Per Serve application, the worker group the ingress calls: decode's, or the aggregated engine's."""
    firsts: dict[str, str] = {}
    for e in engines:
        if e.role != "prefill" and e in placed.engine_group:
            firsts.setdefault(e.app, placed.engine_group[e])
    return list(dict.fromkeys(firsts.values()))


def _columns(placed: _Placed, engines: list[Engine]) -> list[Box]:
    """The head's pool first, then the pools in the request's order (decode before its prefill)."""
    order = [placed.head_pool]
    order += [placed.group_pool[placed.engine_group[e]] for e in engines if e in placed.engine_group]
    return [placed.pools[p] for p in dict.fromkeys(order + list(placed.pools))]


def _path(engines: list[Engine], placed: _Placed, entries: list[str], fallback: bool) -> tuple[list[Edge], Box]:
    """The request's path as numbered arrows, and the legend that says what each number is."""
    head_pool = placed.head_pool
    edges = [Edge("clients", "front", 1, "request", "down"), Edge("front", "head", 2, "request", "down")]
    for i, g in enumerate(entries):
        route = "across" if i == 0 else "lane"
        at = 0.4 if i == 0 else 0.2 / i
        edges.append(Edge("head", f"group/{g}", 3, "request", route, at=at, gap_of=head_pool, lane=i))
    backends = set()
    for e in engines:
        decode = next((d for d in engines if d.app == e.app and d.role == "decode"), None)
        if e.role != "prefill" or decode is None or {e, decode} - set(placed.engine_group):
            continue
        backends.add(e.kv_backends)
        pre, dec = f"group/{placed.engine_group[e]}", f"group/{placed.engine_group[decode]}"
        edges.append(Edge(dec, pre, 4, "request", "across", at=0.3))
        edges.append(Edge(pre, dec, 5, "kv", "across", at=0.7))
    if fallback:
        edges.append(Edge("head", "provider", 6, "fallback", "side", at=0.75, gap_of=head_pool))
    legend = {
        1: "1  a client calls the OpenAI API with an API key",
        2: "2  the front door -> the Ray head: its HTTP proxy -> the OpenAI ingress (key, limits, routing)",
        3: "3  the ingress -> the model's engine: decode (P/D) or the aggregated engine",
        4: "4  decode -> prefill: the prompt is computed there",
        5: f"5  the KV cache, prefill -> decode over NIXL ({', '.join(sorted(b for b in backends if b)) or 'default'})",
        6: "6  the ingress -> the external provider, when the cluster cannot serve (fallback.when)",
    }
    steps = sorted({e.step for e in edges})
    return edges, Box("the request's path", [legend[s] for s in steps], kind="legend")


def _cluster_box(r: Rendered, inner: list[Box]) -> Box:
    eks = r.one("eks:index:Cluster")
    if eks is None:
        return Box("cluster", children=inner, kind="cluster", caption_below=True)
    inp = eks["inputs"]
    access = "private" if not inp.get("endpointPublicAccess") else "public"
    lines = [
        f"Kubernetes {inp.get('version')}, {access} API endpoint"
        + (", KMS-encrypted Secrets" if inp.get("encryptionConfigKeyArn") else "")
        + f", {len(inp.get('enabledClusterLogTypes') or [])} control-plane log types",
    ]
    resources = tuple(x for x in (eks["parent"], eks["name"]) if x)
    return Box(f"EKS cluster {inp.get('name', '')}", lines, inner, "cluster", resources, "cluster", caption_below=True)


def _vpc_box(r: Rendered, inner: list[Box]) -> Box:
    vpc = r.one("aws:ec2/vpc:Vpc")
    subnets = r.of_type("aws:ec2/subnet:Subnet")
    zones = sorted({s["inputs"].get("availabilityZone", "") for s in subnets})
    nats = len(r.of_type("aws:ec2/natGateway:NatGateway"))
    if vpc is None:  # an existing VPC: the cluster names it
        eks = r.one("eks:index:Cluster") or {"inputs": {}}
        ids = eks["inputs"].get("privateSubnetIds") or eks["inputs"].get("subnetIds") or []
        lines = [f"not created by the stack; {len(ids)} private subnet(s) given"]
        return Box(f"existing VPC {eks['inputs'].get('vpcId', '')}", lines, inner, "vpc", (), "vpc", caption_below=True)
    lines = [f"{len(zones)} zones ({', '.join(zones)}): private and public subnets, {nats} NAT gateway(s)"]
    resources = tuple(x for x in (vpc["parent"], vpc["name"]) if x)
    return Box(f"VPC {vpc['inputs'].get('cidrBlock')}", lines, inner, "vpc", resources, "vpc", caption_below=True)


def _beside(r: Rendered, drawn: set[str]) -> tuple[list[Box], list[Box]]:
    """What the stack creates outside the cluster: in the VPC (ElastiCache), and beside it (S3, ECR,
    and a box for every top-level component not drawn yet)."""
    in_vpc, aws = [], []
    for g in r.of_type("aws:elasticache/replicationGroup:ReplicationGroup"):
        i = g["inputs"]
        lines = [f"{i.get('engine')} {i.get('engineVersion')}, {i.get('numCacheClusters')} x {i.get('nodeType')}"]
        in_vpc.append(
            Box("GCS Redis (ElastiCache)", lines, kind="aws", resources=(g["parent"] or "", g["name"]), fill=False)
        )
    for repo in r.of_type("aws:ecr/repository:Repository"):
        tags = [t for img in r.of_type("docker-build:index:Image") for t in img["inputs"].get("tags") or []]
        lines = [f"worker image :{t.rsplit(':', 1)[-1]}" for t in tags] or ["images"]
        aws.append(
            Box(
                f"ECR {repo['inputs'].get('name', repo['name'])}",
                lines,
                kind="aws",
                resources=(repo["parent"] or "", repo["name"]),
            )
        )
    for b in r.of_type("aws:s3/bucket:Bucket"):
        owner = next((c for c in r.top() if c["name"] == b["parent"]), None)
        lines = [f"of the {owner['type'].rsplit(':', 1)[-1]} {owner['name']}"] if owner else []
        aws.append(Box(f"S3 bucket {b['name']}", lines, kind="aws", resources=(b["parent"] or "", b["name"])))
    drawn |= {n for box in in_vpc + aws for n in box.resources}
    for c in r.top():
        if c["name"] not in drawn:
            counts = Counter(x["type"].rsplit(":", 1)[-1] for x in r.resources if x["parent"] == c["name"])
            lines = [", ".join(f"{n} {t}" for t, n in sorted(counts.items()))] if counts else ["creates nothing itself"]
            aws.append(Box(f"{c['type'].rsplit(':', 1)[-1]} {c['name']}", lines, kind="aws", resources=(c["name"],)))
    return in_vpc, aws


@dataclass
class Scene:
    root: Box
    edges: list[Edge]
    title: str


def _row(children: list[Box], spread: bool = False) -> Box:
    return Box("", children=children, kind="canvas", row=True, spread=spread)


def scene(r: Rendered) -> Scene:
    """The boxes and arrows of one stack's render."""
    eks = r.one("eks:index:Cluster")
    placed = _Placed({ng["name"]: _pool_box(r, ng, eks["parent"] if eks else None) for ng in r.of_type(MNG)})
    rs = next(iter(r.kinds("RayService")), None)
    serve = (yaml.safe_load(rs["spec"].get("serveConfigV2") or "{}") if rs else None) or {}
    engines = rendered.engines(serve)
    rs_res = r.one(RAYSERVICE)
    service = (rs_res["parent"] or rs_res["name"]) if rs_res else ""
    placed.head_pool = next(iter(placed.pools), "")
    if rs:
        _ray_boxes(r, placed, serve, engines, service)
    _release_boxes(r, placed)
    entries = _entry_groups(engines, placed)
    columns = _columns(placed, engines)
    for c in columns:
        c.caption_below, c.top = True, LANE * (len(entries) + 1)
    front = _front_door(rs, service) if rs else None
    nlb = front is not None and "NLB" in front.title
    cluster = _cluster_box(r, [*([front] if front and not nlb else []), _row(columns)])
    vpc = _vpc_box(r, [front] if front and nlb else [])
    in_vpc, aws = _beside(r, {n for box in (cluster, vpc) for x in box.walk() for n in x.resources})
    vpc.children.append(_row([cluster, *in_vpc]))
    top = _row([Box("clients", ["OpenAI SDKs, curl"], kind="external", key="clients")], spread=True)
    fallback = rendered.fallback_host(serve)
    if fallback:
        provider = Box(
            "external provider (fallback)", [fallback], kind="external", resources=(service,), key="provider"
        )
        top.children.append(provider)
    edges, legend = _path(engines, placed, entries, bool(fallback)) if rs else ([], Box("", kind="canvas"))
    title = f"stack {r.stack}: what `pulumi up` creates"
    rows = [Box(title, kind="canvas"), top, vpc, *([_row(aws)] if aws else []), legend]
    return Scene(Box("", kind="canvas", children=rows), edges, title)


def draw(r: Rendered) -> str:
    """The SVG of one stack's render."""
    s = scene(r)
    return svg(s.root, s.edges, s.title)


def write(out: Path, stack: str) -> Path:
    """`out`/diagram.svg, from the render in `out`."""
    path = out / FILE
    path.write_text(draw(load(out, stack)))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.diagram", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a directory tools.render wrote (build/<stack>)")
    ap.add_argument("--stack", help="the stack's name (default: the directory's name)")
    args = ap.parse_args(argv)
    print(f"wrote {write(args.out, args.stack or args.out.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
