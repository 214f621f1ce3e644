"""bench/prefill_mode.py: reading the serving mode from Ray's metrics pages (no Ray)."""

from __future__ import annotations

from bench.prefill_mode import PATH_METRIC, ModeSampler, by_path, path_counts, path_delta, remote_share


def page(remote: float, retry: float, local: float) -> str:
    # As Ray 2.60 exports a Serve Counter (written by hand from a scrape of the local stack).
    return (
        f"# HELP {PATH_METRIC} P/D requests by how they were prefilled.\n"
        f"# TYPE {PATH_METRIC} counter\n"
        f'{PATH_METRIC}{{Component="core_worker",model="tiny-llama",path="remote",reason=""}} {remote}\n'
        f'{PATH_METRIC}{{Component="core_worker",model="tiny-llama",path="remote_retry",reason=""}} {retry}\n'
        f'{PATH_METRIC}{{Component="core_worker",model="tiny-llama",path="local",reason="circuit_open"}} {local}\n'
        "# HELP ray_other_total x\n# TYPE ray_other_total counter\nray_other_total 99.0\n"
    )


def test_counts_are_summed_over_nodes_and_other_metrics_ignored():
    counts = path_counts([page(3, 1, 2), page(4, 0, 0)])
    assert by_path(counts) == {"remote": 7, "remote_retry": 1, "local": 2}


def test_local_prefills_between_two_readings_by_path_and_by_reason():
    before = {"remote||r1|0": 10, "local|prefill_down|r1|0": 1}
    after = {"remote||r1|0": 12, "local|prefill_down|r1|0": 4, "local|prefill_down|r2|0": 2}
    assert path_delta(before, after) == {"remote": 2, "local": 5}
    assert path_delta(before, {}) == {}  # a series Ray stopped exporting did not fall
    assert path_delta(before, after, by_reason=True) == {"remote/": 2, "local/prefill_down": 5}


def test_remote_share_is_of_the_requests_between_two_readings():
    share, n = remote_share({"remote": 10, "local": 5}, {"remote": 13, "remote_retry": 1, "local": 5})
    assert n == 4 and share == 1.0
    share, n = remote_share({"remote": 10, "local": 5}, {"remote": 11, "local": 8})
    assert n == 4 and share == 0.25
    assert remote_share({"remote": 1}, {"remote": 1}) == (None, 0.0)


def test_a_series_ray_stopped_exporting_is_not_read_as_a_fall():
    # Ray ages out a counter that is no longer incremented: the local series of the outage
    # disappears from later pages while remote requests go on.
    before = path_counts([page(10, 0, 40)])
    after = path_counts(
        [page(18, 0, 0).replace(f'{PATH_METRIC}{{Component="core_worker",model="tiny-llama",path="local"', "#")]
    )
    share, n = remote_share(before, after)
    assert n == 8 and share == 1.0


def _sampler(samples):
    s = ModeSampler([], 0.0)
    s.samples = samples
    return s


def test_a_stack_that_stays_aggregated_never_counts_as_back():
    # Requests keep succeeding but every one is prefilled locally: the 2026-12-01 defect.
    samples = [(float(t), {"remote": 50.0, "local": 4.0 * t}) for t in range(0, 60, 2)]
    assert _sampler(samples).back_to_remote_after(10.0) is None


def test_back_to_remote_is_the_first_window_at_the_target_after_recovery():
    samples = []
    for t in range(0, 60, 2):
        local = 4.0 * min(t, 30)  # local prefill until t = 30, remote from then on
        remote = 4.0 * max(0, t - 30)
        samples.append((float(t), {"remote": remote, "local": local}))
    back = _sampler(samples).back_to_remote_after(20.0)
    assert back == 10.0  # the window starting at t = 30
