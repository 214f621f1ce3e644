"""Benchmarks of the local serving path (make bench)."""
