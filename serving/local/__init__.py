"""Local-only serving code: `make serve` on this machine's CPU with a tiny model built here.

Nothing under serving/local/ ships to the cluster (`infra.package` leaves it out).
"""
