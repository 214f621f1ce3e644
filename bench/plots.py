"""PNG plots of the benchmarks, next to their JSON (matplotlib, no display needed).

What flows through here: the report `make bench` writes (build/bench/serving.json, with the
per-request samples under "samples") -> `serving_png()`: per target, the distribution of TTFT
and TPOT at each concurrency (empirical CDFs, log time axis) -> serving.png beside the JSON.
(`make chaos` prints tables and writes JSON only: its figures are counts per phase.)
`python -m bench.plots build/bench/serving.json` redraws a saved report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

DPI = 90


def _ecdf(ax, values: list[float], label: str) -> None:
    xs = sorted(v for v in values if v > 0)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def serving_png(report: dict[str, Any], out: Path) -> Path:
    """TTFT and TPOT distributions per target (rows: metric; columns: target)."""
    samples: dict[str, dict[str, dict[str, list[float]]]] = report["samples"]
    targets = list(samples)
    fig, axes = plt.subplots(2, len(targets), figsize=(4.2 * len(targets), 6.4), squeeze=False, sharey=True)
    for col, target in enumerate(targets):
        for row, (key, title) in enumerate((("ttft_s", "TTFT"), ("tpot_s", "TPOT"))):
            ax = axes[row][col]
            for conc, per in sorted(samples[target].items(), key=lambda kv: int(kv[0])):
                _ecdf(ax, per[key], f"concurrency {conc}")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: readable
            ax.set_title(f"{target}: {title}")
            ax.set_xlabel("seconds (log)")
            ax.grid(True, which="both", alpha=0.3)
            if col == 0:
                ax.set_ylabel("share of requests")
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"make bench: {report['workload']['requests_total']} requests, "
        f"{report['machine']['cpus']} CPUs (distribution per target and concurrency)",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m bench.plots <serving.json>", file=sys.stderr)
        return 2
    path = Path(args[0])
    png = serving_png(json.loads(path.read_text()), path.with_suffix(".png"))
    print(f"PNG: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
