"""Where two profiled steps differ: the per-kernel tables that ``hydra-lm bench --profile DIR`` writes on CUDA
(``kernels_ARCH.csv``), compared by category and by kernel. Inductor numbers its kernels per graph, so a kernel of
the same code can carry another suffix in each run: names are matched with the trailing ``_N`` dropped.

    python benchmarks/kernel_table_diff.py A/kernels_hydra.csv B/kernels_hydra.csv [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict


def load(path: str) -> dict[str, list]:
    """kernel name without inductor's suffix -> [ms per step, launches per step, category]."""
    table: dict[str, list] = defaultdict(lambda: [0.0, 0.0, ""])
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            entry = table[re.sub(r"_\d+$", "", row["kernel"])]
            entry[0] += float(row["ms_per_step"])
            entry[1] += float(row["launches_per_step"])
            entry[2] = row["category"]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--top", type=int, default=40, help="kernels with the largest differences to list")
    args = parser.parse_args()
    a, b = load(args.a), load(args.b)
    empty = [0.0, 0.0, ""]
    categories: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for side, table in ((0, a), (2, b)):
        for ms, calls, category in table.values():
            categories[category][side] += ms
            categories[category][side + 1] += calls
    print(f"{'category':<18}{'A ms':>9}{'A calls':>9}{'B ms':>9}{'B calls':>9}{'B - A ms':>10}")
    for category, (ams, acalls, bms, bcalls) in sorted(categories.items(), key=lambda kv: kv[1][0] - kv[1][2]):
        print(f"{category:<18}{ams:9.3f}{acalls:9.0f}{bms:9.3f}{bcalls:9.0f}{bms - ams:10.3f}")
    print(f"{'total':<18}{sum(v[0] for v in categories.values()):9.3f}{'':9}"
          f"{sum(v[2] for v in categories.values()):9.3f}")
    names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, empty)[0] - a.get(n, empty)[0]))
    for name in names[:args.top]:
        x, y = a.get(name, empty), b.get(name, empty)
        print(f"{y[0] - x[0]:8.3f}  A {x[0]:7.3f} x{x[1]:<4.0f} B {y[0]:7.3f} x{y[1]:<4.0f} {x[2] or y[2]:<16}"
              f"{name[:120]}")


if __name__ == "__main__":
    main()
