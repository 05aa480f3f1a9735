#!/usr/bin/env bash
# Run `hydra-lm compare` studies on a lent GPU machine across several short device calls.
#
# A lent machine is given back after ~30 s without a call, and one call may run 10 minutes, so a study
# runs detached (it survives between calls while the machine stays warm) and each following call polls it
# and is issued at once. What comes back is one tarball (a call returns a limited number of files).
#
#   bash benchmarks/device_compare.sh start DATA OUT [compare flags...]   # detached; queued behind others
#   CUDA_VISIBLE_DEVICES=2,3 bash benchmarks/device_compare.sh start ...  # the same, in the lane of GPUs 2-3
#   bash benchmarks/device_compare.sh poll OUT [SECONDS]                  # progress; packs OUT into $OUT
#
# start: returns at once, with a snapshot of src (OUT.src) that the study imports. The study waits for
#   every study started before it in its lane (a ticket per start, taken in order under the lane's lock,
#   so a lane's studies never share its GPUs and run in the order they were started), then, when DATA
#   holds no prepared corpus, builds one from the machine's source code (python_source_corpus.sh DATA 900
#   code: ~218M tokens on the device image, 2 minutes; one lane builds it, the others wait for it), then
#   runs the compare. A lane is the CUDA_VISIBLE_DEVICES the
#   study is started with (unset: one lane, every GPU): lanes on disjoint GPUs run at once, so a study can
#   be queued on two GPUs while another runs on the other two, without stopping anything. A lane's study
#   is pinned to its share of the host's cores (cores x its GPUs / all GPUs, `taskset`), which compare
#   divides among its runs, so lanes do not compile on each other's cores.
# poll: prints each run's last training and evaluation lines, waits up to SECONDS (default 0) for the
#   study to end, then writes $OUT/OUT_NAME.tgz (report, results, plots, run logs) when $OUT is set.
#   Run nothing else on the host during a seconds budget: other jobs' compilation makes the training
#   runs' tokens/s waver (benchmarks/BENCHMARKS.md, fifteenth session).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lane=${CUDA_VISIBLE_DEVICES:-all}
lane=${lane//[^0-9a-zA-Z]/_}
lock=${TMPDIR:-/tmp}/hydra_device_compare.$lane.lock
tickets=${TMPDIR:-/tmp}/hydra_device_compare.$lane.tickets
cmd=${1:?usage: device_compare.sh start DATA OUT [compare flags...] | poll OUT [SECONDS]}
shift

# The cores of the lane's GPUs' share of the host ("" when there is no lane, or no taskset / nvidia-smi).
lane_cpus() {
  [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && command -v taskset >/dev/null && command -v nvidia-smi >/dev/null || return 0
  local n per g out=""
  n=$(nvidia-smi -L | wc -l)
  [ "$n" -gt 0 ] || return 0
  per=$(($(nproc) / n))
  [ "$per" -gt 0 ] || return 0
  for g in ${CUDA_VISIBLE_DEVICES//,/ }; do
    [[ "$g" =~ ^[0-9]+$ ]] || return 0  # GPU UUIDs: no pinning
    out+="${out:+,}$((g * per))-$((g * per + per - 1))"
  done
  echo "$out"
}

case "$cmd" in
  start)
    data=${1:?start needs DATA}; out=${2:?start needs OUT}
    mkdir -p "$(dirname "$out")" "$tickets"
    # A waiting flock is not first come, first served: the tickets keep the order of the starts.
    ticket=$(date +%s%N); touch "$tickets/$ticket"
    # The study imports hydra_lm from a snapshot of src: the next device call re-sends the working tree, and a
    # study importing from it meanwhile once failed with a module missing (fifty-eighth session).
    rm -rf "$out.src"; cp -r "$here/../src" "$out.src"
    setsid nohup bash "$here/device_compare.sh" run "$ticket" "$@" >"$out.log" 2>&1 < /dev/null &
    echo "study queued in lane $lane (pid $!): log $out.log; poll with: bash $0 poll $out SECONDS"
    ;;
  run)  # what start runs: waits for its turn in the lane, then holds the lane's lock while it runs
    ticket=$1; data=$2; out=$3; shift 3
    export PYTHONPATH="$out.src${PYTHONPATH:+:$PYTHONPATH}"
    exec 9>"$lock"
    while flock 9 && [ "$(ls "$tickets" | sort -n | head -1)" != "$ticket" ]; do flock -u 9; sleep 2; done
    trap 'rm -f "$tickets/$ticket"' EXIT
    trap 'exit 143' INT TERM
    # One lane builds a missing corpus; a lane that finds it being built waits, then finds it built.
    mkdir -p "$(dirname "$data")"
    flock "$data.lock" bash -c '[ -f "$1/meta.json" ] || bash "$2/python_source_corpus.sh" "$1" 900 code' _ "$data" "$here"
    mkdir -p "$out"
    cpus=$(lane_cpus)
    pin=()
    [ -z "$cpus" ] || { pin=(taskset -c "$cpus"); echo "lane $lane: cores $cpus"; }
    "${pin[@]}" python -m hydra_lm compare --data "$data" --out "$out" "$@"
    ;;
  poll)
    out=${1:?poll needs OUT}; wait_s=${2:-0}
    # queued (waiting for the lock), preparing data, or training
    running() { pgrep -f -- "(device_compare.sh run [0-9]+ [^ ]+|compare --data [^ ]+ --out) $out( |$)" >/dev/null; }
    end=$((SECONDS + wait_s))
    while running && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    for log in "$out"/runs/*/train.log; do
      [ -f "$log" ] || continue
      echo "== $(basename "$(dirname "$log")")"
      grep -E " step +[0-9]+/" "$log" | tail -1 | cut -c1-150 || true
      grep -E "eval step [0-9]+: val loss" "$log" | tail -1 | cut -c1-150 || true
    done
    if running; then echo "study: still running or queued"; else echo "study: ended"; tail -5 "$out.log"; fi
    if [ -n "${OUT:-}" ]; then
      (cd "$out" && tar czf "$OUT/$(basename "$out").tgz" --ignore-failed-read \
        report.md results.json ./*.png compare*.log runs/*/train.log runs/*/metrics.jsonl 2>/dev/null) || true
      echo "packed: $OUT/$(basename "$out").tgz"
    fi
    ;;
  *) echo "device_compare.sh: start or poll, not $cmd" >&2; exit 2 ;;
esac
