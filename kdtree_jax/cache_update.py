"""After acceptance: move the accepted path's latents to contiguous rows and commit the emitted tokens.

Accepted node at depth d was verified at position start + d and lands at row start + d, so its cached k_pe
needs no re-rotation (docs/DESIGN.md, "One round"). Everything is gathered before anything is written.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kdtree_jax import paged


def write_rows(buffer: jax.Array, rows: jax.Array, start: jax.Array, *, layer: int | None = None) -> jax.Array:
    """Per-request `buffer[b, start[b] : start[b] + R] = rows[b]`.  buffer: [Bt, S, ...] (or [L, Bt, S, ...] with
    `layer`: that layer's rows), rows: [Bt, R, ...].

    One scatter with explicit (request, row) indices: a vmapped dynamic_update_slice becomes a scatter wrapped in
    transposes, which XLA materialises as copies of the whole buffer. Rows past S are dropped (never shifted back
    over earlier rows, as a clamped dynamic_update_slice would)."""
    index = _rows_after(start, rows.shape[1])
    index = index if layer is None else (layer, *index)
    return buffer.at[index].set(rows.astype(buffer.dtype), mode="drop")


def write_cache_rows(latent: jax.Array, page_table: jax.Array | None, rows: jax.Array, start: jax.Array, *,
                     layer: int) -> jax.Array:
    """`write_rows` into layer `layer` of a latent cache, contiguous [L, Bt, S, A] or a page pool [L, n_pages, P, A]
    addressed by page_table [Bt, W]; rows outside what a request owns are dropped."""
    if page_table is None:
        return write_rows(latent, rows, start, layer=layer)
    page, offset = _locate(latent, page_table, _rows_after(start, rows.shape[1])[1])
    return latent.at[layer, page, offset].set(rows.astype(latent.dtype), mode="drop")


def _locate(pool: jax.Array, page_table: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of logical rows [Bt, R] in a pool [L, n_pages, P, ...]."""
    return paged.locate(page_table, rows, pool.shape[2], pool.shape[1])


def _rows_after(start: jax.Array, r: int) -> tuple[jax.Array, jax.Array]:
    """(request [Bt, 1], row [Bt, R]) indices of rows start[b] .. start[b] + R - 1 of every request."""
    return jnp.arange(start.shape[0])[:, None], start[:, None] + jnp.arange(r, dtype=start.dtype)[None, :]


def compact_latents(latent: jax.Array, start: jax.Array, src_slot: jax.Array,
                    page_table: jax.Array | None = None) -> jax.Array:
    """Row start+j takes row start+src_slot[j] in every layer.

    latent: [n_layers, Bt, S, A] (or a page pool [n_layers, n_pages, P, A] with page_table [Bt, W]: the accepted
    path moves within the request's own pages), start: [Bt], src_slot: [Bt, P] (identity past the accepted length).
    """
    rows = start[:, None] + src_slot  # [Bt, P]
    if page_table is not None:
        src_page, src_off = _locate(latent, page_table, rows)
        gathered = latent[:, jnp.minimum(src_page, latent.shape[1] - 1), src_off]  # [n_layers, Bt, P, A]
        dst_page, dst_off = _locate(latent, page_table, _rows_after(start, src_slot.shape[1])[1])
        return latent.at[:, dst_page, dst_off].set(gathered, mode="drop")
    gathered = jnp.take_along_axis(latent, rows[None, :, :, None], axis=2)  # [n_layers, Bt, P, A]
    return latent.at[(slice(None), *_rows_after(start, src_slot.shape[1]))].set(gathered, mode="drop")


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
