"""Benchmarks of the local serving path (make bench)."""

from infra.paths import BUILD_DIR

# Where every bench writes its JSON (and bench.report reads it): build/bench/.
BENCH_DIR = BUILD_DIR / "bench"
