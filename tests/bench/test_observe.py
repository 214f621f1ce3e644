"""bench/observe.py: how make bench reads the P/D requests' prefill paths from the decode
node's metrics, as Ray exports the decode replicas' pd_prefill_path counter."""

from __future__ import annotations

from bench import hops, observe, prefill_mode

LABELS = 'application="llm",deployment="Decode:tiny",model="tiny",replica="r1"'


def scrape(**series: float) -> list[hops.Sample]:
    """A decode node's Prometheus text with one pd_prefill_path series per `path_reason=count`
    (Ray prefixes a Serve counter's name with ray_ and exports it as <name>_total)."""
    lines = ["# TYPE ray_pd_prefill_path_total counter"]
    for key, count in series.items():
        path, _, reason = key.partition("__")
        lines.append(f'ray_pd_prefill_path_total{{{LABELS},path="{path}",reason="{reason}"}} {count}')
    lines.append('ray_pd_prefill_retries_total{reason="timeout"} 9.0')  # another counter: not a path
    return hops.parse_prometheus("\n".join(lines) + "\n")


def test_a_level_counts_each_path_between_its_two_scrapes():
    before = scrape(remote=30, local__kv_timeout=2)
    after = scrape(remote=80, remote_retry=3, local__kv_timeout=12, local__no_replica=1)
    mode = observe.serving_mode(before, after)
    assert mode == {"local:kv_timeout": 10, "local:no_replica": 1, "remote": 50, "remote_retry": 3}
    assert prefill_mode.share_of(mode) == (53 / 64, 64)


def test_a_series_ray_stopped_exporting_counts_as_unchanged():
    # Ray ages out a series that stopped moving; its last count must not read as a drop.
    mode = observe.serving_mode(scrape(remote=30, local__kv_timeout=2), scrape(remote=46))
    assert mode == {"remote": 16}


def test_the_line_says_the_remote_share_and_what_the_rest_did_per_level():
    line = observe.serving_mode_line({"1": {"remote": 32}, "16": {"local:kv_timeout": 40, "remote": 88}, "4": {}})
    assert "c1 100% of 32 remote" in line
    assert "c16 69% of 128 remote (local:kv_timeout 40)" in line
    assert "c4 -" in line  # nothing counted (metrics not read): no share made up
