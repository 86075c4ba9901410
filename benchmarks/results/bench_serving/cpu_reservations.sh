#!/usr/bin/env bash
# CPU: reservations that follow acceptance (HEAD, /tmp/wt) against the worst-case reservation (1365337, /tmp/base):
# a burst of ten 24-token requests on a 4-slot table's bytes, the mixed trace, and tokens/s at c = 16
set -u
. /work/main/.venv/bin/activate
ck=/work/main/checkpoints/kdtree-mini
R=/work/main/benchmarks/results/bench_serving
BURST="--trace mixed --trace-mode ddtree --budget 16 --trace-context 256 --trace-page-size 16 --mixed-requests 10 --mixed-prompt-tokens 16,32 --mixed-new-tokens 24,24 --pool-slots 4 --paged-slots 16"
TABLE="--max-slots 16 --max-context 192 --min-prompt-bucket 64 --step-widths 1,4,8,16 --rounds-per-step 8"
args="$TABLE --checkpoint $ck/target --drafter $ck/drafter --prompts $ck/heldout_prompts.jsonl --num-prompts 16 --max-new-tokens 64"
for side in before after; do
  [ $side = before ] && dir=/tmp/base || dir=/tmp/wt
  (cd $dir && PYTHONPATH=$dir KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 900 python scripts/bench_serving.py $BURST --out $R/cpu_burst_$side.json > $R/cpu_burst_$side.log 2>&1); echo "burst $side rc=$?"
done
(cd /tmp/wt && PYTHONPATH=/tmp/wt KDTREE_COMPILATION_CACHE=/tmp/xla-cache-after timeout 1200 python scripts/bench_serving.py --trace mixed --out $R/cpu_mixed_after.json > $R/cpu_mixed_after.log 2>&1); echo "mixed rc=$?"
for cfg in ar ddtree; do for side in before after; do
  [ $side = before ] && dir=/tmp/base || dir=/tmp/wt
  (cd $dir && PYTHONPATH=$dir KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 900 python scripts/bench_serving.py --configs $cfg --concurrency 16 --repeats 3 $args --out $R/cpu_c16_${cfg}_$side.json > $R/cpu_c16_${cfg}_$side.log 2>&1)
  echo "c16 $cfg $side rc=$?"
done; done
