#!/usr/bin/env python3
"""Draws the memory of a `perch soak` run (its printed table) as an SVG line chart.

Usage: python3 scripts/soak_graph.py SOAK_OUTPUT.txt OUT.svg
Needs matplotlib (`pip install matplotlib`; not part of the tests). Plots, per minute, the process's
resident memory, MLX's live arrays (active) and MLX's cache of freed buffers, in MiB, and prints resident
memory's mean over each half of the run and its least-squares trend.
"""

import re
import sys

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

# A row: minute, finished, cancelled, errors, gen tok/s, then "N MiB" for active, peak, cache, RSS.
ROW = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s+\d+\s+\d+\s+\d+\s+[\d.]+\s+(\d+) MiB\s+\d+ MiB\s+(\d+) MiB\s+(\d+) MiB"
)


def read(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = ROW.match(line)
            if m:
                minute, active, cache, rss = m.groups()
                rows.append((float(minute), int(active), int(cache), int(rss)))
    if not rows:
        sys.exit(f"{path}: no rows of a perch soak table")
    return rows


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rows = read(sys.argv[1])
    minutes = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    for column, label in [(3, "resident memory (RSS)"), (1, "MLX active"), (2, "MLX cache")]:
        ax.plot(minutes, [r[column] for r in rows], label=label, linewidth=1.6)
    ax.set_xlabel("minute")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    ax.set_title("perch soak: memory each minute")
    fig.tight_layout()
    fig.savefig(sys.argv[2], metadata={"Date": None})
    middle = minutes[-1] / 2
    halves = [[r[3] for r in rows if r[0] <= middle], [r[3] for r in rows if r[0] > middle]]
    first, second = (sum(h) / len(h) if h else float("nan") for h in halves)
    mean_t = sum(minutes) / len(minutes)
    mean_rss = sum(r[3] for r in rows) / len(rows)
    spread = sum((t - mean_t) ** 2 for t in minutes)
    slope = sum((t - mean_t) * (r[3] - mean_rss) for t, r in zip(minutes, rows)) / spread if spread else 0.0
    print(f"RSS mean {first:.0f} MiB over the first half, {second:.0f} over the second "
          f"({100 * (second - first) / first:+.1f}%); trend {slope:+.2f} MiB a minute; "
          f"range {min(r[3] for r in rows)}-{max(r[3] for r in rows)} MiB")


if __name__ == "__main__":
    main()
