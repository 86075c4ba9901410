"""After acceptance: move the accepted path's latents to contiguous rows and commit the emitted tokens.

Accepted node at depth d was verified at position start + d and lands at row start + d, so its cached k_pe
needs no re-rotation (docs/DESIGN.md, "One round"). Everything is gathered before anything is written.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kdtree_jax.model import paged


def write_rows(buffer: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """Per-request `buffer[b, start[b] : start[b] + R] = rows[b]`.  buffer: [Bt, S, ...], rows: [Bt, R, ...].

    One scatter with explicit (request, row) indices: a vmapped dynamic_update_slice becomes a scatter wrapped in
    transposes, which XLA materialises as copies of the whole buffer. Rows past S are dropped (never shifted back
    over earlier rows, as a clamped dynamic_update_slice would)."""
    return buffer.at[_rows_after(start, rows.shape[1])].set(rows.astype(buffer.dtype), mode="drop")


def write_cache_rows(layer_cache: jax.Array, page_table: jax.Array | None, rows: jax.Array,
                     start: jax.Array) -> jax.Array:
    """`write_rows` into one layer's latent cache, contiguous [Bt, S, A] or a page pool [n_pages, P, A] addressed by
    page_table [Bt, W]; rows outside what a request owns are dropped."""
    if page_table is None:
        return write_rows(layer_cache, rows, start)
    page, offset = _locate(layer_cache, page_table, _rows_after(start, rows.shape[1])[1])
    return layer_cache.at[page, offset].set(rows.astype(layer_cache.dtype), mode="drop")


def _locate(pool: jax.Array, page_table: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of logical rows [Bt, R] in one layer's pool [n_pages, P, ...]."""
    return paged.locate(page_table, rows, pool.shape[1], pool.shape[0])


def _rows_after(start: jax.Array, r: int) -> tuple[jax.Array, jax.Array]:
    """(request [Bt, 1], row [Bt, R]) indices of rows start[b] .. start[b] + R - 1 of every request."""
    return jnp.arange(start.shape[0])[:, None], start[:, None] + jnp.arange(r, dtype=start.dtype)[None, :]


def compact_latents(latent: tuple[jax.Array, ...], start: jax.Array, src_slot: jax.Array,
                    page_table: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Row start+j takes row start+src_slot[j] in every layer.

    latent: one array per layer, [Bt, S, A] (or a page pool [n_pages, P, A] with page_table [Bt, W]: the accepted
    path moves within the request's own pages), start: [Bt], src_slot: [Bt, P] (identity past the accepted length).
    Each layer is gathered before it is written, and no layer's write touches another's buffer. The root (j = 0,
    src_slot 0) never moves, so an AR round (P = 1) leaves the cache as it is: its read and write of one row per
    request would fuse with the attention's write of that row into a read of the layer's pool from before that
    write, which XLA keeps alive with a copy of the whole pool.
    """
    if src_slot.shape[1] == 1:
        return tuple(latent)
    rows = start[:, None] + src_slot  # [Bt, P]
    dst = _rows_after(start, src_slot.shape[1])
    if page_table is None:
        src, dst_index = (lambda x: jnp.take_along_axis(x, rows[:, :, None], axis=1)), dst
    else:
        src_page, src_off = _locate(latent[0], page_table, rows)
        src_page = jnp.minimum(src_page, latent[0].shape[0] - 1)
        src, dst_index = (lambda x: x[src_page, src_off]), _locate(latent[0], page_table, dst[1])
    return tuple(_move(x, src(x), dst_index) for x in latent)


def _move(x: jax.Array, moved: jax.Array, dst_index) -> jax.Array:
    """`x.at[dst_index].set(moved)` where `moved` was read from x itself. The barrier keeps the read a gather of its
    own, so the scatter that updates x in place never has a fused read of the buffer it writes (the GPU serving
    step's temp stays flat in the pool with it: BENCHMARKS.md §5f)."""
    x, moved = jax.lax.optimization_barrier((x, moved))
    return x.at[dst_index].set(moved, mode="drop")


def emitted_tokens(tree_tokens: jax.Array, path: jax.Array, n_accepted: jax.Array, bonus: jax.Array) -> jax.Array:
    """Tokens committed this round, starting with the root: path tokens, then the new bonus, then padding.

    tree_tokens: [Bt, N], path: [Bt, P] (pads -1), n_accepted: [Bt], bonus: [Bt] -> [Bt, P + 1].
    """
    path_tokens = jnp.take_along_axis(tree_tokens, jnp.maximum(path, 0), axis=1)  # [Bt, P]
    padded = jnp.concatenate([path_tokens, jnp.zeros_like(path_tokens[:, :1])], axis=1)
    j = jnp.arange(padded.shape[1])[None, :]
    return jnp.where(j == n_accepted[:, None], bonus[:, None], padded)


def gather_slots(values: jax.Array, slots: jax.Array) -> jax.Array:
    """values: [Bt, N, F], slots: [Bt, P] (pads -1 read slot 0) -> [Bt, P, F]."""
    return jnp.take_along_axis(values, jnp.maximum(slots, 0)[:, :, None], axis=1)
