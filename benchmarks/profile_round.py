"""One DDTree round at Kimi K2.6 width, part by part, from a profiler trace of the engine's own decode loop.

    python benchmarks/profile_round.py [--layers 6] [--batch 1] [--budgets 16 64] [--prompt 4096]
                                       [--sliding-window 2048] [--out DIR]

The target is K2.6 (`kimi_k2_6()`) cut to `--layers` decoder layers (layer 0 dense, the rest MoE with INT4 experts),
random weights made on the device (`bench_kimi_layer.build_model`); the drafter has the shape of z-lab's
Kimi-K2.5/K2.6-DFlash (6 Qwen3 layers of hidden 7168, 64 query / 8 KV heads, block 8; its taps spread over the
target's layers; all layers full attention as K2.5's, or `--sliding-window 2048` for K2.6's layout), random weights
too. Random weights accept about one token per round; the cost of a round's parts
hardly depends on that, which is what this measures.

Per (budget, mode): prefill a random `--prompt`-token prompt with the engine's `prefill`, then
  - the round's wall time: `decode_loop` (the engine's while loop, data-dependent stop test included) run for R1
    and R2 rounds from the same state; the slope (t2 - t1) / (R2 - R1) drops the fixed cost per call;
  - a jax.profiler trace of `--trace-rounds` rounds, each GPU kernel attributed to the named scope of the HLO
    instruction that launched it (`round/tree`, `round/verify`, `round/sample`, `round/accept`,
    `round/cache_update`, `round/draft`, `round/draft/topk`), through the compiled loop's HLO text.
The round's bookkeeping is tree + topk + accept + cache_update; its share is its kernel time per
round over the round's wall time. Only `--layers` of K2.6's 61 target layers run, so a real round is longer and
the share smaller: this is an upper bound.

XLA command buffers are turned off (XLA_FLAGS gets --xla_gpu_enable_command_buffer=) unless --command-buffers is
given: inside a buffer a kernel reports the buffer as its HLO op, and kernel names alone are ambiguous (XLA
deduplicates identical fusions into one kernel). Measured on the H200: the round's wall time was the same to 0.01%
either way (K2.6 x 6 layers, batch 1, B = 16). Kernels no HLO op matches count as "unattributed".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from trace_parts import command_buffers_off, gpu_kernels, hlo_scopes, part_times  # (no jax inside)

if __name__ == "__main__" and "--command-buffers" not in sys.argv[1:]:  # before jax reads XLA_FLAGS
    command_buffers_off()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kimi_layer import build_model, random_module  # noqa: E402
from bench_util import median_s, write_results  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax.decode.params import RequestParams  # noqa: E402
from kdtree_jax.decode.programs import decode_loop, prefill  # noqa: E402
from kdtree_jax.decode.speculative import DecodeSpec, RequestRows  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.model.drafter import DFlashDrafter  # noqa: E402
from kdtree_jax.model.drafter_config import DrafterConfig  # noqa: E402
from pallas_kernels.verify_attn import BACKENDS  # noqa: E402

PARTS = ("tree", "verify", "sample", "accept", "cache_update", "draft", "topk")
BOOKKEEPING = ("tree", "topk", "accept", "cache_update")
PALLAS_PARTS = {"verify_attn": "verify", "int4": "verify", "tree_build": "tree", "tree_accept": "accept",
                "topk": "topk"}  # our Triton kernels' names (pallas_call name=; a numeric suffix may follow) -> part
ROUNDS = (2, 10)  # decode_loop lengths whose time difference gives the time per round


def drafter_config(cfg, num_layers: int, sliding_window: int = 0) -> DrafterConfig:
    """z-lab's Kimi-K2.5-DFlash shape (tests/test_drafter.py: KIMI_K25_DRAFTER) over this target's layers; on a
    CPU backend a tiny one of the same layout. sliding_window > 0: the K2.6 drafter's layout, every layer but the
    last sliding with that window."""
    big = cfg.hidden_size >= 1024
    taps = sorted({int(round(i * (cfg.num_hidden_layers - 1) / 5)) for i in range(6)})
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": 18432 if big else 2 * cfg.hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": 64 if big else 4, "num_key_value_heads": 8 if big else 2,
        "head_dim": 128 if big else 16, "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_hidden_layers,
        "block_size": 8, "dflash_config": {"target_layer_ids": taps, "mask_token_id": cfg.vocab_size - 2},
        "max_position_embeddings": 262144, "rope_theta": 50000, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "yarn", "factor": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1,
                         "mscale_all_dim": 1, "original_max_position_embeddings": 4096},
        "attention_bias": False, "tie_word_embeddings": False,
    }
    if sliding_window:
        raw.update(sliding_window=sliding_window, use_sliding_window=True,
                   layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"])
    return DrafterConfig.from_hf_dict(raw, source="profile_round drafter")


# ---- attribution ----------------------------------------------------------------------------------------------
def part_of(op_name: str) -> str | None:
    if "round/draft" in op_name and "topk" in op_name:
        return "topk"
    m = re.search(r"round/(\w+)", op_name)
    return m.group(1) if m and m.group(1) in PARTS else None


# ---- run --------------------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="target decoder layers (of K2.6's 61)")
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="drafter layers but the last slide with this window (2048: the K2.6 drafter); 0: none")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--attn-backend", choices=("auto", *BACKENDS), default="auto",
                        help="verify_attn backend (auto: mosaic on an H100/H200 where it applies)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--ar", action="store_true", help="also the AR loop (no drafter)")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens per request")
    parser.add_argument("--trace-rounds", type=int, default=4)
    parser.add_argument("--command-buffers", action="store_true",
                        help="keep XLA's command buffers (kernels then attribute by name only)")
    parser.add_argument("--out", default="profile_round", help="directory for traces, HLO and results JSON")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    base, dtype = (kimi_k2_6(), jnp.bfloat16) if on_gpu else (tiny(), jnp.float32)
    cfg = dataclasses.replace(base, num_hidden_layers=args.layers)
    prompt = args.prompt if on_gpu else min(args.prompt, 48)
    dcfg = drafter_config(cfg, args.draft_layers, args.sliding_window)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    t_graph, t_state = build_model(cfg, dtype)
    d_graph, d_state = random_module(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0), param_dtype=dtype,
                                                           compute_dtype=dtype), 1, seed=1)
    print(f"K2.6 x {args.layers} layers + drafter x {args.draft_layers} on {jax.devices()[0].device_kind}: built in "
          f"{time.perf_counter() - t0:.0f} s; taps {dcfg.target_layer_ids}", flush=True)
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size - 2, (args.batch, prompt)), jnp.int32)
    lens = jnp.full((args.batch,), prompt, jnp.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), args.batch))
    plan = [("ddtree", b) for b in args.budgets] + ([("ar", 0)] if args.ar else [])
    results = []
    for mode, budget in plan:
        spec = DecodeSpec(mode=mode, batch=args.batch, prompt_cap=prompt, max_new_tokens=16 * max(ROUNDS),
                          budget=budget, block=1 if mode == "ar" else dcfg.block_size, vocab=cfg.vocab_size,
                          prefill_chunk=min(256, prompt), taps=() if mode == "ar" else dcfg.target_layer_ids,
                          mask_token_id=dcfg.mask_token_id,
                          attn_backend=None if args.attn_backend == "auto" else args.attn_backend)
        uses_drafter = mode != "ar"

        def merged(ts, ds):
            return nnx.merge(t_graph, ts), (nnx.merge(d_graph, ds) if uses_drafter else None)

        rows = RequestRows.of([RequestParams(max_new_tokens=spec.max_new_tokens)] * args.batch, [()] * args.batch,
                              1)  # greedy, no stop id: every round runs
        pre = jax.jit(lambda ts, ds, p, n, k: prefill(spec, *merged(ts, ds), p, n, k, rows))
        loop = jax.jit(lambda ts, ds, st, r: decode_loop(spec, *merged(ts, ds), st, r))
        tc = time.perf_counter()
        state = jax.block_until_ready(pre(t_state, d_state, prompts, lens, keys))
        compiled = loop.lower(t_state, d_state, state, jnp.int32(1)).compile()
        compile_s = time.perf_counter() - tc
        tag = f"{mode}_b{args.batch}" + (f"_B{budget}" if mode == "ddtree" else "")
        with open(os.path.join(args.out, f"{tag}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        scopes = hlo_scopes(compiled.as_text(), part_of)

        def run(rounds):
            return compiled(t_state, d_state, state, jnp.int32(rounds))

        secs = [median_s(lambda r=r: run(r), min_reps=3, max_reps=10, min_total_s=0.1) for r in ROUNDS]
        ran = [int(run(r).round) for r in ROUNDS]
        if ran != list(ROUNDS):
            raise RuntimeError(f"{tag}: decode_loop ran {ran} rounds, asked {list(ROUNDS)} (requests finished early)")
        round_us = (secs[1] - secs[0]) / (ROUNDS[1] - ROUNDS[0]) * 1e6
        trace_dir = os.path.join(args.out, f"trace_{tag}")
        jax.block_until_ready(run(args.trace_rounds))
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            final = jax.block_until_ready(run(args.trace_rounds))
        parts = part_times(gpu_kernels(trace_dir), scopes, part_of, PALLAS_PARTS, "outside the round",
                           args.trace_rounds)
        kernel_us = sum(parts.values())
        book = sum(parts.get(p, 0.0) for p in BOOKKEEPING)
        accept = np.asarray(final.accept_len)[:, :args.trace_rounds]
        row = dict(mode=mode, batch=args.batch, budget=budget, layers=args.layers, prompt=prompt,
                   round_us=round_us, fixed_us_per_call=(secs[0] * 1e6 - ROUNDS[0] * round_us),
                   kernel_us_per_round=kernel_us, parts_us=parts, bookkeeping_us=book,
                   bookkeeping_share=book / round_us, mean_accept=float(accept.mean()), compile_s=compile_s,
                   xla_flags=os.environ.get("XLA_FLAGS", ""), attn_backend=args.attn_backend)
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n" + markdown(results))
    write_results(os.path.join(args.out, f"profile_round_b{args.batch}.json"), results)


def markdown(rows: list[dict]) -> str:
    cols = list(PARTS) + ["unattributed"]
    out = ["| mode | batch | B | round µs (wall) | kernels µs | " + " | ".join(cols)
           + " | tree+topk+accept+cache_update | share of round |",
           "|---|---|---|---|---|" + "---|" * len(cols) + "---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['parts_us'].get(c, 0.0):.1f}" for c in cols)
        out.append(f"| {r['mode']} | {r['batch']} | {r['budget'] or '-'} | {r['round_us']:.1f} | "
                   f"{r['kernel_us_per_round']:.1f} | {cells} | {r['bookkeeping_us']:.1f} | "
                   f"{100 * r['bookkeeping_share']:.1f}% |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
