#!/bin/bash
# issue 14 compiled decode; issue 12: MoD-only at the best dense depth, two seeds
cd "$(dirname "$0")/.." ; export PYTHONPATH=$PWD/src
T0=$(date +%s)
(bash benchmarks/python_source_corpus.sh /tmp/gpudata 80 > $OUT/prepare.log 2>&1) &
timeout 170 python -m hydra_lm bench --model_size 100M --arch both --no-compile --no-cuda_graph --steps 2 --warmup 1 --inference --decode_batches 1,32 --json $OUT/decode_compiled.json > $OUT/decode.log 2>&1
echo "decode rc=$? $(( $(date +%s)-T0 ))s"; grep -i "inference\|arch\|error" $OUT/decode.log | tail -6
wait
for SEED in 0 1; do
  V=(--variant "mod_b5:recursions=1,n_blocks=5"); [ $SEED = 1 ] && V+=(--variant "d5:arch=dense,n_layers=5")
  python -m hydra_lm compare --data /tmp/gpudata --out /tmp/cmp$SEED --budget seconds=40 --model_size 100M \
    --batch_size 16 --seq_len 1024 --grad_accum 1 --seed $SEED --eval_batches 16 --evals 4 --experimental_skip_pretest \
    "${V[@]}" > $OUT/compare$SEED.log 2>&1
  echo "compare seed $SEED rc=$? $(( $(date +%s)-T0 ))s"; grep -A6 "^variant " $OUT/compare$SEED.log
done
