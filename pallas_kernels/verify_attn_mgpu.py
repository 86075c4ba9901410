"""Absorbed-MLA attention over the latent-cache prefix as a Mosaic GPU kernel (Hopper wgmma, warp-specialised).

Why a second backend: with H = 64 heads, each 1,152-byte cache row feeds 139 kFLOP, so the prefix pass is
tensor-core-bound on the Triton backend, which emits Ampere `mma.sync` for its tiles (BENCHMARKS.md §3). This kernel
issues Hopper `wgmma` from 64-row query tiles, the FlashMLA layout:

  - warpgroup 2 (memory) streams KV blocks [block_k, 576] into a ring of shared-memory stages by TMA;
  - warpgroup 0 computes the scores S = q · kᵀ over all 576 dims and the online softmax, writes P (bf16) and the
    row rescale factor to shared memory, then P · V for the first half of the 512 value columns;
  - warpgroup 1 rescales its accumulator and computes P · V for the second half, reading P from shared memory.

An fp32 [64, 512] accumulator would take 256 registers per thread; split over two warpgroups it takes 128, and the
scores are computed once. Each program (request b, query tile t, split j: `SplitPlan`) writes the normalised output of
its share of the prefix blocks and its rows' log-sum-exp; when a tile holds one tree node (H % 64 == 0) its last
split also runs the tree block, masked by the node's mask row (`tree_bits`), else `verify_attn` adds the tree part
in XLA; `verify_attn` merges the splits. The output leaves through shared memory (the q tile's, dead by then) and
TMA stores: written from the wgmma register layout it cost 4.4 µs per program alone (8.5 µs with 128 programs; TMA:
1.8 / 2.9 µs), the largest part of a short call (BENCHMARKS.md §3). That buffer holds the input dtype, so the fp32
output goes as two parts, hi = o rounded and lo = o - hi: 16 significant bits, as many bytes as fp32. One bf16 part
alone (8 bits) made the greedy ddtree and AR calls round differently enough to pick different tokens on a random
model: one prefix over 1 and over 5 splits then differs by 2.3e-3 relative before the final cast, against 8e-4 with
both parts (P's own bf16 rounding).

Limits (checked by `supports`): bf16/fp16 inputs, value width a multiple of 128, rope width a multiple of 64 and cache
rows a multiple of 8; everything else takes the Triton kernel. Query rows (N*H per request) come in whole 64-row
tiles: `verify_attn` pads them (rows are independent in the prefix pass), so H = 8 decode runs 8 real rows per tile,
which costs tensor-core time but not HBM bytes. Off the GPU the kernel runs in Mosaic GPU's interpreter
(`plgpu.InterpretGPUParams`), which simulates the warpgroups, shared memory, TMA and barriers.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma's M: one query tile
BLOCK_K = 64  # KV rows per stage; P [64, 64] bf16 is one 128-byte swizzle row, as wgmma needs it to match V's
STAGES = 2  # KV ring depth: q tile 72 KiB + 2 x 72 KiB KV + 8 KiB P fills the 227 KiB a block may have
P_STAGES = 1  # P buffers: warpgroup 0 writes P(i+1) after warpgroup 1 has read P(i) (a third stage does not fit)
BIT_WORD = BLOCK_K // 2  # tree-mask bits per int32 word (`tree_bits`): a key block's columns in two words
SEQ_ALIGN = 8  # TMA reads the cache in tiles of 8 rows: its row count must be a multiple
TILE_ROWS = 8  # rows of one shared-memory tile (_smem_transforms): the output's TMA stores go one tile row each
SWIZZLE = 128  # bytes; the widest TMA/wgmma shared-memory swizzle
NEG = -1e30  # finite initial running max: exp2(NEG - m) = 0 for any real m, never inf - inf
LOG2E = math.log2(math.e)
# The split plan's overheads (`verify_attn._tail_plan`), in cache rows of one program's prefix work (35 ns a row
# per 64-row tile): a program's fixed work (q tile load, pipeline fill, output stores) and the merge of one split's
# partial outputs per wave of programs. Fitted to an H200 trace of batch-8 B = 16 verify steps at 13 splits, 4k and
# 32k prefixes: 17.8 and 96.5 µs per wave, 69 µs per layer's merge (BENCHMARKS.md §4b).
PROGRAM_ROWS, MERGE_ROWS = 188, 148
# per-thread registers after rebalancing: the two compute warpgroups hold a [64, 256] fp32 accumulator each (128
# registers); 2 x 232 + 40 fits the 3 x 170 a 64K-register file gives three warpgroups
COMPUTE_REGS, MEMORY_REGS = 232, 40


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How the query tiles' prefixes are split over programs. An item is one query tile of one request (item = b *
    tiles + t); the first `items - tail_items` items take `splits` splits each and the last `tail_items` take
    `tail_splits`: more, shorter programs that fill the last wave of SMs, which equal splits leave mostly idle (136
    tiles on 132 SMs: a fourth wave of 12 full-length programs at three splits). Program p is its item's first
    program plus the split index, so one request's tiles, which read the same cache rows, run side by side."""

    items: int
    splits: int
    tail_items: int = 0
    tail_splits: int = 1
    min_split_blocks: int = 1  # prefix blocks a split reads at least (a short prefix uses fewer splits)

    def __post_init__(self):
        if not (self.items >= 1 and self.splits >= 1 and self.tail_splits >= 1 and 0 <= self.tail_items <= self.items
                and self.min_split_blocks >= 1):
            raise ValueError(f"verify_attn_mgpu: {self} needs items, splits, tail_splits, min_split_blocks >= 1 and "
                             f"0 <= tail_items <= items")

    @property
    def head_items(self) -> int:
        return self.items - self.tail_items

    @property
    def programs(self) -> int:
        return self.head_items * self.splits + self.tail_items * self.tail_splits

    def groups(self):
        """(first program, first item, items, splits) of each non-empty group, in program order."""
        head = self.head_items * self.splits
        return [g for g in ((0, 0, self.head_items, self.splits),
                            (head, self.head_items, self.tail_items, self.tail_splits)) if g[2]]


def supports(dtype, value_width: int, rope_width: int, seq: int) -> bool:
    """Whether this kernel handles a call: wgmma-friendly dtype and widths, and a cache whose row count TMA can
    tile (the engine allocates multiples of SEQ_ALIGN). Query rows are padded to whole tiles by the caller."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and value_width % 128 == 0
            and rope_width % 64 == 0 and seq % SEQ_ALIGN == 0)


def _smem_transforms(minor: int, itemsize: int):
    """Tiling + swizzle for a shared-memory tile whose minor dim holds `minor` elements (wgmma/TMA layout)."""
    swizzle = min(SWIZZLE, minor * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def shared_memory(dtype, width: int):
    """A program's shared memory: q tile, KV ring, P buffers (the input dtype, wgmma/TMA tiled) and the rows' alpha
    (fp32). One list, so that kernels measured against prefix_attn's launch shape take the same occupancy."""
    itemsize = jnp.dtype(dtype).itemsize
    return (plgpu.SMEM((ROWS, width), dtype, transforms=_smem_transforms(width, itemsize)),
            plgpu.SMEM((STAGES, BLOCK_K, width), dtype, transforms=_smem_transforms(width, itemsize)),
            plgpu.SMEM((P_STAGES, ROWS, BLOCK_K), dtype, transforms=_smem_transforms(BLOCK_K, itemsize)),
            plgpu.SMEM((P_STAGES, ROWS), jnp.float32))


def join_parts(out):
    """prefix_attn's output [..., 2, rows, R] (hi and lo parts in the input dtype) -> [..., rows, R] fp32."""
    return out[..., 0, :, :].astype(jnp.float32) + out[..., 1, :, :].astype(jnp.float32)


def block_range(prefix, j, n_splits, block_k: int, min_split_blocks: int):
    """Prefix blocks [lo, hi) of split j: every split but the last reads the same count, >= min_split_blocks."""
    n_blocks = pl.cdiv(prefix, block_k)
    per_split = jnp.maximum(pl.cdiv(n_blocks, n_splits), min_split_blocks)
    lo = jnp.minimum(j * per_split, n_blocks)
    return lo, jnp.minimum(n_blocks, lo + per_split)


def split_outputs(out, lse, plan: SplitPlan):
    """prefix_attn's outputs per group: [(first item, o [items, splits, ..., 64, R], lse [items, splits, 64]), ...]."""
    return [(i0, out[p0:p0 + n * sp].reshape(n, sp, *out.shape[1:]), lse[p0:p0 + n * sp].reshape(n, sp, *lse.shape[1:]))
            for p0, i0, n, sp in plan.groups()]


def tree_bits(tree_mask, tiles_per_node: int):
    """tree_mask [Bt, N, N] bool -> [Bt * N * tiles_per_node, 2 * ceil(N / BLOCK_K)] int32: each query tile's row of
    the mask (the tile's rows are all heads of one node) as BIT_WORD-bit words, bit c of word w = tree column
    w * BIT_WORD + c. `prefix_attn`'s tree blocks read them as scalars: no mask tile in shared memory, which is full."""
    bt, n, _ = tree_mask.shape
    width = pl.cdiv(n, BLOCK_K) * BLOCK_K
    m = jnp.pad(tree_mask.astype(jnp.uint32), ((0, 0), (0, 0), (0, width - n)))
    shifts = jnp.arange(BIT_WORD, dtype=jnp.uint32)
    words = jnp.sum(m.reshape(bt, n, width // BIT_WORD, BIT_WORD) << shifts, axis=-1, dtype=jnp.uint32)  # disjoint
    words = lax.bitcast_convert_type(words, jnp.int32)  # [Bt, N, words]
    return jnp.repeat(words, tiles_per_node, axis=1).reshape(bt * n * tiles_per_node, width // BIT_WORD)


def prefix_attn(q, cache, prefix_len, *, scale: float, value_width: int, plan: SplitPlan | int, layer: int = 0,
                tree=None, page_table=None, interpret: bool = False):
    """q [Bt, rows, A] (rows % 64 == 0), cache [L, Bt, S, A] read at `layer`, prefix_len [Bt] int32 (clipped to S
    here), `plan` (an int: that many splits for every tile) -> (out [programs, 2, 64, R] normalised, as hi and lo
    parts in q's dtype (`join_parts` adds them in fp32); lse [programs, 64] f32 natural-log log-sum-exp of the
    scores), one entry per program in the plan's order (`split_outputs` groups them). A split with no blocks writes
    out = 0 and lse = NEG (weighs 0 in a merge).

    tree = (tree_kv [Bt, T, A] with T a multiple of BLOCK_K, `tree_bits` [items, 2 * T / BLOCK_K]): the last split
    of each query tile also attends to the tree's own rows under its mask, as more blocks of the same online
    softmax, so no tree part is computed or merged outside (a single-split tile's output is then final).

    page_table [Bt, W] int32: `cache` is a page pool [L, n_pages, P, A] (P a power of two, 16..128) and prefix row s
    of request b is cache[layer, page_table[b, s // P], s % P]. A KV block is then fetched by one TMA copy per page
    it spans (BLOCK_K // P copies below 64-row pages, landing on one barrier), each from its page in place; the table
    entries a block needs are read as scalars by the memory warpgroup just before it issues the copies."""
    bt, rows, width = q.shape
    page = 0 if page_table is None else cache.shape[2]
    seq = cache.shape[2] * (1 if page_table is None else page_table.shape[1])  # the prefix rows a request can have
    if page and not (page >= 16 and page & (page - 1) == 0 and page_table.shape[0] == bt):
        raise ValueError(f"verify_attn_mgpu: a paged cache {cache.shape} needs a power-of-two page size >= 16 and a "
                         f"page table [{bt}, W], got {page_table.shape}")
    if rows % ROWS or not supports(q.dtype, value_width, width - value_width, seq):
        raise ValueError(f"verify_attn_mgpu: q {q.shape} {q.dtype} / cache {cache.shape} with R = {value_width}: "
                         f"needs rows % {ROWS} == 0 and what `supports` lists")
    r, bk, stages, p_stages = value_width, BLOCK_K, STAGES, P_STAGES
    half = r // 2
    n_tiles = rows // ROWS
    chunk = min(bk, page or bk)  # rows of one TMA copy: a block, or a page when pages are smaller than a block
    if isinstance(plan, int):
        plan = SplitPlan(items=bt * n_tiles, splits=plan)
    if plan.items != bt * n_tiles:
        raise ValueError(f"verify_attn_mgpu: {plan} is for {plan.items} query tiles, q {q.shape} has {bt * n_tiles}")
    tree_blocks = 0
    if tree is not None:
        tree_kv, bits = tree
        tree_blocks = tree_kv.shape[1] // bk
        if (tree_kv.shape != (bt, tree_blocks * bk, width) or tree_blocks < 1 or tree_kv.dtype != q.dtype
                or bits.shape != (plan.items, 2 * tree_blocks) or bits.dtype != jnp.int32):
            raise ValueError(f"verify_attn_mgpu: tree_kv {tree_kv.shape} {tree_kv.dtype} / bits {bits.shape} "
                             f"{bits.dtype} must be [{bt}, a multiple of {bk}, {width}] {q.dtype} / [{plan.items}, "
                             f"2 * blocks] int32")
    c = scale * LOG2E  # scores in log2 units: exp2 is one instruction

    def body(plen_ref, *refs):
        page_ref, refs = (refs[0], refs[1:]) if page else (None, refs)
        q_ref, cache_ref, *refs = refs
        tree_ref, bits_ref, refs = (refs[0], refs[1], refs[2:]) if tree_blocks else (None, None, refs)
        (out_ref, lse_ref, q_smem, kv_smem, p_smem, alpha_smem, q_bar, kv_bar, kv_free, p_ready, p_free,
         l_ready) = refs
        prog = lax.axis_index("prog")
        item, j, n_splits = 0, 0, 1
        for p0, i0, _, sp in plan.groups():  # prog belongs to the last group that starts at or before it
            mine, local = prog >= p0, jnp.maximum(prog - p0, 0)
            item = jnp.where(mine, i0 + local // sp, item)
            j = jnp.where(mine, local % sp, j)
            n_splits = jnp.where(mine, sp, n_splits)
        b, t = item // n_tiles, item % n_tiles
        wg = lax.axis_index("wg")
        prefix = jnp.minimum(plen_ref[b], seq)  # clipped here: an XLA clip would be one more launch per call
        lo, hi = block_range(prefix, j, n_splits, bk, plan.min_split_blocks)
        n_prefix = hi - lo
        n = n_prefix + jnp.where(j == n_splits - 1, tree_blocks, 0)  # the tree's blocks follow the last split's
        r0 = pl.multiple_of(t * ROWS, ROWS)

        def write_out(o, col0):
            """Normalised output columns [col0, col0 + half), hi then lo part -> q_smem -> TMA to `out_ref`. A TMA
            source must be contiguous, and a column slice of the tiled q tile is so only within one 8-row tile row."""
            cols = pl.ds(col0, half)
            o_hi = o.astype(q.dtype)  # not `hi`: that name is the split's last block
            for part, value in enumerate((o_hi, (o - o_hi.astype(jnp.float32)).astype(q.dtype))):
                if part:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the hi part has left the buffer
                q_smem.at[:, cols][...] = value
                plgpu.commit_smem()
                for i in range(0, ROWS, TILE_ROWS):
                    sub = pl.ds(i, TILE_ROWS)
                    plgpu.copy_smem_to_gmem(q_smem.at[sub, cols],
                                            out_ref.at[prog, part, pl.ds(i, TILE_ROWS), cols])
            plgpu.wait_smem_to_gmem(0)

        def drain(bars, n, depth):
            """Observe the last `depth` phases of a ring of barriers this warpgroup produced into, so that every
            phase is consumed before the kernel ends (the interpreter checks it; compiled it costs one wait)."""
            @pl.loop(jnp.maximum(n - depth, 0), n)
            def _(i):
                plgpu.barrier_wait(bars.at[lax.rem(i, depth)])

        def prefix_rows(row):
            """Prefix rows [row, row + chunk) of request b in the cache: its own rows, or a slice of one page. A
            chunk past the prefix (in its last block, when pages are smaller than a block) reads the prefix's last
            page again instead: the table's entries past it may name any page, and a masked row still meets P · V,
            where 0 x NaN would be NaN. So, as in a contiguous cache, only the request's own rows must be finite."""
            if not page:
                return cache_ref.at[layer, b, pl.ds(pl.multiple_of(row, chunk), chunk)]
            page_id = page_ref[b, jnp.minimum(lax.div(row, page), lax.div(prefix - 1, page))]
            return cache_ref.at[layer, page_id, pl.ds(pl.multiple_of(lax.rem(row, page), chunk), chunk)]

        def tree_rows(row):
            return tree_ref.at[b, pl.ds(pl.multiple_of(row, chunk), chunk)]

        def copy_block(source, row0, slot):
            """The block of rows [row0, row0 + bk) into `slot` as bk // chunk copies from `source(row)` (the chunk
            starting at row): every block takes as many, so each completes the slot's barrier (bk // chunk
            arrivals). A contiguous cache, or pages of >= bk rows, take one copy of the whole slot."""
            if chunk == bk:
                plgpu.copy_gmem_to_smem(source(row0), kv_smem.at[slot], kv_bar.at[slot])
                return
            for k in range(0, bk, chunk):
                plgpu.copy_gmem_to_smem(source(row0 + k), kv_smem.at[slot, pl.ds(k, chunk)], kv_bar.at[slot])

        def fetch(i, slot):
            """Block i of this program's keys into `slot`: prefix block lo + i, then tree block i - n_prefix."""
            @pl.when(i < n_prefix)
            def _prefix():
                copy_block(prefix_rows, (lo + i) * bk, slot)

            if tree_blocks:
                @pl.when(i >= n_prefix)
                def _tree():
                    copy_block(tree_rows, (i - n_prefix) * bk, slot)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGS, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(r0, ROWS)], q_smem, q_bar)
            for s in range(stages):
                @pl.when(s < n)
                def _prologue():
                    fetch(jnp.int32(s), s)

            @pl.loop(jnp.int32(stages), jnp.maximum(n, stages))
            def _stream(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(kv_free.at[slot])
                fetch(i, slot)

            drain(kv_free, n, stages)

        def pv(acc, p, slot, col0):
            """acc + P · V[:, col0:col0+half]. Compiled, wgmma accumulates into the registers of `acc` in place;
            Mosaic GPU's interpreter has no `run_state`, so there a fresh product is added (same arithmetic)."""
            v = kv_smem.at[slot, :, pl.ds(col0, half)]
            if interpret:
                def product(acc_ref):
                    plgpu.wgmma(acc_ref, p, v)
                    return acc_ref[...]
                return acc + pl.run_scoped(product, plgpu.ACC((ROWS, half), jnp.float32))

            def issue(acc_ref):
                plgpu.wgmma(acc_ref, p, v)
            return pl.run_state(issue)(plgpu.ACC.init(acc))

        @pl.when(wg == 0)
        def _softmax_and_first_half():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            plgpu.barrier_wait(q_bar)
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
            m = plgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)

            def prefix_visible(i):
                return col < prefix - (lo + i) * bk

            # the tile's mask words, loaded before the prefix loop so that their latency hides behind it
            words = [bits_ref[item, w] for w in range(2 * tree_blocks)]

            def tree_visible(i):
                """Tree block i - n_prefix: column k is visible where bit k of the tile's mask row is set."""
                lo_word, hi_word = words[0], words[1]
                for blk in range(1, tree_blocks):
                    lo_word = jnp.where(i - n_prefix == blk, words[2 * blk], lo_word)
                    hi_word = jnp.where(i - n_prefix == blk, words[2 * blk + 1], hi_word)
                word = jnp.where(col < BIT_WORD, lo_word, hi_word)
                return (lax.shift_right_logical(word, lax.rem(col, BIT_WORD)) & 1) != 0

            def step(visible, i, carry):
                acc, m, l = carry
                slot, pslot = lax.rem(i, stages), lax.rem(i, p_stages)
                plgpu.barrier_wait(kv_bar.at[slot])

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot].transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, bk), jnp.float32))
                s = jnp.where(visible(i), s * c, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                @pl.when(i >= p_stages)
                def _wait_p_free():
                    plgpu.barrier_wait(p_free.at[pslot])

                p_smem[pslot] = p.astype(q.dtype)
                alpha_smem[pslot] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[pslot])
                acc = pv(acc, p_smem.at[pslot], slot, 0)
                plgpu.barrier_arrive(kv_free.at[slot])
                return acc, m_new, l

            carry = lax.fori_loop(jnp.int32(0), n_prefix, functools.partial(step, prefix_visible), (acc, m, l))
            if tree_blocks:  # a loop of its own: the prefix steps test no mask bits
                carry = lax.fori_loop(n_prefix, n, functools.partial(step, tree_visible), carry)
            acc, m, l = carry
            drain(p_free, n, p_stages)  # warpgroup 1 has read the last alpha: the slot can take 1 / l
            seen = l > 0.0
            inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)  # a row that saw nothing writes 0
            alpha_smem[0] = inv_l
            plgpu.commit_smem()
            plgpu.barrier_arrive(l_ready)
            write_out(acc * lax.broadcast_in_dim(inv_l, acc.shape, [0]), 0)  # q is dead: the last scores are done
            lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * math.log(2.0), NEG)
            lse_ref.at[prog][...] = lse

        @pl.when(wg == 1)
        def _second_half():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            acc = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)

            def step(i, acc):
                slot, pslot = lax.rem(i, stages), lax.rem(i, p_stages)
                plgpu.barrier_wait(kv_bar.at[slot])
                plgpu.barrier_wait(p_ready.at[pslot])
                alpha = plgpu.load(alpha_smem.at[pslot], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = pv(acc, p_smem.at[pslot], slot, half)
                plgpu.barrier_arrive(p_free.at[pslot])
                plgpu.barrier_arrive(kv_free.at[slot])
                return acc

            acc = lax.fori_loop(jnp.int32(0), n, step, acc)
            plgpu.barrier_wait(l_ready)
            inv_l = plgpu.load(alpha_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            write_out(acc * lax.broadcast_in_dim(inv_l, acc.shape, [0]), half)

    out_type = (jax.ShapeDtypeStruct((plan.programs, 2, ROWS, r), q.dtype),
                jax.ShapeDtypeStruct((plan.programs, ROWS), jnp.float32))
    scratch = (
        *shared_memory(q.dtype, width),
        plgpu.Barrier(num_barriers=1),  # q tile landed
        plgpu.Barrier(num_arrivals=bk // chunk, num_barriers=stages),  # KV block landed (its TMA copies)
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # KV slot read by both compute warpgroups
        plgpu.Barrier(num_barriers=p_stages),  # P and alpha written by warpgroup 0
        plgpu.Barrier(num_barriers=p_stages),  # P read by warpgroup 1
        plgpu.Barrier(num_barriers=1),  # 1 / l written by warpgroup 0
    )
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(plan.programs,), grid_names=("prog",), num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
                                            reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    paged = () if page_table is None else (page_table.astype(jnp.int32),)
    return kernel(prefix_len.astype(jnp.int32), *paged, q, cache, *(tree if tree_blocks else ()))
