"""`make conformance`: every path of ours answers as plain vLLM serving the same model answers.

What flows through here: a seed and a count -> generated bodies (bench/conformance_bodies.py)
-> the oracle, plain vLLM serving the tiny model with the stack's own flags and parsers (the
stand-in provider's vLLM, local/provider.py), and the local stack (`python -m local --mode
both`, started with the ingress's test hook, TEST_HOOKS_ENV) -> each body, one at a time, to
the oracle and to each path of ours:
  disaggregated  the P/D app (prefill + NIXL + decode, the KV-aware prefill router)
  aggregated     the aggregated app
  migration      the P/D app with the stream cut after the case's k-th token (the relay's
                 test hook, serving/ingress/relay.py CUT_AFTER_HEADER): migration at every k,
                 no process killed; streamed, continuable, greedy bodies only
  fallback       the P/D app with every request sent to the external fallback (the routing
                 test hook, serving/ingress/routing.py ROUTE_HEADER; the provider is the
                 oracle's vLLM), compared with the oracle's answer to the part of the body
                 OpenAI documents: the fallback sends no vLLM extension (a documented
                 deviation, docs/conformance.md)
Every answer must come from where its path says (`x-served-by`: cluster, or fallback).
-> each answer compared with the oracle's (bench/conformance_compare.py: status, text, token
ids, finish, usage, logprobs within tolerance, tool calls; for streams the joined deltas, one
id, the final usage, one [DONE]) -> each difference shrunk (fields dropped while the difference
stays) -> `build/conformance/report.json` and one line:
  conformance: <bodies> bodies x <paths> paths, <differences> differences (seed <seed>)
Beside the generated bodies, the documented deviations (`DEVIATIONS`) are sent as fixed
requests, each with the answer we chose instead of plain vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.conformance_bodies import Case, generate
from bench.conformance_compare import Answer, answer_of, differences, refusal_status
from infra.paths import BUILD_DIR

PATHS = ("disaggregated", "aggregated", "migration", "fallback")
KEY = "sk-conformance-key"
REQUEST_TIMEOUT_S = 180.0
SHRINK_SIGNATURES = 8  # distinct differences shrunk per run (each shrink sends dozens of requests)


@dataclass(frozen=True)
class Deviation:
    """A documented difference from plain vLLM: the request, and the answer we chose."""

    name: str
    endpoint: str
    raw: bytes
    status: int
    why: str


def _deviations() -> list[Deviation]:
    from serving.ingress.fields import MAX_N

    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        Deviation(
            "internal field",
            "chat",
            json.dumps({**chat, "kv_transfer_params": {"do_remote_decode": True}}).encode(),
            400,
            "the P/D handshake and every engine-internal field are the server's (docs/guardrails.md)",
        ),
        Deviation(
            "unknown field", "chat", json.dumps({**chat, "not_a_field": 1}).encode(), 400, "an allow-list of fields"
        ),
        Deviation("n bound", "chat", json.dumps({**chat, "n": MAX_N + 1}).encode(), 400, "n at most OpenAI's 128"),
        Deviation("n bound (float)", "chat", json.dumps({**chat, "n": float(MAX_N + 72)}).encode(), 400, "n as 200.0"),
        Deviation("n bound (string)", "chat", json.dumps({**chat, "n": str(MAX_N + 72)}).encode(), 400, 'n as "200"'),
        Deviation("deep JSON", "chat", b"[" * 100_000, 400, "nesting past the parser's depth is a bad body"),
        Deviation(
            "streamed refusal",
            "chat",
            json.dumps({**chat, "stream": True, "truncate_prompt_tokens": 0}).encode(),
            400,
            "a prompt P/D prefills before the first byte is refused with its status, not a 200 stream",
        ),
        Deviation(
            "body limit",
            "completions",
            json.dumps({"model": "tiny-llama", "prompt": "x" * (5 << 20), "max_tokens": 1}).encode(),
            413,
            "serving.ingress.maxBodyMiB (4 MiB by default)",
        ),
    ]


@dataclass
class Finding:
    case: int
    path: str
    diffs: list[str]
    body: dict[str, Any]
    endpoint: str
    shrunk: dict[str, Any] | None = None
    cut_after: int | None = None  # the migration path's cut (x-pd-test-cut-after)


@dataclass
class Report:
    seed: int
    bodies: int = 0
    compared: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    findings: list[Finding] = field(default_factory=list)
    deviations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def differences(self) -> int:
        return len(self.findings) + sum(1 for d in self.deviations if not d["ok"])

    def line(self) -> str:
        paths = sum(1 for p in PATHS if self.compared[p])
        return f"conformance: {self.bodies} bodies x {paths} paths, {self.differences} differences (seed {self.seed})"


# --- the servers ---------------------------------------------------------------------------------
@dataclass
class Targets:
    oracle: str  # plain vLLM's /v1
    oracle_model: str
    ours: dict[str, str]  # mode -> our /v1 (disaggregated, aggregated)
    model: str


def _url(base: str, endpoint: str) -> str:
    return f"{base}/chat/completions" if endpoint == "chat" else f"{base}/completions"


async def _send(client: httpx.AsyncClient, url: str, raw: bytes, headers: dict[str, str]) -> Answer:
    try:
        async with client.stream("POST", url, content=raw, headers=headers, timeout=REQUEST_TIMEOUT_S) as r:
            text = (await r.aread()).decode("utf-8", "replace")
            answer = answer_of(r.status_code, r.headers.get("content-type", ""), text)
            answer.served_by = r.headers.get("x-served-by")
            return answer
    except httpx.HTTPError as exc:
        return Answer(status=599, text=f"{type(exc).__name__}: {exc}")


def _for_oracle(body: dict[str, Any], targets: Targets) -> dict[str, Any]:
    return {**body, "model": targets.oracle_model} if isinstance(body.get("model"), str) else body


def _openai_part(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    from serving.ingress.fields import openai_fields

    return openai_fields(endpoint, body)


def _migratable(endpoint: str, body: dict[str, Any]) -> bool:
    """A cut stream is compared where the answer cannot depend on the cut: greedy (a seeded
    sampler restarts with the continuation), and a request the ingress continues."""
    from serving.ingress.migration import not_continuable

    greedy = body.get("temperature") in (0, 0.0)
    return bool(body.get("stream")) and greedy and not_continuable(endpoint, body) is None


def _comparable(path: str, endpoint: str, body: dict[str, Any]) -> bool:
    """Whether `path`'s answer to `body` must equal the oracle's (what the shrinker keeps)."""
    from bench.conformance_bodies import reproducible

    return reproducible(body) and (path != "migration" or _migratable(endpoint, body))


class Runner:
    """Sends cases to the oracle and our paths and compares the answers."""

    def __init__(self, targets: Targets, client: httpx.AsyncClient):
        self.t = targets
        self.client = client
        self.auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        self.plain = {"Content-Type": "application/json"}

    async def oracle(self, endpoint: str, body: dict[str, Any]) -> Answer:
        raw = json.dumps(_for_oracle(body, self.t)).encode()
        return await _send(self.client, _url(self.t.oracle, endpoint), raw, self.plain)

    async def ours(self, path: str, endpoint: str, body: dict[str, Any], cut_after: int = 0) -> Answer:
        base = self.t.ours["aggregated" if path == "aggregated" else "disaggregated"]
        headers = dict(self.auth)
        if path == "migration":
            from serving.ingress.relay import CUT_AFTER_HEADER

            headers[CUT_AFTER_HEADER] = str(cut_after)
        if path == "fallback":
            from serving.ingress.routing import ROUTE_HEADER

            headers[ROUTE_HEADER] = "fallback"
        return await _send(self.client, _url(base, endpoint), json.dumps(body).encode(), headers)

    async def compare(self, path: str, case: Case, endpoint: str, body: dict[str, Any]) -> list[str]:
        """The differences of `path` from the oracle for one body. The fallback's oracle gets
        the part OpenAI documents, unless plain vLLM refuses the whole body: the ingress
        validates every body as vLLM does before it routes, so a refusal is one on every path."""
        oracle, ours = await asyncio.gather(
            self.oracle(endpoint, body), self.ours(path, endpoint, body, case.cut_after)
        )
        if path == "fallback" and refusal_status(oracle) is None:
            oracle = await self.oracle(endpoint, _openai_part(endpoint, body))
        where = "fallback" if path == "fallback" else "cluster"
        if ours.status == 200 and ours.served_by != where:
            return [f"x-served-by: {where} != {ours.served_by}"]  # not the path it was sent down
        return differences(oracle, ours)

    async def shrink(self, path: str, case: Case, first: str) -> dict[str, Any]:
        """The body with every optional field dropped whose absence keeps the same difference
        (`first`'s place: another difference is another finding)."""
        from bench.conformance_bodies import REQUIRED

        body = dict(case.body)
        for name in [n for n in case.body if n not in REQUIRED[case.endpoint]]:
            trial = {k: v for k, v in body.items() if k != name}
            if not _comparable(path, case.endpoint, trial):
                continue  # without it the answer may differ by design (sampling, the cut)
            diffs = await self.compare(path, case, case.endpoint, trial)
            if diffs and _place(diffs[0]) == _place(first):
                body = trial
        return body


def _place(diff: str) -> str:
    """Where a difference is (its path), without the values."""
    return diff.split(":")[0]


async def run_cases(runner: Runner, cases: list[Case], paths: tuple[str, ...], report: Report, say: Any) -> None:
    for i, case in enumerate(cases):
        for path in paths:
            if path == "migration" and not _migratable(case.endpoint, case.body):
                continue
            diffs = await runner.compare(path, case, case.endpoint, case.body)
            cut = case.cut_after if path == "migration" else None
            report.compared[path] += 1
            if diffs:
                report.findings.append(Finding(i, path, diffs, case.body, case.endpoint, cut_after=cut))
                say(f"  case {i} {path}: {diffs[0]}")
        if (i + 1) % 50 == 0:
            say(f"{i + 1}/{len(cases)} cases, {len(report.findings)} differences")


async def check_deviations(runner: Runner, report: Report) -> None:
    for dev in _deviations():
        ours = await _send(runner.client, _url(runner.t.ours["disaggregated"], dev.endpoint), dev.raw, runner.auth)
        body_ok = isinstance(ours.doc, dict) and isinstance(ours.doc.get("error"), dict)
        report.deviations.append(
            {
                "name": dev.name,
                "status": ours.status,
                "expected": dev.status,
                "ok": ours.status == dev.status and body_ok,
            }
        )


async def shrink_findings(runner: Runner, cases: list[Case], report: Report, paths: tuple[str, ...]) -> None:
    """Shrinks the first finding of each distinct (path, first difference) on `paths` (the
    stack must still route them as in their phase)."""
    seen: set[tuple[str, str]] = set()
    for f in report.findings:
        sig = (f.path, _place(f.diffs[0]))
        if f.path not in paths or sig in seen or len(seen) >= SHRINK_SIGNATURES:
            continue
        seen.add(sig)
        f.shrunk = await runner.shrink(f.path, cases[f.case], f.diffs[0])


# --- the stack ----------------------------------------------------------------------------------
@contextlib.contextmanager
def running(log_dir: Path) -> Iterator[tuple[Any, Any]]:
    """The oracle (the stand-in provider's vLLM) and the local stack with the test hook."""
    from local.background import background_stack
    from local.config import PREFILL_ROUTER_ENV, local_target
    from local.provider import PROVIDER_KEY, running_provider
    from local.tiny_model import ensure_tiny_model
    from serving.spec import FALLBACK_API_KEY_ENV, TEST_HOOKS_ENV

    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = str(ensure_tiny_model())
    env = {TEST_HOOKS_ENV: "1", FALLBACK_API_KEY_ENV: PROVIDER_KEY, PREFILL_ROUTER_ENV: "kv-aware"}
    with (
        running_provider(model_dir, log_dir / "oracle.log", dict(local_target().engine_env)) as provider,
        background_stack(mode="both", api_key=KEY, log_path=log_dir / "stack.log", extra_env=env) as stack,
    ):
        yield provider, stack


def _fallback_config(stack: Any, provider: Any) -> dict[str, Any]:
    """The P/D ingress's user_config with the provider as its fallback (the routing hook sends
    each request of the fallback path there)."""
    from local.provider import EXTERNAL_MODEL
    from serving.spec import APP_NAME, INGRESS_DEPLOYMENT

    app = next(a for a in stack.state["config"]["applications"] if a["name"] == APP_NAME)
    base = next(d["user_config"] for d in app["deployments"] if d["name"] == INGRESS_DEPLOYMENT)
    return {
        **base,
        "fallback": {
            "base_url": provider.url,
            "models": {stack.model: EXTERNAL_MODEL},
            "when": ["overloaded"],
            "overflow_at": 64,
            "first_token_timeout_s": REQUEST_TIMEOUT_S,
            "timeout_s": REQUEST_TIMEOUT_S,
            "connect_timeout_s": 5,
            "retries": 0,
            "api_key_env": "PD_FALLBACK_API_KEY",
        },
    }


async def _run(args: argparse.Namespace, provider: Any, stack: Any, cases: list[Case], say: Any) -> Report:
    from local.cluster import set_ingress_user_config
    from local.provider import EXTERNAL_MODEL
    from serving.spec import APP_NAME

    report = Report(seed=args.seed, bodies=len(cases))
    targets = Targets(oracle=provider.vllm_url, oracle_model=EXTERNAL_MODEL, ours=stack.urls, model=stack.model)
    paths = tuple(p for p in PATHS if p in args.paths)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
        runner = Runner(targets, client)
        await check_deviations(runner, report)
        cluster_paths = tuple(p for p in paths if p != "fallback")
        say(f"{len(cases)} cases through {', '.join(cluster_paths)}")
        await run_cases(runner, cases, cluster_paths, report, say)
        if not args.no_shrink:
            await shrink_findings(runner, cases, report, cluster_paths)
        if "fallback" in paths:
            state = stack.state
            set_ingress_user_config(
                state["dashboard_url"], state["config"], APP_NAME, _fallback_config(stack, provider)
            )
            say(f"{len(cases)} cases through the fallback")
            await run_cases(runner, cases, ("fallback",), report, say)
            if not args.no_shrink:
                await shrink_findings(runner, cases, report, ("fallback",))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.conformance", description=__doc__.split("\n")[0])
    p.add_argument("--bodies", type=int, default=2000, help="generated bodies (default 2000)")
    p.add_argument("--seed", type=int, default=20261207, help="the generator's seed")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    p.add_argument("--out", type=Path, default=BUILD_DIR / "conformance" / "report.json")
    p.add_argument("--no-shrink", action="store_true", help="report differences unshrunk")
    args = p.parse_args(argv)
    args.paths = tuple(x.strip() for x in args.paths.split(",") if x.strip())
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown path(s) {sorted(unknown)}; choose from {', '.join(PATHS)}")
    return args


def run(args: argparse.Namespace, say: Any = print) -> Report:
    t0 = time.monotonic()
    cases = generate(args.bodies, args.seed)
    say(f"{len(cases)} bodies generated (seed {args.seed})")
    with running(args.out.parent / "logs") as (provider, stack):
        report = asyncio.run(_run(args, provider, stack, cases, say))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {**asdict(report), "line": report.line(), "seconds": round(time.monotonic() - t0, 1)}
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    for f in report.findings[:40]:
        cut = f" cut after {f.cut_after}" if f.cut_after is not None else ""
        print(
            f"DIFF case {f.case} [{f.path}{cut}] {f.endpoint} {json.dumps(f.shrunk or f.body, ensure_ascii=False)[:600]}"
        )
        for line in f.diffs[:5]:
            print(f"    {line}")
    for dev in report.deviations:
        if not dev["ok"]:
            print(f"DEVIATION {dev['name']}: got {dev['status']}, chose {dev['expected']}")
    print(report.line())
    return 0 if report.differences == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
