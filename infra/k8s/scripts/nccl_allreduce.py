"""Two-node NCCL all-reduce bandwidth check: one process per GPU, launched by torchrun.

What flows through here: torchrun's rank variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR)
-> one all-reduce per message size across every GPU of the two nodes -> one line per size
(algorithm and bus bandwidth, as nccl-tests' all_reduce_perf reports them) -> exit status.
It exits non-zero when NCCL did not load the aws-ofi-nccl network plugin (it then falls back to
TCP sockets, ~30x slower, without an error), or when the bus bandwidth of the largest message is
below --min-busbw-gbps.

Shipped in a ConfigMap by infra.k8s.nccl_check (never imported by the Pulumi program); the
tests run it on CPU with the gloo backend. Standard library and torch only.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time


def bus_bandwidth(size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s, nccl-tests' definitions for all-reduce.

    algbw = size / time; busbw = algbw x 2 (n - 1) / n: the bytes each rank's link carries in a
    ring all-reduce, comparable across world sizes (nccl-tests doc/PERFORMANCE.md).
    """
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def _net_used(debug_glob: str) -> str | None:
    """The network NCCL chose, read back from its own debug files ("Using network X")."""
    for path in sorted(glob.glob(debug_glob)):
        with open(path, errors="replace") as f:
            for line in f:
                if "Using network" in line:
                    return line.rsplit("Using network", 1)[1].strip()
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nccl_allreduce")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--sizes-mib", default="1,16,128,1024")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--expect-net", default="Libfabric", help="substring of NCCL's 'Using network ...' line; '' to skip the check"
    )
    p.add_argument("--min-busbw-gbps", type=float, default=0.0)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = "cpu"
    if args.backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group(args.backend)
    failed = False
    results = []
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        n = mib * 1024 * 1024 // 4
        x = torch.ones(n, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up (connections are set up here)
        if args.backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        if args.backend == "nccl":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.iters
        check = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(check)  # sum of 1..world on every rank
        if check[0].item() != world * (world + 1) / 2:
            failed = True
        algbw, busbw = bus_bandwidth(n * 4, dt, world)
        results.append((mib, dt, algbw, busbw))
    if rank == 0:
        print(f"{'size':>10} {'time_us':>10} {'algbw_GB/s':>11} {'busbw_GB/s':>11}  (world {world})")
        for mib, dt, algbw, busbw in results:
            print(f"{mib:>8}Mi {dt * 1e6:>10.1f} {algbw:>11.2f} {busbw:>11.2f}")
    if failed:
        print("FAIL: all-reduce returned wrong values", file=sys.stderr)
    if args.backend == "nccl" and args.expect_net:
        debug = os.environ.get("NCCL_DEBUG_FILE", "")
        net = _net_used(debug.replace("%h", "*").replace("%p", "*")) if debug else None
        if net is None or args.expect_net not in net:
            print(
                f"FAIL: NCCL used network {net!r}, expected {args.expect_net!r} "
                "(is libnccl-net-ofi.so on LD_LIBRARY_PATH and NCCL_NET_PLUGIN=ofi set?)",
                file=sys.stderr,
            )
            failed = True
    if args.min_busbw_gbps and results and results[-1][3] * 8 < args.min_busbw_gbps:
        print(f"FAIL: bus bandwidth {results[-1][3] * 8:.0f} Gbps < {args.min_busbw_gbps:g} Gbps", file=sys.stderr)
        failed = True
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
