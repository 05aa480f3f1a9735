#!/usr/bin/env bash
# A/B of a change's training speed on one GPU: `hydra-lm bench` from this tree (A) and from another
# tree (B, e.g. the branch: `git archive BRANCH | tar x -C DIR`), alternately, A B A B ..., on the same
# GPU. Each tree keeps its own inductor cache, so round 1 also times the cold compile and later rounds
# are warm. One GPU, one run at a time: no card-to-card or shared-host difference enters the ratio (on an
# H100 a tree's two rounds agreed within 0.1%, benchmarks/BENCHMARKS.md, twenty-seventh session).
#   bash benchmarks/device_ab.sh OTHER_TREE ROUNDS [bench flags...]
# Writes each run's log and JSON to $OUT (when set, else ./ab_runs) and prints a table last (with
# `--inference`, each run's decode tokens/s per batch too). AB_SHARED_CACHE=1: both trees share one inductor
# cache, so only the first run compiles cold (where the change leaves the compiled graphs alone: a shorter call).
# AB_COLD=1: every run gets empty inductor and Triton caches of its own, so every round times the cold first step
# (a change to the compile's start-up: compare the first steps, whose run-to-run spread on one H100 host was 55-62 s,
# benchmarks/BENCHMARKS.md, seventy-sixth session).
set -uo pipefail
other=$(cd "${1:?usage: device_ab.sh OTHER_TREE ROUNDS [bench flags...]}" && pwd)
rounds=${2:?ROUNDS}
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/ab_runs}
mkdir -p "$out"
caches=$(mktemp -d)
for round in $(seq "$rounds"); do
  for side in A B; do
    tree=$here; [ "$side" = B ] && tree=$other
    cache=$caches/$side; [ "${AB_SHARED_CACHE:-0}" = 1 ] && cache=$caches/shared
    [ "${AB_COLD:-0}" = 1 ] && cache=$caches/${side}_$round
    (cd "$tree" && TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton_kernels \
      PYTHONPATH="$tree/src${PYTHONPATH:+:$PYTHONPATH}" \
      python -m hydra_lm bench "$@" --json "$out/ab_${side}_$round.json" > "$out/ab_${side}_$round.log" 2>&1) \
      || echo "$side round $round failed: $out/ab_${side}_$round.log"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
print(f"{'run':<6}{'arch':<7}{'tokens/s':>12}{'ms/step':>9}{'peak GB':>9}{'first step s':>14}")
means, firsts = {}, {}
for r in range(1, rounds + 1):
    for side in "AB":
        path = out / f"ab_{side}_{r}.json"
        if not path.exists():
            print(f"{side} {r:<4}failed")
            continue
        for row in json.loads(path.read_text())["rows"]:
            means.setdefault((side, row["arch"]), []).append(row["tokens_per_s"])
            firsts.setdefault((side, row["arch"]), []).append(row["first_step_s"])
            peak = row.get("peak_memory_gb")
            decode = [(k.rsplit("batch", 1)[1], v) for k, v in row.items() if k.startswith("decode_tokens_per_s_batch")]
            print(f"{side} {r:<4}{row['arch']:<7}{row['tokens_per_s']:>12,.0f}{row['step_ms']:>9.1f}"
                  f"{'-' if peak is None else f'{peak:.1f}':>9}{row['first_step_s']:>14.1f}"
                  + ("  decode " + " / ".join(f"b{b} {v:,.0f}" for b, v in decode) if decode else "")
                  + (f"  ({row['parallel_compile']})" if row.get("parallel_compile") else ""))
for (side, arch), v in sorted(means.items()):
    if side == "B" and ("A", arch) in means:
        a = sum(means[("A", arch)]) / len(means[("A", arch)])
        print(f"{arch}: B/A {sum(v) / len(v) / a:.4f} (mean tokens/s over {len(v)} rounds)")
        fa, fb = firsts[("A", arch)], firsts[("B", arch)]
        print(f"{arch}: first step B - A {sum(fb) / len(fb) - sum(fa) / len(fa):+.1f} s (means; A {min(fa):.1f}-"
              f"{max(fa):.1f}, B {min(fb):.1f}-{max(fb):.1f})")
PY
