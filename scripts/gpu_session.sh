#!/usr/bin/env bash
# The GPU measurements still owed, as device calls that each fit the lent machine's 600 s per call.
#
#   bash scripts/gpu_session.sh kernels   # compiled kernel tests + verify_attn tune/sweep + tree kernels (1 GPU)
#   bash scripts/gpu_session.sh kimi      # INT4 expert matmul vs XLA vs bf16; full-width K2.6 layers (1 GPU)
#   bash scripts/gpu_session.sh engine    # round breakdown; budget profile (auto vs every fixed B) (1 GPU)
#   bash scripts/gpu_session.sh mesh2     # sharding tests + 2-GPU generation == 1 GPU, timed (nvidia-h200-x2)
#   bash scripts/gpu_session.sh scaling   # K2-width layers on 2/4/8 GPUs == 1 GPU, ms per round, batch 1 and 8 (x2, x8)
#   bash scripts/gpu_session.sh retune    # after a kernel retune: compiled tests, verify_attn H 64 / 8, K2.6 verify
#                                         # layers, INT4 kernel (both GPUs of nvidia-h200-x2 in parallel, ~7 min)
#   bash scripts/gpu_session.sh split     # verify_attn tune (wave split rule, value chunks) H 64 | compiled tests, top-K
#                                         # variants, tune H 8 (nvidia-h200-x2, ~10 min)
#   bash scripts/gpu_session.sh defaults  # after the wave-rule retune: K2.6 layers + verify_attn H 64 sweep | H 8 tune,
#                                         # sweep, nsys trace of a small decode call (nvidia-h200-x2, ~9 min)
#   bash scripts/gpu_session.sh bookkeeping  # top-K / INT4 kernels compiled tests, top-K variants, round parts |
#                                         # INT4 breakdown + tune, K2.6 AR-step breakdown, engine tests (x2, ~10 min)
#   bash scripts/gpu_session.sh owed4     # what session 4 left unmeasured: K2.6 AR breakdown with 3-stage INT4, ddtree vs
#                                         # ar tokens on the GPU, round parts at batch 1 and 8 (x2, ~3 min)
#   bash scripts/gpu_session.sh profile5  # owed4 plus the AR step kernel by kernel (ncu, jax.profiler trace) and with
#                                         # XLA command buffers off / extended to while loops (x2, ~8 min)
#   bash scripts/gpu_session.sh round5    # a K2.6-width round part by part (profile_round, batch 1 and 8, command buffers
#                                         # on / off) and the AR step per step from two loop lengths (x2, ~9 min)
#   bash scripts/gpu_session.sh round5b   # the round profile again (command buffers off: every kernel attributed; 4k and
#                                         # 32k), compiled tree / top-K / drafter tests, ddtree == ar tokens (x2, ~9 min)
#   bash scripts/gpu_session.sh drafter5  # after the drafter cache layout / barrier change: K2.6-width round at batch 1
#                                         # (4k, 32k) and 8, compiled drafter tests, ddtree == ar tokens (x2, ~6 min)
#   bash scripts/gpu_session.sh owed5     # what session 5 left unmeasured: the K2.6-width round at 32k with an all-full
#                                         # drafter | with K2.6's sliding layers (window 2048, read as a slice) (x2, ~4 min)
#   bash scripts/gpu_session.sh mosaic6   # the Mosaic GPU (wgmma) verify_attn: compiled tests, then both backends side by
#                                         # side at H = 64 (AR rows, batch 1/8/64, 8k/32k; B = 16 trees) (1 GPU, ~8 min)
#   bash scripts/gpu_session.sh mosaic6b  # verify_attn kernel by kernel (jax.profiler), both backends (1 GPU, ~2 min)
#   bash scripts/gpu_session.sh mosaic6c  # compiled wgmma tests incl. engine ddtree == ar; K2.6-width round at 32k,
#                                         # B = 16 and AR, triton vs mosaic (1 GPU, ~8 min)
#   bash scripts/gpu_session.sh small7    # the wgmma path's fixed costs: compiled tests, fixed vs per-block time, kernel
#                                         # by kernel, both backends' AR rows with a same-bytes XLA read (1 GPU, ~9 min)
#   bash scripts/gpu_session.sh small8    # compiled tests, fixed vs per-block time, kernel by kernel, AR rows with a
#                                         # same-bytes read; session 8 ran it on the KV-slot staging (efab2b0, reverted)
#                                         # (1 GPU, ~8 min)
#   bash scripts/gpu_session.sh trim8     # after trimming idle splits: compiled verify_attn tests (both backends), AR rows
#                                         # of both backends with the same-bytes read (1 GPU, ~7 min)
#   bash scripts/gpu_session.sh owed8     # the shipped budget profile re-measured; the K2.6 AR step vs the roofline with
#                                         # the wgmma kernel (1 GPU, ~9 min)
#   bash scripts/gpu_session.sh budget9   # the shipped budget profile re-measured one batch size per run, merged into a
#                                         # copy of the shipped one: copy $OUT's file to checkpoints/ (1 GPU, ~9 min)
#   bash scripts/gpu_session.sh owed5s    # owed5 on one GPU, one run after the other (1 GPU, ~7 min)
#   bash scripts/gpu_session.sh mosaic6d  # verify_attn wall + GPU-kernel time per call, both backends (1 GPU, ~6 min)
#   bash scripts/gpu_session.sh mosaic6e  # K2.6-width round at batch 8, 4k, B = 16 and AR, triton vs mosaic (1 GPU)
#   bash scripts/gpu_session.sh mosaic6f  # H = 8 (rows padded to tiles) on the wgmma kernel vs Triton (1 GPU, ~3 min)
#   bash scripts/gpu_session.sh pair10    # the shipped pair end to end: ar / chain / ddtree B 16-256 at batch 1 (GPU 0) and
#                                         # batch 8 (GPU 1), JSON + plot; eval_pair.py fills a copy of the model card
#                                         # (nvidia-h200-x2, ~9 min)
#   bash scripts/gpu_session.sh owed      # what session 3 left unmeasured: round + budget profile with the retuned
#                                         # kernel (GPU 0); verify_attn H = 8 sweep, K2.6 prefill (GPU 1) (x2, ~10 min)
#
# Run from the repository root on the device machine (PYTHONPATH is set here); logs and JSON go to $OUT (or ./out).
# Each step bounds its parts with `timeout` so a hang leaves the rest of the call's output.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}

write_prompts() {  # the first 16 held-out prompts, cut to 300 characters, one per line -> $OUT/prompts.txt
    "$PY" -c 'import json, sys
texts = [json.loads(l)["text"][:300] for l in open("checkpoints/kdtree-mini/heldout_prompts.jsonl")][:16]
open(sys.argv[1], "w").write("".join(t.replace("\\", "\\\\").replace("\n", "\\n") + "\n" for t in texts))' "$OUT/prompts.txt"
}

same_tokens() {  # same_tokens A B LABEL: how many prompts of $OUT/generate_A.log and generate_B.log have equal tokens
    "$PY" - "$OUT" "$1" "$2" "$3" <<'EOF'
import json, sys
out, a, b, label = sys.argv[1:]
rows = {m: [json.loads(l) for l in open(f"{out}/generate_{m}.log") if l.startswith("{")] for m in (a, b)}
same = [x["token_ids"] == y["token_ids"] for x, y in zip(rows[a], rows[b])]
print(f"{label}: {sum(same)}/{len(same)} prompts token-identical")
EOF
}

generate_ddtree_vs_ar() {  # the CLI on the held-out prompts in both modes, batch 8, and whether the tokens agree
    write_prompts
    for mode in ddtree ar; do
        run "generate_$mode" 70 "$PY" -m kdtree_jax.generate --json --batch-size 8 --max-new-tokens 64 \
            --mode "$mode" --prompt-file "$OUT/prompts.txt"
    done
    same_tokens ddtree ar "ddtree vs ar on the GPU"
}

run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, print its tail and the exit code
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? ($(date +%T))"
    tail -c 2500 "$OUT/$name.log"; echo
}

nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
case "${1:-}" in
mosaic6)
    PYTHONUNBUFFERED=1 run pytest_mgpu 150 "$PY" -m pytest -v -x -rf tests/test_verify_attn_mgpu.py
    PYTHONUNBUFFERED=1 run pytest_verify_attn 150 "$PY" -m pytest -q -rf tests/test_verify_attn.py
    run bench_ar 200 "$PY" scripts/bench_kernels.py --skip-tree --budget-s 150 --batches 1 8 64 --nodes 1 \
        --prefixes 8192 32768 --out "$OUT/bench_mosaic_ar.json"
    run bench_tree 120 "$PY" scripts/bench_kernels.py --skip-tree --budget-s 80 --batches 1 8 --nodes 17 \
        --prefixes 4096 32768 --out "$OUT/bench_mosaic_tree.json"
    ;;
small7)  # the wgmma path's fixed costs: compiled tests, fixed vs per-block time, kernel by kernel, AR rows vs a read
    PYTHONUNBUFFERED=1 run pytest_mgpu 150 "$PY" -m pytest -v -x -rf tests/test_verify_attn_mgpu.py
    for i in 1 2; do  # fresh seeds: the greedy ddtree == ar check again
        run "pytest_engine_$i" 90 "$PY" -m pytest -q -rf tests/test_verify_attn_mgpu.py -k engine_greedy
    done
    run probe 240 "$PY" scripts/probe_mgpu_fixed_cost.py --programs 8 128 --blocks 0 1 8 32 --micro \
        --out "$OUT/probe.json"
    run trace 120 "$PY" scripts/trace_verify_attn.py --backends mosaic \
        --shapes 1x1x8192 1x1x32768 8x1x8192 8x1x32768 64x1x8192 8x17x32768 --out "$OUT/trace.json"
    run bench_ar 240 "$PY" scripts/bench_kernels.py --skip-tree --trace --budget-s 190 --batches 1 8 64 --nodes 1 \
        --prefixes 8192 32768 --out "$OUT/bench_ar_trace.json"
    ;;
small8)  # after an output-path change (session 8: KV-slot staging): compiled tests, probe, kernel by kernel, AR rows
    PYTHONUNBUFFERED=1 run pytest_mgpu 150 "$PY" -m pytest -v -x -rf tests/test_verify_attn_mgpu.py
    run probe 90 "$PY" scripts/probe_mgpu_fixed_cost.py --programs 8 128 --blocks 0 1 8 32 --out "$OUT/probe.json"
    run trace 90 "$PY" scripts/trace_verify_attn.py --backends mosaic \
        --shapes 1x1x8192 1x1x32768 8x1x8192 8x1x32768 64x1x8192 8x17x32768 --out "$OUT/trace.json"
    run bench_ar 200 "$PY" scripts/bench_kernels.py --skip-tree --trace --budget-s 150 --batches 1 8 64 --nodes 1 \
        --prefixes 8192 32768 --out "$OUT/bench_ar_trace.json"
    ;;
trim8)  # the default split count trimmed to busy splits: compiled tests of both backends, AR rows side by side
    PYTHONUNBUFFERED=1 run pytest_verify_attn 240 "$PY" -m pytest -q -rf tests/test_verify_attn_mgpu.py \
        tests/test_verify_attn.py
    run bench_ar 240 "$PY" scripts/bench_kernels.py --skip-tree --trace --budget-s 170 --batches 1 8 64 --nodes 1 \
        --prefixes 8192 32768 --out "$OUT/bench_ar_trace.json"
    ;;
owed8)  # the shipped budget profile after sessions 6-8's kernel changes; the AR step vs the roofline (wgmma kernel)
    run profile_budget 330 "$PY" scripts/profile_budget.py --out "$OUT/budget_profile.nvidia-h200.json"
    run bench_kimi_ar 200 "$PY" scripts/bench_kimi_layer.py --ar-breakdown --steps 8 32 --budget-s 120 \
        --out "$OUT/bench_kimi_ar.json"
    ;;
budget9)  # the budget profile, one batch size per run into a copy of the shipped profile (a cut run keeps the rest)
    cp checkpoints/kdtree-mini/budget_profile.nvidia-h200.json "$OUT/"
    for batch in 1 8; do
        run "profile_budget_b$batch" 280 "$PY" scripts/profile_budget.py --batches "$batch" \
            --out "$OUT/budget_profile.nvidia-h200.json"
    done
    ;;
owed5s)  # owed5 on one GPU: the K2.6-width round at 32k, all-full drafter, then K2.6's sliding layers
    run profile_round_b1_32k 240 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --prompt 32768 \
        --out "$OUT/round_full"
    run profile_round_b1_32k_sliding 240 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --prompt 32768 \
        --sliding-window 2048 --out "$OUT/round_sliding"
    ;;
mosaic6c)  # the wgmma kernel inside the engine: compiled tests (ddtree == ar on it), K2.6-width round at 32k (1 GPU)
    PYTHONUNBUFFERED=1 run pytest_mgpu 150 "$PY" -m pytest -v -rf tests/test_verify_attn_mgpu.py
    for backend in triton mosaic; do
        run "profile_round_32k_$backend" 210 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --ar \
            --prompt 32768 --attn-backend "$backend" --out "$OUT/round_$backend"
    done
    ;;
mosaic6d)  # the final side-by-side: wall and GPU-kernel time per call, both backends, AR rows and B = 16 trees (1 GPU)
    run bench_ar 260 "$PY" scripts/bench_kernels.py --skip-tree --trace --budget-s 200 --batches 1 8 64 --nodes 1 \
        --prefixes 8192 32768 --out "$OUT/bench_mosaic_ar_trace.json"
    run bench_tree 200 "$PY" scripts/bench_kernels.py --skip-tree --trace --budget-s 140 --batches 1 8 --nodes 17 \
        --prefixes 4096 32768 --out "$OUT/bench_mosaic_tree_trace.json"
    ;;
mosaic6e)  # the engine at batch 8: K2.6-width round, B = 16 and AR, 4k, triton vs mosaic (1 GPU, ~5 min)
    for backend in triton mosaic; do
        run "profile_round_b8_$backend" 200 "$PY" scripts/profile_round.py --batch 8 --budgets 16 --ar \
            --attn-backend "$backend" --out "$OUT/round_b8_$backend"
    done
    ;;
mosaic6f)  # rows padded to 64-row tiles: H = 8 on the wgmma kernel, compiled tests and both backends (1 GPU, ~3 min)
    PYTHONUNBUFFERED=1 run pytest_mgpu 60 "$PY" -m pytest -q -rf -k "matches_reference or lowers" \
        tests/test_verify_attn_mgpu.py
    run bench_h8 90 "$PY" scripts/bench_kernels.py --skip-tree --trace --budget-s 50 --heads 8 --batches 8 64 \
        --nodes 1 --prefixes 8192 32768 --out "$OUT/bench_h8_trace.json"
    ;;
mosaic6b)  # where a mosaic call's time goes, kernel by kernel (1 GPU, ~2 min)
    run trace_verify_attn 150 "$PY" scripts/trace_verify_attn.py --out "$OUT/trace_verify_attn.json"
    ;;
kernels)
    run pytest_kernels 240 "$PY" -m pytest -q -rf --durations=10 tests/test_verify_attn.py tests/test_tree_build.py \
        tests/test_tree_accept.py tests/test_int4_moe.py tests/test_moe_kernel.py tests/test_engine_lowering.py
    run bench_kernels 330 "$PY" scripts/bench_kernels.py --tune --budget-s 280 --out "$OUT/bench_kernels.json"
    ;;
kimi)
    run bench_int4_moe 220 "$PY" scripts/bench_int4_moe.py --out "$OUT/bench_int4_moe.json"
    run bench_kimi_layer 340 "$PY" scripts/bench_kimi_layer.py --budget-s 270 --out "$OUT/bench_kimi_layer.json"
    ;;
engine)
    run bench_round 260 "$PY" scripts/bench_round.py --time-limit 200 --out "$OUT/bench_round.json"
    run profile_budget 320 "$PY" scripts/profile_budget.py --out "$OUT/budget_profile.nvidia-h200.json"
    ;;
mesh2)
    "$PY" -c 'import jax; print(jax.devices())' > "$OUT/devices.txt" 2>&1
    run pytest_sharding 240 "$PY" -m pytest -q -rf tests/test_sharding.py
    write_prompts
    for mesh in none 1x2; do
        flag=(); [ "$mesh" = none ] || flag=(--mesh "$mesh")
        run "generate_$mesh" 120 "$PY" -m kdtree_jax.generate --json --batch-size 8 --max-new-tokens 128 \
            --prompt-file "$OUT/prompts.txt" "${flag[@]}"
    done
    same_tokens none 1x2 "2-GPU vs 1-GPU"
    ;;
retune)
    (
        export CUDA_VISIBLE_DEVICES=0
        run pytest_retune 100 "$PY" -m pytest -q -rf tests/test_verify_attn.py tests/test_moe_kernel.py \
            tests/test_int4_moe.py
        run bench_kimi_layer 230 "$PY" scripts/bench_kimi_layer.py --skip-prefill --budget-s 160 \
            --out "$OUT/bench_kimi_layer.json"
        run bench_kernels_h8 70 "$PY" scripts/bench_kernels.py --heads 8 --skip-tree --budget-s 35 \
            --out "$OUT/bench_kernels_h8.json"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_kernels_h64 320 "$PY" scripts/bench_kernels.py --heads 64 --skip-tree --budget-s 250 \
        --out "$OUT/bench_kernels_h64.json"
    run bench_int4_moe 90 "$PY" scripts/bench_int4_moe.py --quick --kernel-only --out "$OUT/bench_int4_moe.json"
    wait
    ;;
owed)
    (
        export CUDA_VISIBLE_DEVICES=0
        run bench_round 260 "$PY" scripts/bench_round.py --time-limit 200 --out "$OUT/bench_round.json"
        run profile_budget 320 "$PY" scripts/profile_budget.py --out "$OUT/budget_profile.nvidia-h200.json"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_kernels_h8 300 "$PY" scripts/bench_kernels.py --heads 8 --skip-tree --budget-s 240 \
        --out "$OUT/bench_kernels_h8.json"
    run bench_kimi_layer 270 "$PY" scripts/bench_kimi_layer.py --budget-s 200 --out "$OUT/bench_kimi_layer.json"
    wait
    ;;
split)
    (
        export CUDA_VISIBLE_DEVICES=0
        run bench_kernels_tune_h64 570 "$PY" scripts/bench_kernels.py --tune --heads 64 --skip-tree --budget-s 500 \
            --out "$OUT/bench_kernels_tune_h64.json"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run pytest_verify 150 "$PY" -m pytest -q -rf tests/test_verify_attn.py
    run bench_topk 150 "$PY" scripts/bench_topk.py --out "$OUT/bench_topk.json"
    run bench_kernels_tune_h8 260 "$PY" scripts/bench_kernels.py --tune --heads 8 --skip-tree --budget-s 220 \
        --out "$OUT/bench_kernels_tune_h8.json"
    wait
    ;;
defaults)
    (
        export CUDA_VISIBLE_DEVICES=0
        run bench_kimi_layer 300 "$PY" scripts/bench_kimi_layer.py --budget-s 250 --out "$OUT/bench_kimi_layer.json"
        run bench_kernels_h64 250 "$PY" scripts/bench_kernels.py --heads 64 --skip-tree --budget-s 200 \
            --out "$OUT/bench_kernels_h64.json"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_kernels_tune_h8 240 "$PY" scripts/bench_kernels.py --tune --heads 8 --skip-tree --budget-s 200 \
        --out "$OUT/bench_kernels_tune_h8.json"
    run bench_kernels_h8 170 "$PY" scripts/bench_kernels.py --heads 8 --skip-tree --budget-s 130 \
        --out "$OUT/bench_kernels_h8.json"
    run trace_verify_attn 80 "$PY" scripts/trace_verify_attn.py --heads 8 --backends triton --shapes 1x1x1024
    wait
    ;;
bookkeeping)
    (
        export CUDA_VISIBLE_DEVICES=0
        run pytest_kernels 200 "$PY" -m pytest -q -rf tests/test_topk.py tests/test_tree_build.py \
            tests/test_int4_moe.py tests/test_moe_kernel.py
        run bench_topk 190 "$PY" scripts/bench_topk.py --out "$OUT/bench_topk.json"
        run bench_round 190 "$PY" scripts/bench_round.py --time-limit 130 --out "$OUT/bench_round.json"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_int4_breakdown 220 "$PY" scripts/bench_int4_moe.py --quick --kernel-only --breakdown --tune \
        --unpack bf16x2 --budget-s 140 --out "$OUT/bench_int4_breakdown.json"
    run bench_kimi_ar 200 "$PY" scripts/bench_kimi_layer.py --ar-breakdown --budget-s 150 --out "$OUT/bench_kimi_ar.json"
    run pytest_engine 160 "$PY" -m pytest -q -rf -x tests/test_engine.py
    wait
    ;;
owed4)
    (
        export CUDA_VISIBLE_DEVICES=0
        run bench_kimi_ar 90 "$PY" scripts/bench_kimi_layer.py --ar-breakdown --budget-s 60 --out "$OUT/bench_kimi_ar.json"
        generate_ddtree_vs_ar
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_round 170 "$PY" scripts/bench_round.py --batches 1 8 --budgets 16 32 --time-limit 110 --unroll \
        --calls 8 --out "$OUT/bench_round.json"
    wait
    ;;
profile5)
    (
        export CUDA_VISIBLE_DEVICES=0
        run bench_kimi_ar 90 "$PY" scripts/bench_kimi_layer.py --ar-breakdown --budget-s 60 --out "$OUT/bench_kimi_ar.json"
        run ncu_ar_b1 180 ncu --profile-from-start off --print-units base --csv --metrics gpu__time_duration.sum \
            "$PY" scripts/profile_step.py --batch 1 --hlo "$OUT/ar_b1.hlo.txt"
        run profile_ar_b1 100 "$PY" scripts/profile_step.py --batch 1 --trace "$OUT/trace_ar_b1"
        XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL \
            run profile_ar_b1_cmdbuf_while 100 "$PY" scripts/profile_step.py --batch 1
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_round 170 "$PY" scripts/bench_round.py --batches 1 8 --budgets 16 32 --time-limit 110 --unroll \
        --calls 8 --out "$OUT/bench_round.json"
    generate_ddtree_vs_ar
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run profile_ar_b1_cmdbuf_off 100 "$PY" scripts/profile_step.py --batch 1
    wait
    for f in "$OUT"/ncu_*.log; do
        wall=$(grep -o '[0-9.]* µs wall per step' "$OUT/profile_ar_b1.log" | cut -d' ' -f1)
        "$PY" scripts/profile_step.py --summarize "$f" ${wall:+--wall-us $wall} > "${f%.log}.md" 2>&1
        cat "${f%.log}.md"
    done
    ;;
round5)
    (
        export CUDA_VISIBLE_DEVICES=0
        run profile_round_b1 330 "$PY" scripts/profile_round.py --batch 1 --budgets 16 64 --ar --out "$OUT/round"
        run bench_kimi_ar 200 "$PY" scripts/bench_kimi_layer.py --ar-breakdown --steps 8 32 --budget-s 120 \
            --out "$OUT/bench_kimi_ar.json"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run profile_round_b8 300 "$PY" scripts/profile_round.py --batch 8 --budgets 16 --ar --out "$OUT/round"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run profile_round_b1_nocmdbuf 220 "$PY" scripts/profile_round.py \
        --batch 1 --budgets 16 --out "$OUT/round_nocmdbuf"
    wait
    ;;
round5b)
    (
        export CUDA_VISIBLE_DEVICES=0
        run profile_round_b1 300 "$PY" scripts/profile_round.py --batch 1 --budgets 16 64 --ar --out "$OUT/round"
        run profile_round_b1_32k 200 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --prompt 32768 \
            --out "$OUT/round_32k"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run profile_round_b8 260 "$PY" scripts/profile_round.py --batch 8 --budgets 16 --ar --out "$OUT/round"
    run pytest_round5 150 "$PY" -m pytest -q -rf tests/test_topk.py tests/test_tree_build.py tests/test_tree_accept.py \
        tests/test_drafter.py tests/test_profile_tools.py
    generate_ddtree_vs_ar
    wait
    ;;
drafter5)
    (
        export CUDA_VISIBLE_DEVICES=0
        run profile_round_b1 200 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --out "$OUT/round"
        run profile_round_b1_32k 200 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --prompt 32768 \
            --out "$OUT/round_32k"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run profile_round_b8 200 "$PY" scripts/profile_round.py --batch 8 --budgets 16 --out "$OUT/round"
    run pytest_drafter 100 "$PY" -m pytest -q -rf tests/test_drafter.py
    generate_ddtree_vs_ar
    wait
    ;;
owed5)
    (
        export CUDA_VISIBLE_DEVICES=0
        run profile_round_b1_32k 200 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --prompt 32768 \
            --out "$OUT/round_full"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run profile_round_b1_32k_sliding 200 "$PY" scripts/profile_round.py --batch 1 --budgets 16 --prompt 32768 \
        --sliding-window 2048 --out "$OUT/round_sliding"
    wait
    ;;
pair10)
    (
        export CUDA_VISIBLE_DEVICES=0
        run bench_engine_b1 280 "$PY" scripts/bench_engine.py --batches 1 --repeats 2 \
            --out "$OUT/bench_engine_b1.json" --plot "$OUT/bench_engine_b1.png"
        cp checkpoints/kdtree-mini/MODEL_CARD.md "$OUT/MODEL_CARD.md"
        run eval_pair 290 "$PY" scripts/eval_pair.py --out-dir "$OUT/eval_pair" --batch-sizes 1,8 \
            --budgets 16,64,256 --model-card "$OUT/MODEL_CARD.md"
    ) &
    export CUDA_VISIBLE_DEVICES=1
    run bench_engine_b8 560 "$PY" scripts/bench_engine.py --batches 8 --repeats 2 \
        --out "$OUT/bench_engine_b8.json" --plot "$OUT/bench_engine_b8.png"
    wait
    ;;
scaling)
    for batch in 1 8; do
        run "bench_mesh_scaling_b$batch" 280 "$PY" scripts/bench_mesh_scaling.py --layers 4 --batch "$batch" \
            --modes ar ddtree --meshes 1x1x2 1x1x4 1x1x8 --out "$OUT/bench_mesh_scaling_b$batch.json"
    done
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh kernels|kimi|engine|mesh2|scaling" >&2
    exit 2
    ;;
esac
