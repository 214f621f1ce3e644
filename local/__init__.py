"""Local-only serving code: `make serve` on this machine's CPU with a tiny model built here.

It lives outside serving/ (which ships whole, as the cluster's working_dir zip) and may import
infra/ (paths, the instance catalog); serving/ never imports it.
"""
