"""bench/goodput_plan.py: the CPU profile from the bench's own runs, `make plan`'s verdict at each
measured rate beside the measured one, and the GPU crossing from a shipped stack's roofline."""

from __future__ import annotations

import pytest

from bench import goodput_plan as gplan
from bench.goodput_load import PROMPT, STREAM, Workload
from infra.sizing import disaggregation as dis

AGG_RUN = {
    "tpot_s": {"1": 0.010, "4": 0.016},
    "ttft_s": {"long": 0.30, "short": 0.05},
    "prompt_tokens": {"long": 900, "short": 32},
    "kv_transfer_s": None,
}
PD_RUN = {**AGG_RUN, "tpot_s": {"1": 0.008, "4": 0.011}, "kv_transfer_s": 0.018}
CORES = {"prefill": 1, "decode": 1, "aggregated": 2}


def test_the_profile_is_a_step_through_two_batches_and_prompt_tokens_per_second():
    r = gplan.replica(AGG_RUN, 2)
    assert r is not None
    # (16 - 10) ms over 3 more sequences: 2 ms each; batch 1 at 10 ms leaves 8 ms fixed.
    assert r.step_s_per_seq == pytest.approx(0.002) and r.step_s == pytest.approx(0.008)
    # 868 more prompt tokens for 250 ms more to the first token.
    assert r.prefill_tokens_per_s == pytest.approx(868 / 0.25)
    assert (r.gpus, r.gpus_per_node, r.usd_per_node_hour) == (2, 1, 1.0)  # a core is the unit of cost
    # P/D: the KV transfer's extra (18 ms x 868 / 900) is not prefill.
    assert gplan.prefill_tokens_per_s(PD_RUN) == pytest.approx(868 / (0.25 - 0.018 * 868 / 900))
    p = gplan.profile({"aggregated": AGG_RUN, "disaggregated": PD_RUN}, CORES, 450)
    assert p is not None and p.kv_transfer_s == pytest.approx(0.009)  # half the long prompt's KV
    assert (p.prefill.gpus, p.decode.gpus, p.aggregated.gpus) == (1, 1, 2)
    assert gplan.replica({**AGG_RUN, "ttft_s": {"long": 0.05, "short": 0.05}}, 2) is None  # no prefill figure


def _summary(streams: int, prompts: int, pd_good: float, agg_good: float | None = None) -> dict:
    return {
        "completed_by_kind": {STREAM: streams, PROMPT: prompts},
        "window_s": 100.0,
        "goodput": {"0.5/0.1": {"req_s": pd_good if agg_good is None else agg_good}},
    }


def test_the_plan_at_each_rate_beside_the_measured_winner():
    wl = Workload()
    # 300 streams and 100 long prompts in 100 s: 4 req/s, mean prompt (300 x 32 + 100 x 900) / 400.
    assert gplan.mix(_summary(300, 100, 0.0), wl) == pytest.approx(
        ((300 * 32 + 100 * 900) / 400, (300 * 256 + 100 * 16) / 400, 4.0)
    )
    figures = {
        "aggregated": {"1": _summary(300, 100, 0.0, agg_good=3.0), "6": _summary(200, 600, 0.0, agg_good=1.0)},
        "disaggregated": {"1": _summary(300, 100, 2.0), "6": _summary(200, 600, 2.5)},
    }
    runs = {"aggregated": AGG_RUN, "disaggregated": PD_RUN}
    out = gplan.verdicts(runs, figures, CORES, wl, dis.Slo(0.5, 0.1), "0.5/0.1")
    assert [out[r]["measured"] for r in ("1", "6")] == [dis.AGGREGATED, dis.DISAGGREGATED]
    for r in ("1", "6"):
        assert out[r]["plan"] in (dis.AGGREGATED, dis.DISAGGREGATED, "neither")
        assert out[r]["agree"] == (out[r]["plan"] == out[r]["measured"])
        assert out[r]["workload"]["req_s"] == pytest.approx(gplan.mix(figures["aggregated"][r], wl)[2])
    assert gplan.verdicts({}, figures, CORES, wl, dis.Slo(0.5, 0.1), "0.5/0.1")["1"]["plan"] is None
    assert [gplan.measured_winner(a, b) for a, b in ((0, 0), (1, 1), (2, 1), (None, 1))] == [
        "neither",
        "tie",
        dis.DISAGGREGATED,
        dis.AGGREGATED,
    ]


def test_the_gpu_crossing_is_the_lowest_searched_rate_the_plan_picks_pd_at():
    from infra import config
    from infra.plan.disaggregation_plan import disaggregation_for
    from infra.plan.planning import Workload as PlanWorkload
    from infra.plan.planning import model_view, plan
    from tools import stackfile

    got = gplan.gpu_crossing(900, 16)
    values, secrets, _ = stackfile.read_as_deployed("prod")
    cfg = config.load(values, secret_keys=secrets, source="stacks/Pulumi.prod.yaml")
    p = plan(cfg, workload=PlanWorkload(prompt_tokens=900, output_tokens=16))

    def winner(rate: float) -> str | None:
        v = disaggregation_for(model_view(cfg, cfg.serving.served[0]), p.shape, list(p.roles), p.kv_link, rate, 900, 16)
        assert v is not None
        return v.winner

    assert got["stack"] == "prod" and got["model"] == cfg.serving.model.id
    if got["rate"] is None:
        assert all(winner(r) != dis.DISAGGREGATED for r in gplan.GPU_RATES)
    else:
        i = gplan.GPU_RATES.index(got["rate"])
        assert winner(got["rate"]) == dis.DISAGGREGATED
        assert all(winner(r) != dis.DISAGGREGATED for r in gplan.GPU_RATES[:i])
