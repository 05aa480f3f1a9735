#!/bin/bash
# issue 12: equal-time compare at 100M (one seed)
cd "$(dirname "$0")/.." ; export PYTHONPATH=$PWD/src
SEED=${SEED:-0}; BUDGET=${BUDGET:-40}
T0=$(date +%s)
bash benchmarks/python_source_corpus.sh /tmp/gpudata 80 > $OUT/prepare.log 2>&1; echo "data $(( $(date +%s)-T0 ))s"
EARLY="mod_enable_pct=0.0,mod_force_enable_pct=0.0,mor_enable_pct=0.0"
python -m hydra_lm compare --data /tmp/gpudata --out /tmp/cmp --budget seconds=$BUDGET --model_size 100M \
  --batch_size 16 --seq_len 1024 --grad_accum 1 --seed $SEED --eval_batches 16 --evals 4 --experimental_skip_pretest \
  --variants hydra dense dense-flops "$@" > $OUT/compare.log 2>&1
echo "compare rc=$? $(( $(date +%s)-T0 ))s"
cd /tmp/cmp && tar czf $OUT/cmp.tgz report.md results.json *.png runs/*/metrics.jsonl runs/*/config.json 2>/dev/null
grep -v "^step\|it/s" $OUT/compare.log | tail -30
