"""Registers, spills and shared memory of every Pallas kernel at engine sizes, compiled for an H200 on a CPU.

    python benchmarks/kernel_resources.py [--out resources.json] [--only verify_attn]

Each case lowers a kernel (interpret=False) for an abstract H200 and compiles its Triton IR for sm_90 with the
`triton` package (`benchmarks/triton_report.py`); no GPU is used. A kernel whose shared memory exceeds what a
block may have cannot launch; one with stack bytes / LDL / STL spills registers in its inner loop.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_util import write_results  # noqa: E402
from triton_report import MIX_GROUPS, SHARED_LIMIT, instruction_mix, report  # noqa: E402

from pallas_kernels.int4_moe import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_BLOCK_W,
    DEFAULT_WARPS,
    UNPACK_MODES,
    int4_moe_ffn,
    tile_ffn_int4,
)
from pallas_kernels.tree_accept import tree_accept  # noqa: E402
from pallas_kernels.tree_build import tree_build  # noqa: E402
from pallas_kernels.verify_attn import verify_attn  # noqa: E402

SPEC = jax.ShapeDtypeStruct
K2_LATENT, K2_LORA, K2_HEADS, K2_SCALE = 576, 512, 64, 0.1446796
GROUP = 32  # INT4 scale group


def verify_case(bt: int, n: int, s: int, dtype, heads: int = K2_HEADS, layers: int | None = None, **kw):
    """layers: the engine's form, the whole [layers, Bt, S, A] cache read at its last layer (64-bit offsets)."""
    cache = (bt, s, K2_LATENT) if layers is None else (layers, bt, s, K2_LATENT)
    specs = (SPEC((bt, n, heads, K2_LATENT), dtype), SPEC(cache, dtype), SPEC((bt,), jnp.int32),
             SPEC((bt, n, K2_LATENT), dtype), SPEC((bt, n, n), jnp.bool_))
    layer = None if layers is None else layers - 1
    fn = functools.partial(verify_attn, scale=K2_SCALE, kv_lora_rank=K2_LORA, layer=layer, interpret=False, **kw)
    where = "" if layers is None else f" layer {layer} of {layers}"
    return f"verify_attn {jnp.dtype(dtype).name} batch={bt} N={n} H={heads} S={s}{where}", fn, specs


def tree_build_case(bt: int, budget: int, depth: int = 15):
    specs = (SPEC((bt, depth, budget), jnp.float32), SPEC((bt, depth, budget), jnp.int32), SPEC((bt,), jnp.int32))
    return f"tree_build batch={bt} B={budget} D={depth}", functools.partial(tree_build, budget=budget,
                                                                            interpret=False), specs


def tree_accept_case(bt: int, budget: int, depth: int = 15):
    specs = [SPEC((bt, budget + 1), jnp.int32)] * 3 + [SPEC((bt,), jnp.int32)]
    return f"tree_accept batch={bt} B={budget} D={depth}", functools.partial(tree_accept, max_depth=depth,
                                                                             interpret=False), specs


def int4_moe_case(m: int, d: int = 7168, inter: int = 2048, e: int = 384, k: int = 8, dtype=jnp.bfloat16,
                  unpack: str | None = None, tiled: bool = False):
    """unpack None: the kernel's default for the dtype (what the engine runs); tiled: the experts tile-major, as the
    engine stores them on one GPU (`tile_ffn_int4`), with each kernel's own launch."""
    specs = (SPEC((m, d), dtype), SPEC((m, k), jnp.int32), SPEC((m, k), jnp.float32),
             SPEC((e, inter, d // 8), jnp.int32), SPEC((e, inter, d // GROUP), jnp.bfloat16),
             SPEC((e, inter, d // 8), jnp.int32), SPEC((e, inter, d // GROUP), jnp.bfloat16),
             SPEC((e, d, inter // 8), jnp.int32), SPEC((e, d, inter // GROUP), jnp.bfloat16))
    if tiled:
        specs = specs[:3] + tuple(jax.eval_shape(tile_ffn_int4, *specs[3:]))
    tag = ("" if unpack is None else f" unpack={unpack}") + (" tile-major" if tiled else "")
    return (f"int4_moe tokens={m} E={e} top-{k}{tag}", functools.partial(int4_moe_ffn, unpack=unpack, interpret=False),
            specs)


# ---- INT4 unpack: instruction mix of the K loop -------------------------------------------------------------------
INT4_WEIGHT_SETS = {"int4_swiglu": 2, "int4_matmul": 1}  # gate + up fused, down alone
UNPACK_GROUPS = ("int_alu", "convert", "fp32", "half2")  # ALU work per weight (unpack, accumulate, addresses)
WARP = 32


def int4_weights_per_thread(kernel: str) -> int:
    """Weights one thread dequantizes per K-loop iteration with the default K2.6 tiles (every weight once)."""
    per_set = DEFAULT_BLOCK_N * DEFAULT_BLOCK_W * 8 // (WARP * DEFAULT_WARPS)
    return INT4_WEIGHT_SETS[kernel] * per_set


def int4_mix_rows(tokens=(1, 64), unpacks=UNPACK_MODES) -> list[dict]:
    """One row per (tokens, unpack, kernel): K-loop opcode groups and ALU instructions per weight."""
    rows = []
    for m in tokens:
        for unpack in unpacks:
            case, fn, specs = int4_moe_case(m, unpack=unpack)
            for mix in instruction_mix(fn, *specs):
                per_thread = int4_weights_per_thread(mix.name)
                groups = {g: mix.group(g) for g in MIX_GROUPS}
                alu = sum(groups[g] for g in UNPACK_GROUPS)
                rows.append(dict(tokens=m, unpack=unpack, name=mix.name, weights_per_thread=per_thread, **groups,
                                 loop_instructions=sum(mix.loop.values()), alu_per_weight=alu / per_thread,
                                 loop=mix.loop))
    return rows


def mix_markdown(rows: list[dict]) -> str:
    head = ["tokens", "unpack", "kernel", "weights/thread/iter", *MIX_GROUPS, "loop instr", "ALU instr/weight"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["tokens"], r["unpack"], r["name"], r["weights_per_thread"], *(r[g] for g in MIX_GROUPS),
                 r["loop_instructions"], f"{r['alu_per_weight']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def engine_cases() -> list:
    """The shapes the engine and the Kimi benchmarks launch: AR and tree verify, both dtypes; tree kernels up to
    B = 256 at batch 64; the INT4 expert FFN from one token to a 512-token prefill chunk, and tile-major up
    to a batch-64 B = 16 verify (1088 tokens)."""
    return [
        verify_case(1, 1, 32768, jnp.bfloat16), verify_case(64, 1, 8192, jnp.bfloat16),
        verify_case(8, 17, 32768, jnp.bfloat16, layers=61),
        verify_case(8, 17, 8192, jnp.bfloat16), verify_case(1, 257, 8192, jnp.bfloat16),
        verify_case(2, 17, 4096, jnp.float32, heads=8), verify_case(8, 65, 4096, jnp.float32),
        tree_build_case(64, 64), tree_build_case(64, 256), tree_accept_case(64, 64), tree_accept_case(64, 256),
        int4_moe_case(1), int4_moe_case(64), int4_moe_case(512),
        int4_moe_case(1, tiled=True), int4_moe_case(64, tiled=True), int4_moe_case(1088, tiled=True),
    ]


def markdown(rows: list[dict]) -> str:
    lines = ["| case | kernel | warps | stages | regs | stack B | LDL/STL | shared KiB | fits | blocks / SM | HGMMA/HMMA | "
             "cp.async+TMA |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['name']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
                     f"{r['stack_bytes']} | {r['spill_loads']}/{r['spill_stores']} | {r['shared_bytes'] / 1024:.0f} | "
                     f"{'yes' if r['shared_bytes'] <= SHARED_LIMIT else '**no**'} | {r['blocks_per_sm']} | "
                     f"{r['wgmma']}/{r['mma']} | {r['async_copies']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON to this path")
    parser.add_argument("--only", help="only cases whose name starts with this")
    parser.add_argument("--int4-mix", action="store_true",
                        help="instead: SASS instruction mix of the INT4 kernels' K loop, per unpack variant")
    args = parser.parse_args(argv)
    if args.int4_mix:
        print(mix_markdown(int4_mix_rows()))
        return
    rows = []
    for case, fn, specs in engine_cases():
        if args.only and not case.startswith(args.only):
            continue
        for res in report(fn, *specs):
            rows.append(dict(case=case, **dataclasses.asdict(res), blocks_per_sm=res.blocks_per_sm))
            print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    if args.out:
        write_results(args.out, rows)


if __name__ == "__main__":
    main()
