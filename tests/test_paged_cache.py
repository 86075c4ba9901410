"""The paged caches give exactly what the contiguous ones give: target verify (writes, reads, compaction) and the
drafter's context, with rows scattered over shuffled pages and every page no request owns poisoned with NaN."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import drafter_config, random_drafter

from kdtree_jax.checkpoint.weights import init_random
from kdtree_jax.model import cache_update, config, paged
from kdtree_jax.model.drafter import DrafterCache, draft
from kdtree_jax.model.target import LatentCache, forward_verify

B, N, P, W = 3, 4, 8, 5  # requests, tree rows, page size, pages per request
S = W * P


def _table(rng, n_pages: int, owned: list[int]) -> np.ndarray:
    """Each request's first owned[b] entries on distinct shuffled pages, the rest unowned (-1)."""
    pages = rng.permutation(n_pages)
    table = np.full((B, W), paged.UNOWNED, np.int32)
    at = 0
    for b in range(B):
        table[b, : owned[b]] = pages[at: at + owned[b]]
        at += owned[b]
    return table


def _to_pool(contiguous: np.ndarray, table: np.ndarray, n_pages: int, page_axis: int, row_axis: int) -> np.ndarray:
    """Scatter a contiguous cache (request axis `page_axis`, rows `row_axis` = page_axis + k) into a NaN pool."""
    shape = list(contiguous.shape)
    shape[page_axis], shape[row_axis] = n_pages, P
    pool = np.full(shape, np.nan, contiguous.dtype)
    for b in range(B):
        for j in range(W):
            if table[b, j] >= 0:
                src = np.take(np.take(contiguous, [b], axis=page_axis), range(j * P, (j + 1) * P), axis=row_axis)
                index = [slice(None)] * pool.ndim
                index[page_axis] = slice(int(table[b, j]), int(table[b, j]) + 1)
                pool[tuple(index)] = src
    return pool


def _from_pool(pool: np.ndarray, table: np.ndarray, page_axis: int, row_axis: int, b: int, rows: int) -> np.ndarray:
    """Request b's first `rows` rows gathered back from a pool."""
    parts = [np.take(pool, [int(table[b, j])], axis=page_axis) for j in range(-(-rows // P))]
    out = np.concatenate(parts, axis=row_axis)
    return np.take(np.squeeze(out, axis=page_axis), range(rows), axis=row_axis - 1)


@pytest.fixture(scope="module")
def target():
    return init_random(config.tiny(eos_token_id=()), seed=3)


@pytest.mark.timeout(300)
def test_paged_verify_and_compaction_equal_contiguous(target, rng):
    cfg = target.cfg
    start = rng.integers(0, S - N - 2, size=B).astype(np.int32)
    start[0] = P - 1  # the tree crosses a page boundary
    owned = [-(-(int(s) + N + 2) // P) for s in start]
    n_pages = sum(owned) + 3  # three pages nobody owns
    table = _table(rng, n_pages, owned)
    latent = rng.standard_normal((cfg.num_hidden_layers, B, S, cfg.latent_dim)).astype(np.float32)
    for b in range(B):  # a request's rows past its pages do not exist in the paged form
        latent[:, b, owned[b] * P:] = 0
    tokens = rng.integers(0, cfg.vocab_size, (B, N)).astype(np.int32)
    depth = np.array([0, 1, 1, 2])
    positions = (start[:, None] + depth[None, :]).astype(np.int32)
    mask = np.broadcast_to(np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool), (B, N, N))

    flat = forward_verify(target, tokens, positions, jnp.asarray(start), mask, LatentCache.from_stacked(jnp.asarray(latent)))
    pool = _to_pool(latent, table, n_pages, 1, 2)
    cache = LatentCache.from_stacked(jnp.asarray(pool), page_table=jnp.asarray(table))
    got = forward_verify(target, tokens, positions, jnp.asarray(start), mask, cache)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(flat.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.hidden), np.asarray(flat.hidden), rtol=1e-5, atol=1e-5)
    after = np.asarray(got.cache.stacked())
    for b in range(B):
        rows = int(start[b]) + N
        np.testing.assert_allclose(_from_pool(after, table, 1, 2, b, rows), np.asarray(flat.cache.stacked())[:, b, :rows],
                                   rtol=1e-5, atol=1e-5)
    unowned = sorted(set(range(n_pages)) - set(table[table >= 0].tolist()))
    assert np.isnan(after[:, unowned]).all()  # nothing wrote outside the requests' own pages

    src = np.tile(np.arange(N)[None, :], (B, 1)).astype(np.int32)
    src[:, 1] = 3  # the path 0 -> 1 -> 3 moves row 3 to row 1
    want = np.stack(cache_update.compact_latents(flat.cache.latent, jnp.asarray(start), jnp.asarray(src)))
    moved = np.stack(cache_update.compact_latents(got.cache.latent, jnp.asarray(start), jnp.asarray(src),
                                                    jnp.asarray(table)))
    for b in range(B):
        rows = int(start[b]) + N
        np.testing.assert_allclose(_from_pool(moved, table, 1, 2, b, rows), np.asarray(want)[:, b, :rows],
                                   rtol=1e-5, atol=1e-5)
    assert np.isnan(moved[:, unowned]).all()


@pytest.mark.timeout(300)
def test_paged_drafter_context_equals_contiguous(target, rng):
    dcfg = drafter_config(target.cfg, block_size=4)
    drafter = random_drafter(dcfg, seed=5)
    length = rng.integers(1, S - 8, size=B).astype(np.int32)
    n_ctx = np.array([3, 0, 2], np.int32)
    owned = [-(-(int(length[b]) + int(n_ctx[b])) // P) for b in range(B)]
    n_pages = sum(owned) + 2
    table = _table(rng, n_pages, owned)
    shape = (dcfg.num_hidden_layers, B, dcfg.num_key_value_heads, S, dcfg.head_dim)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    for b in range(B):
        k[:, b, :, owned[b] * P:] = v[:, b, :, owned[b] * P:] = 0
    ctx = rng.standard_normal((B, 3, dcfg.feature_dim)).astype(np.float32)
    bonus = rng.integers(0, target.cfg.vocab_size, B).astype(np.int32)
    args = (jnp.asarray(ctx), jnp.asarray(n_ctx), jnp.asarray(bonus), target.embed_table(), target.lm_head_table())

    flat_logits, flat = draft(drafter, DrafterCache.from_stacked(jnp.asarray(k), jnp.asarray(v), jnp.asarray(length)), *args)
    pooled = DrafterCache.from_stacked(jnp.asarray(_to_pool(k, table, n_pages, 1, 3)), jnp.asarray(_to_pool(v, table, n_pages, 1, 3)),
                                    jnp.asarray(length), page_table=jnp.asarray(table))
    logits, got = draft(drafter, pooled, *args)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(flat_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.length), length + n_ctx)
    for b in range(B):
        rows = int(length[b] + n_ctx[b])
        np.testing.assert_allclose(_from_pool(np.stack(got.k), table, 1, 3, b, rows),
                                   np.stack(flat.k)[:, b, :, :rows], rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
def test_locate_drops_rows_a_request_does_not_own():
    table = jnp.asarray([[4, 2, paged.UNOWNED]], jnp.int32)
    rows = jnp.asarray([[0, 9, 15, 16, 24, -1]], jnp.int32)
    page, offset = paged.locate(table, rows, 8, 6)
    np.testing.assert_array_equal(np.asarray(page), [[4, 2, 2, 6, 6, 6]])
    np.testing.assert_array_equal(np.asarray(offset)[0, :3], [0, 1, 7])
