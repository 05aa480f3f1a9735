#!/usr/bin/env bash
# Issue 14's speed targets on one GPU, each part within one device call's 10 minutes (cold inductor caches,
# so the first steps are cold first steps), then a table of every target met or missed from the JSON
# reports found in $OUT (when set, else ./target_runs): with the parts' reports copied into one folder,
# `OUT=folder bash benchmarks/device_targets.sh table` fills the whole table.
#   bash benchmarks/device_targets.sh preset    # 100M bench defaults, both archs: tokens/s, MFU, cold first
#                                               # step, routing efficiency, decoding at batch 1/8/32/128
#   bash benchmarks/device_targets.sh memory    # 100M at vocabulary 8,192, both archs: peak memory of the
#                                               # trainer's step; then capacity 0.5 on every block: routing efficiency
#   bash benchmarks/device_targets.sh 1B        # the 1B preset's MFU
#   bash benchmarks/device_targets.sh decode    # HYDRA's decoding with its decisions read back to the host,
#                                               # against the preset part's (CUDA graph IF nodes)
#   bash benchmarks/device_targets.sh table     # the table alone
set -uo pipefail
part=${1:?usage: device_targets.sh preset|memory|1B|decode|table}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/target_runs}
mkdir -p "$out"
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
bench() {  # NAME, then bench flags
  local name=$1; shift
  (cd "$here" && python -m hydra_lm bench --seq_len 1024 --warmup 2 "$@" --json "$out/$name.json" > "$out/$name.log" 2>&1) \
    || echo "$name failed: see $out/$name.log"
}
case $part in
  preset) bench preset --model_size 100M --arch both --routing_efficiency --inference --decode_batches 1,8,32,128 ;;
  memory) bench vocab8192 --model_size 100M --arch both --vocab_size 8192
          bench cap05 --model_size 100M --arch hydra --routing_efficiency --model.mod_capacity 0.5 --model.mod_every 1 ;;
  1B) bench 1B --model_size 1B --arch hydra ;;
  decode) bench readback --model_size 100M --arch hydra --inference --decode_batches 1,8,32,128 \
            --no-decode_device_decisions ;;
  table) ;;
  *) echo "unknown part $part: preset, memory, 1B, decode or table" >&2; exit 2 ;;
esac
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(name):
    path = out / f"{name}.json"
    return {r["arch"]: r for r in json.loads(path.read_text())["rows"]} if path.exists() else {}

preset, small, cap05, big = rows("preset"), rows("vocab8192"), rows("cap05"), rows("1B")
readback = rows("readback").get("hydra", {})
table = []
def target(name, value, goal, ok, fmt):  # ok None: reported, no target
    verdict = "-" if value is None or ok is None else ("met" if ok(value) else "MISSED")
    table.append((name, "-" if value is None else fmt.format(value), goal, verdict))
h, d = preset.get("hydra", {}), preset.get("dense", {})
target("HYDRA 100M tokens/s, bench defaults", h.get("tokens_per_s"), ">= 330,000", lambda v: v >= 330_000, "{:,.0f}")
target("HYDRA 100M executed-FLOP MFU", h.get("mfu"), ">= 40%", lambda v: v >= 0.40, "{:.1%}")
target("HYDRA 100M cold first step", h.get("first_step_s"), "<= 60 s", lambda v: v <= 60, "{:.1f} s")
target("routing efficiency, preset routing", h.get("routing_efficiency"), ">= 90%", lambda v: v >= 0.9, "{:.0%}")
target("routing efficiency, capacity 0.5 every block", cap05.get("hydra", {}).get("routing_efficiency"), ">= 90%",
       lambda v: v >= 0.9, "{:.0%}")
hs, ds = small.get("hydra", {}).get("peak_memory_gb"), small.get("dense", {}).get("peak_memory_gb")
target("trainer-step peak memory, HYDRA / dense (vocab 8,192)", hs / ds if hs and ds else None, "<= 1.5x",
       lambda v: v <= 1.5, "{:.2f}x")
for b in (1, 8, 32, 128):
    key = f"decode_tokens_per_s_batch{b}"
    ratio = h[key] / d[key] if key in h and key in d else None
    targeted = b in (1, 32)
    target(f"decode HYDRA / dense tokens/s, batch {b}", ratio, ">= 1.0x" if targeted else "",
           (lambda v: v >= 1.0) if targeted else None, "{:.2f}x")
for b in (1, 8, 32, 128):  # the preset part's decisions on the device against the decode part's read-backs
    key = f"decode_tokens_per_s_batch{b}"
    ratio = h[key] / readback[key] if key in h and key in readback else None
    target(f"decode, IF nodes / read-backs, batch {b}", ratio, "", None, "{:.2f}x")
target("dense 100M MFU", d.get("mfu"), ">= 40%", lambda v: v >= 0.40, "{:.1%}")
target("HYDRA 1B MFU", big.get("hydra", {}).get("mfu"), ">= 40%", lambda v: v >= 0.40, "{:.1%}")
width = max(len(t[0]) for t in table)
for name, value, goal, verdict in table:
    print(f"{name:<{width}}  {value:>12}  {goal:>10}  {verdict}")
PY
