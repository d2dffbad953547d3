"""Plot the latency per path from `bench --json FILE`: docs/bench-latency.png.

    .venv-e2b/bin/pip install -r tests/bench/requirements-plot.txt
    .venv-e2b/bin/python tests/bench/plot.py bench.json docs/bench-latency.png

One panel per operation (exec true, exec printing 1 MiB, write/read 1 KiB, write/read 256 MiB),
one horizontal bar per path: the median, hot and cold side by side, with the p99 as a whisker.
Floors are drawn in grey. Log scale: the paths span two orders of magnitude.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

LABELS = {
    "exec_true": "exec true",
    "exec1_m": "exec printing 1 MiB",
    "write1_k": "write 1 KiB",
    "read1_k": "read 1 KiB",
    "write256_m": "write 256 MiB",
    "read256_m": "read 256 MiB",
}


def main(src, dst):
    with open(src) as f:
        rep = json.load(f)
    ops = {}
    for o in rep["ops"]:
        ops.setdefault(o["op"], {})[o["mode"]] = o["paths"]
    names = [k for k in LABELS if k in ops]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.6 + 0.9 * len(names) * 3), squeeze=False)
    for ax, op in zip(axes[:, 0], names):
        modes = ops[op]
        paths = [p["path"] for p in (modes.get("hot") or modes.get("cold"))]
        floors = {p["path"] for p in (modes.get("hot") or modes.get("cold")) if p["floor"]}
        y = list(range(len(paths)))
        h = 0.38
        for k, (mode, color) in enumerate((("hot", "tab:blue"), ("cold", "tab:orange"))):
            if mode not in modes:
                continue
            by = {p["path"]: p for p in modes[mode]}
            med, err, ys, cols = [], [], [], []
            for i, name in enumerate(paths):
                st = (by.get(name) or {}).get("stats")
                if not st:
                    continue
                med.append(st["median_s"] * 1e3)
                err.append(max(st["p99_s"] - st["median_s"], 0) * 1e3)
                ys.append(i + (k - 0.5) * h)
                cols.append("0.6" if name in floors else color)
            ax.barh(ys, med, height=h, color=cols, xerr=[[0] * len(err), err], capsize=2)
        ax.set_yticks(y)
        ax.set_yticklabels(paths, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_title(LABELS[op], fontsize=10)
        ax.grid(axis="x", which="both", alpha=0.3)
        handles = [Patch(color=c, label=f"{m} (median, p99 whisker)")
                   for m, c in (("hot", "tab:blue"), ("cold", "tab:orange")) if m in modes]
        handles.append(Patch(color="0.6", label="floor"))
        ax.legend(handles=handles, fontsize=7, loc="lower right")
    m = rep.get("machine", {})
    fig.suptitle(f"tether bench: latency per path ({m.get('cpu', '')}, {m.get('cpus', '?')} CPUs, "
                 f"{m.get('kernel', '')}); grey = floor", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot.py BENCH.json OUT.png")
    main(sys.argv[1], sys.argv[2])
