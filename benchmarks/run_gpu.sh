#!/usr/bin/env bash
# GPU measurements by what they measure: each target is one command; its log and JSON go to $OUT (default ./out).
#
#   bash benchmarks/run_gpu.sh TARGET...        e.g. bash benchmarks/run_gpu.sh kernel-tests engine
#
#   engine          end to end: ar / chain / ddtree B 16-256, batch 1 and 8, tokens/s + plot (scripts/bench_engine.py)
#   eval-pair       the shipped pair: held-out loss, drafter acceptance, engine table into a model-card copy
#   budget-profile  tau(B) and round cost per batch size, the profile budget="auto" reads (scripts/profile_budget.py)
#   kernels         verify_attn against the copy / matmul ceilings, then the tree kernels (benchmarks/bench_kernels.py)
#   kernels-paged   verify_attn at batch 8, B = 16, 4k and 32k over a shuffled pool of 64-row pages against the
#                   contiguous cache, both backends, interleaved in one run (bench_kernels.py --paged)
#   tree-kernels    tree_build / tree_accept against the host heap and walk (benchmarks/bench_tree_kernels.py)
#   topk            per-depth top-K draft log-probs, kernel vs XLA variants (benchmarks/bench_topk.py)
#   int4-moe        the INT4 grouped expert FFN vs dequantize-then-matmul vs bf16 experts (benchmarks/bench_int4_moe.py)
#   int4-serving    the INT4 expert FFN at the routed tokens of AR batch 1-64 and a batch-8 B = 16 verify, row-major vs
#                   tile-major weights, with the tile sweep there (bench_int4_moe.py --layouts --tune)
#   int4-parts      the gate/up and the down kernel each alone at the routed tokens of AR batch 1-64 and a batch-8
#                   B = 16 verify, over tiles, warps, stages and N tiles per program, with % of copy (--part-tune)
#   k26-layer       full-width K2.6 layers against the HBM roofline (benchmarks/bench_kimi_layer.py)
#   k26-ar-step     the K2.6 AR step inside a compiled loop, per step from two loop lengths (bench_kimi_layer.py)
#   k26-batches     the K2.6 AR step at batch 1-64 and the verify step at batch 8, B = 16, per step from two loop
#                   lengths, each part by part from a profiler trace (bench_kimi_layer.py --trace)
#   k26-serving     BENCHMARKS.md §4b's serving table: the K2.6 AR step at batch 1-64 (8- and 64-step loops) and
#                   the verify step at batch 8, 32 and 64 with B = 16 (8- and 32-step loops), for the cost model's refit
#   k26-expert-pools  the AR step at batch 8 and 32 again with the routed experts folded onto 48 and 128 experts
#                   (bench_kimi_layer.py --expert-pools): distinct experts varied at a fixed batch, for the refit
#   k26-before-after  §4b's serving table (AR batch 1-64, verify batch 8-64 with B = 16; 8- and 32-step loops) for
#                   the tree in $BASE and for this one, each part before then after in one call: a before/after of an
#                   engine change. BASE holds the other commit's code, e.g. `git archive C pallas_kernels kdtree_jax
#                   benchmarks | tar -x -C .diag/base`, carried to the GPU machine with the working tree
#   k26-layouts     the K2.6 AR step at batch 1-64 and the verify step at batch 8, B = 16, with the experts row-major
#                   (as loaded) and tile-major (as the engine stores them) side by side (bench_kimi_layer.py)
#   prefix-ttft-k26  time to first token of a 32k-token prefix + 64-token message at K2.6 width (3 layers) in the
#                   serving engine: cold, prefix-cache hit, and caching off, 3 repeats (benchmarks/prefix_ttft_k26.py)
#   serving-k26     the serving engine at K2.6 width (3 layers + a 1-layer drafter): ar and ddtree-16 step times at
#                   concurrency 1-64, tokens/s projected with the shipped pair's tau (benchmarks/serving_k26.py)
#   k26-round       one K2.6-width round part by part, from a profiler trace (benchmarks/profile_round.py)
#   round           one round of the shipped pair part by part (benchmarks/bench_round.py)
#   mesh            K2.6-width layers on 2 GPUs vs one, same tokens, ms per round (nvidia-h200-x2)
#   int4-tma        a TMA-fed Mosaic GPU INT4 matmul (load-only modes and full) vs the Triton kernels, at the
#                   experts and rows of a batch-8 B = 16 verify (benchmarks/bench_int4_tma.py)
#   int4-stalls     where the INT4 kernels' warps wait, per SASS instruction, at the tokens of AR batch 64, then of a
#                   batch-8 B = 16 verify: ncu's warp-state samples by opcode and reason (benchmarks/ncu_sass.py)
#   kernel-tests    the kernel, lowering and engine-equality tests, compiled on the GPU
#   serving         the serving engine in-process: ar / ddtree-16 / auto at concurrency 1-16 (scripts/bench_serving.py)
#   serving-vs-base  the serving target's ar and ddtree-16 rows (concurrency 1-16) for the tree in $BASE and for
#                   this one, alternating, in one call: each tree's programs are compiled first, all four configs at
#                   once, into its own compilation cache (XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 in every run, so the
#                   paged pool has the same shape when timed). BASE holds the other commit's code, e.g. `git archive C
#                   kdtree_jax pallas_kernels scripts | tar -x -C .diag/base`; both use this tree's checkpoints.
#                   AFTER (default: this tree) the other side's code. Both configs: about 7 minutes on one H200
#   serving-http    the OpenAI server, one per config (ar, ddtree-16, auto), at concurrency 1-32; against $SERVING_JSON
#                   (default $OUT/serving.json, the serving target's) for the HTTP layer's cost; the two targets
#                   together take about 10 minutes on one H200 from a cold compilation cache
#   serving-process  the OpenAI server with its engine in its own process (auto) at concurrency 8-32 against the
#                   in-process engine on the same table, in one call: the HTTP + process boundary's cost
#   serving-defaults  `python -m kdtree_jax.serve` with no flags: seconds to /health, its memory line (weights /
#                   programs' peak / pool), 16 concurrent chat requests, and the log checked for OOM and
#                   rematerialization warnings (serving_defaults.json); then paged vs the slot table (BASE, the
#                   slot table's tree, as serving-vs-base) if BASE is given; then constrained ddtree vs constrained
#                   ar at batch 1 (constrained.json). WHEELS=dir installs what the image lacks first
#                   (benchmarks/gpu_wheels.sh makes that folder)
#   serving-burst   ten concurrent 24-token requests on a pool of a 4-slot table's bytes (1024 tokens), ddtree B=16:
#                   how many run at once (serving_burst.json)
#   multi-turn      the multi-turn trace (scripts/bench_serving.py --trace multi-turn): prefix hit rate and TTFT for
#                   ar and ddtree, prefix caching off and on
#   serving-gpu     the serving engine's GPU figures in one call (WHEELS=dir on a bare image): seconds from
#                   `python -m kdtree_jax.serve` (no flags) to /health, cold (an empty compilation cache of its own)
#                   then warm (benchmarks/serve_startup.py, serve_startup.json); the serving table ar / ddtree-16 /
#                   auto at concurrency 1-16 (SERVING_TABLE), paged against the slot table in $BASE alternating
#                   as serving-vs-base when BASE is given, else paged alone as serving; then serving-k26's step
#                   times (K26_BUDGET_S seconds, default 120)
#
# Run from anywhere on the GPU machine; PYTHONPATH is set to the repository here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

# one table for the in-process and HTTP runs: identical programs, so the compilation cache serves both
SERVING_TABLE="--max-slots 16 --max-context 192 --min-prompt-bucket 64 --step-widths 1,4,8,16 --rounds-per-step 8"
PROCESS_TABLE="--max-slots 32 --max-context 192 --min-prompt-bucket 64 --step-widths 8,16,32 --rounds-per-step 8"
export KDTREE_COMPILATION_CACHE=${KDTREE_COMPILATION_CACHE:-$PWD/.xla-cache}

serving_http() {
    local name flags pid rc=0 port=8000
    for cfg in "ar --mode ar" "ddtree --mode ddtree --budget 16" "auto --mode ddtree --budget auto"; do
        read -r name flags <<<"$cfg"
        echo "== server $name" >>"$OUT/servers.log"  # one log for every server
        "$PY" -m kdtree_jax.serve $flags $SERVING_TABLE --port $port >>"$OUT/servers.log" 2>&1 &
        pid=$!
        "$PY" - "$port" <<'PY' || { echo "server $name did not come up"; kill "$pid"; rc=1; continue; }
import sys, time, httpx
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
sys.exit(1)
PY
        "$PY" scripts/bench_serving.py --url "http://127.0.0.1:$port" --label "$name" --concurrency 1,4,8,16,32 \
            --compare "${SERVING_JSON:-$OUT/serving.json}" --out "$OUT/http-$name.json" || rc=1
        kill -TERM "$pid" && wait "$pid" || rc=1
    done
    return $rc
}

k26_before_after() {
    [ -d "${BASE:-}" ] || { echo "k26-before-after: BASE must name the other commit's tree" >&2; return 2; }
    local base out kind side dir rc=0
    base=$(cd "$BASE" && pwd)
    out=$(cd "$OUT" && pwd)
    # 8- and 32-step loops, budgets and timeouts sized so that all four runs fit one 600 s device call
    declare -A args=([ar]="--steps 8 32 --batches 1 8 32 64 --nodes 1 --budget-s 95"
                     [verify]="--steps 8 32 --batches 8 32 64 --nodes 17 --budget-s 85")
    for kind in ar verify; do
        for side in before after; do
            [ "$side" = before ] && dir=$base || dir=$PWD
            (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout 140 "$PY" benchmarks/bench_kimi_layer.py ${args[$kind]} \
                --skip-prefill --as-is-max-tokens 0 --out "$out/k26_${kind}_$side.json") || rc=1
        done
    done
    return $rc
}

serving_vs_base() {
    [ -d "${BASE:-}" ] || { echo "serving-vs-base: BASE must name the other commit's tree" >&2; return 2; }
    local base after out cfg side dir rc=0 pids=() ck=$PWD/checkpoints/kdtree-mini
    base=$(cd "$BASE" && pwd)
    after=$(cd "${AFTER:-.}" && pwd)
    out=$(cd "$OUT" && pwd)
    local args="$SERVING_TABLE --checkpoint $ck/target --drafter $ck/drafter --prompts $ck/heldout_prompts.jsonl"
    # every config's two sides share the GPU while compiling (0.2 each for two configs), and time with the same pool
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${SERVING_MEM_FRACTION:-0.2}
    for cfg in ${SERVING_CONFIGS:-ar ddtree}; do  # compile (warm-up, one request, Engine.generate once) into the cache
        for side in before after; do
            [ "$side" = before ] && dir=$base || dir=$after
            (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 300 "$PY" \
                scripts/bench_serving.py --configs $cfg --concurrency 1 --num-requests 1 --repeats 1 $args \
                >"$out/serving_compile_${cfg}_$side.log" 2>&1) &
            pids+=($!)
        done
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    for cfg in ${SERVING_CONFIGS:-ar ddtree}; do
        for side in before after; do
            [ "$side" = before ] && dir=$base || dir=$after
            (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH KDTREE_COMPILATION_CACHE=/tmp/xla-cache-$side timeout 65 "$PY" \
                scripts/bench_serving.py --configs $cfg --concurrency 1,4,8,16 $args \
                --out "$out/serving_${cfg}_$side.json") || rc=1
        done
    done
    return $rc
}

serving_defaults() {
    local pid rc=0 port=8000 t0
    t0=$(date +%s.%N)
    "$PY" -m kdtree_jax.serve --port $port >"$OUT/serve_defaults.log" 2>&1 &
    pid=$!
    "$PY" - "$port" "$t0" "$OUT" <<'PY' || rc=1
import concurrent.futures, json, re, sys, time, httpx
port, t0, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
url = f"http://127.0.0.1:{port}"
up = None
for _ in range(480):
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
            up = time.time() - t0
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
result = {"seconds_to_health": up}
if up is not None:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = lambda i: {"model": model, "max_tokens": 64,
                      "messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}]}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda i: httpx.post(url + "/v1/chat/completions", json=body(i), timeout=300)
                              .status_code, range(16)))
    result["chat_status"] = codes
log = open(f"{out}/serve_defaults.log").read()
result["memory_line"] = next(iter(re.findall(r"memory: .*", log)), None)
result["page_pool_line"] = next(iter(re.findall(r"page pool: .*", log)), None)
result["oom"] = "OUT_OF_MEMORY" in log or "RESOURCE_EXHAUSTED" in log
result["rematerialization_warning"] = "Can't reduce memory use" in log
json.dump(result, open(f"{out}/serving_defaults.json", "w"), indent=1)
print(json.dumps(result, indent=1))
ok = up is not None and result["chat_status"] == [200] * 16 and not result["oom"]
sys.exit(0 if ok and not result["rematerialization_warning"] else 1)
PY
    kill -TERM "$pid" && wait "$pid"
    if [ -d "${BASE:-}" ]; then serving_vs_base || rc=1; fi
    local schema='{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":99},"name":{"type":"string","maxLength":12}},"required":["n","name"],"additionalProperties":false}'
    timeout 240 "$PY" scripts/bench_engine.py --batches 1 --budgets 16 --repeats 3 --json-schema "$schema" \
        --out "$OUT/constrained.json" || rc=1
    return $rc
}

serving_gpu() {
    local rc=0
    timeout 420 "$PY" benchmarks/serve_startup.py --timeout 300 --out "$OUT/serve_startup.json" || rc=1
    if [ -d "${BASE:-}" ]; then
        SERVING_CONFIGS="ar ddtree auto" SERVING_MEM_FRACTION=0.13 serving_vs_base || rc=1
    else
        timeout 420 "$PY" scripts/bench_serving.py --concurrency 1,4,8,16 --configs ar,ddtree,auto $SERVING_TABLE \
            --out "$OUT/serving.json" || rc=1
    fi
    "$PY" benchmarks/serving_k26.py --budget-s "${K26_BUDGET_S:-120}" --out "$OUT/serving_k26.json" || rc=1
    return $rc
}

target() {
    case "$1" in
    serving-defaults) serving_defaults ;;
    serving-gpu) serving_gpu ;;
    serving-burst) "$PY" scripts/bench_serving.py --trace mixed --trace-mode ddtree --budget 16 --trace-context 256 \
        --trace-page-size 16 --mixed-requests 10 --mixed-prompt-tokens 16,32 --mixed-new-tokens 24,24 --pool-slots 4 \
        --paged-slots 16 --out "$OUT/serving_burst.json" ;;
    engine) "$PY" scripts/bench_engine.py --batches 1,8 --repeats 3 --out "$OUT/engine.json" --plot "$OUT/engine.png" ;;
    eval-pair) cp checkpoints/kdtree-mini/MODEL_CARD.md "$OUT/" && "$PY" scripts/eval_pair.py --engine-prompts 32 \
        --out-dir "$OUT/eval_pair" --model-card "$OUT/MODEL_CARD.md" ;;
    budget-profile) "$PY" scripts/profile_budget.py --out "$OUT/budget_profile.nvidia-h200.json" ;;
    kernels) "$PY" benchmarks/bench_kernels.py --trace --budget-s 280 --out "$OUT/kernels.json" ;;
    kernels-paged) "$PY" benchmarks/bench_kernels.py --skip-tree --trace --paged 64 --batches 8 --nodes 17 \
        --prefixes 4096 32768 --budget-s 300 --out "$OUT/kernels_paged.json" ;;
    tree-kernels) "$PY" benchmarks/bench_tree_kernels.py --out "$OUT/tree_kernels.json" ;;
    topk) "$PY" benchmarks/bench_topk.py --out "$OUT/topk.json" ;;
    int4-moe) "$PY" benchmarks/bench_int4_moe.py --out "$OUT/int4_moe.json" ;;
    k26-layer) "$PY" benchmarks/bench_kimi_layer.py --budget-s 250 --out "$OUT/k26_layer.json" ;;
    k26-ar-step) "$PY" benchmarks/bench_kimi_layer.py --ar-breakdown --steps 8 32 --budget-s 120 \
        --out "$OUT/k26_ar_step.json" ;;
    int4-serving) "$PY" benchmarks/bench_int4_moe.py --kernel-only --unpack bf16x2 --layouts --tune \
        --tokens 1 8 32 64 136 --tune-tokens 32 136 --budget-s 400 --out "$OUT/int4_serving.json" ;;
    int4-parts) "$PY" benchmarks/bench_int4_moe.py --kernel-only --unpack bf16x2 --part-tune --tokens 1 8 32 64 136 \
        --tune-tokens 1 8 32 64 136 --budget-s 400 --out "$OUT/int4_parts.json" ;;
    k26-batches) "$PY" benchmarks/bench_kimi_layer.py --ar-breakdown --steps 8 32 --batches 1 8 32 64 \
        --trace /tmp/k26_trace --budget-s 240 --out "$OUT/k26_ar_batches.json" &&
        "$PY" benchmarks/bench_kimi_layer.py --steps 8 32 --batches 8 --nodes 17 --skip-prefill \
        --trace /tmp/k26_trace --budget-s 120 --out "$OUT/k26_verify_b8.json" ;;
    k26-serving) "$PY" benchmarks/bench_kimi_layer.py --ar-breakdown --steps 8 64 --batches 1 8 32 64 \
        --budget-s 200 --out "$OUT/k26_serving_ar.json" &&
        "$PY" benchmarks/bench_kimi_layer.py --steps 8 32 --batches 8 32 64 --nodes 17 --skip-prefill \
        --budget-s 150 --out "$OUT/k26_serving_verify.json" ;;
    k26-expert-pools) "$PY" benchmarks/bench_kimi_layer.py --ar-breakdown --steps 8 64 --batches 8 32 \
        --expert-pools 48 128 --budget-s 200 --out "$OUT/k26_expert_pools.json" ;;
    k26-before-after) k26_before_after ;;
    k26-layouts) "$PY" benchmarks/bench_kimi_layer.py --ar-breakdown --steps 8 32 --batches 1 8 32 64 \
        --expert-layouts row-major tile-major --budget-s 240 --out "$OUT/k26_ar_layouts.json" &&
        "$PY" benchmarks/bench_kimi_layer.py --steps 8 32 --batches 8 --nodes 17 --skip-prefill \
        --expert-layouts row-major tile-major --budget-s 60 --out "$OUT/k26_verify_b8_layouts.json" ;;
    prefix-ttft-k26) "$PY" benchmarks/prefix_ttft_k26.py --out "$OUT/prefix_ttft_k26.json" ;;
    serving-k26) "$PY" benchmarks/serving_k26.py --out "$OUT/serving_k26.json" ;;
    k26-round) "$PY" benchmarks/profile_round.py --batch 1 --budgets 16 --ar --out "$OUT/k26_round" ;;
    round) "$PY" benchmarks/bench_round.py --time-limit 200 --out "$OUT/round.json" ;;
    mesh) "$PY" benchmarks/bench_mesh_scaling.py --layers 4 --batch 1 --modes ar ddtree --meshes 1x1x2 \
        --out "$OUT/mesh.json" ;;
    int4-tma) "$PY" benchmarks/bench_int4_tma.py --out "$OUT/int4_tma.json" ;;
    int4-stalls) ncu --clock-control none -k regex:int4 --section SourceCounters --section WarpStateStats \
        -o "$OUT/int4_stalls" "$PY" benchmarks/bench_int4_moe.py --once --unpack bf16x2 --tokens 64 136 &&
        ncu -i "$OUT/int4_stalls.ncu-rep" --page source --csv --print-source sass > "$OUT/int4_stalls_sass.csv" &&
        "$PY" benchmarks/ncu_sass.py "$OUT/int4_stalls_sass.csv" | tee "$OUT/int4_stalls.md" ;;
    kernel-tests) "$PY" -m pytest -q -rf -m 'not heavy and not slow' tests/test_verify_attn.py \
        tests/test_verify_attn_mgpu.py tests/test_tree_build.py tests/test_tree_accept.py tests/test_topk.py \
        tests/test_int4_moe.py tests/test_dot_acc.py tests/test_moe_kernel.py tests/test_engine_lowering.py ;;
    serving) "$PY" scripts/bench_serving.py --concurrency 1,4,8,16 --configs ar,ddtree,auto $SERVING_TABLE \
        --out "$OUT/serving.json" ;;
    serving-vs-base) serving_vs_base ;;
    serving-http) serving_http ;;
    serving-process) "$PY" scripts/bench_serving.py --configs auto --concurrency 8,16,32 $PROCESS_TABLE \
            --out "$OUT/serving_inprocess.json" &&
        "$PY" scripts/bench_serving.py --serve "--mode ddtree --budget auto $PROCESS_TABLE" --concurrency 8,16,32 \
            --label auto --extra-body '{"return_token_ids": true}' --compare "$OUT/serving_inprocess.json:auto" \
            --out "$OUT/http_engine_process.json" ;;
    multi-turn) "$PY" scripts/bench_serving.py --trace multi-turn --out "$OUT/multi_turn.json" ;;
    *) echo "unknown target: $1 (see the list at the top of $0)" >&2; return 2 ;;
    esac
}

if [ $# -eq 0 ]; then
    sed -n '2,/^# Run from/p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
if [ -n "${WHEELS:-}" ]; then  # the image reaches no registry: what it lacks comes as wheels
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
status=0
for name in "$@"; do
    echo "== $name ($(date +%T))"
    target "$name" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc ($(date +%T))"
    [ "$rc" -eq 0 ] || status=1
done
exit $status
