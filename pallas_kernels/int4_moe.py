"""INT4 grouped expert matmul (Pallas, Triton backend) and the fused routed-expert SwiGLU FFN built on it.

Why a kernel: at decode / verify sizes (1..512 tokens, top-8 of 384 experts) an MoE layer is bound by reading the
touched experts' weights. XLA's `ragged_dot` costs ~8 ms per layer even for one token and gathering weights copies
them (BENCHMARKS.md §4a). Here each touched expert's packed INT4 words are read once per row block, unpacked in
registers and fed to the tensor cores; untouched experts cost nothing.

Weight layout (`int4_layout.py`, compressed-tensors pack-quantized; the model's stacked INT4 experts): packed
int32 [E, N, K/8] — nibble k of word j is input column 8j+k, offset 8 — and scale bf16 [E, N, K/G]:
W[e, n, i] = (nib - 8) * scale[e, n, i // G]. The kernel also reads the same words tile-major (`tile_int4`:
[E, N/bn, K/8/bw, bn, bw], scales alike), where each K step's tile is one contiguous block instead of bn strided
runs: the engine's layout on one GPU, 1.29-1.33x faster at 8-136 tokens with each kernel's launch (BENCHMARKS.md §4a).

Routing layout (XLA, outside the kernel): the P (token, expert) pairs are sorted by expert; each touched expert
gets a *slot* whose rows start at a multiple of `block_m` (padding rows read as zeros), so every row block belongs
to exactly one expert and the kernel never needs a masked store. Slots = min(E, P) (static); unused slots have
count 0 and no row blocks. Up to PAIRWISE_ROUTE_MAX_PAIRS pairs (decode) the layout comes from [P, P]
comparisons in three stacked reductions instead of a sort and E-wide scatters / prefix sums (CPU HLO of the glue
before the first kernel at 1 token: 10 top-level fusions instead of 41). The gate/up kernel reads its rows from the
M nibble-major tokens through a [R] row -> token map (`row_tokens`): the padded rows are never written out. Loads of
padding rows are masked off, so they cost no memory traffic.

Kernel grid (N tiles / n_per_program, row blocks R / block_m), N tiles fastest so the programs running together share
their block's activation rows through L2, and the blocks of one expert (adjacent) run at about the same time, so the
later blocks can find its weight tiles in L2. (A program per slot looping over its row blocks read an expert's weights
once per block: at a batch-8 B = 16 verify, 1088 pairs on ~135 experts in 16-row blocks, the kernels ran at 52% of copy,
60% with a program per block; BENCHMARKS.md §4b.) Unused blocks (`block_rows` 0) exit at once. A program loops over K
tiles of `block_w` packed words (with n_per_program > 1, over n_per_program N tiles' K tiles in one flat loop, writing
each N tile when its last K tile is in): it loads the [block_n, block_w] int32 tile once and, for each nibble position
k, forms W_k = ((words >> 4k) & 15) - 8 times the group scale (broadcast over G/8 words) and accumulates x_k @ W_k^T in
fp32 (`acc_in_dot`: inside the MMA, `_dot_acc`; `swap_ab`: as W_k x_k^T, on wgmma). x_k are the input columns
{8j + k}: the wrapper stores the activations nibble-major (`_nibble_major`: column k*K/8 + j holds column 8j + k), so
every load is a contiguous power-of-two tile and no value is ever gathered or reshaped across the nibble axis (Pallas'
Triton lowering takes power-of-two blocks and no value gathers: `jax/_src/pallas/triton/lowering.py`).

With two weight sets (gate, up) the kernel fuses SwiGLU: it writes silu(x Wg^T) * (x Wu^T) directly. In the FFN it
writes that h already in the down kernel's nibble-major column order (each program transposes its output tile in
registers before the store), so no reorder of h runs between the two kernels. The FFN
launches each of its two kernels in its own tiles and program shape (GATE_UP_LAUNCH, DOWN_LAUNCH; `tile_ffn_int4`
lays the experts out in those tiles).
`split_k` (static) splits the K loop over more programs, for few rows: fp32 partials, added in XLA (not bit-identical
to the unsplit kernel; within the same tolerance of the float64 reference).

Unpack variants (static `unpack=`, same bf16 weights bit for bit): "f32" forms each weight in fp32 and rounds it
(~6 ALU instructions per weight in the sm_90 K loop, `benchmarks/kernel_resources.py --int4-mix`); "bf16x2" (bf16
activations only) forms two weights per instruction in inline PTX (~2.9 per weight, loop included). Neither path
round-trips the dequantized tile through shared memory: Triton loads the packed words straight into the mma operand
layout (no STS in the K loop), so the unpack ALU work, not layout conversion, is what the variants differ in.
The default (`unpack=None`) is bf16x2 for bf16 activations: 1.32-1.34x faster on the H200 at 1, 16 and 256 tokens,
same output bits (BENCHMARKS.md §4a); f32 otherwise. "fp16" runs the dot in fp16: fp16 1024.0 leaves room for a
nibble in either half of a byte, so no shift extracts the odd planes (sm_90 K loop, gate/up at 136 tokens: 1291
instructions, bf16x2 1369), and (nib - 8) * scale is exact in fp16's 11 bits. The FFN (`int4_moe_ffn`) then converts
x and keeps h in fp16, both saturating at fp16's range, and returns y in the caller's dtype; with fp16 activations it
is the default, and f32 gives the same bits.

Axes: M tokens, k experts per token, P = M*k pairs, E experts, D hidden, I expert width, K input dim, N output dim,
R padded routed rows, S slots, RB = R / block_m row blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dot_acc import dot_acc
from pallas_kernels._pallas import dot_precision, next_pow2, pallas_call, resolve_interpret
from pallas_kernels.int4_layout import INT4_OFFSET, NIBBLES_PER_WORD, dequant_int4_jnp

MIN_DOT = 16  # smallest dot dimension Triton handles well (and the smallest row block)
MAX_BLOCK_M = 64  # row-block cap: larger blocks waste rows on experts with few tokens
PAIRWISE_ROUTE_MAX_PAIRS = 512  # route by [P, P] comparisons up to here (64 tokens at top-8): 1/4 M int compares
# Tiles and warps from the sm_90 resource report (benchmarks/kernel_resources.py, BENCHMARKS.md): with 64 words per K
# tile the fused gate/up kernel spilled 216 (1 token) to 1176 (512 tokens) bytes per thread on 4 warps; 32 words on
# 8 warps keeps both kernels in registers from 1 to 512 routed tokens.
DEFAULT_BLOCK_N = 64  # output columns per program
DEFAULT_BLOCK_W = 32  # packed words per K tile (= 256 input columns)
DEFAULT_WARPS = 8
DEFAULT_STAGES = 3  # K-loop depth: 1.21x faster than 2 at 1 token, 1.04x at 16 (bench_int4_moe/h200_breakdown_tune)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One FFN kernel's tiles (tile-major weights are laid out in them) and program shape."""

    block_n: int
    block_w: int
    num_warps: int
    num_stages: int = DEFAULT_STAGES
    n_per_program: int = 1
    max_block_m: int = MAX_BLOCK_M  # the largest row block the program runs in its registers and shared memory
    swap_ab: bool = False  # accumulate y^T = W x^T (`grouped_int4_matmul`)
    acc_in_dot: bool = False  # accumulate inside the MMA (`grouped_int4_matmul`)


# The engine's launches on tile-major weights, from the H200 part tune (`bench_int4_moe.py --part-tune`, BENCHMARKS.md
# 4a) at the routed tokens of AR batch 8 to a batch-8 B = 16 verify: 4-warp programs, two or three per SM with
# independent pipelines, beat one 8-warp program in both kernels (gate/up 1.24 / 1.14x, down 1.15 / 1.21x at 8 / 64
# tokens); down, only 8 K tiles of 32 words per N tile at K2.6 width, walks 4 N tiles per program, and its 128-column
# tiles beat 64 x 64 words by 1.04-1.07x from 32 tokens on. gate/up accumulates inside the dot: 1.20x at 1 token
# (one program an SM there, bound by its instruction issue: 16% fewer K-loop instructions), within 1% from 8 tokens
# on; for down it is -2.5 to +2% (kept out). wgmma (swap_ab) ties or loses in both. Row-major weights keep DEFAULT_*
# (tuned on that layout).
# Both take row blocks up to 32 (sm_90 resource report, `benchmarks/kernel_resources.py`, K2.6 at 1088 tokens): at 64
# rows they ask more shared memory than a block may have (237 / 299 KB of 227 KiB: a batch-64 B = 16 verify could not
# launch); at 32 gate/up spills 688 B per thread (16 rows: none), which a batch-32 B = 16 verify runs with.
TILE_MAJOR_MAX_BLOCK_M = 32
GATE_UP_LAUNCH = Launch(block_n=128, block_w=32, num_warps=4, max_block_m=TILE_MAJOR_MAX_BLOCK_M, acc_in_dot=True)
DOWN_LAUNCH = Launch(block_n=128, block_w=32, num_warps=4, n_per_program=4, max_block_m=TILE_MAJOR_MAX_BLOCK_M)
ROW_MAJOR_LAUNCH = Launch(block_n=DEFAULT_BLOCK_N, block_w=DEFAULT_BLOCK_W, num_warps=DEFAULT_WARPS)
NIBBLE_BITS = 4
NIBBLE_MASK = 0xF
MAGIC_BITS = 0x4B000000  # fp32 bit pattern of 2^23: its mantissa's low bits hold an integer exactly
MAGIC = float(1 << 23)
# bf16x2 unpack (sm_90 PTX): one register holds two bf16 lanes (low half = element i, high half = element i+1)
UNPACK_F32 = "f32"  # nibble -> fp32 (mantissa trick), * scale in fp32, round to the compute dtype
UNPACK_BF16X2 = "bf16x2"  # inline PTX: two weights per instruction, straight into bf16 pairs
UNPACK_FP16 = "fp16"  # inline PTX into fp16 pairs, no shift for odd nibbles; fp16 activations (the FFN converts)
UNPACK_MODES = (UNPACK_F32, UNPACK_BF16X2, UNPACK_FP16)
UNPACK_DTYPES = {UNPACK_BF16X2: jnp.bfloat16, UNPACK_FP16: jnp.float16}  # each PTX unpack's weights and activations
BF16X2_MAGIC = 0x43004300  # bf16 128.0 in both halves: ORing a nibble into the mantissa gives 128 + nibble exactly
BF16X2_BIAS = 0x43084308  # bf16 136.0 = 128 + INT4_OFFSET in both halves: (128 + nib) - 136 = nib - 8 exactly
BF16X2_NIBBLE_MASK = 0x000F000F  # the low nibble of each 16-bit half
LOP3_AND_OR = 0xEA  # lop3 truth table of (a & b) | c
BYTES_PER_WORD = 4
PRMT_HIGH_WORD = 4  # prmt selects bytes 4..7 from its second operand
PRMT_BYTE2_SHIFT = 8  # a prmt selector holds one 4-bit source index per output byte: byte 2's sits at bits 8..11
# fp16x2 unpack: fp16 1024.0 has ulp 1 and 10 mantissa bits, so a byte's low nibble ORed in gives 1024 + nib and its
# high nibble, left in place, 1024 + 16 * nib: both exact, no shift
FP16X2_MAGIC = 0x64006400  # fp16 1024.0 in both halves
FP16X2_MASKS = (0x000F000F, 0x00F000F0)  # a byte's low / high nibble in each 16-bit half
FP16X2_LOW_BIAS = 0x64086408  # fp16 1032.0 = 1024 + INT4_OFFSET: (1024 + nib) - 1032 = nib - 8 exactly
FP16X2_SIXTEENTH = 0x2C002C00  # fp16 1/16: (1024 + 16 * nib) / 16 - 72 = nib - 8 exactly, in one fma
FP16X2_HIGH_BIAS = 0xD480D480  # fp16 -72.0 = -(1024 / 16 + INT4_OFFSET)
FP16_MAX = 65504.0  # the largest finite fp16: fp16 activations and outputs saturate here instead of overflowing


# ---- routing layout (XLA) ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RouteLayout:
    """Where each (token, expert) pair lives in the expert-grouped, block-padded row space (a pytree).

    slot_expert [S] expert of each slot (ascending; unused slots 0), slot_start [S] first padded row (a multiple of
    block_m), slot_count [S] rows of the slot (0 = unused), dest [P] padded row of pair p. `rows` R (static) bounds
    the padded row space; `block_m` is the row block the layout was built for. The kernels' grid walks row blocks:
    block_expert [R / block_m] the expert of block b (rows b*block_m ..), block_rows its rows that hold pairs (0 =
    unused block, 1..block_m otherwise).
    """

    slot_expert: jax.Array
    slot_start: jax.Array
    slot_count: jax.Array
    dest: jax.Array
    block_expert: jax.Array
    block_rows: jax.Array
    rows: int
    block_m: int


jax.tree_util.register_dataclass(RouteLayout, data_fields=["slot_expert", "slot_start", "slot_count", "dest",
                                                           "block_expert", "block_rows"],
                                 meta_fields=["rows", "block_m"])


def _with_blocks(slot_expert, slot_start, slot_count, dest, rows: int, block_m: int) -> RouteLayout:
    """The layout with its per-block view. Used slots tile [0, their padded total) in slot order and unused ones
    start and end at that total, so block b's slot is the number of slots that end at or before its first row (S:
    past the used rows): one [R / block_m, S] comparison sum."""
    s = slot_expert.shape[0]
    first_row = jnp.arange(rows // block_m, dtype=jnp.int32) * block_m  # [RB]
    ends = slot_start + (slot_count + block_m - 1) // block_m * block_m  # [S]
    slot = jnp.sum(ends[None, :] <= first_row[:, None], axis=1, dtype=jnp.int32)  # [RB]
    inside = jnp.minimum(slot, s - 1)
    live = jnp.clip(slot_count[inside] - (first_row - slot_start[inside]), 0, block_m)
    block_rows = jnp.where(slot < s, live, 0).astype(jnp.int32)
    return RouteLayout(slot_expert, slot_start, slot_count, dest, slot_expert[inside], block_rows, rows, block_m)


def default_block_m(n_pairs: int, n_experts: int) -> int:
    """Row block ~ twice the mean rows per expert (power of two in [16, 64]): few re-reads, little padding."""
    mean = -(-2 * n_pairs // max(n_experts, 1))
    return int(min(max(next_pow2(mean), MIN_DOT), MAX_BLOCK_M))


def route_layout(expert_ids: jax.Array, n_experts: int, block_m: int) -> RouteLayout:
    """expert_ids [P] int32 -> RouteLayout with min(E, P) slots (jit-friendly, static sizes).

    An id outside 0..E-1 marks an absent pair (another device's expert under expert parallelism): it takes no row,
    its dest is R (out of range: scattered nowhere, gathered as zeros), so it costs the kernel nothing.
    Up to PAIRWISE_ROUTE_MAX_PAIRS pairs (decode, small verify trees) the layout comes from [P, P] comparisons
    (`route_layout_pairwise`, a few fused ops); beyond, from a sort and E-wide counts (`route_layout_sorted`). Both
    give the same layout.
    """
    if expert_ids.ndim != 1:
        raise ValueError(f"route_layout: expert_ids must be 1-D [P], got shape {expert_ids.shape}")
    if block_m < MIN_DOT or block_m != next_pow2(block_m):
        raise ValueError(f"route_layout: block_m={block_m} must be a power of two >= {MIN_DOT}")
    if expert_ids.shape[0] <= PAIRWISE_ROUTE_MAX_PAIRS:
        return route_layout_pairwise(expert_ids, n_experts, block_m)
    return route_layout_sorted(expert_ids, n_experts, block_m)


def _padded_rows(n_pairs: int, slots: int, block_m: int) -> int:
    """R: the sum of the slots' block-padded rows never exceeds this."""
    return -(-(n_pairs + slots * (block_m - 1)) // block_m) * block_m


def route_layout_sorted(expert_ids: jax.Array, n_experts: int, block_m: int) -> RouteLayout:
    """`route_layout` by a stable sort of the pairs and E-wide counts / prefix sums (any P; ~35 small XLA ops)."""
    p = expert_ids.shape[0]
    s = min(n_experts, p)
    ids = expert_ids.astype(jnp.int32)
    present = (ids >= 0) & (ids < n_experts)  # [P]
    ids = jnp.where(present, ids, n_experts)  # absent pairs sort last and are counted nowhere
    counts = jnp.zeros((n_experts,), jnp.int32).at[ids].add(1, mode="drop")  # [E]
    touched = counts > 0
    (slot_expert,) = jnp.nonzero(touched, size=s, fill_value=0)  # [S] ascending
    slot_expert = slot_expert.astype(jnp.int32)
    slot_count = jnp.where(jnp.arange(s) < touched.sum(), counts[slot_expert], 0)  # [S]
    slot_rows = (slot_count + block_m - 1) // block_m * block_m
    slot_start = jnp.cumsum(slot_rows) - slot_rows  # [S] exclusive prefix sum
    expert_slot = jnp.cumsum(touched.astype(jnp.int32)) - 1  # [E] slot of each touched expert
    order = jnp.argsort(ids, stable=True)  # [P] pairs grouped by expert
    sorted_e = jnp.minimum(ids[order], n_experts - 1)  # absent pairs: any valid index, replaced below
    first = jnp.cumsum(counts) - counts  # [E] first sorted position of each expert
    dest_sorted = slot_start[expert_slot[sorted_e]] + jnp.arange(p, dtype=jnp.int32) - first[sorted_e]
    rows = _padded_rows(p, s, block_m)
    dest_sorted = jnp.where(present[order], dest_sorted, rows)
    dest = jnp.zeros((p,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))  # [P]
    return _with_blocks(slot_expert, slot_start.astype(jnp.int32), slot_count.astype(jnp.int32), dest, rows, block_m)


def route_layout_pairwise(expert_ids: jax.Array, n_experts: int, block_m: int) -> RouteLayout:
    """`route_layout` from [P, P] comparisons of the pairs' experts: no sort, nothing E-wide, no scatter.

    Pair i's rank among its expert's pairs (stable order) and its expert's row count, then its slot (touched experts
    below it) and first row (their padded rows summed) are masked sums over the other pairs; the first pair of each
    expert then fills its slot through a [P, S] one-hot sum. Sums that share a mask are stacked into one reduction
    (three in all: each a kernel launch on a GPU). O(P^2) work, so for small P only.
    """
    p = expert_ids.shape[0]
    s = min(n_experts, p)
    ids = expert_ids.astype(jnp.int32)
    present = (ids >= 0) & (ids < n_experts)  # [P]
    key = jnp.where(present, ids, n_experts)  # absent pairs share one key above every expert
    pair = jnp.arange(p, dtype=jnp.int32)
    same = (key[:, None] == key[None, :]).astype(jnp.int32)  # [P, P] (i, j): j has i's expert
    earlier = (pair[None, :] < pair[:, None]).astype(jnp.int32)
    rank, count = _masked_sums(jnp.stack([same * earlier, same], axis=-1), axis=1)  # [P] each
    first = present & (rank == 0)  # [P] one representative pair per touched expert
    padded = (count + block_m - 1) // block_m * block_m  # [P] slot rows of i's expert
    below = (first[None, :] & (key[None, :] < key[:, None])).astype(jnp.int32)  # [P, P] j: an expert below i's
    slot, start = _masked_sums(jnp.stack([below, below * padded[None, :]], axis=-1), axis=1)  # [P] each
    rows = _padded_rows(p, s, block_m)
    dest = jnp.where(present, start + rank, rows)  # [P]
    hit = (first[:, None] & (slot[:, None] == jnp.arange(s, dtype=jnp.int32)[None, :])).astype(jnp.int32)  # [P, S]
    last_rows = jnp.broadcast_to(jnp.where(first, padded, 0)[:, None], (p, s))  # summed: rows of all used slots
    per_slot = [hit * v[:, None] for v in (key, count, start)] + [hit, last_rows]
    slot_expert, slot_count, slot_start, used, total = _masked_sums(jnp.stack(per_slot, axis=-1), axis=0)  # [S]
    slot_start = jnp.where(used > 0, slot_start, total)  # unused slots start after the last used one
    return _with_blocks(slot_expert, slot_start, slot_count, dest, rows, block_m)


def _masked_sums(stacked: jax.Array, axis: int) -> list[jax.Array]:
    """int32 sums of a [..., c] stack of masked terms along `axis`, as c arrays: one reduction for c sums."""
    sums = jnp.sum(stacked, axis=axis, dtype=jnp.int32)
    return [sums[..., c] for c in range(stacked.shape[-1])]


def scatter_rows(x: jax.Array, layout: RouteLayout) -> jax.Array:
    """x [P, K] pair rows -> [R, K] in the padded layout (padding rows are zero; absent pairs are dropped)."""
    return jnp.zeros((layout.rows, x.shape[-1]), x.dtype).at[layout.dest].set(x, mode="drop")


def _nibble_major(x: jax.Array, words: int) -> jax.Array:
    """x [R, K] -> [R, 8*words]: column k*words + j holds input column 8j + k (zero past K)."""
    r, k = x.shape
    x = jnp.pad(x, ((0, 0), (0, words * NIBBLES_PER_WORD - k)))
    return x.reshape(r, words, NIBBLES_PER_WORD).swapaxes(1, 2).reshape(r, words * NIBBLES_PER_WORD)


def row_pairs(layout: RouteLayout, n_pairs: int) -> jax.Array:
    """[R] the pair held by each padded row, n_pairs for padding rows: the inverse of layout.dest.

    Small P: one [R, P] comparison (a fused reduction); larger P: a scatter of P indices (R * P would be large)."""
    if n_pairs <= PAIRWISE_ROUTE_MAX_PAIRS:  # dest is injective on present pairs: the sum picks the one match
        match = layout.dest[None, :] == jnp.arange(layout.rows, dtype=jnp.int32)[:, None]  # [R, P]
        held = jnp.sum(jnp.where(match, jnp.arange(1, n_pairs + 1, dtype=jnp.int32)[None, :], 0), axis=1)
        return jnp.where(held > 0, held - 1, n_pairs)
    return jnp.full((layout.rows,), n_pairs, jnp.int32).at[layout.dest].set(jnp.arange(n_pairs, dtype=jnp.int32),
                                                                             mode="drop")


def row_tokens(layout: RouteLayout, n_tokens: int, top_k: int) -> jax.Array:
    """[R] the token row each padded row reads (pair p is token p // top_k; padding rows: token 0, never used).

    The gate/up kernel gathers its activation rows through this map straight from the M token rows, so the [R, K]
    padded rows (R ~ P + S * (block_m - 1): 98 MB at a batch-8 B = 16 verify) are never written and read back."""
    n_pairs = n_tokens * top_k
    pairs = row_pairs(layout, n_pairs)
    return jnp.where(pairs < n_pairs, pairs // top_k, 0).astype(jnp.int32)


# ---- kernel -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call."""

    rows: int  # R padded routed rows
    words: int  # packed words per weight row after padding (multiple of block_w)
    n_out: int  # output columns after padding (multiple of block_n)
    group_words: int  # words per scale group (G / 8)
    block_m: int
    block_n: int
    block_w: int
    row_blocks: int  # R / block_m: the grid's second axis
    gather: bool = False  # x holds token rows, read through a [R] row -> token map (`row_tokens`)
    split_k: int = 1  # programs per (N tile, row block), each over 1/split_k of the K tiles, writing fp32 partials
    tiled: bool = False  # weights tile-major (`tile_int4`): each K-loop tile is one contiguous block
    n_per_program: int = 1  # consecutive N tiles one program walks in one flat, pipelined loop
    out_nibble_major: bool = False  # write y nibble-major (`_nibble_major` of y): the next kernel's input order
    swap_ab: bool = False  # accumulate y^T = W x^T: the weight tile is the MMA's M side (wgmma on sm_90)
    acc_in_dot: bool = False  # the K loop accumulates inside each MMA (`_dot_acc`), not with an add after it
    loads_only: bool = False  # benchmarks: the K loop's loads alone, writing their checksum (`grouped_int4_matmul`)


def _nibble_f32(words, k: int):
    """Nibble k of each int32 word minus the offset, as exact fp32 (-8..7), without an int-to-float conversion: the
    nibble ORed into the mantissa of 2^23 is the float 2^23 + nibble; subtracting 2^23 + 8 is exact. The conversion
    instruction runs at a quarter of the ALU rate on sm_90 and the unpacking, not the tensor cores, bounds this kernel
    at decode sizes (one conversion per weight)."""
    nib = (words >> (NIBBLE_BITS * k)) & NIBBLE_MASK
    return lax.bitcast_convert_type(nib | MAGIC_BITS, jnp.float32) - (MAGIC + INT4_OFFSET)


def prmt_selector(byte: int) -> int:
    """prmt.b32 selector putting byte `byte` of the first word in byte 0 and of the second word in byte 2."""
    return byte | (PRMT_HIGH_WORD + byte) << PRMT_BYTE2_SHIFT


def _bf16x2_asm(k: int) -> str:
    """PTX for plane k of two words (pack=2) as one bf16x2 register: (nib - 8) * scale, each product rounded once.

    prmt gathers byte k//2 of both words into the two 16-bit halves (odd k: one shift brings the high nibble down);
    one lop3 gives (t & 0x000F000F) | 128.0-pattern = 128 + nib per half; sub.bf16x2 of 136 is exact (integers
    -8..7) and mul.rn.bf16x2 by the two scales rounds the exact product once, as the fp32 path does. The prmt is
    the same for planes 2b and 2b+1 (ptxas sees the pasted PTX and can share it). Operands: $0 the plane, $1 / $2
    the two words, $3 their two bf16 scales. (jax 0.11.2 lowers a multi-result inline asm wrongly: one op per plane.)
    """
    byte, high = divmod(k, 2)
    sel = prmt_selector(byte)
    shift = [f"shr.u32 t, t, {NIBBLE_BITS};"] if high else []
    return "\n".join(["{", ".reg .b32 t, u, bias;", f"mov.b32 bias, {BF16X2_BIAS:#010x};",
                      f"prmt.b32 t, $1, $2, {sel:#x};", *shift,
                      f"lop3.b32 u, t, {BF16X2_NIBBLE_MASK:#010x}, {BF16X2_MAGIC:#010x}, {LOP3_AND_OR:#x};",
                      "sub.rn.bf16x2 u, u, bias;", "mul.rn.bf16x2 $0, u, $3;", "}"])


def _fp16x2_asm(k: int) -> str:
    """PTX for plane k of two words (pack=2) as one fp16x2 register: (nib - 8) * scale, exact.

    prmt gathers byte k//2 of both words into the two 16-bit halves, as in `_bf16x2_asm`; one lop3 keeps that byte's
    low (even k) or high (odd k) nibble in place and ORs in fp16 1024.0, so no shift is needed: the half is 1024 + nib
    or 1024 + 16 * nib. sub.f16x2 of 1032, or fma.f16x2 by 1/16 plus -72, gives nib - 8 exactly, and mul.rn.f16x2
    by the two scales is exact too: |nib - 8| <= 8 takes 3 significant bits and a bf16 scale 8, within fp16's 11.
    Operands as `_bf16x2_asm`'s, $3 the two scales in fp16."""
    byte, high = divmod(k, 2)
    if high:
        shift = [f"mov.b32 a, {FP16X2_SIXTEENTH:#010x};", f"mov.b32 c, {FP16X2_HIGH_BIAS:#010x};",
                 "fma.rn.f16x2 u, u, a, c;"]
    else:
        shift = [f"mov.b32 c, {FP16X2_LOW_BIAS:#010x};", "sub.f16x2 u, u, c;"]
    return "\n".join(["{", ".reg .b32 t, u, a, c;", f"prmt.b32 t, $1, $2, {prmt_selector(byte):#x};",
                      f"lop3.b32 u, t, {FP16X2_MASKS[high]:#010x}, {FP16X2_MAGIC:#010x}, {LOP3_AND_OR:#x};",
                      *shift, "mul.rn.f16x2 $0, u, $3;", "}"])


def to_fp16(x: jax.Array) -> jax.Array:
    """x in fp16, values past fp16's range saturated to +-FP16_MAX rather than turned into infinities."""
    return jnp.clip(x.astype(jnp.float32), -FP16_MAX, FP16_MAX).astype(jnp.float16)


def _planes_f32(words, sc, cdt):
    """The eight dequantized planes of a [bn, bw] word tile in cdt: fp32 nibble times fp32 scale, rounded once."""
    sc = sc.astype(jnp.float32)
    return [(_nibble_f32(words, k) * sc).astype(cdt) for k in range(NIBBLES_PER_WORD)]


def _planes_ptx(words, sc, unpack: str, *, interpret: bool):
    """The eight dequantized planes of a [bn, bw] word tile in the dtype of a PTX unpack (`UNPACK_DTYPES`; sc: [bn, bw]
    scale of each word).

    Compiled: its inline PTX (`_bf16x2_asm`, `_fp16x2_asm`), two weights per instruction. Interpreted (inline asm
    cannot run there): `_planes_f32`, the same values: (nib - 8) * scale is exact in fp32 and rounds once into the
    dtype, as the PTX's last multiply does."""
    dtype = UNPACK_DTYPES[unpack]
    if interpret:
        return _planes_f32(words, sc, dtype)
    asm = _bf16x2_asm if unpack == UNPACK_BF16X2 else _fp16x2_asm  # looked up per call: benchmarks swap them
    out = jax.ShapeDtypeStruct(words.shape, dtype)
    return [plt.elementwise_inline_asm(asm(k), args=[words, sc.astype(dtype)], constraints="=r,r,r,r", pack=2,
                                       result_shape_dtypes=[out])[0] for k in range(NIBBLES_PER_WORD)]


def _round_to(y, dtype):
    """fp32 y in dtype; into fp16 saturating at +-FP16_MAX (an fp16 h must not hand the next kernel infinities)."""
    if jnp.dtype(dtype) == jnp.float16:
        y = jnp.clip(y, -FP16_MAX, FP16_MAX)
    return y.astype(dtype)


def _silu_mul(g, u):
    """silu(g) * u in fp32 (the fused SwiGLU epilogue, in the kernel and after a split-K reduction alike)."""
    return g / (1.0 + jnp.exp(-g)) * u


def _kernel(block_expert_ref, block_rows_ref, *refs, plan: _Plan, swiglu: bool, precision, unpack: str,
            interpret: bool):
    # block_expert / block_rows [R / block_m] i32 | gather: token_ref [R] i32 | x_ref [R or M, 8*words] nibble-major
    # | (packed [E, N, words] i32, scale [E, N, words/gw]) for each weight set, then out_ref [R, N] (split_k > 1:
    # one fp32 [split_k, R, N] partial per weight set)
    token_ref, refs = (refs[0], refs[1:]) if plan.gather else (None, refs)
    x_ref, refs = refs[0], refs[1:]
    n_sets = 2 if swiglu else 1
    w_refs, out_refs = refs[:2 * n_sets], refs[2 * n_sets:]
    weights = [(w_refs[i], w_refs[i + 1]) for i in range(0, len(w_refs), 2)]
    j, b = pl.program_id(0), pl.program_id(1)
    q = pl.program_id(2) if plan.split_k > 1 else 0  # K range (read here: the interpreter has no program_id in loops)
    k_tiles = plan.words // plan.block_w // plan.split_k
    bm, bn, bw, gw = plan.block_m, plan.block_n, plan.block_w, plan.group_words
    e = block_expert_ref[b]
    n_live = block_rows_ref[b]  # 0 for unused blocks: the program exits at once
    cdt = x_ref.dtype
    nt = (((1,), (1,)), ((), ()))  # a @ b.T

    def load_x(rows, live, col):
        """[bm, bw] activations at x rows `rows`, columns col.., padding rows 0 without a memory access."""
        if interpret:  # the interpreter has no masked gather: load, then zero (same values)
            return jnp.where(live, x_ref[rows, pl.ds(col, bw)], 0).astype(cdt)
        return plt.load(x_ref.at[rows, pl.ds(col, bw)], mask=live, other=0)

    def accumulate(rows, live, jn, t, accs):
        """accs + this K tile's products for N tile jn, K tile t (rows: the block's x rows; live: [bm, bw], the
        rows that hold pairs)."""
        w0 = pl.multiple_of(t * bw, bw)
        n0 = pl.multiple_of(jn * bn, bn)
        xs = [load_x(rows, live, k * plan.words + w0) for k in range(NIBBLES_PER_WORD)]  # [bm, bw] each
        if plan.loads_only:  # a checksum of this K step's loads keeps every load live; no unpack, no MMA
            x_sum = sum(jnp.sum(xk.astype(jnp.float32), axis=1) for xk in xs)  # [bm]
        new = []
        for (p_ref, s_ref), acc in zip(weights, accs):
            if plan.tiled:
                words, sc = p_ref[e, jn, t], s_ref[e, jn, t]  # [bn, bw] int32, [bn, bw/gw]
            else:
                words = p_ref[e, pl.ds(n0, bn), pl.ds(w0, bw)]  # [bn, bw] int32
                sc = s_ref[e, pl.ds(n0, bn), pl.ds(t * (bw // gw), bw // gw)]  # [bn, bw/gw]
            if plan.loads_only:
                w_sum = (jnp.sum((words & 1).astype(jnp.float32), axis=1)
                         + jnp.sum(sc.astype(jnp.float32), axis=1))  # [bn]
                part = x_sum[:, None] + w_sum[None, :]  # x counted once per weight set
                new.append(acc + (part.T if plan.swap_ab else part))
                continue
            sc = jnp.broadcast_to(sc[:, :, None], (bn, bw // gw, gw)).reshape(bn, bw)  # [bn, bw] per word
            if unpack in UNPACK_DTYPES:
                planes = _planes_ptx(words, sc, unpack, interpret=interpret)
            else:
                planes = _planes_f32(words, sc, cdt)
            for k in range(NIBBLES_PER_WORD):
                a, bt = (planes[k], xs[k]) if plan.swap_ab else (xs[k], planes[k])
                if plan.acc_in_dot:
                    acc = dot_acc(acc, a, bt)
                else:
                    acc = acc + lax.dot_general(a, bt, nt, precision=precision,
                                                preferred_element_type=jnp.float32)  # [bm, bn] ([bn, bm] swapped)
            new.append(acc)
        return tuple(new)

    def store(r0, jn, accs):
        y = sum(accs) if plan.loads_only else _silu_mul(*accs) if swiglu else accs[0]
        y = _round_to(y, out_refs[0].dtype)
        y = y.T if plan.swap_ab else y
        if plan.out_nibble_major:  # out [R, 8, N/8]: column 8i + k of this tile goes to [k, jn*bn/8 + i]
            w0 = pl.multiple_of(jn * (bn // NIBBLES_PER_WORD), bn // NIBBLES_PER_WORD)
            y = y.reshape(bm, bn // NIBBLES_PER_WORD, NIBBLES_PER_WORD).swapaxes(1, 2)
            out_refs[0][pl.ds(r0, bm), :, pl.ds(w0, bn // NIBBLES_PER_WORD)] = y
        else:
            out_refs[0][pl.ds(r0, bm), pl.ds(pl.multiple_of(jn * bn, bn), bn)] = y

    zeros = tuple(jnp.zeros((bn, bm) if plan.swap_ab else (bm, bn), jnp.float32) for _ in weights)
    n_first = j * plan.n_per_program

    def row_block():
        r0 = pl.multiple_of(b * bm, bm)
        live = jnp.broadcast_to((lax.iota(jnp.int32, bm) < n_live)[:, None], (bm, bw))
        rows = token_ref[pl.ds(r0, bm)] if plan.gather else pl.ds(r0, bm)
        if plan.split_k > 1:
            accs = lax.fori_loop(q * k_tiles, (q + 1) * k_tiles, lambda t, a: accumulate(rows, live, j, t, a), zeros)
            for o_ref, acc in zip(out_refs, accs):
                o_ref[q, pl.ds(r0, bm), pl.ds(pl.multiple_of(j * bn, bn), bn)] = acc.T if plan.swap_ab else acc
        elif plan.n_per_program == 1:
            store(r0, j, lax.fori_loop(0, k_tiles, lambda t, a: accumulate(rows, live, j, t, a), zeros))
        else:  # one flat loop over (N tile, K tile): the pipeline keeps loading across N tiles

            def step(f, accs):
                kt = jnp.int32(k_tiles)  # lax, not jnp's floor div / mod: f >= 0, and Triton lowers lax.rem
                jn, t = n_first + lax.div(f, kt), lax.rem(f, kt)
                accs = accumulate(rows, live, jn, t, accs)
                last = t == k_tiles - 1
                pl.when(last)(lambda: store(r0, jn, accs))
                return tuple(jnp.where(last, 0.0, a) for a in accs)

            lax.fori_loop(0, plan.n_per_program * k_tiles, step, zeros)

    pl.when(n_live > 0)(row_block)


def _resolve_unpack(unpack: str | None, dtype) -> str:
    """A PTX unpack forms weights in its own 16-bit type, so the dot must run in it: for bf16 / fp16 activations it is
    the default, f32 otherwise."""
    if unpack is None:
        return next((u for u, d in UNPACK_DTYPES.items() if jnp.dtype(dtype) == d), UNPACK_F32)
    if unpack not in UNPACK_MODES:
        raise ValueError(f"int4 matmul: unpack={unpack!r} must be one of {UNPACK_MODES}")
    want = UNPACK_DTYPES.get(unpack)
    if want is not None and jnp.dtype(dtype) != want:
        raise ValueError(f"int4 matmul: unpack={unpack!r} needs {jnp.dtype(want).name} activations, got "
                         f"{jnp.dtype(dtype).name}")
    return unpack


def int4_dims(packed: jax.Array) -> tuple[int, int, int]:
    """(E, N, K/8) of packed words, row-major [E, N, K/8] or tile-major [E, N/bn, K/8/bw, bn, bw] (`tile_int4`)."""
    if packed.ndim == 5:
        e, nt, wt, bn, bw = packed.shape
        return e, nt * bn, wt * bw
    return tuple(packed.shape)


def int4_scale_groups(scale: jax.Array) -> int:
    """Scale groups per weight row of a row-major [E, N, K/G] or tile-major [E, N/bn, K/8/bw, bn, bw/gw] scale."""
    return scale.shape[2] * scale.shape[4] if scale.ndim == 5 else scale.shape[-1]


def tile_int4(packed: jax.Array, scale: jax.Array, *, block_n: int | None = None,
              block_w: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Row-major packed [E, N, K/8] + scale [E, N, K/G] -> tile-major [E, N/bn, K/8/bw, bn, bw] + [..., bn, bw/gw].

    Why: the kernel's program j reads, at K step t, the [bn, bw] words of rows j*bn.. and words t*bw..; row-major,
    that is bn runs of 4*bw bytes (128 B at the default tiles) strided by a whole weight row, and its scales are bn
    runs of 16 B. Tile-major, each K step's words and its scales are one contiguous block each. Same values, a
    different order: a one-time re-layout of the stored experts, not a per-call copy. The tiles (default: gate/up's,
    GATE_UP_LAUNCH) become the kernel's for these weights; N and K/8 must be whole tiles. `tile_ffn_int4` tiles an
    FFN's three matrices each in its own kernel's tiles.
    """
    if packed.ndim != 3 or scale.ndim != 3 or scale.shape[:2] != packed.shape[:2]:
        raise ValueError(f"tile_int4: packed must be [E, N, K/8] and scale [E, N, K/G], got {packed.shape} and "
                         f"{scale.shape}")
    e, n_out, words = packed.shape
    k_in = words * NIBBLES_PER_WORD
    if k_in % scale.shape[-1]:
        raise ValueError(f"tile_int4: scale {scale.shape} does not fit packed {packed.shape}")
    if block_n is None:
        block_n = _capped_block_n(GATE_UP_LAUNCH.block_n, n_out)
    plan = _make_plan(0, k_in, n_out, k_in // scale.shape[-1], MIN_DOT, block_n, block_w)
    if (plan.n_out, plan.words) != (n_out, words):
        raise ValueError(f"tile_int4: N={n_out} and K/8={words} must be multiples of the tiles (block_n="
                         f"{plan.block_n}, block_w={plan.block_w})")
    bn, bw, gw = plan.block_n, plan.block_w, plan.group_words

    def tiles(a, cols):
        return a.reshape(e, n_out // bn, bn, words // bw, cols).transpose(0, 1, 3, 2, 4)

    return tiles(packed, bw), tiles(scale, bw // gw)


def _capped_block_n(block_n: int, n_out: int) -> int:
    """A launch's N tile, capped at N rounded up to a power of two (small test widths)."""
    return min(block_n, max(MIN_DOT, next_pow2(n_out)))


def _plan_block_n(block_n: int | None, n_out: int) -> int:
    """The N tile a row-major call runs: the one asked for, else DEFAULT_BLOCK_N capped at N."""
    return block_n or _capped_block_n(DEFAULT_BLOCK_N, n_out)


def ffn_tiles(gate_n: int, up_n: int, down_n: int) -> list[dict]:
    """`tile_int4` tiles of gate, up and down with N output rows each: GATE_UP_LAUNCH's and DOWN_LAUNCH's, the N
    tile capped at N rounded up to a power of two (small test widths)."""
    return [dict(block_n=_capped_block_n(t.block_n, n), block_w=t.block_w)
            for n, t in zip((gate_n, up_n, down_n), (GATE_UP_LAUNCH, GATE_UP_LAUNCH, DOWN_LAUNCH))]


def tile_ffn_int4(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale) -> tuple[jax.Array, ...]:
    """The six expert arrays of an FFN tile-major in the engine's tiles (`ffn_tiles`, `tile_int4`; same order)."""
    pairs = [(gate_packed, gate_scale), (up_packed, up_scale), (down_packed, down_scale)]
    tiles = ffn_tiles(*(int4_dims(p)[1] for p, _ in pairs))
    return tuple(a for (p, s), t in zip(pairs, tiles) for a in tile_int4(p, s, **t))


def _launch_of(launch: Launch, packed: jax.Array) -> Launch:
    """`launch` on tile-major weights (where it was tuned), ROW_MAJOR_LAUNCH on row-major ones."""
    return launch if packed.ndim == 5 else ROW_MAJOR_LAUNCH


def ffn_block_m(n_pairs: int, n_experts: int, gate_packed: jax.Array, down_packed: jax.Array) -> int:
    """The FFN's row block: `default_block_m`, capped by what both kernels' launches on these weights can run."""
    return min(default_block_m(n_pairs, n_experts), _launch_of(GATE_UP_LAUNCH, gate_packed).max_block_m,
               _launch_of(DOWN_LAUNCH, down_packed).max_block_m)


def _launch_kw(launch: Launch, packed: jax.Array, num_warps, num_stages, n_per_program, swap_ab,
               acc_in_dot) -> dict:
    """The call's program shape: given values win, else `launch` on tile-major weights (where it was tuned;
    n_per_program only where it divides the N tiles) and ROW_MAJOR_LAUNCH on row-major ones."""
    tiled = packed.ndim == 5
    launch = _launch_of(launch, packed)
    if n_per_program is None:
        n_per_program = launch.n_per_program if tiled and packed.shape[1] % launch.n_per_program == 0 else 1
    pick = lambda given, tuned: tuned if given is None else given  # noqa: E731
    return dict(num_warps=num_warps or launch.num_warps, num_stages=num_stages or launch.num_stages,
                n_per_program=n_per_program, swap_ab=pick(swap_ab, launch.swap_ab),
                acc_in_dot=pick(acc_in_dot, launch.acc_in_dot))


def untile_int4(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `tile_int4` (row-major arrays pass through): what the dequantizing XLA paths read."""
    if packed.ndim != 5:
        return packed, scale
    e, n_out, _ = int4_dims(packed)

    def rows(a):
        return a.transpose(0, 1, 3, 2, 4).reshape(e, n_out, -1)

    return rows(packed), rows(scale)


def _pad_weights(packed, scale, plan: _Plan):
    """Pad [E, N, words] / [E, N, words/gw] to the plan (tiny shapes only: K2.6 needs no copy)."""
    e, n, w = packed.shape
    if (n, w) == (plan.n_out, plan.words):
        return packed, scale
    packed = jnp.pad(packed, ((0, 0), (0, plan.n_out - n), (0, plan.words - w)))
    scale = jnp.pad(scale, ((0, 0), (0, plan.n_out - n), (0, plan.words // plan.group_words - scale.shape[-1])))
    return packed, scale  # zero scales: padded weights are exactly 0


def _k_tiling(k_in: int, group_size: int, block_w: int | None) -> tuple[int, int]:
    """(words per K tile, packed words per row padded to whole tiles) for K = k_in input columns."""
    gw = group_size // NIBBLES_PER_WORD
    words = k_in // NIBBLES_PER_WORD
    bw = block_w or min(DEFAULT_BLOCK_W, max(MIN_DOT, next_pow2(words)))
    while bw > MIN_DOT and words % bw:  # largest tile that divides K (K2.6: 896 and 256 words -> 32)
        bw //= 2
    bw = max(bw, gw)
    return bw, -(-words // bw) * bw


def _make_plan(rows, k_in, n_out, group_size, block_m, block_n, block_w, split_k: int = 1) -> _Plan:
    if group_size % NIBBLES_PER_WORD:
        raise ValueError(f"int4 matmul: group_size {group_size} must be a multiple of 8")
    gw = group_size // NIBBLES_PER_WORD
    if gw != next_pow2(gw):
        raise ValueError(f"int4 matmul: group_size {group_size} must be 8 times a power of two")
    for name, blk in (("block_n", block_n), ("block_w", block_w)):
        if blk is not None and (blk < MIN_DOT or blk != next_pow2(blk)):
            raise ValueError(f"int4 matmul: {name}={blk} must be a power of two >= {MIN_DOT}")
    bw, words = _k_tiling(k_in, group_size, block_w)
    if split_k < 1 or (words // bw) % split_k:
        raise ValueError(f"int4 matmul: split_k={split_k} must divide the {words // bw} K tiles of {bw} words")
    bn = _plan_block_n(block_n, n_out)
    return _Plan(rows=rows, words=words, n_out=-(-n_out // bn) * bn, group_words=gw, block_m=block_m, block_n=bn,
                 block_w=bw, row_blocks=rows // block_m, split_k=split_k)


def grouped_int4_matmul(x: jax.Array, weights, layout: RouteLayout, *, row_token: jax.Array | None = None,
                        swiglu: bool = False, out_dtype=None,
                        block_n: int | None = None, block_w: int | None = None, num_warps: int = DEFAULT_WARPS,
                        num_stages: int = DEFAULT_STAGES, split_k: int = 1, n_per_program: int = 1,
                        nibble_major: bool = False, out_nibble_major: bool = False, unpack: str | None = None,
                        swap_ab: bool = False, acc_in_dot: bool = False, loads_only: bool = False,
                        interpret: bool | None = None) -> jax.Array:
    """Rows of x [R, K] (padded layout) times their row block's expert: -> [R, N] (fp32 accumulation).

    row_token [R] int32 (`row_tokens`): x instead holds token rows (any count) and padded row r reads x row
    row_token[r]; the padded rows are never materialised. Either way padding rows read as zeros.
    weights: ((packed [E, N, K/8] i32, scale [E, N, K/G]),) or two such pairs (gate, up) with swiglu=True, which
    returns silu(x Wg^T) * (x Wu^T). Rows outside every slot's blocks are left unwritten (garbage).
    unpack: how weights are dequantized (UNPACK_MODES; None: bf16x2 for bf16 x, else f32); "bf16x2" needs bf16 x and
    gives the same bf16 weights.
    nibble_major: x is already [rows, 8*words'] in the kernel's column order (`moe_route`), words' = K/8 padded
    to whole K tiles; otherwise the wrapper reorders it (a copy of x).
    out_nibble_major: the output comes nibble-major ([R, N], column k*N/8 + j holding column 8j + k: `_nibble_major`
    of the plain output), as a kernel reading it over K = N expects, so that no reorder runs between the two. Each
    program transposes its tile in registers before the store. N must be whole N tiles and a multiple of 8.
    split_k > 1: each (N tile, row block) runs as split_k programs over consecutive K ranges (more programs, shorter
    loops, for few rows); their fp32 partial sums are added in XLA before the SwiGLU epilogue and the rounding, so
    results match the unsplit kernel to fp32 summation order, not bit for bit.
    n_per_program > 1: each program walks that many consecutive N tiles in one flat loop over (N tile, K tile), so the
    load pipeline runs on across N tiles instead of starting cold in a new program (for short K loops, e.g. the down
    projection's 8 K tiles at K2.6 width); same bits as 1.
    swap_ab: each program accumulates y^T [block_n, block_m] = W x^T and transposes it before the store, so the weight
    tile is the MMA's M side: at 16-32 rows a block, M = block_n >= 64 lets sm_90 run warpgroup MMAs (wgmma, the
    unpacked weights straight from registers) where x W^T (M = block_m) runs mma.sync. Same products; the MMA may
    sum them in another order.
    acc_in_dot: the K loop accumulates inside each MMA (`pallas_kernels._dot_acc`) instead of adding each dot's
    result after it: no fp32 add per output element per dot, and chained wgmmas. Other rounding order.
    loads_only (benchmarks: the kernel with its unpack and MMA left out, timing its access pattern alone): the same
    loads, each row [r, n] of the output their checksum, per weight set sum_i x[r, i] + sum_j (word[n, j] & 1) +
    sum_g scale[n, g] over the row block's expert, the sets added (no SwiGLU); needs split_k=1. With no dot to feed,
    Triton loads the tiles straight into registers (no cp.async pipeline, far fewer registers and shared memory):
    the same addresses and order, not the same load machinery.
    """
    interpret = resolve_interpret(interpret)
    unpack = _resolve_unpack(unpack, x.dtype)
    if len(weights) != (2 if swiglu else 1):
        raise ValueError(f"grouped_int4_matmul: swiglu={swiglu} needs {2 if swiglu else 1} weight sets, "
                         f"got {len(weights)}")
    r, x_cols = x.shape
    if row_token is None and r != layout.rows:
        raise ValueError(f"grouped_int4_matmul: x has {r} rows, layout has {layout.rows}")
    if row_token is not None and (row_token.shape != (layout.rows,) or row_token.dtype != jnp.int32):
        raise ValueError(f"grouped_int4_matmul: row_token must be int32 [{layout.rows}] (the layout's rows), got "
                         f"{row_token.dtype} {row_token.shape}")
    shape = weights[0][0].shape
    tiled = len(shape) == 5
    if tiled:  # the tiles are the layout's
        if block_n not in (None, shape[3]) or block_w not in (None, shape[4]):
            raise ValueError(f"grouped_int4_matmul: block_n={block_n}, block_w={block_w} differ from the tile-major "
                             f"weights' tiles ({shape[3]}, {shape[4]})")
        block_n, block_w = shape[3], shape[4]
    _, n_out, words = int4_dims(weights[0][0])
    for i, (p, sc) in enumerate(weights):
        if p.shape != shape or p.dtype != jnp.int32:
            raise ValueError(f"grouped_int4_matmul: packed weight {i} must be int32 {list(shape)}, got "
                             f"{p.dtype} {p.shape}")
        if (sc.ndim != len(shape) or sc.shape[:-1] != shape[:-1] or not 0 < sc.shape[-1] <= shape[-1]
                or (words * NIBBLES_PER_WORD) % int4_scale_groups(sc)):
            raise ValueError(f"grouped_int4_matmul: scale {i} {sc.shape} does not fit packed {shape}")
    k_in = words * NIBBLES_PER_WORD
    group_size = k_in // int4_scale_groups(weights[0][1])
    plan = _make_plan(layout.rows, k_in, n_out, group_size, layout.block_m, block_n, block_w, split_k)
    if tiled and (plan.n_out, plan.words) != (n_out, words):
        raise ValueError(f"grouped_int4_matmul: tile-major weights {shape} are not whole K tiles of "
                         f"{plan.block_w} words")
    if loads_only and split_k > 1:
        raise ValueError(f"grouped_int4_matmul: loads_only needs split_k=1, got {split_k}")
    n_tiles = plan.n_out // plan.block_n
    if n_per_program < 1 or n_tiles % n_per_program or (n_per_program > 1 and split_k > 1):
        raise ValueError(f"grouped_int4_matmul: n_per_program={n_per_program} must divide the {n_tiles} N tiles of "
                         f"{plan.block_n} columns (and needs split_k=1, got {split_k})")
    if out_nibble_major and (plan.n_out != n_out or n_out % NIBBLES_PER_WORD):
        raise ValueError(f"grouped_int4_matmul: out_nibble_major needs N={n_out} to be whole N tiles of "
                         f"{plan.block_n} columns and a multiple of {NIBBLES_PER_WORD}")
    plan = dataclasses.replace(plan, tiled=tiled, n_per_program=n_per_program, gather=row_token is not None,
                               out_nibble_major=out_nibble_major and split_k == 1, swap_ab=swap_ab,
                               acc_in_dot=acc_in_dot, loads_only=loads_only)
    want_cols = plan.words * NIBBLES_PER_WORD if nibble_major else k_in
    if x_cols != want_cols:
        raise ValueError(f"grouped_int4_matmul: x has {x_cols} columns, the packed weights need {want_cols}"
                         f"{' (nibble-major, padded to whole K tiles)' if nibble_major else ''}")
    xp = x if nibble_major else _nibble_major(x, plan.words)  # [R, 8*words']
    flat = [a for p, sc in weights for a in ((p, sc) if tiled else _pad_weights(p, sc, plan))]
    precision = dot_precision(x.dtype)
    kernel = functools.partial(_kernel, plan=plan, swiglu=swiglu, precision=precision, unpack=unpack,
                               interpret=interpret)
    any_spec = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731  (whole array, indexed)
    gather = () if row_token is None else (row_token,)
    args = (layout.block_expert, layout.block_rows, *gather, xp, *flat)
    grid = (n_tiles // n_per_program, plan.row_blocks) + ((split_k,) if split_k > 1 else ())
    rows = layout.rows
    if plan.out_nibble_major:
        out_shape = [jax.ShapeDtypeStruct((rows, NIBBLES_PER_WORD, plan.n_out // NIBBLES_PER_WORD),
                                          out_dtype or x.dtype)]
    elif split_k == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, plan.n_out), out_dtype or x.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((split_k, rows, plan.n_out), jnp.float32) for _ in weights]
    outs = pallas_call(kernel, interpret=interpret, num_warps=num_warps, num_stages=num_stages, grid=grid,
                       in_specs=[any_spec(a) for a in args], out_specs=[any_spec(o) for o in out_shape],
                       out_shape=out_shape, name="int4_swiglu" if swiglu else "int4_matmul")(*args)
    if plan.out_nibble_major:
        return outs[0].reshape(rows, n_out)
    if split_k == 1:
        return outs[0][:, :n_out]
    accs = [o[:, :, :n_out].sum(axis=0) for o in outs]  # fp32 partials, added in split order
    y = _round_to(_silu_mul(*accs) if swiglu else accs[0], out_dtype or x.dtype)
    return _nibble_major(y, n_out // NIBBLES_PER_WORD) if out_nibble_major else y  # fused into the partials' sum


def int4_expert_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, expert_ids: jax.Array, *,
                       block_m: int | None = None, block_n: int | None = None, block_w: int | None = None,
                       num_warps: int = DEFAULT_WARPS, unpack: str | None = None,
                       interpret: bool | None = None) -> jax.Array:
    """y[p] = x[p] @ W[expert_ids[p]]^T for P routed rows: x [P, K], packed [E, N, K/8], scale [E, N, K/G] -> [P, N].

    Output in x's dtype, fp32 accumulation; every expert id must lie in 0..E-1.
    """
    if x.ndim != 2 or expert_ids.shape != (x.shape[0],):
        raise ValueError(f"int4_expert_matmul: x must be [P, K] and expert_ids [P], got {x.shape} and "
                         f"{expert_ids.shape}")
    n_exp = packed.shape[0]
    layout = route_layout(expert_ids, n_exp, block_m or default_block_m(x.shape[0], n_exp))
    y = grouped_int4_matmul(x, ((packed, scale),), layout, row_token=row_tokens(layout, x.shape[0], 1),  # row p: pair p
                            block_n=block_n, block_w=block_w, num_warps=num_warps, unpack=unpack, interpret=interpret)
    return y.at[layout.dest].get(mode="fill", fill_value=0)


def _check_ffn(x, idx, weights, gate, up, down):
    m, d = x.shape
    if idx.shape != weights.shape or idx.ndim != 2 or idx.shape[0] != m:
        raise ValueError(f"int4_moe_ffn: idx {idx.shape} and weights {weights.shape} must both be [M={m}, k]")
    e, inter, d_words = int4_dims(gate[0])
    if d_words * NIBBLES_PER_WORD != d or up[0].shape != gate[0].shape:
        raise ValueError(f"int4_moe_ffn: gate/up packed must be [E, I, D/8] with D={d}, got {gate[0].shape} and "
                         f"{up[0].shape}")
    if int4_dims(down[0]) != (e, d, inter // NIBBLES_PER_WORD) or down[0].ndim != gate[0].ndim:
        raise ValueError(f"int4_moe_ffn: down packed must be [E={e}, D={d}, I/8={inter // NIBBLES_PER_WORD}] in "
                         f"gate's layout, got {down[0].shape}")
    for name, (p, sc) in (("gate", gate), ("up", up), ("down", down)):
        if (sc.ndim != p.ndim or sc.shape[:-1] != p.shape[:-1]
                or (int4_dims(p)[2] * NIBBLES_PER_WORD) % int4_scale_groups(sc)):
            raise ValueError(f"int4_moe_ffn: {name} scale {sc.shape} does not fit packed {p.shape}")


def moe_route(x: jax.Array, idx: jax.Array, n_experts: int, *, group_size: int, block_m: int | None = None,
              block_w: int | None = None) -> tuple[RouteLayout, jax.Array, jax.Array]:
    """The glue before the first kernel: x [M, D], idx [M, k] -> (layout, [M, 8*words'] nibble-major tokens,
    [R] token of each padded row). Only the M token rows are reordered; the kernel gathers the routed rows."""
    m, d = x.shape
    layout = route_layout(idx.reshape(-1), n_experts, block_m or default_block_m(idx.size, n_experts))
    _, words = _k_tiling(d, group_size, block_w)
    return layout, _nibble_major(x, words), row_tokens(layout, m, idx.shape[1])


def moe_gate_up(xt: jax.Array, layout: RouteLayout, row_token: jax.Array, gate, up, *, num_warps: int | None = None,
                num_stages: int | None = None, n_per_program: int | None = None, swap_ab: bool | None = None,
                acc_in_dot: bool | None = None, **kw) -> jax.Array:
    """Fused gate/up kernel on nibble-major token rows xt (`moe_route`): -> h [R, I] = silu(x Wg^T) * (x Wu^T) in
    xt's dtype (out_nibble_major=True: in the order `moe_down` reads). Launch options left None come from
    GATE_UP_LAUNCH (tile-major weights) or ROW_MAJOR_LAUNCH."""
    launch = _launch_kw(GATE_UP_LAUNCH, gate[0], num_warps, num_stages, n_per_program, swap_ab, acc_in_dot)
    return grouped_int4_matmul(xt, (gate, up), layout, row_token=row_token, swiglu=True, nibble_major=True,
                               **launch, **kw)


def moe_down(h: jax.Array, layout: RouteLayout, down, *, num_warps: int | None = None, num_stages: int | None = None,
             n_per_program: int | None = None, swap_ab: bool | None = None, acc_in_dot: bool | None = None,
             **kw) -> jax.Array:
    """Down kernel: h [R, I] -> y [R, D] (nibble_major=True: h is already in the kernel's column order, else it is
    reordered first). Launch options left None come from DOWN_LAUNCH (tile-major weights) or ROW_MAJOR_LAUNCH."""
    launch = _launch_kw(DOWN_LAUNCH, down[0], num_warps, num_stages, n_per_program, swap_ab, acc_in_dot)
    return grouped_int4_matmul(h, (down,), layout, **launch, **kw)


def _h_nibble_major(gate_packed, down_packed, down_scale, block_n: int | None, block_w: int | None) -> bool:
    """Whether gate/up can write h straight in down's column order: I is whole gate/up N tiles (no padded columns)
    and whole down K tiles (no padded words). K2.6 (I = 2048) is; the reorder it saves ran as its own XLA transpose,
    33 µs a step at a batch-8 B = 16 verify (the trace in BENCHMARKS.md §4b)."""
    _, inter, _ = int4_dims(gate_packed)
    gate_n = gate_packed.shape[3] if gate_packed.ndim == 5 else _plan_block_n(block_n, inter)
    down_w = down_packed.shape[4] if down_packed.ndim == 5 else block_w
    down_group = inter // int4_scale_groups(down_scale)
    return inter % gate_n == 0 and _k_tiling(inter, down_group, down_w)[1] * NIBBLES_PER_WORD == inter


def moe_combine(y: jax.Array, layout: RouteLayout, weights: jax.Array, out_dtype) -> jax.Array:
    """Each token's k expert rows of y [R, D], weighted and added in fp32: weights [M, k] -> [M, D] in out_dtype."""
    m, top_k = weights.shape
    y = y.at[layout.dest].get(mode="fill", fill_value=0).reshape(m, top_k, y.shape[-1]).astype(jnp.float32)
    return jnp.einsum("mk,mkd->md", weights.astype(jnp.float32), y).astype(out_dtype)


def int4_moe_ffn(x: jax.Array, idx: jax.Array, weights: jax.Array, gate_packed, gate_scale, up_packed, up_scale,
                 down_packed, down_scale, *, block_m: int | None = None, block_n: int | None = None,
                 block_w: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 split_k: int = 1, gate_up_n_per_program: int | None = None, down_n_per_program: int | None = None,
                 out_dtype=None, unpack: str | None = None, interpret: bool | None = None) -> jax.Array:
    """Routed SwiGLU experts + weighted combine: x [M, D], idx / weights [M, k] -> [M, D] in out_dtype (x's).

    Gate/up run as one fused kernel call (silu(g) * u written directly, h in x's dtype), down as a second call over
    the same routing layout; the k expert outputs of a token are combined in fp32. A pair whose id is outside
    0..E-1 is absent (contributes 0, costs nothing): expert parallelism passes other devices' pairs that way, and
    out_dtype=float32 keeps its partial sums unrounded until the cross-device reduction.
    unpack="fp16": both kernels run in fp16 with exact weights (`_fp16x2_asm`): x is converted and h kept in fp16,
    saturating at +-FP16_MAX (an expert input past fp16's range is clipped), and y comes back in out_dtype.
    split_k applies to the gate/up call only; gate_up_n_per_program / down_n_per_program are each call's
    n_per_program (see `grouped_int4_matmul`). Launch options left None are each kernel's own (`moe_gate_up`,
    `moe_down`): on tile-major weights from `tile_ffn_int4`, the tuned GATE_UP_LAUNCH / DOWN_LAUNCH.
    """
    _check_ffn(x, idx, weights, (gate_packed, gate_scale), (up_packed, up_scale), (down_packed, down_scale))
    out_dtype = out_dtype or x.dtype
    y_dtype = None  # h's
    if unpack == UNPACK_FP16:  # fp16 kernels, x and h saturating
        x = to_fp16(x)
        y_dtype = jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.float32 else out_dtype  # y unsaturated: caller's 16 bits
    route_w = gate_packed.shape[4] if gate_packed.ndim == 5 else block_w  # tile-major weights carry their tiles
    kw = dict(block_n=block_n, block_w=block_w, num_warps=num_warps, num_stages=num_stages, unpack=unpack,
              interpret=interpret)
    group = x.shape[1] // int4_scale_groups(gate_scale)
    block_m = block_m or ffn_block_m(idx.size, gate_packed.shape[0], gate_packed, down_packed)
    layout, xt, row_token = moe_route(x, idx, gate_packed.shape[0], group_size=group, block_m=block_m,
                                      block_w=route_w)
    h_nibble_major = _h_nibble_major(gate_packed, down_packed, down_scale, block_n, block_w)
    h = moe_gate_up(xt, layout, row_token, (gate_packed, gate_scale), (up_packed, up_scale), split_k=split_k,
                    n_per_program=gate_up_n_per_program, out_nibble_major=h_nibble_major, **kw)
    y = moe_down(h, layout, (down_packed, down_scale), n_per_program=down_n_per_program, nibble_major=h_nibble_major,
                 out_dtype=y_dtype, **kw)  # [R, D]
    return moe_combine(y, layout, weights, out_dtype)


# ---- XLA baselines (benchmarks) ---------------------------------------------------------------------------------
def dequant_then_matmul_ffn(x, idx, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale):
    """Baseline: dequantize the touched experts (min(E, P) slots) with `dequant_int4_jnp`, then dense einsums of every
    token through every touched expert, combined with the (mostly zero) routing weights. Same math as the kernel."""
    m, d = x.shape
    n_exp, dt = gate_packed.shape[0], x.dtype
    group = d // gate_scale.shape[-1]
    slots = min(n_exp, idx.size)
    touched = jnp.zeros((n_exp,), bool).at[idx.reshape(-1)].set(True)
    (slot_expert,) = jnp.nonzero(touched, size=slots, fill_value=0)  # [S]

    def deq(p, s, g):
        return dequant_int4_jnp(p[slot_expert], s[slot_expert], g, dt)  # [S, out, in]

    wg, wu = deq(gate_packed, gate_scale, group), deq(up_packed, up_scale, group)
    wd = deq(down_packed, down_scale, down_packed.shape[-1] * NIBBLES_PER_WORD // down_scale.shape[-1])
    h = jax.nn.silu(jnp.einsum("md,sid->smi", x, wg)) * jnp.einsum("md,sid->smi", x, wu)  # [S, M, I]
    y = jnp.einsum("smi,sdi->smd", h, wd)  # [S, M, D]
    expert_slot = jnp.cumsum(touched.astype(jnp.int32)) - 1  # [E]
    combine = jnp.zeros((m, slots), jnp.float32).at[jnp.arange(m)[:, None], expert_slot[idx]].add(weights)
    return jnp.einsum("ms,smd->md", combine, y.astype(jnp.float32)).astype(dt)


def bf16_ragged_dot_ffn(x, idx, weights, w_gate, w_up, w_down):
    """Baseline with float experts [E, D, I] / [E, I, D]: sort pairs by expert, `jax.lax.ragged_dot` for gate, up and
    down (XLA's grouped GEMM), un-sort, combine."""
    m, d = x.shape
    top_k, n_exp = idx.shape[1], w_gate.shape[0]
    ids = idx.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    xs = x[order // top_k]  # [P, D] pair rows grouped by expert
    sizes = jnp.zeros((n_exp,), jnp.int32).at[ids].add(1)
    h = jax.nn.silu(lax.ragged_dot(xs, w_gate, sizes)) * lax.ragged_dot(xs, w_up, sizes)  # [P, I]
    ys = lax.ragged_dot(h, w_down, sizes)  # [P, D]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(m, top_k, d).astype(jnp.float32)
    return jnp.einsum("mk,mkd->md", weights.astype(jnp.float32), y).astype(x.dtype)


def bf16_gather_ffn(x, idx, weights, w_gate, w_up, w_down):
    """Baseline with float experts: gather each pair's expert weights (`w[idx]`, a copy), then batched einsums."""
    wg, wu, wd = w_gate[idx], w_up[idx], w_down[idx]  # [M, k, D, I], [M, k, D, I], [M, k, I, D]
    h = jax.nn.silu(jnp.einsum("md,mkdi->mki", x, wg)) * jnp.einsum("md,mkdi->mki", x, wu)
    y = jnp.einsum("mki,mkid->mkd", h, wd)
    return jnp.einsum("mk,mkd->md", weights.astype(jnp.float32), y.astype(jnp.float32)).astype(x.dtype)
