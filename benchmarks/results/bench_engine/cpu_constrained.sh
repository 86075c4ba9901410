#!/usr/bin/env bash
# CPU: constrained decoding with exact numeric bounds (HEAD, /tmp/wt) against the bound-free regex (1365337,
# /tmp/base), same schema, alternating sides; then the automata's size at V = 163,840
set -u
. /work/main/.venv/bin/activate
R=/work/main/benchmarks/results/bench_engine
schema='{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":99},"name":{"type":"string","maxLength":12}},"required":["n","name"],"additionalProperties":false}'
for side in before after before after; do
  [ $side = before ] && dir=/tmp/base || dir=/tmp/wt
  (cd $dir && PYTHONPATH=$dir KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 900 python scripts/bench_engine.py --batches 1 --budgets 8 --repeats 3 --n-prompts 4 --max-new-tokens 64 --json-schema "$schema" --out $R/cpu_constrained_$side.json >> $R/cpu_constrained_$side.log 2>&1); echo "constrained $side rc=$?"
done
(cd /tmp/wt && PYTHONPATH=/tmp/wt timeout 900 python benchmarks/constraint_tables.py > /work/main/benchmarks/results/constraint_tables.log 2>&1); echo "tables rc=$?"
