"""verify_attn over a paged latent cache (a page pool read through a page table) vs the float64 reference, on the
Triton and the Mosaic GPU (wgmma) kernels; lowering of both for an abstract H200."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import verify_attn_mgpu as vm
from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.verify_attn import _make_plan, verify_attn
from pallas_kernels.verify_attn_ref import verify_attn_paged_ref
from tests.test_verify_attn import GARBAGE, TOL, ancestor_mask, assert_close

SPARE_PAGES = 3  # pool pages beyond the requests' tables: owned by nobody, poisoned


def make_paged_case(rng, *, prefix, width, page, n, h, r, dr, dtype=np.float32):
    """Fresh random inputs over a shuffled pool: each request's table is a slice of one permutation of the pool's
    pages (no page shared), table entries past a request's last prefix page are 0 (as callers fill them), rows of
    a request's own pages past its prefix hold large finite junk (as past prefix_len in a contiguous cache), and
    every page no prefix row lives in is NaN, so reading one shows in the output."""
    bt, a = len(prefix), r + dr
    n_pages = bt * width + SPARE_PAGES
    table = rng.permutation(n_pages)[:bt * width].reshape(bt, width).astype(np.int32)
    pool = np.full((n_pages, page, a), np.nan)
    for b, p in enumerate(prefix):
        used = -(-p // page)
        rows = rng.standard_normal((used * page, a))
        rows[p:] *= GARBAGE
        pool[table[b, :used]] = rows.reshape(used, page, a)
        table[b, used:] = 0
    tree_mask = np.stack([ancestor_mask(rng, n) for _ in range(bt)])
    cast = lambda x: np.array(jnp.asarray(x, dtype))  # noqa: E731  (inputs as the kernel sees them)
    return dict(q=cast(rng.standard_normal((bt, n, h, a))), pool=cast(pool), prefix_len=np.asarray(prefix, np.int32),
                tree_kv=cast(rng.standard_normal((bt, n, a))), tree_mask=tree_mask, page_table=table)


def garbage_past_prefix(rng, case):
    """The case's table with every entry past a request's last prefix page naming a random page (NaN ones too)."""
    table, page, n_pages = case["page_table"].copy(), case["pool"].shape[1], case["pool"].shape[0]
    for b, p in enumerate(case["prefix_len"]):
        used = -(-int(p) // page)
        table[b, used:] = rng.integers(0, n_pages, table.shape[1] - used)
    return table


def gathered(case):
    """The contiguous cache [Bt, W * P, A] the table describes; rows of pages past the prefix are finite junk."""
    pool, table = case["pool"], case["page_table"]
    cache = GARBAGE * np.ones((table.shape[0], table.shape[1] * pool.shape[1], pool.shape[2]), pool.dtype)
    for b, p in enumerate(case["prefix_len"]):
        used = -(-int(p) // pool.shape[1])
        cache[b, :used * pool.shape[1]] = pool[table[b, :used]].reshape(-1, pool.shape[2])
    return cache


def scale_of(case):
    return 1.5 / math.sqrt(case["q"].shape[-1])


def run_paged(case, *, r, page_table=None, pool=None, **kw):
    """The kernel on the case (or with another table / pool) -> float64 [Bt, N, H, R]."""
    table = case["page_table"] if page_table is None else page_table
    pool = case["pool"] if pool is None else pool
    out = verify_attn(jnp.asarray(case["q"]), jnp.asarray(pool), jnp.asarray(case["prefix_len"]),
                      jnp.asarray(case["tree_kv"]), jnp.asarray(case["tree_mask"]), page_table=jnp.asarray(table),
                      scale=scale_of(case), kv_lora_rank=r, **kw)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape[:3] + (r,)
    return np.asarray(out.astype(jnp.float32), np.float64)


def reference(case, r):
    return verify_attn_paged_ref(*(case[k] for k in ("q", "pool", "prefix_len", "tree_kv", "tree_mask",
                                                     "page_table")), scale=scale_of(case), kv_lora_rank=r)


# (prefix per request, W pages a table, page size, N, H, num_splits): prefixes of 0, of part of a page, ending on a
# page edge, filling the whole table (W * P), and spanning pages; one split and several.
CASES = [
    ([37, 0, 80], 5, 16, 5, 4, 1),
    ([37, 0, 80], 5, 16, 5, 4, 3),
    ([192, 130, 1], 3, 64, 3, 4, 2),
    ([200, 256], 2, 128, 4, 2, 1),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefix,width,page,n,h,splits", CASES)
def test_matches_reference_and_contiguous(rng, interpret, prefix, width, page, n, h, splits):
    """Paged Triton kernel against float64; bit-equal to the contiguous kernel on the gathered cache with the same
    blocking (block_k <= P, same splits); entries past each prefix's pages naming random pages change nothing."""
    r = 64
    case = make_paged_case(rng, prefix=prefix, width=width, page=page, n=n, h=h, r=r, dr=16)
    kw = dict(num_splits=splits, interpret=interpret, backend="triton")
    out = run_paged(case, r=r, **kw)
    assert_close(out, reference(case, r), TOL[np.float32], f"P={page} prefix={prefix} splits={splits}")
    np.testing.assert_array_equal(out, run_paged(case, r=r, page_table=garbage_past_prefix(rng, case), **kw))
    plan = _make_plan(len(prefix), n, h, width * page, r, 16, None, None, splits, 4, page)
    contiguous = verify_attn(*(jnp.asarray(x) for x in (case["q"], gathered(case), case["prefix_len"],
                                                        case["tree_kv"], case["tree_mask"])),
                             scale=scale_of(case), kv_lora_rank=r, block_k=plan.block_k, **kw)
    np.testing.assert_array_equal(out, np.asarray(contiguous, np.float64))


@pytest.mark.timeout(60)
def test_layer_of_the_whole_pool_bf16(rng, interpret):
    """A [L, n_pages, P, A] pool with a static layer reads that layer in place: equal to passing that layer's pool,
    and to float64; the other layers are NaN, so reading one would show. bf16, A = 40 (padded inside)."""
    r, layer = 32, 1
    case = make_paged_case(rng, prefix=[100, 7], width=4, page=32, n=3, h=4, r=r, dr=8, dtype=jnp.bfloat16)
    whole = np.full((3, *case["pool"].shape), np.nan, case["pool"].dtype)
    whole[layer] = case["pool"]
    kw = dict(num_splits=2, interpret=interpret, backend="triton")
    got = run_paged(case, r=r, pool=whole, layer=layer, **kw)
    np.testing.assert_array_equal(got, run_paged(case, r=r, **kw))
    assert_close(got, reference(case, r), TOL[jnp.bfloat16], "layer of the whole pool")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("page,width,prefix,splits", [(16, 8, [90, 0], 2), (128, 3, [256, 70], 1)])
def test_mosaic_matches_reference(rng, interpret, page, width, prefix, splits):
    """The wgmma kernel through the table: a 64-row KV block as four 16-row page copies (the last block's copies past
    the prefix re-read its last page, never the NaN pages the table's tail names), or a slice of a 128-row page."""
    r = 128
    case = make_paged_case(rng, prefix=prefix, width=width, page=page, n=2, h=vm.ROWS, r=r, dr=64,
                           dtype=jnp.bfloat16)
    case["page_table"] = garbage_past_prefix(rng, case)
    out = run_paged(case, r=r, num_splits=splits, interpret=interpret, backend="mosaic")
    assert_close(out, reference(case, r), TOL[jnp.bfloat16], f"mosaic P={page} prefix={prefix}")


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("page", [16, 64, 128])
def test_compiled_engine_sizes(rng, backend, page):
    """Compiled kernels at K2 sizes (A 576, 64 heads, 4096 rows a table) over a shuffled pool against float64."""
    r = 512
    case = make_paged_case(rng, prefix=[4000, 1234, 0, 4096], width=4096 // page, page=page, n=17, h=64, r=r, dr=64,
                           dtype=jnp.bfloat16)
    case["page_table"] = garbage_past_prefix(rng, case)
    out = run_paged(case, r=r, interpret=False, backend=backend)
    assert_close(out, reference(case, r), TOL[jnp.bfloat16], f"compiled {backend} P={page}")


@pytest.mark.timeout(60)
def test_reference_reads_through_the_table(rng):
    """The paged reference on a shuffled pool equals verify_attn_ref's definition on the cache the table describes."""
    from pallas_kernels.verify_attn_ref import verify_attn_ref

    case = make_paged_case(rng, prefix=[20, 0, 33], width=3, page=16, n=3, h=2, r=8, dr=4)
    want = verify_attn_ref(case["q"], gathered(case), case["prefix_len"], case["tree_kv"], case["tree_mask"],
                           scale=0.3, kv_lora_rank=8)
    got = verify_attn_paged_ref(*(case[k] for k in ("q", "pool", "prefix_len", "tree_kv", "tree_mask",
                                                    "page_table")), scale=0.3, kv_lora_rank=8)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,page,splits", [("triton", 16, None), ("triton", 128, 4), ("mosaic", 16, None),
                                                 ("mosaic", 128, 3)])
def test_lowers_for_h200(backend, page, splits):
    """Both kernels over a [L, n_pages, P, A] pool at K2 widths lower for an abstract H200, as one kernel each (no
    XLA gather of the prefix: the pool goes in whole)."""
    spec, bt, n, h, a, width = jax.ShapeDtypeStruct, 2, 3, 64, 576, 4096 // page
    fn = functools.partial(verify_attn, scale=0.1, kv_lora_rank=512, layer=1, num_splits=splits, interpret=False,
                           backend=backend)
    text = lower_for_h200(lambda q, c, p, t, m, pt: fn(q, c, p, t, m, page_table=pt),
                          spec((bt, n, h, a), jnp.bfloat16), spec((3, bt * width + 5, page, a), jnp.bfloat16),
                          spec((bt,), jnp.int32), spec((bt, n, a), jnp.bfloat16), spec((bt, n, n), jnp.bool_),
                          spec((bt, width), jnp.int32)).as_text()
    kernel = "__gpu$xla.gpu.triton" if backend == "triton" else "custom_call @mosaic_gpu_v2"
    assert text.count(kernel) == 1 and "gather" not in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pool_shape,table_shape,match", [((9, 24, 40), (2, 3), "page size"),
                                                          ((9, 16, 40), (3, 3), "page_table must have shape"),
                                                          ((9, 16, 41), (2, 3), "cache must have shape")])
def test_bad_paged_inputs_name_the_problem(pool_shape, table_shape, match):
    with pytest.raises(ValueError, match=match):
        verify_attn(jnp.ones((2, 3, 4, 40)), jnp.ones(pool_shape), jnp.ones((2,), jnp.int32), jnp.ones((2, 3, 40)),
                    jnp.ones((2, 3, 3), bool), page_table=jnp.zeros(table_shape, jnp.int32), scale=0.1,
                    kv_lora_rank=32, interpret=True)
