"""serving/ingress/limits.py: token estimates, the limiter's client side and its reservations.

The windows and the ledger actor: test_ledger.py."""

from __future__ import annotations

import asyncio

import pytest

from serving.ingress import limits
from serving.ingress.limits import Decision, KeyLimit, LimitsConfig, LimitsLedger, Reservation, estimate_tokens
from serving.spec import KEY_ID_RE, key_id


def test_key_id_is_a_short_hash_never_the_key():
    kid = key_id("sk-secret-123")
    assert KEY_ID_RE.match(kid) and "secret" not in kid
    assert kid == key_id("sk-secret-123") != key_id("sk-secret-124")


def test_unlimited_keys_and_per_key_overrides():
    cfg = LimitsConfig.from_user_config(
        {
            "requests_per_minute": 10,
            "tokens_per_minute": 0,
            "keys": {"k-000000000000": {"requests_per_minute": 0, "tokens_per_minute": 0}},
        }
    )
    assert cfg.for_key("k-000000000000", "m").unlimited
    assert cfg.for_key("k-111111111111", "m") == KeyLimit(10, 0)
    assert LimitsConfig.from_user_config(None).default.unlimited


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"prompt": "abcdefgh", "max_tokens": 10}, 2 + 10),
        ({"prompt": [1, 2, 3], "max_tokens": 5}, 3 + 5),
        ({"messages": [{"role": "user", "content": "abcd" * 10}], "max_completion_tokens": 7, "n": 2}, 10 + 14),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}, 1),
    ],
)
def test_estimate_tokens(body, expected):
    assert estimate_tokens(body) == expected


class _Meter:
    def __init__(self):
        self.limited, self.errors = [], 0

    def rate_limited(self, kid, model, limit):
        self.limited.append((kid, model, limit))

    def limiter_error(self):
        self.errors += 1


class _Ref:
    def __init__(self, value=None, delay=0.0):
        self.value, self.delay = value, delay

    def __await__(self):
        async def get():
            await asyncio.sleep(self.delay)
            return self.value

        return get().__await__()


class _Ledger:
    def __init__(self, decision=None, delay=0.0):
        self.calls = []
        outer = self

        class _M:
            def remote(self, *a):
                outer.calls.append(a)
                return _Ref(decision, delay)

        self.admit = _M()
        self.settle = _M()
        self.totals = _M()


def test_limiter_skips_the_ledger_for_unlimited_keys_and_fails_open_when_it_is_slow(monkeypatch):
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    meter = _Meter()
    ledger = _Ledger(Decision(True), delay=1.0)
    lim = limits.Limiter(LimitsConfig.from_user_config(None), lambda: ledger, meter)
    assert asyncio.run(lim.admit("k-1", "m", {})).ok and ledger.calls == []
    lim.config = LimitsConfig.from_user_config({"requests_per_minute": 1})
    assert asyncio.run(lim.admit("k-1", "m", {})).ok  # slow ledger: let through, counted
    assert meter.errors == 1 and len(ledger.calls) == 1


def test_limiter_refusal_is_counted_per_key_and_limit():
    meter = _Meter()
    ledger = _Ledger(Decision(False, 7, "rpm", "no"))
    lim = limits.Limiter(LimitsConfig.from_user_config({"requests_per_minute": 1}), lambda: ledger, meter)
    d = asyncio.run(lim.admit("k-abc", "m:adapter", {"prompt": "x"}))
    assert not d.ok and d.retry_after_s == 7
    assert meter.limited == [("k-abc", "m", "rpm")]  # the window's model: the adapter's base
    assert [c[:5] for c in ledger.calls] == [("k-abc", "m", 1, 0, 0)]  # no token estimate without a TPM limit


def test_while_the_ledger_is_down_the_policy_decides_at_once_and_refuse_keeps_limits(monkeypatch):
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    now = [0.0]
    meter = _Meter()
    ledger = _Ledger(Decision(True), delay=1.0)  # never answers in time
    cfg = LimitsConfig.from_user_config({"requests_per_minute": 1, "when_ledger_unreachable": "refuse"})
    lim = limits.Limiter(cfg, lambda: ledger, meter, clock=lambda: now[0])

    async def go():
        return [await lim.admit("k-1", "m", {}) for _ in range(3)]

    decisions = asyncio.run(go())
    assert [d.ok for d in decisions] == [False, False, False]
    assert all(d.retry_after_s >= 1 for d in decisions)
    assert len(ledger.calls) == 1  # asked once; the next two decided without waiting on it
    assert meter.errors == 3
    now[0] = limits.LEDGER_RETRY_S + 1  # later it is asked again
    asyncio.run(lim.admit("k-1", "m", {}))
    assert len(ledger.calls) == 2


def test_an_unknown_unreachable_policy_is_refused():
    with pytest.raises(ValueError, match="when_ledger_unreachable"):
        LimitsConfig.from_user_config({"when_ledger_unreachable": "maybe"})


def test_the_ledger_is_looked_up_off_the_event_loop():
    import threading

    seen = []

    def factory():
        seen.append(threading.current_thread() is threading.main_thread())
        return _Ledger(Decision(True))

    lim = limits.Limiter(LimitsConfig.from_user_config({"requests_per_minute": 5}), factory, _Meter())
    assert asyncio.run(lim.admit("k-1", "m", {})).ok
    assert seen == [False]


def test_a_new_ledger_is_waited_for_before_traffic_not_counted_as_down(monkeypatch):
    """The first call creates the actor, which takes seconds to start: warm_up (run when
    limits are configured) waits for it, so the first requests are checked, not waved through."""
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    meter = _Meter()
    ledger = _Ledger(Decision(False, 3, "rpm", "no"), delay=0.2)  # starts slower than one request may wait
    lim = limits.Limiter(LimitsConfig.from_user_config({"requests_per_minute": 1}), lambda: ledger, meter)

    async def go():
        assert await lim.warm_up(timeout_s=1.0)
        ledger.admit = _Ledger(Decision(False, 3, "rpm", "no")).admit  # started: answers at once
        return await lim.admit("k-1", "m", {})

    d = asyncio.run(go())
    assert not d.ok and d.limit == "rpm" and meter.errors == 0


# --- per-key model access and per-model limits -----------------------------------------
KID, OTHER = "k-0123456789ab", "k-111111111111"


def test_a_key_limited_to_models_may_use_them_and_their_adapters_only():
    cfg = LimitsConfig.from_user_config({"keys": {KID: {"models": ["a"]}}})
    assert [cfg.may_use(KID, m) for m in ("a", "a:tenant", "b", "b:tenant", "ab", "")] == [
        True,
        True,
        False,
        False,
        False,  # a model whose id starts with an allowed one is another model
        False,
    ]
    assert all(cfg.may_use(OTHER, m) for m in ("a", "b", "b:tenant"))  # lists no models: every one
    assert cfg.for_key(KID, "b") == KeyLimit()  # listing models lifts or adds no limit


def test_model_limits_apply_to_unlisted_keys_and_a_keys_own_values_replace_them():
    cfg = LimitsConfig.from_user_config(
        {
            "requests_per_minute": 100,
            "keys": {
                KID: {"requests_per_minute": 5, "tokens_per_minute": 0},
                "k-22222222222c": {"models": ["a"]},  # models only: everyone's limits
            },
            "models": {"a": {"requests_per_minute": 1, "tokens_per_minute": 50}},
        }
    )
    assert cfg.for_key(OTHER, "a") == cfg.for_key(OTHER, "a:tenant") == KeyLimit(1, 50)
    assert cfg.for_key(OTHER, "b") == KeyLimit(100, 0)
    assert cfg.for_key(KID, "a") == cfg.for_key(KID, "b") == KeyLimit(5, 0)
    assert cfg.for_key("k-22222222222c", "a") == KeyLimit(1, 50)
    assert cfg.any
    assert LimitsConfig.from_user_config({"models": {"a": {"requests_per_minute": 1}}}).any
    assert not LimitsConfig.from_user_config({"keys": {KID: {"models": ["a"]}}}).any  # access needs no ledger


def _limiter(cfg):
    from tests.serving.fakes import LocalLedger

    ledger = LocalLedger()
    return limits.Limiter(LimitsConfig.from_user_config(cfg), lambda: ledger, _Meter()), ledger


def test_windows_are_per_key_and_model_an_adapter_counting_on_its_base():
    """Exhausting a key's requests on model a leaves its budget on b whole (and another key's
    on a): a cheap model's traffic must not starve the key's access to another."""
    lim, _ = _limiter({"requests_per_minute": 2})

    async def go():
        on_a = [(await lim.admit(KID, m, {})).ok for m in ("a", "a:tenant", "a")]
        return on_a, (await lim.admit(KID, "b", {})).ok, (await lim.admit(OTHER, "a", {})).ok

    on_a, on_b, other_on_a = asyncio.run(go())
    assert on_a == [True, True, False]  # the adapter's request counted on a's window
    assert on_b and other_on_a


def test_a_refusal_names_the_model_whose_budget_is_spent():
    lim, _ = _limiter({"models": {"a": {"requests_per_minute": 1}}})

    async def go():
        await lim.admit(KID, "a", {})
        return await lim.admit(KID, "a:tenant", {})

    d = asyncio.run(go())
    assert not d.ok and "1 requests per minute for this API key on model 'a'" in d.message
    assert lim._metrics.limited == [(KID, "a", "rpm")]


def test_settled_tokens_land_in_the_window_they_were_reserved_in():
    lim, ledger = _limiter({"tokens_per_minute": 1000})

    async def go():
        d = await lim.admit(KID, "a:tenant", {"prompt": "abcd", "max_tokens": 99})
        reserved = ledger.actor.totals(KID, "a")
        lim.settle(KID, "a:tenant", d, 7)
        return d, reserved

    d, reserved = asyncio.run(go())
    assert d.ok and reserved == (1, 100)
    assert ledger.actor.totals(KID, "a") == (1, 7) and ledger.actor.totals(KID, "b") == (0, 0)


def test_the_spec_renders_what_the_ingress_reads():
    from serving.spec import ServingSpec

    spec = ServingSpec.model_validate(
        {
            "models": [
                {"model": {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct"}},
                {"model": {"id": "qwen", "source": "Qwen/Qwen2.5-7B-Instruct"}, "mode": "aggregated"},
            ],
            "limits": {
                "tokensPerMinute": 9000,
                "keys": {KID: {"models": ["qwen"]}, OTHER: {"requestsPerMinute": 30}},
                "models": {"llama": {"requestsPerMinute": 10}},
                "whenLedgerUnreachable": "refuse",
            },
        }
    )
    cfg = LimitsConfig.from_user_config(spec.ingress_user_config()["limits"])
    assert cfg.when_ledger_unreachable == "refuse"
    assert (cfg.may_use(KID, "qwen:tenant"), cfg.may_use(KID, "llama"), cfg.may_use(OTHER, "llama")) == (
        True,
        False,
        True,
    )
    assert cfg.for_key(KID, "qwen") == KeyLimit(0, 9000)  # its entry lists models only
    assert cfg.for_key(KID, "llama") == KeyLimit(10, 0)
    assert cfg.for_key(OTHER, "llama") == cfg.for_key(OTHER, "qwen") == KeyLimit(30, 0)


# --- every reservation settled once: a late admit, a dropped handle, the refuse policy ----------
class _Handle:
    """A ledger actor's handle over a real LimitsLedger. Each call runs when it is sent (it
    lands at once) unless `hold_admits` keeps admits back until `land()`; its answer comes
    `delay` seconds later (past LEDGER_TIMEOUT_S: the replica stops waiting)."""

    def __init__(self, delay=0.0, hold_admits=False):
        self.ledger = LimitsLedger()
        self.delay, self.hold_admits, self.held = delay, hold_admits, []

    def land(self):
        for call in self.held:
            call()
        self.held.clear()

    def __getattr__(self, name):
        method, outer = getattr(self.ledger, name), self

        class _Call:
            def remote(self, *args):
                if name == "admit" and outer.hold_admits:
                    outer.held.append(lambda: method(*args))
                    return _Ref(None, 3600)
                return _Ref(method(*args), outer.delay)

        return _Call()


BIG = {"prompt": "x" * 40, "max_tokens": 500}  # reserves 510


def _reserve(handle, policy="allow", tpm=10_000):
    cfg = LimitsConfig.from_user_config({"tokens_per_minute": tpm, "when_ledger_unreachable": policy})
    lim = limits.Limiter(cfg, lambda: handle, _Meter())

    async def go():
        d = await lim.admit(KID, "a", BIG)
        return lim, d

    return asyncio.run(go())


def test_a_reservation_whose_admit_answered_too_late_is_still_corrected(monkeypatch):
    """The defect: the ledger counted the admit, the replica stopped waiting for its answer
    and let the request through with no ticket, so the whole estimate stayed in the key's
    window for a minute whatever the request used."""
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    handle = _Handle(delay=1.0)
    lim, d = _reserve(handle)
    assert d.ok and handle.ledger.totals(KID, "a") == (1, 510)  # landed, unanswered
    Reservation(lim, KID, "a", d).settle(20)
    assert handle.ledger.totals(KID, "a") == (1, 20)


def test_an_admit_that_lands_after_its_settle_counts_nothing_more(monkeypatch):
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    handle = _Handle(hold_admits=True)
    lim, d = _reserve(handle)
    assert d.ok
    Reservation(lim, KID, "a", d).settle(20)  # served: its tokens count when it ends
    handle.land()
    assert handle.ledger.totals(KID, "a") == (0, 20)


def test_a_request_refused_for_want_of_an_answer_is_taken_out_of_the_window(monkeypatch):
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    for hold in (False, True):  # the admit landed before, or lands after, the release
        handle = _Handle(delay=1.0, hold_admits=hold)
        _, d = _reserve(handle, policy="refuse")
        assert not d.ok and d.limit == limits.UNCHECKED
        handle.land()
        assert handle.ledger.totals(KID, "a") == (0, 0)


def test_a_reservation_is_settled_through_its_own_handle_after_the_replicas_is_dropped(monkeypatch):
    """The defect: a timeout on another request dropped the replica's handle, and every
    reservation admitted before it was then never settled."""
    monkeypatch.setattr(limits, "LEDGER_TIMEOUT_S", 0.05)
    handle = _Handle()
    cfg = LimitsConfig.from_user_config({"tokens_per_minute": 10_000})
    lim = limits.Limiter(cfg, lambda: handle, _Meter())

    async def go():
        first = await lim.admit(KID, "a", BIG)
        handle.delay = 1.0
        second = await lim.admit(KID, "a", BIG)  # no answer in time: the handle is dropped
        assert lim._ledger is None
        return first, second

    first, second = asyncio.run(go())
    Reservation(lim, KID, "a", first).settle(20)
    Reservation(lim, KID, "a", second).settle(30)
    assert handle.ledger.totals(KID, "a") == (2, 50)


def test_each_reservation_has_an_id_of_its_own():
    handle = _Handle()
    lim = limits.Limiter(LimitsConfig.from_user_config({"requests_per_minute": 100}), lambda: handle, _Meter())
    other = limits.Limiter(LimitsConfig.from_user_config({"requests_per_minute": 100}), lambda: handle, _Meter())

    async def go():
        return [(await limiter.admit(KID, "a", {})).ticket for limiter in (lim, lim, other)]

    tickets = asyncio.run(go())
    assert len(set(tickets)) == 3 and all(tickets)


def test_a_chat_request_is_sized_as_vllm_reads_it_without_its_deprecation_warning():
    """vLLM 0.32 marks ChatCompletionRequest.max_tokens deprecated (pydantic warns on each
    read of the attribute): sizing every chat request must not warn."""
    import warnings

    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": "5", "n": 2.0}
    typed = ChatCompletionRequest.model_validate(body)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sized = limits.engine_view(body, typed)
    assert estimate_tokens(sized) == estimate_tokens({**body, "max_tokens": 5, "n": 2})


# --- budgets, cache groups and the spend of keys without a reservation -------------------------
def test_budgets_cache_groups_and_isolation_are_read_from_the_user_config():
    cfg = LimitsConfig.from_user_config(
        {
            "keys": {
                "k-000000000000": {"budget": {"usd": 20.0, "period": "day", "when_exceeded": "small"}},
                "k-111111111111": {"cache_group": "team-a", "models": ["m"]},
            },
            "cache_isolation": "key",
        }
    )
    assert cfg.budgets == {"k-000000000000": limits.Budget(20.0, "day", "small")}
    assert cfg.cache_groups == {"k-111111111111": "team-a"}
    # A budget alone is no rate limit: the key keeps the limits every key has.
    assert cfg.for_key("k-000000000000", "m").unlimited and cfg.any
    assert LimitsConfig.from_user_config(None).cache_isolation == "key"
    with pytest.raises(ValueError, match="cache_isolation"):
        LimitsConfig.from_user_config({"cache_isolation": "none"})


def test_a_key_with_only_a_budget_is_asked_of_the_ledger_and_a_budget_refusal_is_left_to_the_pipeline():
    meter = _Meter()
    ledger = _Ledger(Decision(False, 3600, "budget", "Budget exceeded"))
    cfg = LimitsConfig.from_user_config({"keys": {"k-abc": {"budget": {"usd": 1.0, "period": "month"}}}})
    lim = limits.Limiter(cfg, lambda: ledger, meter)
    d = asyncio.run(lim.admit("k-abc", "m", {"prompt": "x"}))
    assert not d.ok and d.limit == "budget" and ledger.calls[0][-1] == [1.0, "month"]
    assert meter.limited == []  # it may still overflow elsewhere: counted where it is answered
    # A request that overflows past the budget is admitted without it.
    assert asyncio.run(lim.admit("k-abc", "m", {"prompt": "x"}, budget=False)).ok and len(ledger.calls) == 1


class _Recorder:
    """The ledger's record and spend calls, answered at once."""

    def __init__(self):
        self.rows = []
        outer = self

        class _Record:
            def remote(self, rows):
                outer.rows.append(rows)

        class _Spend:
            def remote(self, kid):
                return _Ref({"asked": kid, "rows": list(outer.rows)})

        self.record, self.spend = _Record(), _Spend()


def test_the_spend_of_keys_without_a_reservation_is_sent_in_batches():
    now = [100.0]
    ledger = _Recorder()
    lim = limits.Limiter(LimitsConfig.from_user_config(None), lambda: ledger, _Meter(), clock=lambda: now[0])

    async def go():
        for kid, usd in (("k-a", 0.5), ("k-a", 0.25), ("k-b", 1.0)):
            lim.settle(kid, "m", Decision(True), 10, limits.Spend(usd, 1, 8, 2, 0))
        await asyncio.sleep(0)
        sent_early = list(ledger.rows)
        now[0] += limits.SPEND_FLUSH_S
        lim.settle("k-a", "m", Decision(True), 10, limits.Spend(0.25, 1, 8, 2, 0))
        for _ in range(3):
            await asyncio.sleep(0)
        return sent_early

    assert asyncio.run(go()) == []  # within a second of the last send: held
    assert ledger.rows == [[["k-a", 1.0, 3, 24, 6, 0], ["k-b", 1.0, 1, 8, 2, 0]]]


def test_reading_a_keys_spend_sends_this_replicas_batch_first():
    ledger = _Recorder()
    lim = limits.Limiter(LimitsConfig.from_user_config(None), lambda: ledger, _Meter(), clock=lambda: 100.0)
    lim.settle("k-a", "m", Decision(True), 10, limits.Spend(0.5, 1, 8, 2, 0))
    got = asyncio.run(lim.spend("k-a"))
    assert got == {"asked": "k-a", "rows": [[["k-a", 0.5, 1, 8, 2, 0]]]}
