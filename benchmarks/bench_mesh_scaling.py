"""Sharded generation of a K2-shaped model on 1, 2, 4, 8 devices: same tokens as one device, and per-round time.

    python benchmarks/bench_mesh_scaling.py [--layers 4] [--meshes 1x1x2 1x1x4 1x1x8] [--modes ar chain ddtree]
                                            [--budget 16] [--batch 1] [--prompt-len 64] [--max-new-tokens 32]
                                            [--short-tokens 8] [--dtype float32] [--out scaling.json]

The target is `kimi_k2_6()` cut to `--layers` decoder layers (layer 0 dense, the rest MoE with 384 INT4 experts),
random weights made on the device leaf by leaf (`bench_kimi_layer.random_module`); the drafter is a random
one-layer DFlash drafter of the same width (it accepts ~nothing: this measures the cost of a round, not tau). The
one-device run (no mesh, the model's own MoE path) is the reference; each mesh runs the same generation with the
model sharded by the engine's rules (`sharding.shard_model`, expert-parallel MoE). In float32 it must give the
reference's tokens; in bfloat16 the sharded sums round in another order, so a near-tie of the random model may go
the other way. On every layout and dtype, chain and ddtree must give that layout's own ar tokens (last column).

A generation's wall time holds the prefill too, which at K2.6 width weighs like many rounds, so the time per round
is a slope: the same prompts generated for `--short-tokens` and for `--max-new-tokens` new tokens, (t2 - t1) /
(rounds2 - rounds1); what is left of the short run is the fixed part (prefill, transfers). Each generation runs once
to compile, then is timed. The tokens compared are the long run's. On a CPU backend it runs a tiny config over
simulated devices (set XLA_FLAGS=--xla_force_host_platform_device_count=8), which checks the script, not the speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kimi_layer import build_model, random_module  # noqa: E402
from bench_util import write_results  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax.decode.engine import Engine  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.model.drafter import DFlashDrafter  # noqa: E402
from kdtree_jax.model.drafter_config import DrafterConfig  # noqa: E402
from kdtree_jax.parallel import sharding as sh  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def target_config(layers: int, on_gpu: bool):
    base = kimi_k2_6() if on_gpu else tiny()
    return dataclasses.replace(base, num_hidden_layers=layers, first_k_dense_replace=min(1, layers - 1),
                               eos_token_id=())  # no stop token: every request runs to max_new_tokens


def drafter_config(cfg) -> DrafterConfig:
    """One layer of the target's width, fed by the first and last target layers (the DFlash recipe)."""
    heads = max(2, cfg.hidden_size // 128)
    return DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128 if heads > 2
                         else cfg.hidden_size // 2, vocab_size=cfg.vocab_size,
                         target_layer_ids=(0, cfg.num_hidden_layers - 1), mask_token_id=cfg.vocab_size - 1,
                         block_size=16, num_target_layers=cfg.num_hidden_layers, rope_theta=10000.0,
                         max_position_embeddings=cfg.max_position_embeddings)


def models(cfg, dtype, moe_impl: str):
    graphdef, state = build_model(cfg, dtype, moe_impl=moe_impl)
    dcfg = drafter_config(cfg)
    d_graphdef, d_state = random_module(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0), param_dtype=dtype), 32, seed=1)
    return nnx.merge(graphdef, state), nnx.merge(d_graphdef, d_state)


def run(engine: Engine, prompts, mode: str, args) -> dict:
    """Tokens and timing of one mode: ms per round from two generation lengths, the rest as fixed ms."""
    timed = []
    for n in (args.short_tokens, args.max_new_tokens):
        kw = dict(max_new_tokens=n, mode=mode, budget=args.budget)
        engine.generate(prompts, **kw)  # compile + first run
        timed.append(engine.generate(prompts, **kw))
    short, long = (r.stats for r in timed)
    extra_rounds = long.rounds - short.rounds
    ms_per_round = 1e3 * (long.wall_s - short.wall_s) / extra_rounds if extra_rounds > 0 else float("nan")
    return dict(tokens=[o.token_ids for o in timed[1].outputs], rounds=long.rounds, ms_per_round=ms_per_round,
                fixed_ms=1e3 * short.wall_s - short.rounds * ms_per_round, tokens_per_s=long.tokens_per_s)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--meshes", nargs="+", default=["1x1x2", "1x1x4", "1x1x8"], help="data x tensor x expert")
    p.add_argument("--modes", nargs="+", default=["ar", "chain", "ddtree"])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--short-tokens", type=int, default=8, help="the shorter generation of the round-time slope")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--out", help="write the rows as JSON")
    args = p.parse_args(argv)
    if not 1 <= args.short_tokens < args.max_new_tokens:
        p.error(f"--short-tokens must be in 1..--max-new-tokens - 1 ({args.max_new_tokens - 1}), "
                f"got {args.short_tokens}")
    on_gpu = jax.default_backend() == "gpu"
    cfg = target_config(args.layers, on_gpu)
    dtype = DTYPES[args.dtype]
    meshes = [m for m in args.meshes if int(np.prod([int(x) for x in m.split("x")])) <= jax.device_count()]
    skipped = sorted(set(args.meshes) - set(meshes))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size - 1, (args.batch, args.prompt_len)).tolist()

    def measure(engine: Engine, label: str, devices: int, reference: dict | None) -> dict:
        """Run every mode on `engine`; rows compare each mode's tokens with the one-device run of the mode and with
        this engine's own ar run (the engine's guarantee: ddtree and chain give ar's greedy tokens on any layout)."""
        runs = {mode: run(engine, prompts, mode, args) for mode in args.modes}
        for mode, r in runs.items():
            same = reference is None or r["tokens"] == reference[mode]["tokens"]
            same_as_ar = r["tokens"] == runs["ar"]["tokens"] if "ar" in runs else None
            rows.append(dict(mesh=label, mode=mode, devices=devices, same=same, same_as_ar=same_as_ar,
                             **{k: v for k, v in r.items() if k != "tokens"}))
            print(json.dumps(rows[-1]), flush=True)
        return runs

    rows = []
    target, drafter = models(cfg, dtype, "auto")
    reference = measure(Engine(target, drafter), "1 device", 1, None)
    del target

    for text in meshes:
        mesh = sh.parse_mesh(text, jax.devices()[: int(np.prod([int(x) for x in text.split("x")]))])
        target, _ = models(cfg, dtype, "ep")  # the same random weights (same seeds), expert-parallel MoE
        measure(Engine(sh.shard_model(target, mesh), drafter, mesh=mesh), text, mesh.size, reference)
        del target

    lines = [f"K2-shaped target, {args.layers} layers ({'K2.6 width' if on_gpu else 'tiny CPU config'}), "
             f"{args.dtype}, batch {args.batch}, prompt {args.prompt_len}, {args.max_new_tokens} new tokens, "
             f"ddtree B={args.budget}" + (f"; meshes skipped (too few devices): {skipped}" if skipped else ""),
             f" (ms / round: slope of {args.short_tokens} and {args.max_new_tokens} new tokens)",
             "", "| mesh | devices | mode | rounds | ms / round | fixed ms | tokens/s | same tokens as 1 device | "
             "same tokens as ar on this mesh |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['devices']} | {r['mode']} | {r['rounds']} | {r['ms_per_round']:.2f} | "
                     f"{r['fixed_ms']:.1f} | {r['tokens_per_s']:.1f} | {r['same']} | "
                     f"{'-' if r['same_as_ar'] is None else r['same_as_ar']} |")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
