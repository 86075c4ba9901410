"""Page-table addressing: where a request's logical cache row lives in a pool of fixed-size pages.

A paged cache stores rows in a pool `[..., n_pages, P, ...]` shared by all requests; request b's row s lives in page
`page_table[b, s // P]` at offset `s % P`. The target's latent and the drafter's context are paged with the same
table, so a request's pages hold everything needed to resume it. The host's cache manager
(`kdtree_jax/serving/cache_manager.py`) owns which pages a request has; the device only follows the table.

Table entries a request does not own are -1 (`UNOWNED`). Rows a request does not own (past its table, on an -1
entry, or negative) map to page `n_pages`: out of range, so a scatter with mode="drop" discards them, as the
contiguous caches drop rows past their capacity, and a tree's scratch rows can never land in another request's page.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

UNOWNED = -1  # a page-table entry with no page behind it


def locate(page_table: jax.Array, rows: jax.Array, page_size: int, n_pages: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of logical rows [B, R] of each request; rows outside the table give page n_pages."""
    width = page_table.shape[1]
    slot = rows // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(slot, 0, width - 1), axis=1)
    inside = (rows >= 0) & (slot < width) & (page >= 0)
    return jnp.where(inside, page, n_pages).astype(jnp.int32), (rows % page_size).astype(jnp.int32)


def gather_prefix(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Pool [n_pages, P, ...] -> each request's rows [B, W * P, ...] in logical order (for the jnp paths, which
    read the whole prefix; the verify kernel reads pages in place)."""
    pages = pool[readable(page_table)]  # [B, W, P, ...]
    return pages.reshape(page_table.shape[0], -1, *pool.shape[2:])


def readable(page_table: jax.Array) -> jax.Array:
    """The table with unowned entries on page 0: for reads, which never look past a request's valid rows."""
    return jnp.maximum(page_table, 0)
