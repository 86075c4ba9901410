"""Exact per-depth top-k log-probs (`tree_build.topk_logprobs`) as two Pallas Triton kernels.

logits [Bt, D, V] -> lp [Bt, D, k] f32 (top values minus the row's full-vocab logsumexp), ids [Bt, D, k] int32,
sorted by value descending, equal values by lower vocab index first: the ids and top values of `lax.top_k`.

Order key. Each float32 logit maps to an int32 whose signed order is the float's total order (flip the low 31 bits
of negatives), so one int compare orders values, -0.0 sorts just below +0.0 (as XLA's top_k on CPU; GPU unchecked),
and INT32_MIN (below -inf) marks "taken / padding". `argmax` on the Triton path keeps the lowest index on ties (its
combine takes the min index on equal values), like `jnp.argmax` in interpret mode.

Stage 1, grid (rows = Bt*D, chunks of L = CHUNK vocab entries). Extracting the top-k by k full-chunk argmaxes costs
k*L work per chunk (a rough instruction count, not a measurement, put it near 2 ms at K2.6 size, Bt=8, k=256, slower
than XLA), so the chunk is viewed as [L/ROW, ROW] rows and only each row's current head (best remaining entry) is
kept: a step takes the best head (argmax over L/ROW heads; the lowest row wins ties, and lower rows hold lower
indices), then reloads that row from the ref and finds its next head among the entries after the taken one in (value
desc, index asc) order. No "taken" mask is needed and a step touches L/ROW + ROW entries. The chunk's max and
sum(exp(x - max)) go out with its k candidates, so the logsumexp needs no separate pass over V.

Stage 2, grid (rows): a k-way merge of the chunks' candidate lists (each sorted, k long, padded to a power of two
with INT32_MIN): heads are the lists' first entries, a step takes the best head and advances that list's pointer by
one (one scalar load). Ties need no index compare: among equal values, a lower list means a lower chunk, hence lower
ids, and inside a list equal values already sit in ascending id order. It also merges the chunks' (max, sum) into
the logsumexp. With one chunk (V <= L) stage 1 writes the final output and stage 2 is skipped.

Padding: V is padded to a multiple of L with -inf. Padded entries tie with real -inf logits but carry larger ids, so
with k <= V they are never returned, and exp(-inf) adds nothing to the logsumexp. The chunk grid is padded to a
power of two; programs past the last chunk write empty lists.

Limits: k <= MAX_K (topk_logprobs uses XLA above FASTER_MAX_K, where XLA is faster); NaN logits are unsupported (a
drafter never emits them). Both stages run k dependent steps (a few small reductions and one load each), so their
time is latency bound and grows linearly in k (H200 timings: BENCHMARKS.md 4c). lp equals XLA's to float rounding of
the logsumexp (a different summation order), not bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._pallas import next_pow2, pallas_call, resolve_interpret

CHUNK = 16384  # vocab entries per stage-1 program (H200, V = 163840: 5-40% faster than 4096, 1.5-3x than 1024)
ROW = 128  # entries reloaded per stage-1 step
MAX_K = 1024  # candidate lists above this would not fit a program's registers
# Up to this k the kernel beats XLA's top_k on the H200 (BENCHMARKS.md 4c: 1.6-7x at k <= 32, about even at 64);
# its k dependent steps make it 2.4x slower at k = 256, V = 4096, where XLA's sort-based top_k does not grow with k.
FASTER_MAX_K = 64
LARGE_VOCAB = 131072  # ... except at K2.6's 163840 entries, where it is 1.02-1.5x faster at k = 256 too (no vocab
# between 4096 and 163840 was measured)
CHUNK_WARPS = 4
MERGE_WARPS = 1  # the merge touches at most a few dozen heads per step: one warp reduces by shuffles alone
_TAKEN = -(2**31)  # order key below every float (-inf included): taken entries and padding
_NO_ID = 2**31 - 1
_LOW31 = 0x7FFFFFFF
_STATS = 2  # per chunk: max, sum(exp(x - max))


@dataclasses.dataclass(frozen=True)
class Plan:
    chunk: int  # L, a power of two >= k
    row: int  # entries per stage-1 row, L = rows_per_chunk * row
    n_chunks: int  # C = ceil(V / L)
    n_lists: int  # next_pow2(C): stage-2 heads
    kp: int  # next_pow2(k): candidate list length

    @property
    def rows_per_chunk(self) -> int:
        return self.chunk // self.row


def plan(v: int, k: int, chunk: int = CHUNK) -> Plan:
    """Chunk length: `chunk`, raised to hold k entries, lowered to the padded vocab."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"topk: chunk={chunk} must be a power of two")
    size = min(next_pow2(v), max(chunk, next_pow2(k)))
    n_chunks = -(-v // size)
    return Plan(chunk=size, row=min(ROW, size), n_chunks=n_chunks, n_lists=next_pow2(n_chunks), kp=next_pow2(k))


def supported(v: int, k: int) -> bool:
    return 1 <= k <= min(v, MAX_K)


def preferred(v: int, k: int) -> bool:
    """Where `tree_build.topk_logprobs` runs this kernel rather than XLA (measured, FASTER_MAX_K)."""
    return supported(v, k) and (k <= FASTER_MAX_K or v >= LARGE_VOCAB)


def order_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same (total) order; its own inverse up to the bitcast."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & _LOW31)


def key_value(key: jax.Array) -> jax.Array:
    """Inverse of `order_key`."""
    return lax.bitcast_convert_type(key ^ ((key >> 31) & _LOW31), jnp.float32)


def _safe_max(m):
    """A max usable as an exp offset: all -inf -> 0 so exp(-inf - 0) = 0 instead of NaN."""
    return jnp.where(m == -jnp.inf, jnp.float32(0.0), m)


def _take_best(head_key, per_head, heads, t, slots, out_key):
    """One extraction step shared by both stages: the best head's key and index, its entry of `per_head` (a column or
    a list pointer), and out_key with that key recorded at slot t."""
    best = jnp.max(head_key)
    r = jnp.argmax(head_key).astype(jnp.int32)
    return best, r, jnp.sum(jnp.where(heads == r, per_head, 0)), jnp.where(slots == t, best, out_key)


def _chunk_topk(x_ref, k: int, kp: int):
    """Top-k of one chunk x_ref [R, S] by row heads. Returns (keys [kp], positions [kp] in the chunk, max, sumexp)."""
    n_rows, row = x_ref.shape
    f32, i32 = jnp.float32, jnp.int32
    x = x_ref[...].astype(f32)
    keys = order_key(x)
    head_key = jnp.max(keys, axis=1)
    head_col = jnp.argmax(keys, axis=1).astype(i32)
    m = jnp.max(x)
    sumexp = jnp.sum(jnp.exp(x - _safe_max(m)))
    rows = lax.iota(i32, n_rows)
    cols = lax.iota(i32, row)
    slots = lax.iota(i32, kp)

    def step(t, carry):
        head_key, head_col, out_key, out_pos = carry
        best, r, c, out_key = _take_best(head_key, head_col, rows, t, slots, out_key)
        out_pos = jnp.where(slots == t, r * row + c, out_pos)
        line = order_key(x_ref[r, :].astype(f32))
        later = (line < best) | ((line == best) & (cols > c))
        rest = jnp.where(later, line, _TAKEN)
        head_key = jnp.where(rows == r, jnp.max(rest), head_key)
        head_col = jnp.where(rows == r, jnp.argmax(rest).astype(i32), head_col)
        return head_key, head_col, out_key, out_pos

    init = (head_key, head_col, jnp.full((kp,), _TAKEN, i32), jnp.full((kp,), _NO_ID, i32))
    _, _, out_key, out_pos = lax.fori_loop(0, k, step, init)
    return out_key, out_pos, m, sumexp


def _stats(m, sumexp):
    """[max, sumexp] as one vector store (Triton lowers constant scalar stores badly)."""
    return jnp.where(lax.iota(jnp.int32, _STATS) == 0, m, sumexp)


def _chunk_kernel(x_ref, key_ref, id_ref, stat_ref, *, k: int, n_chunks: int):
    """Stage 1: one chunk's sorted candidates (order keys, vocab ids) and its (max, sumexp)."""
    c = pl.program_id(1)
    kp = key_ref.shape[0]

    @pl.when(c < n_chunks)
    def _():
        out_key, out_pos, m, sumexp = _chunk_topk(x_ref, k, kp)
        key_ref[...] = out_key
        id_ref[...] = out_pos + c * (x_ref.shape[0] * x_ref.shape[1])
        stat_ref[...] = _stats(m, sumexp)

    @pl.when(c >= n_chunks)
    def _():
        key_ref[...] = jnp.full((kp,), _TAKEN, jnp.int32)
        id_ref[...] = jnp.full((kp,), _NO_ID, jnp.int32)
        stat_ref[...] = _stats(jnp.float32(-jnp.inf), jnp.float32(0.0))


def _single_chunk_kernel(x_ref, lp_ref, id_ref, *, k: int):
    """V fits one chunk: stage 1 finishes the logsumexp itself."""
    out_key, out_pos, m, sumexp = _chunk_topk(x_ref, k, lp_ref.shape[0])
    lp_ref[...] = key_value(out_key) - (_safe_max(m) + jnp.log(sumexp))
    id_ref[...] = out_pos


def _merge_kernel(key_ref, cid_ref, stat_ref, lp_ref, id_ref, *, k: int):
    """Stage 2: k-way merge of the chunks' sorted lists key_ref [lists, kp] and the logsumexp."""
    n_lists, kp = key_ref.shape
    i32 = jnp.int32
    lists = lax.iota(i32, n_lists)
    slots = lax.iota(i32, kp)

    def step(t, carry):
        head_key, head_ptr, out_key, out_id = carry
        _, r, j, out_key = _take_best(head_key, head_ptr, lists, t, slots, out_key)
        out_id = jnp.where(slots == t, cid_ref[r, j], out_id)
        nxt = jnp.where(j + 1 < kp, key_ref[r, jnp.minimum(j + 1, kp - 1)], _TAKEN)
        head_key = jnp.where(lists == r, nxt, head_key)
        head_ptr = jnp.where(lists == r, j + 1, head_ptr)
        return head_key, head_ptr, out_key, out_id

    init = (key_ref[:, 0], jnp.zeros((n_lists,), i32), jnp.full((kp,), _TAKEN, i32), jnp.full((kp,), _NO_ID, i32))
    _, _, out_key, out_id = lax.fori_loop(0, k, step, init)
    m = stat_ref[:, 0]
    top = _safe_max(jnp.max(m))
    lse = top + jnp.log(jnp.sum(stat_ref[:, 1] * jnp.exp(m - top)))
    lp_ref[...] = key_value(out_key) - lse
    id_ref[...] = out_id


def check_topk_args(logits, k: int):
    """ValueErrors naming the argument, shared by every top-k path."""
    if logits.ndim != 3:
        raise ValueError(f"topk_logprobs: logits must be [Bt, D, V], got shape {logits.shape}")
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"topk_logprobs: k={k} must be in 1..V={logits.shape[-1]}")


def _rows_of_chunks(logits, p: Plan):
    """[Bt, D, V] -> [Bt*D, C*R, S]; V padded with -inf to C*L."""
    bt, d, v = logits.shape
    x = logits.reshape(bt * d, v)
    pad = p.n_chunks * p.chunk - v
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    return x.reshape(bt * d, p.n_chunks * p.rows_per_chunk, p.row)


@functools.partial(jax.jit, static_argnames=("k", "chunk", "interpret"))
def topk_logprobs_pallas(logits: jax.Array, k: int, *, chunk: int = CHUNK, interpret: bool | None = None):
    """Same contract as `tree_build.topk_logprobs` (k <= MAX_K); see the module docstring for the design."""
    check_topk_args(logits, k)
    if k > MAX_K:
        raise ValueError(f"topk_logprobs_pallas: k={k} exceeds MAX_K={MAX_K}")
    interpret = resolve_interpret(interpret)
    bt, d, v = logits.shape
    p = plan(v, k, chunk)
    x = _rows_of_chunks(logits, p)
    n = bt * d
    x_spec = pl.BlockSpec((None, p.rows_per_chunk, p.row), lambda i, c: (i, jnp.minimum(c, p.n_chunks - 1), 0))
    if p.n_chunks == 1:
        lp, ids = pallas_call(
            functools.partial(_single_chunk_kernel, k=k), interpret=interpret, num_warps=CHUNK_WARPS,
            name="topk_single", grid=(n, 1), in_specs=[x_spec],
            out_specs=[pl.BlockSpec((None, p.kp), lambda i, c: (i, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((n, p.kp), jnp.float32), jax.ShapeDtypeStruct((n, p.kp), jnp.int32)],
        )(x)
    else:
        list_spec = pl.BlockSpec((None, None, p.kp), lambda i, c: (i, c, 0))
        keys, cids, stats = pallas_call(
            functools.partial(_chunk_kernel, k=k, n_chunks=p.n_chunks), interpret=interpret,
            num_warps=CHUNK_WARPS, name="topk_chunk", grid=(n, p.n_lists), in_specs=[x_spec],
            out_specs=[list_spec, list_spec, pl.BlockSpec((None, None, _STATS), lambda i, c: (i, c, 0))],
            out_shape=[jax.ShapeDtypeStruct((n, p.n_lists, p.kp), jnp.int32)] * 2
            + [jax.ShapeDtypeStruct((n, p.n_lists, _STATS), jnp.float32)],
        )(x)
        lists_spec = pl.BlockSpec((None, p.n_lists, p.kp), lambda i: (i, 0, 0))
        lp, ids = pallas_call(
            functools.partial(_merge_kernel, k=k), interpret=interpret, num_warps=MERGE_WARPS, name="topk_merge",
            grid=(n,),
            in_specs=[lists_spec, lists_spec, pl.BlockSpec((None, p.n_lists, _STATS), lambda i: (i, 0, 0))],
            out_specs=[pl.BlockSpec((None, p.kp), lambda i: (i, 0))] * 2,
            out_shape=[jax.ShapeDtypeStruct((n, p.kp), jnp.float32), jax.ShapeDtypeStruct((n, p.kp), jnp.int32)],
        )(keys, cids, stats)
    return lp.reshape(bt, d, p.kp)[..., :k], ids.reshape(bt, d, p.kp)[..., :k]
