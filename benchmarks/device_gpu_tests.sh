#!/usr/bin/env bash
# Every GPU test (`-m gpu`) of this tree, split over the machine's GPUs (test i on GPU i mod N), one
# pytest per GPU at the same time: 40 tests in ~5-7.5 minutes on 4 H100s, against the 10-minute limit of
# one device call for a single GPU.
#   bash benchmarks/device_gpu_tests.sh [N_GPUS] [extra pytest args]
# GPU_IDS="2 3" picks the GPUs (then N_GPUS is their count), leaving the others to other jobs.
# PART=i/n runs only the i-th of n shares of the tests (every n-th from the i-th, i from 1): on one GPU the whole
# set takes over 20 minutes (fifty-third session), so PART=1/3, 2/3, 3/3 in three device calls run it all.
# Logs to $OUT/gpu_tests_gG.log (when set, else ./gpu_test_logs); prints each GPU's summary line last.
# The device image lacks pytorch-optimizer (an install dependency: the Lion test fails without it), torchao and
# liger-kernel (their tests skip): carry them as wheels in .whl and install them first (the device tool's README).
set -uo pipefail
n=${1:-$(nvidia-smi -L | wc -l)}
shift || true
read -r -a gpus <<< "${GPU_IDS:-$(seq -s ' ' 0 $((n - 1)))}"
n=${#gpus[@]}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/gpu_test_logs}
mkdir -p "$out"
cd "$here"
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/ 2>/dev/null | grep "::" > "$out/gpu_test_ids.txt"
if [ -n "${PART:-}" ]; then
  part=${PART%/*} parts=${PART#*/}
  if ! [[ "$part" =~ ^[0-9]+$ && "$parts" =~ ^[0-9]+$ ]] || [ "$part" -lt 1 ] || [ "$part" -gt "$parts" ]; then
    echo "PART=$PART: give i/n with 1 <= i <= n, e.g. PART=2/3" >&2
    exit 2
  fi
  awk -v i="$part" -v n="$parts" '(NR - 1) % n == i - 1' "$out/gpu_test_ids.txt" > "$out/gpu_test_ids.part"
  mv "$out/gpu_test_ids.part" "$out/gpu_test_ids.txt"
fi
echo "$(wc -l < "$out/gpu_test_ids.txt") GPU tests over GPUs ${gpus[*]}"
for i in $(seq 0 $((n - 1))); do
  g=${gpus[$i]}
  mapfile -t ids < <(awk -v i="$i" -v n="$n" '(NR - 1) % n == i' "$out/gpu_test_ids.txt")
  [ "${#ids[@]}" -gt 0 ] || continue
  CUDA_VISIBLE_DEVICES=$g python -m pytest -v -p no:cacheprovider -m gpu "$@" "${ids[@]}" > "$out/gpu_tests_g$g.log" 2>&1 &
done
wait
for g in "${gpus[@]}"; do
  [ -f "$out/gpu_tests_g$g.log" ] && echo "GPU $g: $(tail -1 "$out/gpu_tests_g$g.log")"
done
