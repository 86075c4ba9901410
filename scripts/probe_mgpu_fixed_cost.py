"""The wgmma prefix kernel's time per call against the KV blocks each program reads: fixed cost vs streaming.

    python scripts/probe_mgpu_fixed_cost.py [--programs 8 128] [--blocks 0 1 2 4 8 16 32] [--micro] [--out f.json]

Calls `verify_attn_mgpu.prefix_attn` alone (no merge, no tree block) at H = 64 (one 64-row query tile per
request), K2 widths, bf16, on 8 distinct caches back to back in one jit under `jax.profiler`, and reports the GPU
time of the kernel per call. P programs = 8 requests x P/8 splits, each split reading `blocks` KV blocks of 64 rows
(blocks = 0: the q load, the empty loops and the partial write only). A line fitted through the rows of one program
count splits a call into a fixed part and a per-block part: the fixed part is what a short call cannot hide.
`--micro` times kernels of the same launch shape doing only parts of that fixed work (micro_kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from bench_kernels import SCALE, traced_kernels  # noqa: E402
from pallas_kernels import verify_attn_mgpu as vm  # noqa: E402

REQUESTS, CALLS, R, DR = 8, 8, 512, 64


def kernel_us(programs: int, blocks: int) -> float:
    splits = programs // REQUESTS
    prefix = splits * blocks * vm.BLOCK_K
    seq = max(prefix, vm.BLOCK_K)
    keys = jax.random.split(jax.random.key(programs * 100 + blocks), CALLS + 1)
    q = jax.random.normal(keys[0], (REQUESTS, vm.ROWS, R + DR), jnp.bfloat16)
    caches = [jax.random.normal(k, (1, REQUESTS, seq, R + DR), jnp.bfloat16) for k in keys[1:]]
    plen = jnp.full((REQUESTS,), prefix, jnp.int32)

    def call(q, c, p):
        return vm.prefix_attn(q, c, p, scale=SCALE, value_width=R, n_splits=splits)

    return mosaic_us_per_call(call, [(q, c, plen) for c in caches])


def mosaic_us_per_call(fn, sets) -> float:
    """GPU µs per call of the Mosaic GPU kernels fn launches, over `sets` run back to back in one jit."""
    return sum(e["dur"] for e in traced_kernels(fn, sets) if "mosaic" in e["name"]) / len(sets)


MICRO = ("launch", "q", "q+store", "q+tma-store")


def micro_kernel(variant: str, programs: int, interpret: bool = False):
    """A kernel with prefix_attn's launch shape (3 warpgroups, the same shared memory) doing only part of a program's
    fixed work: nothing ("launch"), the q tile's TMA load ("q"), plus the [64, 512] bf16 partial written from
    registers ("q+store") or staged in the q tile's shared memory and written by TMA ("q+tma-store")."""
    width, half = R + DR, R // 2

    def body(q_ref, out_ref, q_smem, kv_smem, p_smem, alpha_smem, q_bar):
        p, wg = lax.axis_index("p"), lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            if variant != "launch":
                plgpu.copy_gmem_to_smem(q_ref.at[p % REQUESTS], q_smem, q_bar)

        for w in (0, 1):
            @pl.when(wg == w)
            def _compute():
                if variant == "launch":
                    return
                plgpu.barrier_wait(q_bar)
                if variant == "q":
                    return
                acc = plgpu.broadcasted_iota(jnp.float32, (vm.ROWS, half), 1, layout=plgpu.Layout.WGMMA)
                acc = (acc * (p + 1).astype(jnp.float32)).astype(jnp.bfloat16)
                cols = pl.ds(w * half, half)
                if variant == "q+store":
                    out_ref.at[p, :, cols][...] = acc
                else:
                    q_smem.at[:, cols][...] = acc
                    plgpu.commit_smem()
                    for r0 in range(0, vm.ROWS, vm.TILE_ROWS):  # a TMA source must be contiguous: a tile row each
                        rows = pl.ds(r0, vm.TILE_ROWS)
                        plgpu.copy_smem_to_gmem(q_smem.at[rows, cols], out_ref.at[p, rows, cols])
                    plgpu.wait_smem_to_gmem(0)

    scratch = (*vm.shared_memory(jnp.bfloat16, width), plgpu.Barrier(num_barriers=1))
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs, vm.ROWS, R), jnp.bfloat16),
                        scratch_types=scratch, grid=(programs,), grid_names=("p",), num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
                        interpret=plgpu.InterpretGPUParams() if interpret else None)


def micro_us(variant: str, programs: int) -> float:
    kernel = micro_kernel(variant, programs)
    keys = jax.random.split(jax.random.key(programs), CALLS)
    qs = [jax.random.normal(k, (REQUESTS, vm.ROWS, R + DR), jnp.bfloat16) for k in keys]
    return mosaic_us_per_call(kernel, [(q,) for q in qs])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[8, 128], help="multiples of 8")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32])
    parser.add_argument("--micro", action="store_true", help="also the fixed-work-only kernels (micro_kernel)")
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("times the compiled kernel: needs a GPU backend")
    rows = []
    print("| programs | blocks per program | kernel µs | µs per block |\n|---|---|---|---|")
    for programs in args.programs:
        for blocks in args.blocks:
            us = kernel_us(programs, blocks)
            rows.append(dict(programs=programs, blocks=blocks, kernel_us=us))
            print(f"| {programs} | {blocks} | {us:.1f} | {us / blocks if blocks else float('nan'):.2f} |", flush=True)
    for programs in args.programs:
        pts = [(x["blocks"], x["kernel_us"]) for x in rows if x["programs"] == programs]
        if len(pts) >= 2:
            slope, fixed = np.polyfit(*zip(*pts), 1)
            print(f"{programs} programs: time ~ {fixed:.1f} µs + {slope:.2f} µs per block")
    if args.micro:
        print("\n| programs | fixed work only | kernel µs |\n|---|---|---|")
        for programs in args.programs:
            for variant in MICRO:
                us = micro_us(variant, programs)
                rows.append(dict(programs=programs, micro=variant, kernel_us=us))
                print(f"| {programs} | {variant} | {us:.1f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
