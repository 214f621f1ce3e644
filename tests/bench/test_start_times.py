"""make bench's timed `make serve` (bench/start_times.py), dry: what it deploys, built without Ray."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("cache_dir", [None, "/tmp/pd-cold-x"])
def test_the_timed_make_serve_is_the_disaggregated_app(cache_dir):
    from bench.start_times import start_options
    from tests.bench import dry_run

    options = start_options(cache_dir)
    assert options["extra_env"] == ({"PD_CACHE_DIR": cache_dir} if cache_dir else {})
    assert list(dry_run.build(dry_run.plan(options).config)) == ["llm"]
