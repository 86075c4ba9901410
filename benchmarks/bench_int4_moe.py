"""INT4 routed-expert FFN on one GPU: the Pallas grouped kernel vs dequantize-then-matmul in XLA vs bf16 experts.

    python benchmarks/bench_int4_moe.py [--quick] [--out results.json] [--tune] [--kernel-only] [--unpack f32,bf16x2]
                                        [--breakdown] [--budget-s 200] [--skew 1.5] [--part-tune] [--unpack-drop]
                                        [--once]

K2.6 MoE layer shapes (hidden 7168, expert width 2048, 384 experts, top-8, INT4 group 32). For each token count the
routing is random (distinct experts per token; uniform, or Zipf-skewed with --skew, and each row gives the row blocks
of its block_m that the experts' rows fill); N_SETS input sets (x and routing) run back to back inside
one jit (`bench_util.per_call_s`: host dispatch amortised, and L2 never holds the previous call's experts). Bytes = the distinct touched experts' packed words + scales (gate, up,
down); "% copy" = achieved bandwidth / a device copy measured in the same run. The bf16 column runs the same routed
shape with bf16 experts through XLA (`ragged_dot`, and `gather` for small counts). Every config is guarded: an OOM or
compile failure is recorded and the sweep goes on. On a CPU backend it runs a tiny smoke sweep (numbers meaningless).
--unpack times each listed INT4 unpack variant (`int4_moe.UNPACK_MODES`) on the same inputs and weights, and checks
each variant's output against the first one's on one input set (they should agree bit for bit). On CPU the bf16x2
variant runs its jnp stand-in in the interpreter (inline PTX needs a GPU), and the smoke sweep uses bf16 activations
when it is asked for (bf16x2 requires them).
--breakdown times the parts of one `int4_moe_ffn` call alone, each on the previous part's precomputed outputs and
in its own back-to-back jit: the routing glue before the first kernel (`moe_route`), the fused gate/up kernel (h
written nibble-major), the down kernel, the combine; each part's share of the whole call (timed alongside).
--tune times TUNE configs (block_n, block_w, warps, num_stages, split_k, weight layout) with the default unpack at
TUNE_TOKENS and reports the best per token count; no new config starts after --budget-s seconds (one GPU call has a
hard limit). --part-tune times the gate/up and the down kernel each alone under PART_TUNE configs (tiles, warps,
stages, N tiles per program) at the --tune-tokens, each with its % of the copy rate. --layouts times the default
kernel on row-major weights and on tile-major ones in the engine's tiles (`int4_moe.tile_ffn_int4`).
--unpack-drop times each kernel at the engine's launch with the bf16x2 unpack's sub, then its sub and mul, left out
(UNPACK_DROPS: wrong values, GPU only), beside the whole unpack: the kernel's time that its ALU work costs.
--once runs each --unpack variant's FFN once per token count on tile-major weights at the engine's launches, after
compiling it, and times nothing: the calls a profiler records (`ncu -k regex:int4 python ... --once`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import copy_ceiling, finish_on_sigterm, is_oom, per_call_s, short_error, write_results  # noqa: E402

from pallas_kernels import int4_moe  # noqa: E402
from pallas_kernels.int4_moe import (  # noqa: E402
    DOWN_LAUNCH,
    GATE_UP_LAUNCH,
    UNPACK_BF16X2,
    UNPACK_F32,
    UNPACK_MODES,
    Launch,
    bf16_gather_ffn,
    bf16_ragged_dot_ffn,
    dequant_then_matmul_ffn,
    ffn_block_m,
    grouped_int4_matmul,
    int4_moe_ffn,
    moe_combine,
    moe_gate_up,
    moe_route,
    tile_ffn_int4,
    tile_int4,
)

N_SETS = 8  # input sets per timed jit, run back to back (dispatch amortised; routing differs call to call)
GATHER_MAX_TOKENS = 16  # gathering weights per pair copies k experts per token: only for small counts


@dataclasses.dataclass(frozen=True)
class Shape:
    d: int = 7168
    inter: int = 2048
    experts: int = 384
    top_k: int = 8
    group: int = 32
    tokens: tuple[int, ...] = (1, 8, 16, 64, 256, 512)
    copy_bytes: int = 2 << 30
    skew: float = 0.0  # routing: expert e drawn with weight (e + 1) ** -skew (Zipf); 0 = uniform


FULL = Shape()
QUICK = dataclasses.replace(FULL, tokens=(1, 16, 256))
CPU_SMOKE = Shape(d=1024, inter=128, experts=16, top_k=2, tokens=(1, 5), copy_bytes=16 << 20)  # D: 4 K tiles


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    block_n: int
    block_w: int = 32
    warps: int = 8
    stages: int = 2
    split_k: int = 1  # gate/up kernel only
    tiled: bool = False  # weights tile-major (`tile_int4`) at (block_n, block_w)

    @property
    def key(self) -> str:
        tail = "_tiled" if self.tiled else ""
        return f"pallas_bn{self.block_n}_bw{self.block_w}_w{self.warps}_s{self.stages}_k{self.split_k}{tail}"


# One launch for both kernels (the per-kernel launches are --part-tune's): tile-major 128 x 32 words, 8 warps, 3
# stages first, then tile-major neighbours (narrower N tiles, deeper pipeline, wider / narrower K tiles), then
# row-major ones around the row-major default (64, 32, 8 warps, 3 stages) with split-K gate/up for decode (K2.6
# gate/up: 28 K tiles of 32 words, so split_k 2 and 4 divide them). A run past --budget-s skips the configs at the end.
TUNE = (TuneConfig(128, stages=3, tiled=True), TuneConfig(64, stages=3, tiled=True),
        TuneConfig(64, stages=4, tiled=True), TuneConfig(32, warps=4, stages=3, tiled=True),
        TuneConfig(64, block_w=64, stages=3, tiled=True), TuneConfig(128, block_w=16, stages=4, tiled=True),
        TuneConfig(64), TuneConfig(64, stages=3), TuneConfig(64, stages=4),
        TuneConfig(32, warps=4), TuneConfig(32, warps=4, stages=3), TuneConfig(128), TuneConfig(128, stages=3),
        TuneConfig(64, split_k=2), TuneConfig(64, split_k=4), TuneConfig(32, warps=4, stages=3, split_k=4))
TUNE_TOKENS = (1, 16)  # decode and a small verify tree: where the grid, not the bytes, may bound the call


def part_key(launch: Launch) -> str:
    """A --part-tune config's row key."""
    return (f"bn{launch.block_n}_bw{launch.block_w}_w{launch.num_warps}_s{launch.num_stages}"
            f"_n{launch.n_per_program}" + ("_swap" if launch.swap_ab else "") + ("_acc" if launch.acc_in_dot else ""))


# --part-tune: each kernel alone, the engine's launch first, then its neighbours. The sm_90 report at 64 tokens
# (`triton_report.py`): on [16-32 rows, block_n] (M = the row block) the K loop runs mma.sync, and with an add after
# each dot one fp32 add per output element per dot (gate/up: 192 registers, 88 KiB, 2 programs an SM, where ncu saw
# an instruction issued in only 59% of cycles); with the accumulator inside the dot (the engine's gate/up) 16% fewer
# K-loop instructions and 172 registers. Swapped (y^T = W x^T, M = block_n) with the accumulator inside it runs
# wgmma from registers in fewer registers: gate/up 128 x 32 words 182 (2 programs), 128 x 16 96 (4), 8 warps 95
# (2 x 8 warps); down 128 x 32 161 (3), 128 x 16 80 (6). 256 x 16 words reads each activation row half as often per
# weight byte (at 8 live rows a block, down's h rows are a fifth of its weight bytes). At 1 token (8 experts) down
# walking 4 of its 56 N tiles a program runs 112 programs on 132 SMs; 2 or 1 tile a program fills them.
_WG = dict(swap_ab=True, acc_in_dot=True)
PART_TUNE = {
    "gate_up": (GATE_UP_LAUNCH, Launch(128, 32, 4), Launch(128, 32, 4, **_WG),
                Launch(128, 16, 4, **_WG), Launch(128, 16, 4, num_stages=4, **_WG), Launch(128, 32, 8, **_WG),
                Launch(64, 32, 4, **_WG), Launch(256, 16, 4, **_WG), Launch(256, 16, 4)),
    "down": (DOWN_LAUNCH, Launch(128, 32, 4, n_per_program=4, acc_in_dot=True),
             Launch(128, 32, 4, n_per_program=4, **_WG), Launch(128, 16, 4, n_per_program=4, **_WG),
             Launch(128, 32, 8, n_per_program=4, **_WG), Launch(256, 16, 4, n_per_program=4, **_WG),
             Launch(64, 64, 4, n_per_program=4, **_WG), Launch(256, 16, 4, n_per_program=4),
             Launch(64, 64, 4, n_per_program=4), Launch(128, 32, 4, n_per_program=2),
             Launch(128, 32, 4, n_per_program=1)),
}
BREAKDOWN_PARTS = ("route", "gate_up", "down", "combine")
# --unpack-drop: the engine's launch of each kernel with instructions left out of its bf16x2 unpack (wrong values,
# timing only), against the whole unpack: how much of the kernel's time its ALU work costs. "sub, mul": each plane
# is the magic-ORed nibble itself.
UNPACK_DROPS = {"none": (), "sub": ("sub.rn.bf16x2",), "sub, mul": ("sub.rn.bf16x2", "mul.rn.bf16x2")}
BF16X2_MUL = "mul.rn.bf16x2 $0, u, $3;"  # the unpack's last instruction, which writes the plane


CPU_UNPACK_NOTE = "CPU: bf16x2 runs its jnp stand-in in the Pallas interpreter, not the inline PTX (needs a GPU)"


# ---- timing helpers (also used by bench_kimi_layer.py) -----------------------------------------------------------
def cycling(fn, sets):
    """A no-argument callable that runs fn on the next input set each call."""
    state = {"i": 0}

    def call():
        args = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args)

    return call


# ---- weights and inputs ------------------------------------------------------------------------------------------
def random_int4(key, e: int, n_out: int, n_in: int, group: int):
    """Random packed words and bf16 scales made on the device (magnitude of a 1/sqrt(fan_in) init)."""
    kb, ks = jax.random.split(key)
    bits = jax.random.bits(kb, (e, n_out, n_in // 8), jnp.uint32)
    scale = jax.random.uniform(ks, (e, n_out, n_in // group), jnp.float32, 0.5, 1.5) / (4.0 * n_in**0.5)
    return jax.lax.bitcast_convert_type(bits, jnp.int32), scale.astype(jnp.bfloat16)


def int4_expert_bytes(shape: Shape) -> int:
    """Packed words + bf16 scales of one expert's gate, up and down."""
    per_matrix = shape.d * shape.inter
    return 3 * (per_matrix // 2 + per_matrix // shape.group * 2)


def make_sets(shape: Shape, tokens: int, dtype, seed: int):
    """N_SETS (x [M, D], idx [M, k] distinct experts, weights [M, k]) made on the device. Each token's k experts
    are drawn without replacement with weights (e + 1) ** -skew (Gumbel top-k): skew 0 is uniform; larger skews put
    many tokens on a few experts, as tokens of one context (a verify tree) do."""
    sets = []
    log_w = -shape.skew * jnp.log(jnp.arange(1, shape.experts + 1, dtype=jnp.float32))
    for i in range(N_SETS):
        kx, kr, kw = jax.random.split(jax.random.key(seed * 100 + i), 3)
        x = jax.random.normal(kx, (tokens, shape.d), dtype)
        _, idx = jax.lax.top_k(jax.random.gumbel(kr, (tokens, shape.experts)) + log_w, shape.top_k)
        w = jax.random.uniform(kw, (tokens, shape.top_k), jnp.float32, 0.2, 1.0)
        sets.append((x, idx.astype(jnp.int32), w))
    return sets


def distinct_experts(sets) -> float:
    return float(np.mean([len(np.unique(np.asarray(idx))) for _, idx, _ in sets]))


def row_blocks(sets, n_experts: int, block_m: int) -> float:
    """Mean used row blocks of `block_m` rows (each expert's rows rounded up to whole blocks): the weight passes a
    kernel reading each expert once per block would make, against `distinct_experts` passes."""
    counts = [np.bincount(np.asarray(idx).ravel(), minlength=n_experts) for _, idx, _ in sets]
    return float(np.mean([np.sum(-(-c // block_m)) for c in counts]))


# ---- sweep ---------------------------------------------------------------------------------------------------------
def unpack_key(unpack: str) -> str:
    """Row key of an unpack variant's timing (the fp32 path keeps the historical `pallas_int4`)."""
    return "pallas_int4" if unpack == UNPACK_F32 else f"pallas_int4_{unpack}"


def parse_unpacks(text: str) -> tuple[str, ...]:
    unpacks = tuple(u.strip() for u in text.split(",") if u.strip())
    bad = [u for u in unpacks if u not in UNPACK_MODES]
    if bad or not unpacks:
        raise SystemExit(f"--unpack: {bad or text!r} not in {UNPACK_MODES}")
    return unpacks


def check_variants(row: dict, outs: dict, unpacks) -> None:
    """Each variant's output vs the first variant's on the same inputs: bitwise equality and the largest gap."""
    first = unpacks[0]
    for u in unpacks[1:]:
        if u in outs and first in outs:
            row[f"{u}_same_bits_as_{first}"] = bool(np.array_equal(outs[u], outs[first]))
            row[f"{u}_max_abs_diff_vs_{first}"] = float(np.max(np.abs(outs[u] - outs[first])))


def tuned_ffn(cfg: TuneConfig, interpret: bool):
    tiles = {} if cfg.tiled else dict(block_n=cfg.block_n, block_w=cfg.block_w)  # tile-major: the arrays' tiles
    return lambda x, i, w, *ws: int4_moe_ffn(x, i, w, *ws, num_warps=cfg.warps, num_stages=cfg.stages,
                                             split_k=cfg.split_k, interpret=interpret, **tiles)


def tiled_weights(w4, block_n: int | None = None, block_w: int | None = None) -> list:
    """The six expert arrays tile-major, made on the device: in the engine's tiles (`tile_ffn_int4`) unless given."""
    if block_n is None and block_w is None:
        return list(jax.jit(tile_ffn_int4)(*w4))
    tile = jax.jit(functools.partial(tile_int4, block_n=block_n, block_w=block_w))
    return [a for p, s in zip(w4[::2], w4[1::2]) for a in tile(p, s)]


def run_tune(row: dict, sets, w4, interpret: bool, deadline: float) -> None:
    """Each TUNE config's ms in `row` (or its error, or `skipped` past the deadline), then the best one."""
    for cfg in TUNE:
        if time.perf_counter() > deadline:
            row[f"{cfg.key}_error"] = "skipped: --budget-s reached"
            continue
        try:
            ws = tiled_weights(w4, cfg.block_n, cfg.block_w) if cfg.tiled else w4
            row[f"{cfg.key}_ms"] = per_call_s(tuned_ffn(cfg, interpret), [s + tuple(ws) for s in sets]) * 1e3
            del ws
        except Exception as e:  # noqa: BLE001
            row[f"{cfg.key}_error"] = short_error(e)
    timed = {c.key: row[f"{c.key}_ms"] for c in TUNE if f"{c.key}_ms" in row}
    if timed:
        row["tune_best"] = min(timed, key=timed.get)


def stage_fns(shape: Shape, interpret: bool):
    """The parts of one `int4_moe_ffn` call (default tiles and unpack), each returning what the next part takes.
    Outputs pass an optimization barrier: the timing jit reads one element of each, which XLA could otherwise
    compute alone (a gather or reorder sliced to one element costs nothing)."""
    kw = dict(interpret=interpret)
    bar = jax.lax.optimization_barrier

    def route(x, i, w, *ws):
        return bar(moe_route(x, i, shape.experts, group_size=shape.group))

    def gate_up(layout, xt, token, *ws):
        return bar(moe_gate_up(xt, layout, token, (ws[0], ws[1]), (ws[2], ws[3]), out_nibble_major=True, **kw))

    def down(layout, hp, *ws):
        return bar(grouped_int4_matmul(hp, ((ws[4], ws[5]),), layout, nibble_major=True, **kw))

    def combine(y, layout, w):
        return bar(moe_combine(y, layout, w, y.dtype))

    return dict(route=route, gate_up=gate_up, down=down, combine=combine)


def run_breakdown(row: dict, sets, w4, shape: Shape, interpret: bool, whole) -> None:
    """Times the whole call and each part alone on the same input sets (each part's inputs precomputed)."""
    fns = stage_fns(shape, interpret)
    ws = tuple(w4)
    try:
        routed = [jax.jit(fns["route"])(*s, *ws) for s in sets]
        hs = [jax.jit(fns["gate_up"])(*r, *ws) for r in routed]  # nibble-major, as down reads it
        ys = [jax.jit(fns["down"])(r[0], h, *ws) for r, h in zip(routed, hs)]
        part_args = dict(route=[s + ws for s in sets], gate_up=[tuple(r) + ws for r in routed],
                         down=[(r[0], h) + ws for r, h in zip(routed, hs)],
                         combine=[(y, r[0], s[2]) for y, r, s in zip(ys, routed, sets)])
        row["bd_whole_ms"] = per_call_s(lambda *a: jax.lax.optimization_barrier(whole(*a)),
                                        [s + ws for s in sets]) * 1e3
        for part in BREAKDOWN_PARTS:
            row[f"bd_{part}_ms"] = per_call_s(fns[part], part_args[part]) * 1e3
        parts_out = np.asarray(fns["combine"](ys[0], routed[0][0], sets[0][2]).astype(jnp.float32))
        row["bd_parts_equal_whole"] = bool(np.array_equal(parts_out, np.asarray(
            jax.jit(whole)(*sets[0], *ws).astype(jnp.float32))))
    except Exception as e:  # noqa: BLE001
        row["bd_error"] = short_error(e)


def run_part_tune(row: dict, sets, w4, shape: Shape, interpret: bool, deadline: float, configs_by_part=None,
                  tag: str = "pt", loads_only: bool = True) -> None:
    """Gate/up and down each alone (inputs precomputed, as --breakdown) under each PART_TUNE config (or
    configs_by_part's), tile-major at the config's tiles: ms, % of the copy rate for the part's bytes (its share of
    the distinct experts' words and scales), and whether the routed pairs' output bits equal the first config's (K
    tiles of another width add in another order: expected to differ in the last bits). Row keys start with `tag`;
    loads_only: also the first config's loads alone."""
    kw = dict(interpret=interpret)
    route = jax.jit(lambda x, i: moe_route(x, i, shape.experts, group_size=shape.group))
    routed = [route(x, i) for x, i, _ in sets]
    tile = functools.partial(jax.jit, static_argnames=("block_n", "block_w"))(tile_int4)
    hs = None
    for part, configs in (configs_by_part or PART_TUNE).items():
        first = None
        for cfg in configs:
            key = f"{tag}_{part}_{part_key(cfg)}"
            if time.perf_counter() > deadline:
                row[f"{key}_error"] = "skipped: --budget-s reached"
                continue
            try:
                pairs = (0, 1) if part == "gate_up" else (2,)
                ws = [a for i in pairs for a in tile(w4[2 * i], w4[2 * i + 1], block_n=cfg.block_n,
                                                      block_w=cfg.block_w)]
                opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, n_per_program=cfg.n_per_program,
                            swap_ab=cfg.swap_ab, acc_in_dot=cfg.acc_in_dot, **kw)
                if part == "gate_up":
                    fn = lambda layout, xt, token, *w, o=opts: jax.lax.optimization_barrier(  # noqa: E731
                        moe_gate_up(xt, layout, token, (w[0], w[1]), (w[2], w[3]), **o))
                    args = [tuple(r) + tuple(ws) for r in routed]
                else:
                    if hs is None:  # h from the engine's gate/up, nibble-major (what down reads)
                        gu = [a for i in (0, 1) for a in tile(w4[2 * i], w4[2 * i + 1])]
                        hs = [jax.jit(lambda layout, xt, token, *w: moe_gate_up(
                            xt, layout, token, (w[0], w[1]), (w[2], w[3]), out_nibble_major=True, **kw))(
                                *r, *gu) for r in routed]
                        del gu
                    fn = lambda layout, hp, *w, o=opts: jax.lax.optimization_barrier(  # noqa: E731
                        grouped_int4_matmul(hp, ((w[0], w[1]),), layout, nibble_major=True, **o))
                    args = [(r[0], h) + tuple(ws) for r, h in zip(routed, hs)]
                row[f"{key}_ms"] = per_call_s(fn, args) * 1e3
                if loads_only and cfg is configs[0]:  # the same launch's loads alone (no unpack, no MMA)
                    try:
                        loads = functools.partial(fn, o=dict(opts, loads_only=True))
                        row[f"{tag}_{part}_loads_only_ms"] = per_call_s(loads, args) * 1e3
                    except Exception as e:  # noqa: BLE001
                        row[f"{tag}_{part}_loads_only_error"] = short_error(e)
                rows_used = routed[0][0].dest  # rows outside every slot's blocks stay unwritten (garbage)
                out = np.asarray(jax.jit(fn)(*args[0])[rows_used].astype(jnp.float32))
                first = out if first is None else first
                row[f"{key}_same_bits"] = bool(np.array_equal(out, first))
                row[f"{key}_rel_diff"] = float(np.linalg.norm(out - first) / np.linalg.norm(first))
                del ws
            except Exception as e:  # noqa: BLE001
                row[f"{key}_error"] = short_error(e)
        timed = {part_key(c): row[f"{tag}_{part}_{part_key(c)}_ms"] for c in configs
                 if f"{tag}_{part}_{part_key(c)}_ms" in row}
        if timed:
            row[f"{tag}_{part}_best"] = min(timed, key=timed.get)


def dropped_asm(drops: tuple[str, ...]):
    """`int4_moe._bf16x2_asm` without the lines that start with `drops` (the plane then written from u, the
    magic-ORed nibble, if the mul that writes it is dropped)."""
    real = int4_moe._bf16x2_asm

    def asm(k: int) -> str:
        lines = real(k).split("\n")
        if BF16X2_MUL not in lines:
            raise RuntimeError(f"--unpack-drop: the unpack no longer ends in {BF16X2_MUL!r}: update UNPACK_DROPS")
        lines = [line for line in lines if not line.startswith(drops)]
        return "\n".join(lines if BF16X2_MUL in lines else lines[:-1] + ["mov.b32 $0, u;", lines[-1]])
    return asm


def run_unpack_drop(row: dict, sets, w4, shape: Shape, deadline: float) -> None:
    """Each kernel at the engine's launch with each UNPACK_DROPS variant of its bf16x2 unpack (compiled only: the
    interpreter runs no inline PTX). Keys `drop_<name>_<part>_<launch>_ms`."""
    real = int4_moe._bf16x2_asm
    launches = {"gate_up": (GATE_UP_LAUNCH,), "down": (DOWN_LAUNCH,)}
    try:
        for name, drops in UNPACK_DROPS.items():
            int4_moe._bf16x2_asm = dropped_asm(drops) if drops else real
            run_part_tune(row, sets, w4, shape, False, deadline, launches, tag=f"drop_{name.replace(', ', '_')}",
                          loads_only=False)
    finally:
        int4_moe._bf16x2_asm = real


def unpack_drop_markdown(rows: list[dict], copy_bw: float) -> str:
    """One line per (kernel, dropped instructions): ms and % copy at each token count."""
    rows = [r for r in rows if any(k.startswith("drop_") for k in r)]
    if not rows:
        return ""
    lines = ["| kernel | left out of the unpack | " + " | ".join(f"{r['tokens']} tok ms (% copy)" for r in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for part, launch in (("gate_up", GATE_UP_LAUNCH), ("down", DOWN_LAUNCH)):
        for name in UNPACK_DROPS:
            key = f"drop_{name.replace(', ', '_')}_{part}_{part_key(launch)}_ms"
            cells = [f"{t:.3f} ({100 * part_bytes(r, part) / (t * 1e-3) / copy_bw:.0f}%)" if (t := r.get(key))
                     else "—" for r in rows]
            lines.append(f"| {part} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def part_bytes(row: dict, part: str) -> float:
    """The part's bytes: gate/up reads two of each distinct expert's three matrices, down one."""
    return row["bytes"] * (2 if part == "gate_up" else 1) / 3


def part_tune_markdown(rows: list[dict], copy_bw: float) -> str:
    """Per kernel: one line per config, ms and % copy at each token count; the best config per count."""
    tuned = [r for r in rows if any(k.startswith("pt_") for k in r)]
    if not tuned:
        return ""
    out = []
    for part, configs in PART_TUNE.items():
        lines = [f"{part}: | block_n | block_w | warps | stages | N tiles / program | MMA | "
                 + " | ".join(f"{r['tokens']} tok ms (% copy)" for r in tuned) + " |",
                 "|---|---|---|---|---|---|" + "---|" * len(tuned)]
        for c in configs:
            cells = []
            for r in tuned:
                t = r.get(f"pt_{part}_{part_key(c)}_ms")
                cells.append(f"{t:.3f} ({100 * part_bytes(r, part) / (t * 1e-3) / copy_bw:.0f}%)" if t
                             else "err" if f"pt_{part}_{part_key(c)}_error" in r else "—")
            mma = ("W x^T" if c.swap_ab else "x W^T") + (", acc in dot" if c.acc_in_dot else "")
            lines.append(f"| {c.block_n} | {c.block_w} | {c.num_warps} | {c.num_stages} | {c.n_per_program} | {mma} | "
                         + " | ".join(cells) + " |")
        cells = [f"{t:.3f} ({100 * part_bytes(r, part) / (t * 1e-3) / copy_bw:.0f}%)"
                 if (t := r.get(f"pt_{part}_loads_only_ms")) else "—" for r in tuned]
        lines.append("| loads only (first row's launch: no unpack, no MMA) | | | | | | " + " | ".join(cells) + " |")
        for r in tuned:
            if f"pt_{part}_best" in r:
                lines.append(f"best at {r['tokens']} tokens: {r[f'pt_{part}_best']}")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def run_layouts(row: dict, sets, w4, w4t, ffn) -> None:
    """The default kernel on row-major weights (one launch for both kernels) and on tile-major ones in the engine's
    tiles and launches, same inputs: ms each, and the relative difference of their outputs (down's 64-word K tiles
    add in another order than row-major's 32, so the last bits differ)."""
    for name, ws in (("row_major", w4), ("tiled", w4t)):
        try:
            row[f"layout_{name}_ms"] = per_call_s(ffn, [s + tuple(ws) for s in sets]) * 1e3
        except Exception as e:  # noqa: BLE001
            row[f"layout_{name}_error"] = short_error(e)
    try:
        outs = [np.asarray(jax.jit(ffn)(*sets[0], *ws).astype(jnp.float32)) for ws in (w4, w4t)]
        row["layout_rel_diff"] = float(np.linalg.norm(outs[1] - outs[0]) / np.linalg.norm(outs[0]))
    except Exception as e:  # noqa: BLE001
        row["layout_check_error"] = short_error(e)


def random_ffn_int4(shape: Shape) -> list:
    """Gate, up and down packed words and scales of `shape`'s experts, row-major (as loaded)."""
    keys = jax.random.split(jax.random.key(0), 3)
    w4 = []
    for key, (n_out, n_in) in zip(keys, ((shape.inter, shape.d), (shape.inter, shape.d), (shape.d, shape.inter))):
        w4 += list(random_int4(key, shape.experts, n_out, n_in, shape.group))
    return w4


def run_once(shape: Shape, unpacks, dtype, interpret: bool) -> dict:
    """{(tokens, unpack): y} of one FFN call each on the first input set, tile-major experts; each call compiled
    before it runs, so a profiler sees only the kernels of the calls themselves."""
    w4t = tiled_weights(random_ffn_int4(shape))
    outs = {}
    for tokens in shape.tokens:
        x, idx, w = make_sets(shape, tokens, dtype, seed=tokens)[0]
        for u in unpacks:
            fn = jax.jit(functools.partial(int4_moe_ffn, unpack=u, interpret=interpret))
            compiled = fn.lower(x, idx, w, *w4t).compile()
            outs[tokens, u] = jax.block_until_ready(compiled(x, idx, w, *w4t))
    return outs


def run_sweep(rows: list[dict], shape: Shape, interpret: bool, dtype, tune: bool, baselines: bool = True,
              unpacks=(UNPACK_F32,), breakdown: bool = False, deadline: float = float("inf"),
              tune_at: tuple[int, ...] = TUNE_TOKENS, layouts: bool = False, part_tune: bool = False,
              unpack_drop: bool = False) -> None:
    """Appends one row per token count to `rows` (so a crash still leaves the finished rows)."""
    w4 = random_ffn_int4(shape)
    ffn = {u: (lambda x, i, w, *ws, u=u: int4_moe_ffn(x, i, w, *ws, unpack=u, interpret=interpret)) for u in unpacks}
    deq = jax.jit(dequant_then_matmul_ffn)
    default_ffn = lambda x, i, w, *ws: int4_moe_ffn(x, i, w, *ws, interpret=interpret)  # noqa: E731
    tune_tokens = [t for t in shape.tokens if t in tune_at] or list(shape.tokens[:1])
    w4t = tiled_weights(w4) if layouts else None
    for tokens in shape.tokens:
        sets = make_sets(shape, tokens, dtype, seed=tokens)
        n_dist = distinct_experts(sets)
        block_m = ffn_block_m(tokens * shape.top_k, shape.experts, w4[0], w4[4])
        row = dict(tokens=tokens, pairs=tokens * shape.top_k, skew=shape.skew, distinct_experts=n_dist,
                   block_m=block_m, row_blocks=row_blocks(sets, shape.experts, block_m),
                   bytes=n_dist * int4_expert_bytes(shape))
        if interpret and UNPACK_BF16X2 in unpacks:
            row["unpack_note"] = CPU_UNPACK_NOTE
        variants = {unpack_key(u): ffn[u] for u in unpacks}
        if baselines:
            variants["xla_dequant"] = dequant_then_matmul_ffn
        for name, fn in variants.items():
            try:
                row[f"{name}_ms"] = per_call_s(fn, [s + tuple(w4) for s in sets]) * 1e3
            except Exception as e:  # noqa: BLE001  (an OOM or failed compile is a result; keep sweeping)
                row[f"{name}_error"] = short_error(e)
        outs = {}
        for u in unpacks:
            try:
                outs[u] = np.asarray(jax.jit(ffn[u])(*sets[0], *w4).astype(jnp.float32))
            except Exception as e:  # noqa: BLE001
                row[f"{u}_check_error"] = short_error(e)
        check_variants(row, outs, unpacks)
        if layouts:
            run_layouts(row, sets, w4, w4t, default_ffn)
        if breakdown:
            run_breakdown(row, sets, w4, shape, interpret, default_ffn)
        if tune and tokens in tune_tokens:
            run_tune(row, sets, w4, interpret, deadline)
        if part_tune and tokens in tune_tokens:
            run_part_tune(row, sets, w4, shape, interpret, deadline)
        if unpack_drop and tokens in tune_tokens and not interpret:
            run_unpack_drop(row, sets, w4, shape, deadline)
        try:  # the first variant against the XLA baseline on one input set (both bf16: loose, catches wrong experts)
            if unpacks[0] in outs:
                want = np.asarray(deq(*sets[0], *w4).astype(jnp.float32))
                row["rel_diff_vs_xla"] = float(np.linalg.norm(outs[unpacks[0]] - want) / np.linalg.norm(want))
        except Exception as e:  # noqa: BLE001
            row["check_error"] = short_error(e)
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w4, w4t
    if baselines:
        bf16_sweep(shape, rows, dtype)


def bf16_sweep(shape: Shape, rows: list[dict], dtype):
    """Same routed shapes with bf16 experts [E, in, out] (XLA): built after the INT4 weights are freed."""
    try:
        keys = jax.random.split(jax.random.key(1), 3)
        mk = jax.jit(lambda k, s, fan: (jax.random.normal(k, s, jnp.float32) / fan**0.5).astype(jnp.bfloat16),
                     static_argnums=(1, 2))
        wg = mk(keys[0], (shape.experts, shape.d, shape.inter), shape.d)
        wu = mk(keys[1], (shape.experts, shape.d, shape.inter), shape.d)
        wd = mk(keys[2], (shape.experts, shape.inter, shape.d), shape.inter)
    except Exception as e:  # noqa: BLE001
        for row in rows:
            row["bf16_error"] = short_error(e)
        return
    ragged, gather = jax.jit(bf16_ragged_dot_ffn), jax.jit(bf16_gather_ffn)
    for row in rows:
        sets = make_sets(shape, row["tokens"], dtype, seed=row["tokens"])
        row["bf16_bytes"] = row["distinct_experts"] * 3 * shape.d * shape.inter * 2
        todo = {"bf16_ragged_dot": ragged}
        if row["tokens"] <= GATHER_MAX_TOKENS:
            todo["bf16_gather"] = gather
        for name, f in todo.items():
            try:
                row[f"{name}_ms"] = per_call_s(f, [s + (wg, wu, wd) for s in sets]) * 1e3
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = short_error(e)
        print(json.dumps({k: v for k, v in row.items() if k.startswith(("tokens", "bf16"))}), flush=True)


def ms(row, name):
    return f"{row[name + '_ms']:.3f}" if name + "_ms" in row else ("OOM" if "RESOURCE" in row.get(
        name + "_error", "") else ("err" if name + "_error" in row else "—"))


def unpack_markdown(rows: list[dict], copy_bw: float, unpacks) -> str:
    """One line per (tokens, unpack variant): time, bandwidth, speed relative to the first variant, same bits."""
    first = unpacks[0]
    lines = [f"| tokens | unpack | pallas ms | GB/s | % copy | {first} ms / this | same bits as {first} | max abs diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = r.get(unpack_key(first) + "_ms")
        for u in unpacks:
            t = r.get(unpack_key(u) + "_ms")
            gbps = r["bytes"] / (t / 1e3) / 1e9 if t else None
            bw = f"{gbps:.0f} | {100 * gbps * 1e9 / copy_bw:.0f}%" if gbps else "— | —"
            ratio = f"{base / t:.2f}" if t and base else "—"
            same = r.get(f"{u}_same_bits_as_{first}", "—" if u != first else "(ref)")
            diff = r.get(f"{u}_max_abs_diff_vs_{first}")
            lines.append(f"| {r['tokens']} | {u} | {ms(r, unpack_key(u))} | {bw} | {ratio} | {same} | "
                         f"{'—' if diff is None else f'{diff:.1e}'} |")
    notes = sorted({r["unpack_note"] for r in rows if "unpack_note" in r})
    return "\n".join(lines + [f"\nnote: {n}" for n in notes])


def markdown(rows: list[dict], copy_bw: float) -> str:
    lines = ["| tokens | skew | distinct experts | row blocks | INT4 MB | roofline ms | pallas ms | GB/s | % copy | "
             "xla dequant ms | bf16 ragged_dot ms | bf16 gather ms | bf16 roofline ms | rel diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        roof = r["bytes"] / copy_bw * 1e3
        if "pallas_int4_ms" in r:
            gbps = r["bytes"] / (r["pallas_int4_ms"] / 1e3) / 1e9
            bw = f"{gbps:.0f} | {100 * gbps * 1e9 / copy_bw:.0f}%"
        else:
            bw = "— | —"
        bf16_roof = f"{r['bf16_bytes'] / copy_bw * 1e3:.3f}" if "bf16_bytes" in r else "—"
        diff = f"{r['rel_diff_vs_xla']:.1e}" if "rel_diff_vs_xla" in r else "—"
        lines.append(f"| {r['tokens']} | {r.get('skew', 0.0):g} | {r['distinct_experts']:.1f} | "
                     f"{r.get('row_blocks', float('nan')):.1f} | {r['bytes'] / 1e6:.0f} | {roof:.3f} | "
                     f"{ms(r, 'pallas_int4')} | {bw} | {ms(r, 'xla_dequant')} | {ms(r, 'bf16_ragged_dot')} | "
                     f"{ms(r, 'bf16_gather')} | {bf16_roof} | {diff} |")
    return "\n".join(lines)


def layout_markdown(rows: list[dict], copy_bw: float) -> str:
    """Row-major vs tile-major weights, default kernel: ms, % of copy, ratio, relative output difference."""
    done = [r for r in rows if any(k.startswith("layout_") for k in r)]
    if not done:
        return ""
    lines = ["| tokens | INT4 MB | row-major ms (% copy) | tile-major ms (% copy) | row / tile | rel diff |",
             "|---|---|---|---|---|---|"]
    for r in done:
        cells = []
        for name in ("row_major", "tiled"):
            t = r.get(f"layout_{name}_ms")
            cells.append(f"{t:.3f} ({100 * r['bytes'] / (t / 1e3) / copy_bw:.0f}%)" if t else
                         f"err: {r.get(f'layout_{name}_error', '—')}")
        a, b = r.get("layout_row_major_ms"), r.get("layout_tiled_ms")
        ratio = f"{a / b:.3f}" if a and b else "—"
        diff = f"{r['layout_rel_diff']:.1e}" if "layout_rel_diff" in r else "—"
        lines.append(f"| {r['tokens']} | {r['bytes'] / 1e6:.0f} | {cells[0]} | {cells[1]} | {ratio} | {diff} |")
    return "\n".join(lines)


def tune_markdown(rows: list[dict]) -> str:
    """One line per TUNE config (ms per tuned token count), then the best config per token count."""
    tuned = [r for r in rows if any(k.startswith("pallas_bn") for k in r)]
    if not tuned:
        return ""
    lines = ["| block_n | block_w | warps | stages | split_k | weights | "
             + " | ".join(f"{r['tokens']} tok ms" for r in tuned) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(tuned)]
    for c in TUNE:
        lines.append(f"| {c.block_n} | {c.block_w} | {c.warps} | {c.stages} | {c.split_k} | "
                     f"{'tile-major' if c.tiled else 'row-major'} | "
                     + " | ".join(ms(r, c.key) for r in tuned) + " |")
    first = TUNE[0].key
    for r in tuned:
        if "tune_best" in r:
            best = r["tune_best"]
            lines.append(f"\nbest at {r['tokens']} tokens: {best} {r[best + '_ms']:.3f} ms (first config "
                         f"{ms(r, first)} ms)")
    return "\n".join(lines)


def breakdown_markdown(rows: list[dict]) -> str:
    """Each part's ms and share of the whole call; "sum" = the parts added (launch gaps between jits not counted)."""
    done = [r for r in rows if "bd_whole_ms" in r or "bd_error" in r]
    if not done:
        return ""
    lines = ["| tokens | whole ms | " + " | ".join(f"{p} ms (share)" for p in BREAKDOWN_PARTS)
             + " | sum of parts ms | parts = whole |", "|---|---|" + "---|" * len(BREAKDOWN_PARTS) + "---|---|"]
    for r in done:
        if "bd_error" in r:
            lines.append(f"| {r['tokens']} | err: {r['bd_error']} |")
            continue
        whole = r["bd_whole_ms"]
        parts = [r.get(f"bd_{p}_ms") for p in BREAKDOWN_PARTS]
        cells = [f"{t:.3f} ({100 * t / whole:.0f}%)" if t is not None else "—" for t in parts]
        total = sum(t for t in parts if t is not None)
        lines.append(f"| {r['tokens']} | {whole:.3f} | " + " | ".join(cells)
                     + f" | {total:.3f} | {r.get('bd_parts_equal_whole', '—')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tokens 1, 16, 256 only")
    parser.add_argument("--out", help="write all results as JSON to this path")
    parser.add_argument("--tune", action="store_true",
                        help="also time TUNE (block_n, block_w, warps, stages, split_k) at --tune-tokens")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the routing glue, each kernel, the h reorder and the combine alone")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="routed token counts (GPU; default 1 8 16 64 256 512, --quick 1 16 256)")
    parser.add_argument("--tune-tokens", type=int, nargs="+", default=list(TUNE_TOKENS),
                        help="token counts --tune times its configs at (those of the sweep)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="start no --tune config after this many seconds of the run")
    parser.add_argument("--kernel-only", action="store_true", help="skip the XLA and bf16 baselines")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="route expert e with weight (e + 1) ** -skew (Zipf; 0 = uniform, 1.5: ~150 distinct "
                             "experts at 136 tokens)")
    parser.add_argument("--layouts", action="store_true",
                        help="also time the default kernel on tile-major weights (`tile_int4`) next to row-major")
    parser.add_argument("--part-tune", action="store_true",
                        help="time gate/up and down each alone under PART_TUNE configs at --tune-tokens")
    parser.add_argument("--unpack-drop", action="store_true",
                        help="time each kernel at --tune-tokens with parts of its bf16x2 unpack left out (GPU only)")
    parser.add_argument("--unpack", default=f"{UNPACK_F32},{UNPACK_BF16X2}",
                        help=f"comma-separated INT4 unpack variants to time side by side, from {UNPACK_MODES}")
    parser.add_argument("--once", action="store_true",
                        help="run each --unpack variant once per token count and exit (for a profiler)")
    args = parser.parse_args(argv)
    unpacks = parse_unpacks(args.unpack)
    on_gpu = jax.default_backend() == "gpu"
    shape = (QUICK if args.quick else FULL) if on_gpu else CPU_SMOKE
    if args.tokens and on_gpu:
        shape = dataclasses.replace(shape, tokens=tuple(args.tokens))
    shape = dataclasses.replace(shape, skew=args.skew)
    dtype = jnp.bfloat16 if on_gpu or UNPACK_BF16X2 in unpacks else jnp.float32
    if not on_gpu:
        print(f"warning: backend {jax.default_backend()}: tiny smoke sweep in the Pallas interpreter "
              f"({jnp.dtype(dtype).name} activations)", file=sys.stderr)
        if UNPACK_BF16X2 in unpacks:
            print(f"warning: {CPU_UNPACK_NOTE}", file=sys.stderr)
    if args.once:
        for (tokens, u), y in run_once(shape, unpacks, dtype, interpret=not on_gpu).items():
            print(f"tokens {tokens} unpack {u}: y {y.shape} {y.dtype}", flush=True)
        return
    t0 = time.perf_counter()
    device = jax.devices()[0].device_kind
    copy_bw = copy_ceiling(shape.copy_bytes)
    print(f"## INT4 MoE FFN on {device}: D {shape.d}, I {shape.inter}, E {shape.experts}, top-{shape.top_k}, group "
          f"{shape.group}; copy (read+write) {copy_bw / 1e9:.0f} GB/s\n", flush=True)
    finish_on_sigterm()
    rows = []
    try:
        run_sweep(rows, shape, interpret=not on_gpu, dtype=dtype, tune=args.tune, baselines=not args.kernel_only,
                  unpacks=unpacks, breakdown=args.breakdown, deadline=t0 + args.budget_s,
                  tune_at=tuple(args.tune_tokens), layouts=args.layouts, part_tune=args.part_tune,
                  unpack_drop=args.unpack_drop)
    finally:  # print whatever finished, even after an unexpected failure
        result = dict(device=device, copy_gbps=copy_bw / 1e9, shape=dataclasses.asdict(shape), rows=rows,
                      unpacks=unpacks, int4_bytes_per_expert=int4_expert_bytes(shape),
                      total_s=time.perf_counter() - t0)
        extra = [t for t in (layout_markdown(rows, copy_bw), breakdown_markdown(rows), tune_markdown(rows),
                             part_tune_markdown(rows, copy_bw), unpack_drop_markdown(rows, copy_bw)) if t]
        print("\n\n".join([markdown(rows, copy_bw), unpack_markdown(rows, copy_bw, unpacks), *extra])
              + f"\n\ntotal {result['total_s']:.0f} s", flush=True)
        if args.out:
            write_results(args.out, result)


if __name__ == "__main__":
    main()
