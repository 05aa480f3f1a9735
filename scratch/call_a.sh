#!/bin/bash
# issue 14: the default path on one H100 (bench defaults, routing efficiency, decode), then GPU tests
cd "$(dirname "$0")/.." ; export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log -1 --format=%h 2>/dev/null
T0=$(date +%s)
python -m hydra_lm bench --model_size 100M --arch both --routing_efficiency --inference --decode_batches 1,32 --json $OUT/bench_default.json > $OUT/bench_default.log 2>&1
echo "bench default rc=$? $(( $(date +%s)-T0 ))s"; tail -25 $OUT/bench_default.log
T0=$(date +%s)
python -m hydra_lm bench --model_size 100M --arch hydra --routing_efficiency --model.mod_capacity 0.5 --model.mod_every 1 --json $OUT/bench_anchor.json > $OUT/bench_anchor.log 2>&1
echo "bench anchor rc=$? $(( $(date +%s)-T0 ))s"; tail -8 $OUT/bench_anchor.log
T0=$(date +%s)
timeout 330 python -m pytest -q -m gpu -x tests/ -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s)-T0 ))s"; tail -15 $OUT/gpu_tests.log
