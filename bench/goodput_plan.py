"""`make plan`'s recommendation beside what `make bench-goodput` measured, rate by rate.

What flows through here: a short profile run per Ray target before its rates (`measure`: the
decode streams' time per output token alone and `streams` at once, the time to first token of a
long and of a short prompt alone, and for P/D the KV transfer per long prompt from decode's NIXL
counters) -> `profile()`: the CPU replica profile infra/sizing/disaggregation.py takes (a decode
step linear in the batch through those two points; prompt tokens/s from the two prompts' TTFT
difference, less the KV transfer's share for P/D; a core as its "GPU" at one core a node, so each
mode's cost is the cores it takes) -> `recommend()` at each rate's measured workload (the mix's
mean prompt and output, its requests/s on the aggregated app) and the local SLO -> the plan's
winner beside the measured one (the app with more goodput at that SLO). And `gpu_crossing()`:
the same workload's shape on a shipped stack's GPUs (its roofline, `make plan`'s own), the
lowest request rate from which the plan picks disaggregation there.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from bench.goodput_figures import from_sent
from bench.goodput_load import PROMPT, STREAM, Sent, Workload, body, sequential
from infra.sizing import disaggregation as dis
from local.config import LOCAL_ROLE_LIMITS, MAX_MODEL_LEN

PROFILE_OUTPUT_TOKENS = 128
PROFILE_PROMPTS = 4  # long and short prompts each, one at a time
# An engine runs at most its replica's max_ongoing_requests at once (the local role limits).
MAX_BATCH = int(LOCAL_ROLE_LIMITS["maxOngoingRequests"])
# vLLM 0.32's max_num_batched_tokens on CPU for the OpenAI server at world size 1
# (vllm/engine/arg_utils.py get_batch_defaults: 2048 x world size).
MAX_BATCHED_TOKENS = 2048
# Rates the GPU crossing is searched over (requests/s): 0.25 up, 25% apart.
GPU_RATES = tuple(round(0.25 * 1.25**k, 3) for k in range(48))


# --- the profile run ------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(
    url: str,
    headers: Mapping[str, str],
    model: str,
    wl: Workload,
    seed: str,
    kv_seconds: Callable[[], tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """One target's profile run (module doc). `kv_seconds()`: decode's NIXL (transfer seconds,
    transfers) so far, settled (P/D only)."""
    rng = random.Random(f"{seed}:profile")

    def bodies(n: int, prompt: int, out: int) -> list[dict[str, Any]]:
        return [body(rng, model, prompt, out, wl.vocab) for _ in range(n)]

    def run(bs: list[dict[str, Any]], kind: str, conc: int = 1) -> list[Any]:
        got = asyncio.run(sequential(url, headers, bs, conc))
        return [r for r in (from_sent(Sent(kind, 0.0, g)) for g in got) if r.ok]

    alone = run(bodies(2, wl.stream_prompt_tokens, PROFILE_OUTPUT_TOKENS), STREAM)
    batch = run(bodies(wl.streams, wl.stream_prompt_tokens, PROFILE_OUTPUT_TOKENS), STREAM, wl.streams)
    kv_before = kv_seconds() if kv_seconds else None
    long = run(bodies(PROFILE_PROMPTS, wl.prompt_tokens, 2), PROMPT)
    kv_after = kv_seconds() if kv_seconds else None
    short = run(bodies(PROFILE_PROMPTS, wl.stream_prompt_tokens, 2), PROMPT)
    kv = None
    if kv_before is not None and kv_after is not None and kv_after[1] > kv_before[1]:
        kv = (kv_after[0] - kv_before[0]) / (kv_after[1] - kv_before[1])
    return {
        "tpot_s": {
            "1": _median([t for r in alone if (t := r.tpot_s) is not None]),
            str(wl.streams): _median([t for r in batch if (t := r.tpot_s) is not None]),
        },
        "ttft_s": {
            "long": _median([t for r in long if (t := r.ttft_s) is not None]),
            "short": _median([t for r in short if (t := r.ttft_s) is not None]),
        },
        "prompt_tokens": {"long": wl.prompt_tokens, "short": wl.stream_prompt_tokens},
        "kv_transfer_s": kv,
    }


# --- the arithmetic -------------------------------------------------------------------------------
def prefill_tokens_per_s(run: Mapping[str, Any]) -> float | None:
    """Prompt tokens/s: the long prompt's extra tokens over its extra TTFT, less the KV
    transfer's extra (the transfer grows with the prompt)."""
    ttft, tokens = run["ttft_s"], run["prompt_tokens"]
    if ttft.get("long") is None or ttft.get("short") is None:
        return None
    extra = tokens["long"] - tokens["short"]
    kv = (run.get("kv_transfer_s") or 0.0) * extra / tokens["long"]
    spent = ttft["long"] - ttft["short"] - kv
    return extra / spent if spent > 0 else None


def replica(run: Mapping[str, Any], cores: int) -> dis.ReplicaProfile | None:
    """One engine's profile from its run: a decode step through its two (batch, time) points."""
    points = sorted((int(b), t) for b, t in (run.get("tpot_s") or {}).items() if t is not None)
    tok_s = prefill_tokens_per_s(run)
    if len(points) < 2 or tok_s is None:
        return None
    (b1, t1), (bn, tn) = points[0], points[-1]
    per_seq = max(0.0, (tn - t1) / (bn - b1)) if bn > b1 else 0.0
    return dis.ReplicaProfile(
        prefill_tokens_per_s=tok_s,
        step_s=max(1e-6, t1 - per_seq * b1),
        step_s_per_seq=per_seq,
        max_batch=MAX_BATCH,
        max_batched_tokens=MAX_BATCHED_TOKENS,
        gpus=cores,
        gpus_per_node=1,  # a core is a "GPU" and a "node": each mode costs the cores it takes
        usd_per_node_hour=1.0,
    )


def profile(
    runs: Mapping[str, Mapping[str, Any]], cores: Mapping[str, int], prompt_tokens: float
) -> dis.Profile | None:
    """The Profile from the aggregated and disaggregated targets' runs (`cores`: engine role ->
    cores it was bound to); the KV transfer scaled to a `prompt_tokens` prompt."""
    agg_run, pd_run = runs.get("aggregated"), runs.get("disaggregated")
    if not agg_run or not pd_run:
        return None
    agg = replica(agg_run, cores["aggregated"])
    pre = replica(pd_run, cores["prefill"])
    dec = replica(pd_run, cores["decode"])
    if agg is None or pre is None or dec is None:
        return None
    kv = (pd_run.get("kv_transfer_s") or 0.0) * prompt_tokens / pd_run["prompt_tokens"]["long"]
    return dis.Profile(aggregated=agg, prefill=pre, decode=dec, kv_transfer_s=kv)


def mix(summary: Mapping[str, Any], wl: Workload) -> tuple[float, float, float] | None:
    """(mean prompt tokens, mean output tokens, requests/s) of the requests a window completed."""
    n = summary.get("completed_by_kind") or {}
    ns, npr = n.get(STREAM, 0), n.get(PROMPT, 0)
    if ns + npr == 0 or not summary.get("window_s"):
        return None
    prompt = (ns * wl.stream_prompt_tokens + npr * wl.prompt_tokens) / (ns + npr)
    output = (ns * wl.stream_output_tokens + npr * wl.prompt_output_tokens) / (ns + npr)
    return prompt, output, (ns + npr) / summary["window_s"]


def measured_winner(pd: float | None, agg: float | None) -> str:
    pd, agg = pd or 0.0, agg or 0.0
    if pd == agg:
        return "neither" if pd == 0 else "tie"
    return dis.DISAGGREGATED if pd > agg else dis.AGGREGATED


def _always(p: dis.Profile) -> Callable[[int], dis.Profile]:
    """A measured profile, whatever the output length (recommend's `profile_at`)."""
    return lambda _: p


def verdicts(
    runs: Mapping[str, Mapping[str, Any]],
    figures: Mapping[str, Mapping[str, Mapping[str, Any]]],
    cores: Mapping[str, int],
    wl: Workload,
    slo: dis.Slo,
    pair: str,
) -> dict[str, Any]:
    """rate -> the plan's winner at the measured workload beside the measured one (`pair`'s goodput)."""
    out: dict[str, Any] = {}
    agg_figs, pd_figs = figures.get("aggregated") or {}, figures.get("disaggregated") or {}
    for rate, s in agg_figs.items():
        m = mix(s, wl)
        p = None if m is None else profile(runs, cores, m[0])
        if m is None or p is None or rate not in pd_figs:
            out[rate] = {"plan": None, "measured": None, "agree": None}
            continue
        prompt, output, req_s = m
        v = dis.recommend(
            _always(p),
            prompt_tokens=round(prompt),
            output_tokens=max(1, round(output)),
            rate=req_s,
            slo=slo,
            gpus=sum(cores[r] for r in ("prefill", "decode")),
            mode=dis.DISAGGREGATED,
            longest_output=max(1, MAX_MODEL_LEN - round(prompt)),
        )
        got = measured_winner(pd_figs[rate]["goodput"][pair]["req_s"], s["goodput"][pair]["req_s"])
        out[rate] = {
            "workload": {"prompt_tokens": prompt, "output_tokens": output, "req_s": req_s},
            "plan": v.winner or "neither",
            "plan_req_s_per_replica": {
                "aggregated": v.rates.aggregated,
                "prefill": v.rates.prefill,
                "decode": v.rates.decode,
            },
            "measured": got,
            "agree": got == (v.winner or "neither") or got == "tie",
        }
    return out


def gpu_crossing(prompt_tokens: int, output_tokens: int, stack: str = "prod") -> dict[str, Any]:
    """The lowest rate (GPU_RATES) from which `make plan` picks disaggregation for this
    workload's shape on `stack`'s GPUs (its roofline), or None when it never does there."""
    from infra import config
    from infra.plan.disaggregation_plan import disaggregation_for
    from infra.plan.planning import Workload as PlanWorkload
    from infra.plan.planning import model_view, plan
    from tools import stackfile

    values, secrets, _ = stackfile.read_as_deployed(stack)
    cfg = config.load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml")
    p = plan(cfg, workload=PlanWorkload(prompt_tokens=prompt_tokens, output_tokens=output_tokens))
    view = model_view(cfg, cfg.serving.served[0])
    out: dict[str, Any] = {"stack": stack, "model": p.model_id, "prompt_tokens": prompt_tokens}
    out["output_tokens"] = output_tokens
    for rate in GPU_RATES:
        v = disaggregation_for(view, p.shape, list(p.roles), p.kv_link, rate, prompt_tokens, output_tokens)
        if v is None:
            return {**out, "rate": None, "why": "no roofline for the stack's model or GPUs"}
        if v.winner == dis.DISAGGREGATED:
            return {**out, "rate": rate, "slo": {"ttft_s": v.slo.ttft_s, "itl_s": v.slo.itl_s}}
    return {**out, "rate": None, "why": f"aggregation wins at every rate up to {GPU_RATES[-1]:g} req/s"}
