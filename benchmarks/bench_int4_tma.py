"""A TMA-fed INT4 expert matmul (Mosaic GPU) against the copy rate and the engine's Triton kernels.

    python benchmarks/bench_int4_tma.py [--experts 135] [--rows 16] [--modes weights scales loads full]
                                        [--tiles 512x4 256x6] [--out results.json]

Why: the engine's Triton INT4 kernels (`pallas_kernels.int4_moe`) reach 63-65% of copy in a batch-8 B = 16 verify
step (BENCHMARKS.md §4b); their loads alone reach 83-89% (§4a). This measures how far a Hopper-native design gets on
the same bytes: one persistent program per SM, a memory warpgroup streaming each K step's weight tile, scales and
activation tile by TMA into a ring of shared-memory stages across all of the program's tiles, and two compute
warpgroups that dequantize their 64 weight rows in registers (`astype` from int4) and issue wgmma with them as the
register A operand (y^T = W x^T: the tokens are wgmma's N side, so 16 rows cost no padding to 64).
On the H200 it loses to the Triton kernels (BENCHMARKS.md, "Tried, and why it lost"): the engine does not use it.

The problem is one grouped matmul: `experts` experts with `rows` token rows each, y^T[e] = W[e] x[e]^T, W int4
[E, N, K] (two's complement: the compressed-tensors offset-8 nibbles XOR 8), scale [E, K/G, N] bf16 (a group's N
scales contiguous: one [64] row vector per compute warpgroup and group), x [E, rows, K] bf16, at the gate/up shape
(N = 2I, K = D) and the down shape (N = D, K = I). Modes isolate the loads: `weights` streams only the weight tiles,
`scales` adds the scale tiles, `loads` adds the activation tiles (the compute warpgroups only wait and release each
stage), `full` dequantizes and multiplies. Bytes counted are the mode's full problem (weights + scales +
activations + output) in every mode, so the modes compare on one scale. The Triton columns run `moe_gate_up` /
`moe_down` on tile-major weights with each expert holding exactly `rows` rows. On a CPU backend it runs the kernel
once in Mosaic GPU's interpreter on a small shape against a float64 reference (no timings).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_int4_moe import random_int4  # noqa: E402
from bench_util import copy_ceiling, median_s, write_results  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from kdtree_jax.model.config import kimi_k2_6  # noqa: E402
from pallas_kernels.verify_attn import SM_COUNT  # noqa: E402
from pallas_kernels.verify_attn_mgpu import COMPUTE_REGS, MEMORY_REGS, ROWS, SWIZZLE, TILE_ROWS  # noqa: E402

K26 = kimi_k2_6()
GROUP = K26.quantization.group_size  # INT4 scale group along K
COMPUTE_WARPGROUPS = 2  # each takes ROWS (wgmma's M) weight rows of a tile
MODES = ("weights", "scales", "loads", "full")


def _transforms(bits: int, cols: int):
    """Shared-memory tiling + swizzle for rows of `cols` elements of `bits` each (the widest swizzle a row fills)."""
    swizzle = min(SWIZZLE, cols * bits // 8)
    return plgpu.TilingTransform((TILE_ROWS, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def tma_int4_matmul(w, scale, x, *, tk: int = 512, stages: int = 4, mode: str = "full", programs: int = SM_COUNT,
                    interpret: bool = False):
    """w int4 [E, N, K], scale bf16 [E, K/G, N], x bf16 [E, M, K] -> y^T f32 [E, N, M] (see the module docstring)."""
    e, n, k = w.shape
    m = x.shape[1]
    tile_n = COMPUTE_WARPGROUPS * ROWS
    if mode not in MODES or n % tile_n or k % tk or tk % GROUP or m % 8:
        raise ValueError(f"tma_int4_matmul: mode {mode!r} (one of {MODES}), N={n} % {tile_n}, K={k} % tk={tk}, "
                         f"tk % {GROUP} and rows M={m} % 8 must all hold")
    n_tiles, k_steps, groups = n // tile_n, k // tk, tk // GROUP
    tiles = n_tiles * e

    def body(w_ref, s_ref, x_ref, out_ref, w_smem, s_smem, x_smem, w_bar, s_bar, x_bar, free):
        prog, wg = lax.axis_index("prog"), lax.axis_index("wg")
        mine = (tiles - prog + programs - 1) // programs  # tiles prog, prog + programs, ...
        steps = mine * k_steps

        def tile(u):
            t = prog + u * programs
            return t // n_tiles, t % n_tiles  # expert, N tile

        def load(f, slot):
            ex, j = tile(f // k_steps)
            i = f % k_steps
            cols = pl.ds(pl.multiple_of(i * tk, tk), tk)
            n_rows = pl.ds(j * tile_n, tile_n)
            plgpu.copy_gmem_to_smem(w_ref.at[ex, n_rows, cols], w_smem.at[slot], w_bar.at[slot])
            if mode != "weights":
                plgpu.copy_gmem_to_smem(s_ref.at[ex, pl.ds(i * groups, groups), n_rows], s_smem.at[slot],
                                        s_bar.at[slot])
            if mode in ("loads", "full"):
                plgpu.copy_gmem_to_smem(x_ref.at[ex, :, cols], x_smem.at[slot], x_bar.at[slot])

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGS, action="decrease")

            @pl.loop(0, steps)
            def _stream(f):
                slot = lax.rem(f, stages)
                pl.when(f >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                load(f, slot)

            @pl.loop(jnp.maximum(steps - stages, 0), steps)
            def _drain(f):  # every phase is consumed before the program ends (the interpreter checks it)
                plgpu.barrier_wait(free.at[lax.rem(f, stages)])

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            r0 = pl.multiple_of(wg * ROWS, ROWS)

            def landed(slot):
                plgpu.barrier_wait(w_bar.at[slot])
                if mode != "weights":
                    plgpu.barrier_wait(s_bar.at[slot])
                if mode in ("loads", "full"):
                    plgpu.barrier_wait(x_bar.at[slot])

            def dequant(slot):
                """This warpgroup's [64, tk] weights in bf16, in the wgmma register layout (int4 loaded 8 to a
                32-bit word, re-laid out, then converted)."""
                wq = plgpu.load(w_smem.at[slot, pl.ds(r0, ROWS)], layout=plgpu.Layout.WGMMA_UPCAST_4X)
                return plgpu.layout_cast(wq, plgpu.Layout.WGMMA).astype(jnp.bfloat16)

            def scaled(slot, g, wf):
                """Group g's [64, 32] weights times their per-row scale."""
                sg = plgpu.load(s_smem.at[slot, g, pl.ds(r0, ROWS)], layout=plgpu.Layout.WGMMA.reduce(1),
                                optimized=False)
                return wf[:, g * GROUP:(g + 1) * GROUP] * lax.broadcast_in_dim(sg, (ROWS, GROUP), [0])

            @pl.loop(0, mine)
            def _tile(u):
                ex, j = tile(u)
                f0 = u * k_steps
                if interpret:  # the interpreter's wgmma takes no register operand: the same product in jnp
                    def step(i, acc):
                        slot = lax.rem(f0 + i, stages)
                        landed(slot)
                        wf = dequant(slot)
                        for g in range(groups):
                            xg = x_smem[slot, :, pl.ds(g * GROUP, GROUP)]
                            acc = acc + lax.dot_general(scaled(slot, g, wf), xg, (((1,), (1,)), ((), ())),
                                                        preferred_element_type=jnp.float32)
                        plgpu.barrier_arrive(free.at[slot])
                        return acc
                    acc = lax.fori_loop(0, k_steps, step, jnp.zeros((ROWS, m), jnp.float32))
                else:
                    def accumulate(acc_ref):
                        @pl.loop(0, k_steps)
                        def _k(i):
                            slot = lax.rem(f0 + i, stages)
                            landed(slot)
                            if mode == "full":
                                wf = dequant(slot)
                                for g in range(groups):
                                    b = x_smem.at[slot, :, pl.ds(g * GROUP, GROUP)].T
                                    plgpu.wgmma(acc_ref, scaled(slot, g, wf), b)
                                    plgpu.wgmma_wait(1)
                                plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(free.at[slot])
                        return acc_ref[...]
                    acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, m), jnp.float32))
                out_ref.at[ex, pl.ds(j * tile_n + r0, ROWS)][...] = acc

    scratch = (
        plgpu.SMEM((stages, tile_n, tk), jnp.int4, transforms=_transforms(4, tk)),
        plgpu.SMEM((stages, groups, tile_n), jnp.bfloat16),
        plgpu.SMEM((stages, m, tk), jnp.bfloat16, transforms=_transforms(16, GROUP)),  # wgmma reads 32-column slices
        plgpu.Barrier(num_barriers=stages),  # weights landed
        plgpu.Barrier(num_barriers=stages),  # scales landed
        plgpu.Barrier(num_barriers=stages),  # activations landed
        plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),  # stage read by both compute warpgroups
    )
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((e, n, m), jnp.float32), scratch_types=scratch, grid=(programs,),
        grid_names=("prog",), num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return kernel(w, scale, x)


def random_problem(experts: int, n: int, k: int, rows: int, seed: int = 0):
    """(int4 values as int32 [E, N, K], scale [E, K/G, N] bf16, x [E, rows, K] bf16), never zeros."""
    kw, ks, kx = jax.random.split(jax.random.key(seed), 3)
    wi = jax.random.randint(kw, (experts, n, k), -8, 8, jnp.int32)
    scale = (jax.random.uniform(ks, (experts, k // GROUP, n), jnp.float32, 0.5, 1.5) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (experts, rows, k), jnp.float32).astype(jnp.bfloat16)
    return wi, scale, x


def reference(wi, scale, x) -> np.ndarray:
    """float64 y^T of the bf16-rounded dequantized weights (as the kernel forms them) times x."""
    w = np.asarray(wi, np.float64) * np.repeat(np.asarray(scale, np.float64).swapaxes(1, 2), GROUP, axis=2)
    w = np.asarray(jnp.asarray(w, jnp.float32).astype(jnp.bfloat16), np.float64)
    return np.einsum("enk,emk->enm", w, np.asarray(x, np.float64))


def max_rel_err(y, ref: np.ndarray) -> float:
    """Largest |y - ref| relative to the largest |ref|."""
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))


def problem_bytes(experts: int, n: int, k: int, rows: int) -> int:
    return experts * (n * k // 2 + k // GROUP * n * 2 + rows * k * 2 + n * rows * 4)


def time_tma(problem, copy_bw, **kw) -> dict:
    """One config on `problem` = (w int4, scale, x)."""
    w4, scale, x = problem
    (experts, n, k), rows = w4.shape, x.shape[1]
    f = jax.jit(functools.partial(tma_int4_matmul, **kw))
    jax.block_until_ready(f(w4, scale, x))
    s = median_s(lambda: f(w4, scale, x))
    return dict(kernel="tma", n=n, k=k, **kw, us=s * 1e6, copy_frac=problem_bytes(experts, n, k, rows) / s / copy_bw)


def time_triton(experts: int, d: int, inter: int, rows: int, copy_bw: float) -> list[dict]:
    """The engine's gate/up and down kernels (tile-major weights) with each expert holding exactly `rows` rows."""
    from pallas_kernels.int4_moe import moe_down, moe_gate_up, moe_route, tile_ffn_int4
    keys = jax.random.split(jax.random.key(1), 4)
    w = [a for key, (n, kin) in zip(keys, ((inter, d), (inter, d), (d, inter)))
         for a in random_int4(key, experts, n, kin, GROUP)]
    w = list(jax.jit(tile_ffn_int4)(*w))
    top_k = 8
    tokens = experts * rows // top_k
    idx = (jnp.arange(tokens * top_k, dtype=jnp.int32) % experts).reshape(tokens, top_k)  # distinct per token
    x = jax.random.normal(keys[3], (tokens, d), jnp.float32).astype(jnp.bfloat16)
    layout, xt, tok = moe_route(x, idx, experts, group_size=GROUP, block_m=rows)
    gate_up = jax.jit(lambda layout, xt, tok, *w: moe_gate_up(xt, layout, tok, (w[0], w[1]), (w[2], w[3]),
                                                              out_nibble_major=True))
    h = jax.block_until_ready(gate_up(layout, xt, tok, *w))
    down = jax.jit(lambda layout, h, *w: moe_down(h, layout, (w[4], w[5]), nibble_major=True))
    jax.block_until_ready(down(layout, h, *w))
    out = []
    for name, fn, n, k in (("gate_up", lambda: gate_up(layout, xt, tok, *w), 2 * inter, d),
                           ("down", lambda: down(layout, h, *w), d, inter)):
        s = median_s(fn)
        out.append(dict(kernel=f"triton_{name}", n=n, k=k, us=s * 1e6,
                        copy_frac=problem_bytes(experts, n, k, rows) / s / copy_bw))
    return out


def cpu_check() -> float:
    wi, scale, x = random_problem(2, COMPUTE_WARPGROUPS * ROWS, 512, 16)
    y = tma_int4_matmul(wi.astype(jnp.int4), scale, x, tk=256, stages=2, programs=3, interpret=True)
    return max_rel_err(y, reference(wi, scale, x))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=135, help="distinct experts (135: a batch-8 B = 16 verify)")
    parser.add_argument("--rows", type=int, default=16, help="token rows per expert")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tiles", nargs="+", default=["512x4", "256x6"], help="K step x stages, e.g. 512x4")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"backend {jax.default_backend()}: interpreter check only; max relative error vs float64: "
              f"{cpu_check():.2e}")
        return
    d, inter = K26.hidden_size, K26.moe_intermediate_size
    copy_bw = copy_ceiling(1 << 30)
    rows = time_triton(args.experts, d, inter, args.rows, copy_bw)
    for n, k in ((2 * inter, d), (d, inter)):
        wi, scale, x = random_problem(args.experts, n, k, args.rows)
        problem = (wi.astype(jnp.int4), scale, x)
        del wi  # the int32 values are 8x the int4 weights
        for tile in args.tiles:
            tk, stages = (int(v) for v in tile.split("x"))
            for mode in args.modes:
                try:
                    rows.append(time_tma(problem, copy_bw, tk=tk, stages=stages, mode=mode))
                except Exception as err:  # noqa: BLE001 - a config that does not fit is recorded, the sweep goes on
                    rows.append(dict(kernel="tma", n=n, k=k, tk=tk, stages=stages, mode=mode,
                                     error=f"{type(err).__name__}: {str(err)[:200]}"))
    print(f"## {jax.devices()[0].device_kind}: {args.experts} experts x {args.rows} rows, "
          f"copy {copy_bw / 1e9:.0f} GB/s")
    print("| kernel | N x K | K step x stages | mode | µs | % of copy |\n|---|---|---|---|---|---|")
    for r in rows:
        cfg_s = f"{r['tk']}x{r['stages']}" if "tk" in r else "-"
        res = r["error"] if "error" in r else f"{r['us']:.1f} | {r['copy_frac']:.0%}"
        print(f"| {r['kernel']} | {r['n']} x {r['k']} | {cfg_s} | {r.get('mode', '-')} | {res} |")
    if args.out:
        write_results(args.out, dict(device=jax.devices()[0].device_kind, copy_gbps=copy_bw / 1e9, rows=rows))


if __name__ == "__main__":
    main()
