#!/usr/bin/env bash
# CPU: serving at the 5b setting, slot table (9863955) vs paged (HEAD), alternating, median of 3 each
set -u
. /work/main/.venv/bin/activate
ck=/work/main/checkpoints/kdtree-mini
TABLE="--max-slots 16 --max-context 192 --min-prompt-bucket 64 --step-widths 1,4,8,16 --rounds-per-step 8"
args="$TABLE --checkpoint $ck/target --drafter $ck/drafter --prompts $ck/heldout_prompts.jsonl --num-prompts 16 --max-new-tokens 64"
for cfg in ar ddtree; do for side in before after; do
  [ $side = before ] && dir=/tmp/base || dir=/tmp/wt
  (cd $dir && PYTHONPATH=$dir KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 900 python scripts/bench_serving.py --configs $cfg --concurrency 1 --num-requests 1 --repeats 1 $args > /tmp/svb/compile_${cfg}_$side.log 2>&1)
done; done
for cfg in ar ddtree; do for side in before after; do
  [ $side = before ] && dir=/tmp/base || dir=/tmp/wt
  (cd $dir && PYTHONPATH=$dir KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 1200 python scripts/bench_serving.py --configs $cfg --concurrency 1,4,8,16 --repeats 3 $args --out /tmp/svb/serving_${cfg}_$side.json > /tmp/svb/serving_${cfg}_$side.log 2>&1)
  echo "$cfg $side rc=$?"
done; done
