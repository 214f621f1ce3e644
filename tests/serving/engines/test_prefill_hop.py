"""serving/engines/prefill_hop.py against fake Serve streams: the prefill call's deadlines, retries and
circuit, and the decode orchestration (remote, or local prefill when the remote path fails)."""

from __future__ import annotations

import asyncio

import pytest

from serving.core.calls import is_server_error
from serving.core.failures import Reason
from serving.core.metrics import PrefillPath as Path
from serving.engines.circuit import Circuit
from serving.engines.prefill_hop import PrefillOutcome, orchestrate, remote_prefill
from tests.serving.fakes import CFG, Err, FakeStream, collect, is_5xx, is_err, run


# --- prefill hop ----------------------------------------------------------------------------------
def test_prefill_success_first_try():
    streams = [FakeStream(["kv"])]
    retries = []
    out = run(
        remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=Circuit(10), on_retry=retries.append)
    )
    assert out.chunk == "kv" and out.reason is None and retries == []


def test_prefill_replica_death_is_retried_on_another_call():
    from ray.exceptions import ActorDiedError

    dead, good = FakeStream([ActorDiedError()]), FakeStream(["kv"])
    streams = [dead, good]
    retries = []
    circuit = Circuit(10)
    out = run(
        remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append)
    )
    assert out.chunk == "kv"
    assert retries == [Reason.REPLICA_DIED]
    assert dead.cancelled
    assert not circuit.is_open  # the retry succeeded


def test_a_stalled_prefill_is_cancelled_and_retried_and_one_stall_does_not_open_the_circuit():
    first, second = FakeStream(["hang"]), FakeStream(["kv"])
    calls = [first, second]
    retries = []
    circuit = Circuit(10, failures_to_open=3)
    out = run(remote_prefill(lambda: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append))
    assert out.chunk == "kv" and out.path is Path.REMOTE_RETRY
    assert retries == [Reason.TIMEOUT]
    assert first.cancelled
    assert not circuit.is_open


def _concurrently(circuit, *per_request):
    """Each request's prefill calls (a list of streams), run at the same time on one circuit."""

    async def go():
        return await asyncio.gather(
            *(
                remote_prefill(
                    lambda c=calls: c.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None
                )
                for calls in per_request
            )
        )

    return run(go())


def test_a_stall_while_other_prefills_are_answered_is_a_busy_tier_and_leaves_the_circuit_closed():
    # The make bench run of 2026-12-06 07:33: 16 concurrent prefills on a loaded tier, a few
    # past their deadline in the prefill engine's own queue, opened the circuit and sent 38 of
    # 128 requests to prefill on decode. One call answered after the stalled one started says
    # the tier works: the stall is retried, not counted.
    circuit = Circuit(10, failures_to_open=1)
    answered = [FakeStream(["kv"], assign_after_s=0.1)]
    stalled = [FakeStream(["hang"]), FakeStream(["kv"])]
    fast, slow = _concurrently(circuit, answered, stalled)
    assert fast.path is Path.REMOTE
    assert slow.chunk == "kv" and slow.path is Path.REMOTE_RETRY
    assert not circuit.is_open


def test_stalls_with_no_prefill_answered_still_open_the_circuit():
    circuit = Circuit(10, failures_to_open=2)
    # A stalled tier: every call hangs, the retries too.
    first, second = [FakeStream(["hang"]), FakeStream(["hang"])], [FakeStream(["hang"]), FakeStream(["hang"])]
    outcomes = _concurrently(circuit, first, second)
    assert circuit.is_open
    assert [o.path for o in outcomes] == [Path.LOCAL, Path.LOCAL]  # no retry once it opened


def test_queueing_for_a_prefill_replica_does_not_count_against_the_prefill_deadline():
    # Taken after 0.25 s (longer than prefill_timeout_s 0.2, within the queue bound 0.3),
    # then answered at once: a success, not a timeout.
    queued = FakeStream(["kv"], assign_after_s=0.25)
    circuit = Circuit(10, failures_to_open=1)
    out = run(remote_prefill(lambda: queued, is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None))
    assert out.chunk == "kv" and out.path is Path.REMOTE
    assert not circuit.is_open


def test_a_prefill_call_no_replica_takes_is_overload_not_retried_and_leaves_the_circuit_closed():
    never = FakeStream(["kv"], assigned=False)
    retries = []
    circuit = Circuit(10, failures_to_open=1)
    out = run(remote_prefill(lambda: never, is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append))
    assert out.reason is Reason.OVERLOADED and out.path is Path.LOCAL
    assert retries == [] and never.cancelled
    assert not circuit.is_open


def test_waiting_prefills_go_local_the_moment_another_request_trips_the_circuit():
    circuit = Circuit(10, failures_to_open=1)
    # A prefill budget of an hour: the wait can only end this soon because the circuit opened
    # (a hang is ended by the suite's per-test timeout, pytest.ini), and the reason says so.
    cfg = CFG.model_copy(update={"prefill_timeout_s": 3600.0, "total_timeout_s": 3600.0})
    waiting = FakeStream(["hang"])

    async def go():
        task = asyncio.ensure_future(
            remote_prefill(lambda: waiting, is_error=is_err, cfg=cfg, circuit=circuit, on_retry=lambda r: None)
        )
        await asyncio.sleep(0.05)
        circuit.failure()  # another request failed
        return await task

    out = run(go())
    # CIRCUIT_OPEN, not TIMEOUT: it stopped waiting when the circuit opened, not at its deadline.
    assert out.reason is Reason.CIRCUIT_OPEN
    assert waiting.cancelled


def test_after_a_prefill_outage_a_successful_probe_brings_every_request_back_to_remote_prefill():
    """The defect of 2026-12-01: the probe found the trip event of the last outage still set,
    gave up, and the replica prefilled locally for the rest of its life."""
    from ray.exceptions import ActorDiedError

    now = [0.0]
    circuit = Circuit(1.0, failures_to_open=2, clock=lambda: now[0])

    def prefill(streams):
        return run(
            remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None)
        )

    outage = prefill([FakeStream([ActorDiedError()]), FakeStream([ActorDiedError()])])
    assert outage.path is Path.LOCAL and circuit.is_open
    assert prefill([]).reason is Reason.CIRCUIT_OPEN  # no call while open
    now[0] = 1.5
    probe = prefill([FakeStream(["kv"])])
    assert probe.path is Path.REMOTE and not circuit.is_open
    assert [prefill([FakeStream(["kv"])]).path for _ in range(3)] == [Path.REMOTE] * 3


def test_a_failed_probe_opens_the_circuit_again_without_a_retry():
    from ray.exceptions import ActorDiedError

    now = [0.0]
    circuit = Circuit(1.0, failures_to_open=1, clock=lambda: now[0])
    circuit.failure()
    now[0] = 1.5
    calls = [FakeStream([ActorDiedError()])]
    out = run(remote_prefill(lambda: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None))
    assert out.reason is Reason.REPLICA_DIED and calls == []  # one call: the probe is not retried
    assert not circuit.allow()  # open again for another open_s
    now[0] = 2.6
    assert circuit.allow()


def test_a_cancelled_probe_lets_the_next_request_probe():
    now = [0.0]
    circuit = Circuit(1.0, failures_to_open=1, clock=lambda: now[0])
    circuit.failure()
    now[0] = 2.0

    async def go():
        task = asyncio.ensure_future(
            remote_prefill(
                lambda: FakeStream(["hang"]), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=lambda r: None
            )
        )
        await asyncio.sleep(0.05)
        assert not circuit.allow()  # the probe is out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert circuit.allow()  # the probe slot is free again


def test_replica_death_twice_opens_a_two_failure_circuit():
    from ray.exceptions import ActorDiedError

    circuit = Circuit(10, failures_to_open=2)
    streams = [FakeStream([ActorDiedError()]), FakeStream([ActorDiedError()])]
    retries = []
    out = run(
        remote_prefill(lambda: streams.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append)
    )
    assert out.reason is Reason.REPLICA_DIED and retries == [Reason.REPLICA_DIED]
    assert circuit.is_open


def test_prefill_skipped_while_circuit_open():
    circuit = Circuit(10, failures_to_open=1)
    circuit.failure()
    out = run(
        remote_prefill(
            lambda: pytest.fail("no call while open"),
            is_error=is_err,
            cfg=CFG,
            circuit=circuit,
            on_retry=lambda r: None,
        )
    )
    assert out.reason is Reason.CIRCUIT_OPEN


def test_prefill_overload_does_not_open_the_circuit():
    from ray.serve.exceptions import BackPressureError

    circuit = Circuit(10)
    out = run(
        remote_prefill(
            lambda: FakeStream([BackPressureError(num_queued_requests=1, max_queued_requests=1)]),
            is_error=is_err,
            cfg=CFG,
            circuit=circuit,
            on_retry=lambda r: None,
        )
    )
    assert out.reason is Reason.OVERLOADED
    assert not circuit.is_open


# --- decode orchestration -----------------------------------------------------------------------
def _drive(remote, local, *, outcome=None, kv_s=CFG.kv_ready_timeout_s, local_reason=None, is_error=is_5xx):
    """Run `orchestrate` with a prefill that returns `outcome` (None: must not be called), a
    decode that returns `remote` (an item stream) and a local prefill that returns `local`;
    (what the client got, the (path, reason) reports)."""
    paths = []

    async def prefill():
        assert outcome is not None, "the prefill tier must not be called"
        return outcome

    async def decode_with(chunk):
        assert chunk == "kv"
        return remote

    async def decode_local():
        assert local is not None, "no local prefill expected"
        return local

    out = run(
        collect(
            orchestrate(
                prefill=prefill,
                decode_with=decode_with,
                decode_local=decode_local,
                is_server_error=is_error,
                kv_ready_timeout_s=lambda: kv_s,
                on_path=lambda p, r: paths.append((p, r)),
                local_reason=local_reason,
            )
        )
    )
    assert len(paths) == 1  # every request is counted once, on exactly one path
    return out, paths


def _orchestrate(prefill_outcome, remote_items, local_items, *, stream=True):
    remote, local = FakeStream(remote_items), FakeStream(local_items)
    out, paths = _drive(
        remote,
        local,
        outcome=PrefillOutcome(**prefill_outcome),
        kv_s=CFG.kv_ready_timeout_s if stream else None,
    )
    return out, [r for p, r in paths if p is Path.LOCAL], remote, local


def test_orchestrate_remote_path_streams_decode_output():
    out, fallbacks, _, local = _orchestrate({"chunk": "kv"}, ["a", "b"], ["x"])
    assert out == ["a", "b"] and fallbacks == [] and local.items == ["x"]


def test_orchestrate_prefill_failure_runs_locally_once():
    out, fallbacks, _, _ = _orchestrate({"reason": Reason.REPLICA_DIED}, ["a"], ["x", "y"])
    assert out == ["x", "y"] and fallbacks == [Reason.REPLICA_DIED]


def test_orchestrate_kv_never_arrives_aborts_decode_and_reruns_locally():
    out, fallbacks, remote, _ = _orchestrate({"chunk": "kv"}, ["hang"], ["x"])
    assert out == ["x"] and fallbacks == [Reason.KV_TIMEOUT]
    assert remote.closed  # the stuck engine request was aborted


def test_orchestrate_kv_load_error_reruns_locally_without_duplicates():
    out, fallbacks, remote, _ = _orchestrate({"chunk": "kv"}, [[Err(500)], "late"], ["x"])
    assert out == ["x"] and fallbacks == [Reason.KV_LOAD_ERROR] and remote.closed


def test_orchestrate_detects_vllms_in_stream_error_event_as_a_kv_load_error():
    # vLLM's OpenAIServing.create_streaming_error_response, as the engine streams it.
    event = (
        'data: {"error": {"message": "KV load failed", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
    )
    assert is_server_error(event)
    assert not is_server_error('data: {"id": "x", "choices": [{"delta": {"content": "error"}}]}\n\n')
    assert not is_server_error('data: {"error": {"message": "bad", "code": 400}}\n\n')  # the client's, passed on

    remote = FakeStream([[event], "late"])
    out, paths = _drive(
        remote, FakeStream(["x"]), outcome=PrefillOutcome(chunk="kv"), kv_s=1.0, is_error=is_server_error
    )
    assert out == ["x"] and remote.closed
    assert paths == [(Path.LOCAL, Reason.KV_LOAD_ERROR)]


def test_orchestrate_without_a_kv_deadline_waits_for_a_slow_first_token():
    # A saturated decode replica (no free sequence slot): a slow first token is queueing,
    # and rerunning the request with a full prefill here would only add load.
    async def slow():
        await asyncio.sleep(CFG.kv_ready_timeout_s * 2)
        yield "tok"

    out, paths = _drive(slow(), None, outcome=PrefillOutcome(chunk="kv", attempts=1), kv_s=None)
    assert out == ["tok"] and paths == [(Path.REMOTE, None)]


def test_orchestrate_local_reason_skips_the_prefill_tier():
    out, paths = _drive(None, FakeStream(["x"]), local_reason=Reason.PARALLEL_SAMPLING)
    assert out == ["x"] and paths == [(Path.LOCAL, Reason.PARALLEL_SAMPLING)]


def test_orchestrate_non_streamed_request_has_no_kv_deadline():
    async def slow():
        await asyncio.sleep(0.4)  # longer than kv_ready_timeout_s: the whole answer
        yield "answer"

    out, _ = _drive(slow(), None, outcome=PrefillOutcome(chunk="kv"), kv_s=None)
    assert out == ["answer"]


def test_no_running_prefill_replica_prefills_locally_at_once_and_counts_against_the_circuit():
    """Serve says the prefill deployment has no running replica (a restart): waiting
    prefillQueueTimeoutS for one on every request would only add that wait to each TTFT."""
    circuit = Circuit(10, failures_to_open=2)

    def prefill():
        return run(
            remote_prefill(
                lambda: pytest.fail("no call without a replica"),
                is_error=is_err,
                cfg=CFG,
                circuit=circuit,
                on_retry=lambda r: pytest.fail("no retry without a replica"),
                no_replica=lambda: True,
            )
        )

    first = prefill()
    assert first.reason is Reason.NO_REPLICA and first.path is Path.LOCAL and not circuit.is_open
    prefill()
    assert circuit.is_open  # two in a row: the circuit opened, later requests skip even the check


# --- a request error only the prefill engine detects is the client's answer ---------------------
def test_a_prefill_4xx_is_returned_never_retried_and_never_counted_against_the_circuit():
    """vLLM refuses a bad parameter on prefill with Ray's ErrorResponse (code 400): the tier
    is healthy. Before: counted as a prefill failure, retried, and N of them opened the
    circuit, switching P/D off on that decode replica."""

    def is_4xx(x):
        return isinstance(x, Err) and 400 <= x.code < 500

    circuit = Circuit(10, failures_to_open=1)
    for _ in range(5):  # far more than failures_to_open
        calls = [FakeStream([Err(400)]), FakeStream(["kv"])]
        retries = []
        out = run(
            remote_prefill(
                lambda calls=calls: calls.pop(0),
                is_error=is_err,
                is_refusal=is_4xx,
                cfg=CFG,
                circuit=circuit,
                on_retry=retries.append,
            )
        )
        assert isinstance(out.refusal, Err) and out.refusal.code == 400 and out.attempts == 1
        assert retries == [] and len(calls) == 1  # one call, no retry
    assert not circuit.is_open
    # and the remote path still works: the next request prefills remotely
    out = run(
        remote_prefill(
            lambda: FakeStream(["kv"]), is_error=is_err, is_refusal=is_4xx, cfg=CFG, circuit=circuit, on_retry=print
        )
    )
    assert out.chunk == "kv" and out.path is Path.REMOTE


def test_orchestrate_hands_a_prefill_refusal_to_the_client_without_decoding():
    paths = []

    async def prefill():
        return PrefillOutcome(refusal=Err(400), attempts=1)

    async def never(*_):
        raise AssertionError("neither decode path may run")

    out = run(
        collect(
            orchestrate(
                prefill=prefill,
                decode_with=never,
                decode_local=never,
                is_server_error=is_5xx,
                kv_ready_timeout_s=lambda: 1.0,
                on_path=lambda p, r: paths.append((p, r)),
            )
        )
    )
    assert len(out) == 1 and out[0].code == 400 and paths == []


def test_a_completion_with_several_prompts_prefills_locally_by_design():
    from serving.core.prompts import prompt_count

    assert [prompt_count(p) for p in ("a", [1, 2, 3], ["a"], ["a", "b"], [[1], [2, 3]])] == [1, 1, 1, 2, 2]
    assert Reason.PROMPT_BATCH in Reason.designed_local()
    out, paths = _drive(None, FakeStream(["x"]), local_reason=Reason.PROMPT_BATCH)
    assert out == ["x"] and paths == [(Path.LOCAL, Reason.PROMPT_BATCH)]


# --- the request's own failure is never the tier's -------------------------------------------------
def _raised_in_replica(cause: BaseException) -> BaseException:
    """`cause` raised by a prefill replica's code, as Serve hands it to decode: Ray's RayTaskError,
    an instance of the cause's class too (ray/exceptions.py as_instanceof_cause, Ray 2.60)."""
    from ray.exceptions import RayTaskError

    return RayTaskError(
        "chat", "Traceback (most recent call last): ...", cause, proctitle="p", pid=1, ip="127.0.0.1"
    ).as_instanceof_cause()


def _bad_adapter() -> BaseException:
    # Ray 2.60 VLLMEngine.resolve_lora (engines/vllm/vllm_engine.py), raised from
    # LLMServer._run_request before the engine sees the request: the same on decode.
    return _raised_in_replica(ValueError("Failed to load lora model: invalid adapter"))


def test_two_requests_whose_lora_adapter_fails_to_load_leave_the_circuit_closed():
    """Before: each such request counted once per attempt against the circuit, so two of them
    opened it (3 failures to open, 2 attempts each) and every later request of that decode
    replica prefilled locally."""
    from ray.exceptions import ActorDiedError

    circuit = Circuit(10, failures_to_open=2)
    for _ in range(2):
        calls = [FakeStream([_bad_adapter()]), FakeStream(["kv"])]
        retries = []
        out = run(
            remote_prefill(
                lambda calls=calls: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append
            )
        )
        # Not retried (another replica fails it alike); decode runs it and answers as an
        # aggregated engine would.
        assert out.reason is Reason.REQUEST_ERROR and out.path is Path.LOCAL
        assert len(calls) == 1 and retries == []
    assert not circuit.is_open
    assert Reason.REQUEST_ERROR in Reason.designed_local()  # not the stack running aggregated
    # A dead tier still opens it.
    for _ in range(2):
        run(
            remote_prefill(
                lambda: FakeStream([ActorDiedError()]), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=print
            )
        )
    assert circuit.is_open


def test_an_adapter_ray_cannot_find_is_the_clients_404_and_not_a_fault():
    from fastapi import HTTPException

    from serving import ray_internals as ri

    # Ray 2.60 utils/lora_serve_utils.py get_lora_finetuned_context_length: no adapter config.
    missing = _raised_in_replica(HTTPException(404, 'Unable to find LoRA adapter config file "adapter_config.json"'))
    circuit = Circuit(10, failures_to_open=1)
    calls = [FakeStream([missing]), FakeStream(["kv"])]
    out = run(remote_prefill(lambda: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=print))
    assert isinstance(out.refusal, ri.ErrorResponse) and out.refusal.error.code == 404
    assert "adapter_config.json" in out.refusal.error.message
    assert len(calls) == 1 and not circuit.is_open


def test_a_dead_prefill_engine_is_the_tiers_failure():
    from vllm.v1.engine.exceptions import EngineDeadError

    circuit = Circuit(10, failures_to_open=2)
    calls = [FakeStream([_raised_in_replica(EngineDeadError())]), FakeStream([_raised_in_replica(EngineDeadError())])]
    retries = []
    out = run(remote_prefill(lambda: calls.pop(0), is_error=is_err, cfg=CFG, circuit=circuit, on_retry=retries.append))
    assert out.reason is Reason.ERROR and retries == [Reason.ERROR]
    assert circuit.is_open


class _Answering(FakeStream):
    """Taken at once, answered `after_s` later."""

    def __init__(self, after_s: float):
        super().__init__(["kv"])
        self.after_s = after_s

    async def __anext__(self):
        await asyncio.sleep(self.after_s)
        return await super().__anext__()


def test_a_long_prompt_past_the_fixed_deadline_within_its_scaled_one_is_answered_not_counted():
    # 1 ms per prompt token: a 300-token prompt may take 0.2 + 0.3 s; it takes 0.35 s.
    cfg = CFG.model_copy(update={"prefill_timeout_per_token_ms": 1.0})
    circuit = Circuit(10, failures_to_open=1)
    answer_s = cfg.prefill_timeout_s + 0.15

    async def go():
        long = await remote_prefill(
            lambda: _Answering(answer_s), is_error=is_err, cfg=cfg, circuit=circuit, on_retry=print, prompt_tokens=300
        )
        assert long.chunk == "kv" and long.path is Path.REMOTE and not circuit.is_open
        # The same answer time for a short prompt is a stall: counted (the circuit opens).
        return await remote_prefill(
            lambda: _Answering(answer_s), is_error=is_err, cfg=cfg, circuit=circuit, on_retry=print
        )

    short = run(go())
    assert short.path is Path.LOCAL and circuit.is_open


def test_the_prefill_deadline_grows_with_the_prompt_and_stops_at_the_total_deadline():
    from serving.engines.prefill_hop import prefill_deadline_s

    cfg = CFG.model_copy(update={"prefill_timeout_per_token_ms": 0.5})
    assert prefill_deadline_s(cfg, 0) == cfg.prefill_timeout_s
    assert prefill_deadline_s(cfg, 1000) == pytest.approx(cfg.prefill_timeout_s + 0.5)
    assert prefill_deadline_s(cfg, 10**9) == cfg.total_timeout_s


def test_the_prompt_tokens_bound_is_at_least_what_a_byte_level_bpe_tokenizer_makes():
    """The deadline must not be shorter than the prompt needs: the bound counts one token per
    UTF-8 byte of text, and a byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's; the local
    tiny model's, local/tiny_model.py) makes at most that many."""
    import types

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from serving.engines.prefill_hop import prompt_tokens_bound

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer=trainer)

    def req(**kw):
        return types.SimpleNamespace(**{"prompt": None, "messages": None, **kw})

    for text in ("the quick brown fox", "héllo wörld", "日本語のテキスト", "emoji 🦊🦊 and \x00 bytes", "x" * 5000):
        assert prompt_tokens_bound(req(prompt=text)) >= len(tok.encode(text).ids), text
    assert prompt_tokens_bound(req(prompt=[5, 6, 7])) == 3  # token ids: counted as they are
    assert prompt_tokens_bound(req(prompt=[[5, 6], [7]])) == 3
    assert prompt_tokens_bound(req(prompt=["ab", "cde"])) == 5
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    assert prompt_tokens_bound(req(messages=chat)) == len("be brief") + len("hi")  # text parts only
