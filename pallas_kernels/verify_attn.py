"""Absorbed-MLA tree attention for DDTree verify as a Pallas Triton kernel (flash-style, split-K).

`verify_attn(backend=...)` also routes calls to the Mosaic GPU (Hopper wgmma) prefix kernel in verify_attn_mgpu;
`pick_backend` says when. What follows describes the Triton kernel. With a page table (a paged cache) only where a
prefix block's rows are read changes (`_row_address`): blocks never cross a page, so each is one page's slice.

Every query row (node n, head h) attends to the request's latent cache rows [0, prefix_len) and to the tree rows
its mask row allows. The KV side is one shared 576-wide latent head (MQA: c_kv | k_pe), so the (N, H) query rows
are flattened to R_q = N*H rows and processed as 2-D tiles of `block_q` rows; each KV block of `block_k` latents
is loaded once per tile and feeds both dots: scores = q_lat·c_kv + q_pe·k_pe (two power-of-two dots, 512 + 64),
values = c_kv itself (weight absorption: DeepSeek-V2, arXiv 2405.04434, §2.1.2; `kdtree_jax/model/mla.py`).

Grid (query tiles, splits, Bt), tiles fastest: the programs resident at once are mostly tiles of one request and
split, so they share its KV blocks through L2 (what makes large trees compute-bound, not HBM-bound). Split j
walks its share of the prefix blocks (a dynamic trip count from prefix_len, so a short prefix in a long cache costs
only its own blocks); the last split with work also walks the tree blocks. With one split the kernel normalises
and writes the output; with several (chosen when Bt * tiles alone would leave SMs idle) each active split writes
(normalised output, log-sum-exp) and XLA merges the active ones (flash-decoding): a fused reduction over the split
axis, parallel over rows, where a Pallas merge loop over splits measured latency-bound on the H200. Splits read
>= MIN_SPLIT_ROWS cache rows each, so a short prefix uses few of them and idle splits neither compute nor write.
The split count fills whole waves of SMs (`_default_splits`: a grid of 136 equal programs on 132 SMs takes two
program times, as long as 264). The wgmma path plans its splits per tile instead (`_tail_plan`): the tiles that fill
whole waves in equal splits, the rest in more, shorter ones, pricing each program's fixed work and each split's merge.

Triton constraints (the rules of `jax/_src/pallas/triton/lowering.py`) and how they are met:
  - power-of-two tiles only: R and rope dims are padded to powers of two >= 16 in the wrapper only when they are not
    already (never for K2's 512 + 64); row counts need no padding because the last query tile / KV block is
    shifted back to end at the array's end (the overlap is masked for KV and written twice with equal values
    for queries), so no load ever leaves its array.
  - no value gathers: the tree mask of a tile's rows (node = row // H) is fetched as a one-hot [block_q, M] x
    [M, block_k] dot over the M mask rows the tile can touch (0/1 values are exact in bf16).
  - masked scores never produce NaN: probabilities of masked keys are selected to 0, and a row that sees nothing
    keeps l = 0 and writes 0. Cache rows past prefix_len must be finite (they are multiplied by p = 0).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import verify_attn_mgpu
from pallas_kernels._pallas import dot_precision, next_pow2, pallas_call, resolve_interpret

NEG = -1e30  # finite "minus infinity" for the running max: NEG - NEG = 0, never inf - inf
MIN_DOT = 16  # smallest dot dimension Triton handles well
# Defaults by input itemsize: ((block_q, block_k, resident blocks per SM), the same when a request's N*H query rows
# fit one MIN_DOT-row tile, warps, stages); residency is the sm_90 resource report's (shared memory and registers,
# checked by tests/test_kernel_resources.py) and sizes the split rule's wave. bf16 from the H200 tuning sweeps
# (BENCHMARKS.md §3, `bench_kernels.py --tune`): 4 warps and 3 stages beat the 8-warp, 2-stage tiles the sm_90
# resource report suggested by 1.4-2.2x; with the wave split rule, 32 x 64 tiles won 4 of 5 H = 64 shapes
# (tied the fifth), and 16 x 32 (one query tile per request: smaller KV blocks, two blocks per SM) was best or within
# 16% of the best on every H = 8 decode shape. 64-row tiles with wgmma (an output split in
# value chunks to stay in registers) lost on all five H = 64 shapes. fp32 keeps 16 x 32 on 8 warps, 2 stages: larger
# tiles or more stages need more shared memory than a block has (346 KiB at 64 x 32).
DEFAULTS = {2: ((32, 64, 1), (16, 32, 2), 4, 3), 4: ((16, 32, 1), (16, 32, 1), 8, 2)}
SM_COUNT = 132  # H200
WAVE_SLACK = 0.05  # the split rule takes the fewest splits within this fraction of the best predicted time
MIN_SPLIT_ROWS = 256  # a split reads at least this many cache rows, so partial outputs stay small vs the cache
PAGE_SIZES = (16, 32, 64, 128)  # rows per page of a paged cache: powers of two, so a block never crosses a page


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call (all sizes in elements)."""

    r: int  # value width (padded kv_lora_rank)
    dr: int  # rope width (padded)
    heads: int  # H: query rows n*H .. n*H+H-1 belong to node n
    rows: int  # flattened query rows (N*H, or 16 when smaller)
    seq: int  # cache rows (S, or 16 when smaller)
    tree: int  # tree rows padded to a multiple of block_k
    mask_rows: int  # tree-mask rows after padding (every tile can read `sel` rows from its first node)
    sel: int  # mask rows one query tile can touch, padded to a power of two >= 16
    block_q: int
    block_k: int
    n_q: int  # query tiles
    n_splits: int
    min_split_blocks: int  # prefix blocks an active split reads at least
    page: int = 0  # rows per page of a paged cache (a multiple of block_k), 0 for a contiguous one


def _prev_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _default_splits(programs: int, max_splits: int, resident: int, seq: int) -> int:
    """Split-K count for `programs` (query tiles x Bt) equal programs over a `seq`-row cache, `resident` of which fit
    one SM at once (a wave is SM_COUNT x resident programs): the fewest splits whose predicted time is within
    WAVE_SLACK of the best, time = waves x rows per split, a partly filled last wave costing a whole one. 8 programs at
    32k get 16 splits (128 blocks, one wave) where cdiv(132, 8) = 17 splits gave 136 blocks: a second wave of 4."""
    wave = SM_COUNT * resident
    cost = {sp: pl.cdiv(programs * sp, wave) * seq / sp for sp in range(1, max(1, max_splits) + 1)}
    best = min(cost.values())
    return min(sp for sp, c in cost.items() if c <= best * (1 + WAVE_SLACK))


def _busy_splits(n_blocks: int, splits: int, min_split_blocks: int) -> int:
    """The default split count, trimmed to the splits a full cache keeps busy. Splits read cdiv(n_blocks, splits)
    blocks each (at least min_split_blocks), so the rounding can leave the last ones without a block even at prefix =
    S, where they would still launch, write empty partials and be merged: 512 blocks over 122 splits are 5 blocks
    each for 103 splits (batch 1, 32k on the wgmma path). The fewer splits are no slower: no split reads more blocks
    than before."""
    per_split = max(pl.cdiv(n_blocks, splits), min_split_blocks)
    return max(1, pl.cdiv(n_blocks, per_split))


def _auto_splits(programs: int, seq: int, block_k: int, resident: int) -> tuple[int, int]:
    """(split count, blocks each split reads at least) when the caller gives none, Triton path: `_default_splits`
    of `programs`, trimmed to busy splits, each reading >= MIN_SPLIT_ROWS of a `seq`-row cache."""
    min_split_blocks = pl.cdiv(MIN_SPLIT_ROWS, block_k)
    splits = _default_splits(programs, seq // MIN_SPLIT_ROWS, resident, seq)
    return _busy_splits(pl.cdiv(seq, block_k), splits, min_split_blocks), min_split_blocks


def _online_update(carry, q_lat, q_pe, k_lat, k_pe, valid, *, scale, precision):
    """One flash step: fold a KV block (k_lat [bk, r], k_pe [bk, dr], valid [bq or 1, bk]) into (o, m, l)."""
    o, m, l = carry  # [bq, r] f32, [bq] f32, [bq] f32
    nt = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
    s = lax.dot_general(q_lat, k_lat, nt, precision=precision, preferred_element_type=jnp.float32)
    s += lax.dot_general(q_pe, k_pe, nt, precision=precision, preferred_element_type=jnp.float32)
    s = jnp.where(valid, s * scale, NEG)  # [bq, bk]
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)  # [bq, bk]
    corr = jnp.exp(m - m_new)
    pv = jnp.dot(p.astype(k_lat.dtype), k_lat, precision=precision, preferred_element_type=jnp.float32)
    return o * corr[:, None] + pv, m_new, l * corr + p.sum(axis=-1)


def _split_range(prefix, j, plan: _Plan):
    """Prefix blocks [lo, hi) of split j, and how many splits have work (>= 1: the last active one owns the tree).

    Each active split reads at least `min_split_blocks` blocks, so a short prefix in a long cache uses few splits
    and idle splits write nothing (the combine reads only the active ones).
    """
    n_blocks = pl.cdiv(prefix, plan.block_k)
    per_split = jnp.maximum(pl.cdiv(n_blocks, plan.n_splits), plan.min_split_blocks)
    n_active = jnp.maximum(pl.cdiv(n_blocks, per_split), 1)
    lo = j * per_split
    return lo, jnp.minimum(n_blocks, lo + per_split), n_active


def _row_address(page_ref, b, page: int):
    """Where request b's prefix row `row` sits in the cache operand: at `row` in its own contiguous rows, or, paged,
    at its page's first row in the pool (pages back to back) plus its offset in the page. A prefix block of block_k
    rows starts at a multiple of block_k, which divides the page size, so its rows share one page and one address."""
    if not page:
        return lambda row: row
    return lambda row: page_ref[b, lax.div(row, page)] * page + lax.rem(row, page)


def _kernel(*refs, plan: _Plan, scale: float, precision):
    # plen_ref [Bt] i32 | page_ref [Bt, W] i32 (paged only) | q_ref [rows, r+dr] | cache_ref [seq, r+dr] (paged:
    # [n_pages * page, r+dr]) | tree_ref [tree, r+dr] | mask_ref [mask_rows, tree] int8
    # out_refs: (out [rows, r]) with one split, else (o [rows, r] f32, lse [rows] f32) of this split
    plen_ref, page_ref = refs[0], (refs[1] if plan.page else None)
    q_ref, cache_ref, tree_ref, mask_ref, *out_refs = refs[2 if plan.page else 1:]
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    prefix = plen_ref[b]
    lo, hi, n_active = _split_range(prefix, j, plan)
    attend = functools.partial(_attend, q_ref, cache_ref, tree_ref, mask_ref, out_refs, i, prefix, lo, hi,
                               j == n_active - 1, _row_address(page_ref, b, plan.page), plan=plan, scale=scale,
                               precision=precision)
    if plan.n_splits == 1:
        attend()
    else:
        pl.when(j < n_active)(attend)


def _attend(q_ref, cache_ref, tree_ref, mask_ref, out_refs, i, prefix, lo, hi, with_tree, address, *, plan: _Plan,
            scale: float, precision):
    """Query tile i over prefix blocks [lo, hi) (+ the tree blocks if with_tree); writes this split's result.
    `address` maps a prefix row to its row in cache_ref (`_row_address`)."""
    bq, bk, r, dr = plan.block_q, plan.block_k, plan.r, plan.dr
    r0 = jnp.minimum(i * bq, plan.rows - bq)  # the last tile ends at the last row
    q_lat = q_ref[pl.ds(r0, bq), pl.ds(0, r)]  # [bq, r]
    q_pe = q_ref[pl.ds(r0, bq), pl.ds(r, dr)]  # [bq, dr]
    step = functools.partial(_online_update, q_lat=q_lat, q_pe=q_pe, scale=scale, precision=precision)
    carry = (jnp.zeros((bq, r), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))

    def kv(ref, row0):
        """A block's latents [bk, r] (keys and values) and rope keys [bk, dr]."""
        return dict(k_lat=ref[pl.ds(row0, bk), pl.ds(0, r)], k_pe=ref[pl.ds(row0, bk), pl.ds(r, dr)])

    def prefix_block(blk, carry):
        start = jnp.minimum(blk * bk, plan.seq - bk)  # the last block ends at the last row; overlap masked below
        idx = start + jnp.arange(bk, dtype=jnp.int32)
        valid = ((idx >= blk * bk) & (idx < prefix))[None, :]  # [1, bk]
        return step(carry, valid=valid, **kv(cache_ref, address(start)))

    carry = lax.fori_loop(lo, hi, prefix_block, carry)

    n0 = r0 // plan.heads  # first node of the tile
    node = (r0 + jnp.arange(bq, dtype=jnp.int32)) // plan.heads - n0  # [bq] in 0..sel-1
    one_hot = (node[:, None] == jnp.arange(plan.sel, dtype=jnp.int32)[None, :]).astype(jnp.bfloat16)  # [bq, sel]

    def tree_block(t, carry):
        mask = mask_ref[pl.ds(n0, plan.sel), pl.ds(t * bk, bk)].astype(jnp.bfloat16)  # [sel, bk] 0/1
        valid = jnp.dot(one_hot, mask, preferred_element_type=jnp.float32) > 0.5  # [bq, bk]: row's node mask
        return step(carry, valid=valid, **kv(tree_ref, t * bk))

    # Triton's scf.for needs both bounds of one integer type: make them explicit int32 (weak-typed literals are not)
    n_tree = with_tree.astype(jnp.int32) * jnp.int32(plan.tree // bk)
    o, m, l = lax.fori_loop(jnp.int32(0), n_tree, tree_block, carry)

    seen = l > 0.0
    o = o / jnp.where(seen, l, 1.0)[:, None]  # rows that saw nothing have o = 0
    if plan.n_splits == 1:
        (out_ref,) = out_refs
        out_ref[pl.ds(r0, bq), :] = o.astype(out_ref.dtype)
    else:
        o_ref, lse_ref = out_refs
        o_ref[pl.ds(r0, bq), :] = o
        lse_ref[pl.ds(r0, bq)] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)


def _merge_splits(o, lse, tree=None):
    """Flash-decoding merge, both backends: split outputs o [Bt, splits, rows, R] (fp32, normalised) weighed by
    their log-sum-exps lse [Bt, splits, rows], plus on the mosaic path the tree part `tree` = (acc [Bt, rows, R]
    unnormalised, row max m, row sum l [Bt, rows]) -> [Bt, rows, R] fp32. A split that saw nothing has o = 0 and
    lse = NEG; a row that saw nothing anywhere gets 0 (its weights are all 1, on zeros). The denominator is >= 1:
    the largest term has weight 1."""
    top = lse.max(axis=1)
    if tree is not None:
        acc_t, m_t, l_t = tree
        top = jnp.maximum(top, m_t)
    w = jnp.exp(lse - top[:, None])
    num, den = (w[..., None] * o).sum(axis=1), w.sum(axis=1)
    if tree is not None:
        w_t = jnp.exp(m_t - top)
        num, den = num + w_t[..., None] * acc_t, den + w_t * l_t
    return num / den[..., None]


def _combine(o, lse, prefix_len, plan: _Plan):
    """_merge_splits over the Triton kernel's active splits: inactive ones were never written, so they are masked
    to (0, NEG) before any arithmetic."""
    _, _, n_active = _split_range(prefix_len, 0, plan)  # [Bt]
    active = jnp.arange(plan.n_splits)[None, :] < n_active[:, None]  # [Bt, splits]
    return _merge_splits(jnp.where(active[..., None, None], o, 0.0), jnp.where(active[..., None], lse, NEG))


def _pad_latent(x, r, r_pad, dr_pad):
    """[..., r + dr] -> [..., r_pad + dr_pad]: zero-pad the value part and the rope part separately."""
    widths = [(0, 0)] * (x.ndim - 1)
    lat = jnp.pad(x[..., :r], widths + [(0, r_pad - r)])
    pe = jnp.pad(x[..., r:], widths + [(0, dr_pad - (x.shape[-1] - r))])
    return jnp.concatenate([lat, pe], axis=-1)


def _pad_axis(x, axis, size):
    """Zero-pad one axis to `size`; returns x itself when nothing is missing (never copies the cache for K2)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _own_pages(pool, page_table):
    """(pages, table): the pages page_table [Bt, W] names, gathered into a pool of Bt * W pages in reverse order,
    and the table that addresses them there. The interpreter carries (copies) every operand through its grid loop,
    so handed the pool it would keep a copy of it; this copy is the size of the requests' pages instead, and reads
    go through a table as they do compiled."""
    bt, w = page_table.shape
    order = jnp.arange(bt * w - 1, -1, -1, dtype=jnp.int32).reshape(bt, w)  # slot (b, j) -> its page here
    return pool[jnp.maximum(page_table, 0).reshape(-1)[::-1]], order  # one gather: page k is slot bt * w - 1 - k


def _check_inputs(q, cache, prefix_len, tree_kv, tree_mask, kv_lora_rank, layer, page_table):
    if q.ndim != 4:
        raise ValueError(f"verify_attn: q must be [Bt, N, H, A], got shape {q.shape}")
    bt, n, _, a = q.shape
    rows = "Bt, S" if page_table is None else "n_pages, P"
    if layer is not None and not (cache.ndim == 4 and 0 <= layer < cache.shape[0]):
        raise ValueError(f"verify_attn: with layer={layer} the cache must be [L > layer, {rows}, A], got {cache.shape}")
    cache_shape = (bt, None, a) if page_table is None else (None, None, a)
    if layer is not None:
        cache_shape = (cache.shape[0], *cache_shape)
    expect = {"cache": (cache, cache_shape), "prefix_len": (prefix_len, (bt,)),
              "tree_kv": (tree_kv, (bt, n, a)), "tree_mask": (tree_mask, (bt, n, n))}
    if page_table is not None:
        expect["page_table"] = (page_table, (bt, None))
    for name, (x, shape) in expect.items():
        if x.ndim != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape)):
            raise ValueError(f"verify_attn: {name} must have shape {shape} (None = any) for q {q.shape}, "
                             f"got {x.shape}")
    if not 0 < kv_lora_rank < a:
        raise ValueError(f"verify_attn: kv_lora_rank={kv_lora_rank} must be in 1..A-1 (A={a}, the rest is rope)")
    if cache.dtype != q.dtype:
        raise ValueError(f"verify_attn: cache dtype {cache.dtype} must equal q dtype {q.dtype} (no cache copy)")
    if q.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"verify_attn: q dtype {q.dtype} must be bfloat16, float16 or float32")
    if not jnp.issubdtype(prefix_len.dtype, jnp.integer):
        raise ValueError(f"verify_attn: prefix_len must be integer, got {prefix_len.dtype}")
    if page_table is not None:
        page = cache.shape[-2]
        if not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise ValueError(f"verify_attn: page_table must be integer, got {page_table.dtype}")
        if page not in PAGE_SIZES:
            raise ValueError(f"verify_attn: the page size (cache rows per page) must be one of {PAGE_SIZES}, got "
                             f"{page}")


def _make_plan(bt, n, h, s, r_pad, dr_pad, block_q, block_k, num_splits, itemsize, page: int = 0) -> _Plan:
    """The tiling of one call; `page` > 0: a paged cache of `s` = W * page logical rows, whose blocks must not cross
    a page (block_k is capped at the page size: both are powers of two)."""
    rows, seq = max(n * h, MIN_DOT), max(s, MIN_DOT)
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None and (blk < MIN_DOT or blk != next_pow2(blk)):
            raise ValueError(f"verify_attn: {name}={blk} must be a power of two >= {MIN_DOT}")
    tiles, one_tile, _, _ = DEFAULTS[min(itemsize, 4)]
    default_q, default_k, resident = one_tile if n * h <= MIN_DOT else tiles
    bq = min(block_q or default_q, _prev_pow2(rows))
    bk = min(block_k or default_k, _prev_pow2(seq), page or seq)
    n_q = pl.cdiv(rows, bq)
    min_split_blocks = 1  # an explicit num_splits divides any prefix over all of them (tests, tuning)
    if num_splits is None:
        if (block_q or default_q, block_k or default_k) != (default_q, default_k):
            resident = 1  # a tile the report has not measured: assume the least
        num_splits, min_split_blocks = _auto_splits(bt * n_q, s, bk, resident)
    if num_splits < 1:
        raise ValueError(f"verify_attn: num_splits={num_splits} must be >= 1")
    sel = next_pow2(max(MIN_DOT, (bq - 1) // h + 2))  # nodes a tile of bq rows starting anywhere can span
    tree = pl.cdiv(n, bk) * bk
    return _Plan(r=r_pad, dr=dr_pad, heads=h, rows=rows, seq=seq, tree=tree, mask_rows=pl.cdiv(rows, h) + sel,
                 sel=sel, block_q=bq, block_k=bk, n_q=n_q, n_splits=num_splits,
                 min_split_blocks=min_split_blocks, page=page)


BACKENDS = ("triton", "mosaic")


def _is_hopper() -> bool:
    """wgmma exists on sm_90 only (Blackwell has tcgen05 instead)."""
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def pick_backend(backend: str | None, dtype, rows: int, r: int, dr: int, seq: int, interpret: bool) -> str:
    """`mosaic` (Hopper wgmma, verify_attn_mgpu) or `triton` for a call with `rows` = N*H query rows per request.

    By default the wgmma kernel serves, on an sm_90 GPU, every call it supports whose rows fill whole 64-row tiles:
    at H = 64 its GPU time per call measured 1.2-2.7x less than the Triton kernel's (wall time 0.9-2.5x, the 0.9 at
    batch 1, 32k; BENCHMARKS.md §3), while H = 8 decode, padded to a tile, measured a tie (0.95-1.05x)
    and stays on Triton. An explicit choice is honoured (any row count:
    rows are padded) or refused with the reason."""
    fits = verify_attn_mgpu.supports(dtype, r, dr, seq)
    if backend is None:
        whole_tiles = rows % verify_attn_mgpu.ROWS == 0
        return "mosaic" if fits and whole_tiles and not interpret and _is_hopper() else "triton"
    if backend not in BACKENDS:
        raise ValueError(f"verify_attn: backend={backend!r} must be one of {BACKENDS} or None (auto)")
    if backend == "mosaic" and not fits:
        raise ValueError(f"verify_attn: backend='mosaic' needs bf16/fp16, kv_lora_rank % 128 == 0, rope width % 64 "
                         f"== 0 and cache rows % {verify_attn_mgpu.SEQ_ALIGN} == 0; got {jnp.dtype(dtype).name}, "
                         f"{r} + {dr}, S={seq}")
    return backend


def _tree_partial(q, tree_kv, tree_mask, *, scale: float, r: int):
    """The tree block in XLA for the mosaic path: (acc [Bt, N, H, R] unnormalised, m, l [Bt, N, H]) in fp32.
    N x N per request, small next to the prefix; rows that see no tree node get l = 0. The arithmetic is the prefix
    kernel's: products of the bf16/fp16 inputs summed in fp32, P rounded to the input dtype for P · V. Both dots
    then run on tensor cores; fp32 HIGHEST einsums ran as FFMA GEMMs, 36 µs per call at batch 8, N = 17."""
    f32 = jnp.float32
    s = jnp.einsum("bnha,bka->bnhk", q, tree_kv, preferred_element_type=f32) * scale
    vis = tree_mask[:, :, None, :]
    m = jnp.where(vis, s, NEG).max(axis=-1)
    p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bnhk,bkr->bnhr", p.astype(q.dtype), tree_kv[..., :r], preferred_element_type=f32)
    return acc, m, p.sum(axis=-1)


def _makespan(n1: int, w1: int, n2: int, w2: int, sm_count: int = SM_COUNT) -> int:
    """When the last of n1 programs of w1 rows then n2 of w2 rows ends, one program an SM, each program starting on
    the first SM to free up (the order blocks are issued in): the head leaves r1 = n1 % sm_count SMs a program
    longer than the rest, and the tail's programs take the earliest starts after them."""
    q1, r1 = divmod(n1, sm_count)
    early, late = q1 * w1, (q1 + bool(r1)) * w1  # when the SMs with q1 and with q1 + 1 head programs free up
    if not n2:
        return late

    def started(t):  # tail programs started at or before time t
        return sum(count * ((t - free) // w2 + 1) for count, free in ((sm_count - r1, early), (r1, late)) if t >= free)

    firsts = []
    for free in (early, late):  # the n2-th start is free + k * w2 for one of the two free times
        lo, hi = 0, n2
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if started(free + mid * w2) < n2 else (lo, mid)
        firsts.append(free + lo * w2)
    return max(late, min(firsts) + w2)


def _plan_cost(plan: verify_attn_mgpu.SplitPlan, seq: int, block_k: int, program_rows: int, merge_rows: int,
               sm_count: int = SM_COUNT) -> float:
    """A plan's predicted time over a full `seq`-row cache, in cache rows of one program's work: `_makespan` of each
    program's fixed rows plus its split's share of the blocks, plus `merge_rows` per split and wave for writing and
    merging the partial outputs."""
    n_blocks = pl.cdiv(seq, block_k)

    def rows(sp):
        return program_rows + min(max(pl.cdiv(n_blocks, sp), plan.min_split_blocks), n_blocks) * block_k

    head, tail = plan.head_items * plan.splits, plan.tail_items * plan.tail_splits
    return (_makespan(head, rows(plan.splits), tail, rows(plan.tail_splits), sm_count)
            + plan.programs / sm_count * merge_rows)


@functools.lru_cache(maxsize=None)
def _tail_plan(items: int, seq: int, block_k: int, program_rows: int, merge_rows: int,
               sm_count: int = SM_COUNT) -> verify_attn_mgpu.SplitPlan:
    """The wgmma path's split plan for `items` query tiles over a `seq`-row cache: equal splits, or equal splits for
    the tiles that fill whole waves and more of them for the rest (`SplitPlan`), whichever `_plan_cost` predicts
    fastest; the fewest programs within WAVE_SLACK of it. Split counts are those a full cache keeps busy
    (`_busy_splits`), each split reading >= MIN_SPLIT_ROWS rows."""
    min_blocks, n_blocks = pl.cdiv(MIN_SPLIT_ROWS, block_k), pl.cdiv(seq, block_k)
    counts = sorted({_busy_splits(n_blocks, sp, min_blocks) for sp in range(1, max(1, seq // MIN_SPLIT_ROWS) + 1)})
    plan = functools.partial(verify_attn_mgpu.SplitPlan, items=items, min_split_blocks=min_blocks)
    plans = []
    for sp in counts:
        plans.append(plan(splits=sp))
        for waves in range(max(0, items * sp // sm_count - 1), items * sp // sm_count + 1):
            head = waves * sm_count // sp  # the tiles whose programs fill `waves` whole waves
            plans += [plan(splits=sp, tail_items=items - head, tail_splits=c) for c in counts
                      if c > sp and 0 < head < items]
    cost = {p: _plan_cost(p, seq, block_k, program_rows, merge_rows, sm_count) for p in plans}
    best = min(cost.values())
    return min((p for p in plans if cost[p] <= best * (1 + WAVE_SLACK)), key=lambda p: (p.programs, cost[p]))


def _verify_attn_mosaic(q, cache, prefix_len, tree_kv, tree_mask, *, scale, r, layer, num_splits, interpret,
                        plan: verify_attn_mgpu.SplitPlan | None = None, tree_in_kernel: bool | None = None,
                        page_table=None):
    """verify_attn on the wgmma path: verify_attn_mgpu (rows padded to 64-row tiles) in `plan`'s splits (default:
    `_tail_plan`, or `num_splits` for every tile), then the merge of the splits in XLA.

    When every query tile holds one tree node (H a multiple of 64: K2's 64 heads), the kernel's last split of each
    tile also runs the tree block, and a single-split tile's output is final: its hi part is o rounded, as the merge
    would round it. Otherwise (fewer heads: a tile spans nodes) the tree block runs in XLA (`_tree_partial`) and
    joins the merge. tree_in_kernel: False keeps the tree in XLA at any H (None: in the kernel where it can be).
    page_table: cache is a page pool [L, n_pages, P, A] (`verify_attn`), read by the kernel through the table."""
    bt, n, h, a = q.shape
    rows, tile = n * h, verify_attn_mgpu.ROWS
    tiles = pl.cdiv(rows, tile)
    seq = cache.shape[2] * (1 if page_table is None else page_table.shape[1])
    if plan is None:
        plan = (verify_attn_mgpu.SplitPlan(items=bt * tiles, splits=num_splits) if num_splits is not None else
                _tail_plan(bt * tiles, seq, verify_attn_mgpu.BLOCK_K, verify_attn_mgpu.PROGRAM_ROWS,
                           verify_attn_mgpu.MERGE_ROWS))
    q_rows = _pad_axis(q.reshape(bt, rows, a), 1, tiles * tile)  # padding rows: computed, dropped
    in_kernel = h % tile == 0 and tree_in_kernel is not False
    if tree_in_kernel and not in_kernel:
        raise ValueError(f"verify_attn: tree_in_kernel=True needs H % {tile} == 0 (one tree node a query tile), "
                         f"got H={h}")
    tree = None
    if in_kernel:
        keys = pl.cdiv(n, verify_attn_mgpu.BLOCK_K) * verify_attn_mgpu.BLOCK_K
        tree = (_pad_axis(tree_kv, 1, keys), verify_attn_mgpu.tree_bits(tree_mask, h // tile))
    o, lse = verify_attn_mgpu.prefix_attn(q_rows, cache, prefix_len, scale=scale, value_width=r, plan=plan,
                                          layer=layer, tree=tree, page_table=page_table, interpret=interpret)
    if in_kernel:
        merged = [o_g[:, 0, 0].astype(jnp.float32) if o_g.shape[1] == 1 else
                  _merge_splits(verify_attn_mgpu.join_parts(o_g), lse_g)
                  for _, o_g, lse_g in verify_attn_mgpu.split_outputs(o, lse, plan)]
    else:
        acc_t, m_t, l_t = _tree_partial(q, tree_kv, tree_mask, scale=scale, r=r)
        # the tree part per query tile [items, 64, ...]; padding rows see no tree node (l = 0)
        per_tile = [_pad_axis(x.reshape(bt, rows, *x.shape[3:]), 1, tiles * tile).reshape(bt * tiles, tile,
                                                                                         *x.shape[3:])
                    for x in (acc_t, m_t, l_t)]
        merged = [_merge_splits(o_g, lse_g, tuple(x[i0:i0 + o_g.shape[0]] for x in per_tile))
                  for i0, o_g, lse_g in verify_attn_mgpu.split_outputs(verify_attn_mgpu.join_parts(o), lse, plan)]
    out = jnp.concatenate(merged) if len(merged) > 1 else merged[0]
    return out.reshape(bt, tiles * tile, r)[:, :rows].astype(q.dtype).reshape(bt, n, h, r)


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "layer", "block_k", "block_q", "num_splits",
                                             "num_warps", "num_stages", "interpret", "backend", "tree_in_kernel"))
def verify_attn(q, cache, prefix_len, tree_kv, tree_mask, *, scale: float, kv_lora_rank: int, layer: int | None = None,
                page_table: jax.Array | None = None, block_k: int | None = None, block_q: int | None = None,
                num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                interpret: bool | None = None, backend: str | None = None,
                tree_in_kernel: bool | None = None) -> jax.Array:
    """Tree-verify attention over the latent cache: -> [Bt, N, H, R] in q's dtype (fp32 accumulation).

    q [Bt, N, H, A] absorbed queries (q_lat | q_pe); cache [Bt, S, A] latents (c_kv | k_pe), valid rows
    [0, prefix_len[b]) (clipped to S), or the whole model's cache [L, Bt, S, A] with a static `layer`: the kernel
    then reads that layer in place (a sliced operand would be materialised: one extra read + write of the layer's
    cache per call); tree_kv [Bt, N, A] the tree's own latents; tree_mask [Bt, N, N] bool.
    page_table [Bt, W] int32 makes `cache` a page pool, [n_pages, P, A] or [L, n_pages, P, A] with `layer`, P in
    PAGE_SIZES: prefix row s of request b is pool[page_table[b, s // P], s % P], prefix_len <= W * P. The kernels
    read each block of rows from its page in place (no gather into a contiguous cache) and never read table entries
    past a prefix's last page (callers may leave them 0); as in a contiguous cache, the rows of that last page past
    the prefix must be finite.
    backend: "triton" (this module's kernel, any shape), "mosaic" (verify_attn_mgpu: Hopper wgmma for the prefix,
    and for the tree block where a query tile holds one node) or None = `pick_backend`'s choice.
    Tuning knobs (all optional): block_k / block_q (powers of two >= 16, Triton); num_splits (split-K programs per
    query tile; default: whole waves of SMs, each split reading >= MIN_SPLIT_ROWS rows; an explicit value divides
    every prefix over all of them); num_warps / num_stages (Triton); tree_in_kernel (mosaic: False runs the tree
    block in XLA; default: in the kernel when H % 64 == 0, `_verify_attn_mosaic`).
    """
    _check_inputs(q, cache, prefix_len, tree_kv, tree_mask, kv_lora_rank, layer, page_table)
    interpret = resolve_interpret(interpret)
    if layer is not None and interpret:  # the interpreter's loop would carry (copy) every layer: hand it one
        cache, layer = cache[layer], None
    if page_table is not None and interpret:  # nor the whole pool: hand it the requests' own pages
        cache, page_table = _own_pages(cache, page_table)
    if layer is None:
        cache, layer = cache[None], 0  # [1, Bt, S, A] (paged: [1, n_pages, P, A]): one code path
    bt, n, h, a = q.shape
    page = 0 if page_table is None else cache.shape[2]
    s = cache.shape[2] if page_table is None else page * page_table.shape[1]  # the prefix rows a request can have
    r, dr = kv_lora_rank, a - kv_lora_rank
    prefix_len = prefix_len.astype(jnp.int32)
    paged = () if page_table is None else (page_table.astype(jnp.int32),)
    tree_kv = tree_kv.astype(q.dtype)
    if pick_backend(backend, q.dtype, n * h, r, dr, s, interpret) == "mosaic":  # its kernel clips prefix_len
        return _verify_attn_mosaic(q, cache, prefix_len, tree_kv, tree_mask, scale=float(scale), r=r, layer=layer,
                                   num_splits=num_splits, interpret=interpret, tree_in_kernel=tree_in_kernel,
                                   page_table=page_table)
    prefix_len = jnp.clip(prefix_len, 0, s)
    r_pad, dr_pad = next_pow2(max(r, MIN_DOT)), next_pow2(max(dr, MIN_DOT))
    plan = _make_plan(bt, n, h, s, r_pad, dr_pad, block_q, block_k, num_splits, q.dtype.itemsize, page)

    q2 = q.reshape(bt, n * h, a)  # [Bt, N*H, A]: row n*H + h
    if (r_pad, dr_pad) != (r, dr):  # tiny configs only; K2's 512 + 64 needs no copy
        q2, cache, tree_kv = (_pad_latent(x, r, r_pad, dr_pad) for x in (q2, cache, tree_kv))
    q2 = _pad_axis(q2, 1, plan.rows)  # [Bt, rows, A']
    tree_kv = _pad_axis(tree_kv, 1, plan.tree)  # [Bt, tree, A']
    mask = _pad_axis(_pad_axis(tree_mask.astype(jnp.int8), 2, plan.tree), 1, plan.mask_rows)  # [Bt, mask_rows, tree]

    ap = r_pad + dr_pad
    full = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j, b: (b,) + (0,) * len(shape))  # noqa: E731
    if page:  # [L, 1, n_pages * P, A']: the pages back to back (a free reshape), one operand every request reads
        cache = cache.reshape(cache.shape[0], 1, -1, ap)
        cache_spec = pl.BlockSpec((None, None, cache.shape[2], ap), lambda i, j, b: (layer, 0, 0, 0))
    else:
        cache = _pad_axis(cache, 2, plan.seq)  # [L, Bt, seq, A']
        cache_spec = pl.BlockSpec((None, None, plan.seq, ap), lambda i, j, b: (layer, b, 0, 0))
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, b: (0,) * x.ndim)  # noqa: E731
    in_specs = [whole(prefix_len), *map(whole, paged), full(plan.rows, ap), cache_spec, full(plan.tree, ap),
                full(plan.mask_rows, plan.tree)]
    if plan.n_splits == 1:
        out_shape = jax.ShapeDtypeStruct((bt, plan.rows, r_pad), q.dtype)
        out_specs = full(plan.rows, r_pad)
    else:
        out_shape = (jax.ShapeDtypeStruct((bt, plan.n_splits, plan.rows, r_pad), jnp.float32),
                     jax.ShapeDtypeStruct((bt, plan.n_splits, plan.rows), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, plan.rows, r_pad), lambda i, j, b: (b, j, 0, 0)),
                     pl.BlockSpec((None, None, plan.rows), lambda i, j, b: (b, j, 0)))
    precision = dot_precision(q.dtype)
    _, _, default_warps, default_stages = DEFAULTS[min(q.dtype.itemsize, 4)]
    if plan.block_q * plan.r < 16 * 256:  # tiny configs (the shipped pair): small accumulators run fine on 4 warps
        default_warps = 4
    kernel = functools.partial(_kernel, plan=plan, scale=float(scale), precision=precision)
    res = pallas_call(kernel, interpret=interpret, num_warps=num_warps or default_warps,
                      num_stages=num_stages or default_stages, grid=(plan.n_q, plan.n_splits, bt), in_specs=in_specs,
                      out_specs=out_specs, out_shape=out_shape,
                      name="verify_attn")(prefix_len, *paged, q2, cache, tree_kv, mask)
    if plan.n_splits > 1:  # -> [Bt, rows, r_pad]
        res = _combine(*res, prefix_len, plan).astype(q.dtype)
    return res[:, : n * h, :r].reshape(bt, n, h, r)
