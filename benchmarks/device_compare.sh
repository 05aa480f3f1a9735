#!/usr/bin/env bash
# Run `hydra-lm compare` studies on a lent GPU machine across several short device calls.
#
# A lent machine is given back after ~30 s without a call, and one call may run 10 minutes, so a study
# runs detached (it survives between calls while the machine stays warm) and each following call polls it
# and is issued at once. What comes back is one tarball (a call returns a limited number of files).
#
#   bash benchmarks/device_compare.sh start DATA OUT [compare flags...]   # detached; queued behind others
#   bash benchmarks/device_compare.sh poll OUT [SECONDS]                  # progress; packs OUT into $OUT
#
# start: returns at once. The study waits for any study started before it on this host (one lock, so
#   studies never share the GPUs or the host), then, when DATA holds no prepared corpus, builds one from
#   the machine's source code (python_source_corpus.sh DATA 900 code: ~218M tokens on the device image,
#   2 minutes), then runs the compare. Several starts in one call queue several studies in order.
# poll: prints each run's last training and evaluation lines, waits up to SECONDS (default 0) for the
#   study to end, then writes $OUT/OUT_NAME.tgz (report, results, plots, run logs) when $OUT is set.
#   Run nothing else on the host during a seconds budget: other jobs' compilation makes the training
#   runs' tokens/s waver (benchmarks/BENCHMARKS.md, fifteenth session).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lock=${TMPDIR:-/tmp}/hydra_device_compare.lock
cmd=${1:?usage: device_compare.sh start DATA OUT [compare flags...] | poll OUT [SECONDS]}
shift
case "$cmd" in
  start)
    data=${1:?start needs DATA}; out=${2:?start needs OUT}
    mkdir -p "$(dirname "$out")"
    setsid nohup flock "$lock" bash "$here/device_compare.sh" run "$@" >"$out.log" 2>&1 < /dev/null &
    echo "study queued (pid $!): log $out.log; poll with: bash $0 poll $out SECONDS"
    ;;
  run)  # what start runs under the lock
    data=$1; out=$2; shift 2
    [ -f "$data/meta.json" ] || bash "$here/python_source_corpus.sh" "$data" 900 code
    mkdir -p "$out"
    exec python -m hydra_lm compare --data "$data" --out "$out" "$@"
    ;;
  poll)
    out=${1:?poll needs OUT}; wait_s=${2:-0}
    # queued (waiting for the lock), preparing data, or training
    running() { pgrep -f -- "(device_compare.sh run [^ ]+|compare --data [^ ]+ --out) $out( |$)" >/dev/null; }
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
