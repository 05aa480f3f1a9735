"""Train one model per routing setting for the same steps on the same data; tabulate the final causal
and top-k validation losses, their gap, top-k/threshold agreement, speed and training seconds.

    python benchmarks/routing_grid.py --data DATA --out DIR --cells r2_c0.5_e1 r4_c0.75_e2 tc dense

A cell name is ``r{recursions}_c{capacity}_e{mod_every}`` (expert-choice MoR), ``tc`` (token-choice MoR
at the preset's routing), ``preset`` or ``dense`` (the equal-width dense baseline), optionally with
``@dL`` for a dense depth (``dense@d12``). Each cell is an ordinary ``hydra-lm train`` run in
DIR/runs/NAME (an interrupted grid resumes); one JSON line per finished cell goes to DIR/grid.jsonl.
Extra train flags follow ``--``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import median

CELL = re.compile(r"^r(\d+)_c([0-9.]+)_e(\d+)$")


def cell_flags(name: str) -> list[str]:
    if name == "preset":
        return []
    if name == "tc":
        return ["--model.mor_routing", "token"]
    if name.startswith("dense"):
        depth = name.partition("@d")[2]
        return ["--arch", "dense"] + (["--model.n_layers", depth] if depth else [])
    m = CELL.match(name)
    if not m:
        raise SystemExit(f"unknown cell {name!r}: use r{{R}}_c{{capacity}}_e{{mod_every}}, tc, preset or dense[@dL]")
    r, c, e = m.groups()
    return ["--model.recursions", r, "--model.mod_capacity", c, "--model.mod_every", e]


def summarize(name: str, run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    last = evals[-1]
    speeds = [r["tokens_per_s"] for r in train[len(train) // 3:]]  # past compilation and capture
    row = {"cell": name, "step": last["step"], "val_loss_causal": last["val_loss_causal"],
           "val_loss_topk": last["val_loss_topk"], "gap": last["val_loss_causal"] - last["val_loss_topk"],
           "agreement": last.get("val_agreement"), "exec_causal": last.get("val_exec_frac_causal"),
           "exec_topk": last.get("val_exec_frac_topk"), "tokens_per_s": median(speeds),
           "train_s": train[-1].get("train_s"), "memory_mb": max(r.get("memory_mb") or 0 for r in train),
           "mfu": median(r.get("mfu") or 0 for r in train[len(train) // 3:]),
           "evals": [(r["step"], r["val_loss_causal"], r["val_loss_topk"]) for r in evals]}
    if "routing" in last:
        row["worst_router"] = max(last["routing"].items(), key=lambda kv: abs(kv[1]["exec_causal"] - kv[1]["target"]))
    return row


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", nargs="+", required=True)
    p.add_argument("--model_size", default="100M")
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.cells:
        run = out / "runs" / name
        cmd = [sys.executable, "-m", "hydra_lm", "train", "--data", args.data, "--out", str(run),
               "--model_size", args.model_size, "--max_steps", str(args.steps), "--save_every", str(args.steps),
               *cell_flags(name), *extra]
        print("+", " ".join(cmd), flush=True)
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        if rc != 0:
            print(f"{name}: exit {rc}; see {out / f'{name}.log'}", flush=True)
            continue
        row = summarize(name, run)
        row["command"] = " ".join(cmd[1:])
        rows.append(row)
        with open(out / "grid.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'cell':<14} {'causal':>7} {'top-k':>7} {'gap':>7} {'agree':>6} {'exec c/t':>11} {'tok/s':>9} "
          f"{'train_s':>7} {'GB':>5}")
    for r in rows:
        agree = f"{100 * r['agreement']:.1f}" if r["agreement"] is not None else "-"
        execs = f"{r['exec_causal']:.3f}/{r['exec_topk']:.3f}" if r["exec_causal"] is not None else "-"
        print(f"{r['cell']:<14} {r['val_loss_causal']:7.4f} {r['val_loss_topk']:7.4f} {r['gap']:+7.4f} {agree:>6} "
              f"{execs:>11} {r['tokens_per_s']:9,.0f} {r['train_s'] or 0:7.1f} {r['memory_mb'] / 1024:5.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
