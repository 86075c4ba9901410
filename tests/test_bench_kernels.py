"""bench_kernels' paged mode: the shuffled page pool holds the cache's rows where the table says, the side-by-side
table and its 5% verdict, and one tiny interpreted run with both layouts (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from script_loader import load_script


def _load():
    return load_script("benchmarks/bench_kernels.py")


bench_kernels = _load()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bt,width,page", [(1, 1, 16), (3, 5, 16), (2, 4, 64)])
def test_page_pool_holds_each_row_where_the_table_says(rng, bt, width, page):
    cache = jnp.asarray(rng.standard_normal((bt, width * page, 6)), jnp.float32)
    pool, table = bench_kernels.page_pool(cache, page, jax.random.key(int(rng.integers(1 << 30))))
    pool, table, cache = np.asarray(pool), np.asarray(table), np.asarray(cache)
    assert pool.shape == (bt * width, page, 6) and table.shape == (bt, width) and table.dtype == np.int32
    assert sorted(table.ravel()) == list(range(bt * width))  # every pool page belongs to exactly one table entry
    rows = np.arange(width * page)
    for b in range(bt):
        np.testing.assert_array_equal(pool[table[b, rows // page], rows % page], cache[b])


@pytest.mark.timeout(30)
def test_page_pool_shuffles_and_refuses_partial_pages():
    cache = jnp.arange(32 * 64 * 2, dtype=jnp.float32).reshape(2, 32 * 16, 4)
    _, table = bench_kernels.page_pool(cache, 16, jax.random.key(0))
    assert not np.array_equal(np.asarray(table).ravel(), np.arange(64))  # 64 pages: identity has odds 1 / 64!
    with pytest.raises(ValueError, match="whole pages"):
        bench_kernels.page_pool(cache[:, :40], 16, jax.random.key(0))
    assert [bench_kernels.paged_capacity(c, 64) for c in (32792, 64, 65, 4160)] == [32832, 64, 128, 4160]


@pytest.mark.timeout(30)
def test_output_diff_is_relative_and_zero_when_equal(rng):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    assert bench_kernels.output_diff(a, a) == 0.0
    b = a.copy()
    b[1, 2] += 0.5
    assert bench_kernels.output_diff(b, a) == pytest.approx(0.5 / np.abs(a).max(), rel=1e-5)


def _row(rng, layout, backend="mosaic", prefix=4096, ms=None, kernel_ms=None):
    return dict(backend=backend, layout=layout, batch=8, nodes=17, heads=64, prefix=prefix,
                ms=ms or float(rng.uniform(0.2, 2.0)), kernel_ms=kernel_ms or float(rng.uniform(0.2, 2.0)),
                diff_vs_contiguous=0.0)


@pytest.mark.timeout(30)
def test_paged_table_pairs_rows_and_gives_the_ratio(rng):
    rows = []
    for backend in ("mosaic", "triton"):
        for prefix in (4096, 32768):
            c = _row(rng, "contiguous", backend, prefix)
            p = _row(rng, "paged64", backend, prefix)
            rows += [c, p]
    rows.append(_row(rng, "contiguous", "triton", 8192))  # no paged twin: no line
    lines = bench_kernels.paged_table(rows).splitlines()
    header = [x.strip() for x in lines[0].split("|")[1:-1]]
    assert len(lines) == 2 + 4
    for (c, p), line in zip(zip(rows[0:8:2], rows[1:8:2]), lines[2:]):
        got = dict(zip(header, [x.strip() for x in line.split("|")[1:-1]]))
        assert (got["backend"], got["prefix"], got["layout"]) == (p["backend"], str(p["prefix"]), "paged64")
        assert got["paged / contiguous"] == f"{p['ms'] / c['ms']:.3f}"
        assert got["paged / contiguous (kernels)"] == f"{p['kernel_ms'] / c['kernel_ms']:.3f}"


@pytest.mark.timeout(30)
def test_paged_summary_judges_the_worst_row_against_five_percent(rng):
    rows = [_row(rng, "contiguous", ms=1.0, kernel_ms=1.0), _row(rng, "paged64", ms=1.04, kernel_ms=1.07),
            _row(rng, "contiguous", prefix=32768, ms=2.0, kernel_ms=2.0),
            _row(rng, "paged64", prefix=32768, ms=1.9, kernel_ms=2.02)]
    text = bench_kernels.paged_summary(rows)
    assert "mosaic, wall: paged / contiguous 0.950-1.040 over 2 rows (goal <= 1.05: met)" in text
    assert "mosaic, kernels: paged / contiguous 1.010-1.070 over 2 rows (goal <= 1.05: not met)" in text
    untraced = [dict(x, kernel_ms=float("nan")) for x in rows]
    assert "kernels" not in bench_kernels.paged_summary(untraced)


@pytest.mark.timeout(240)
def test_interpreted_run_times_both_layouts(monkeypatch):
    """One tiny shape in the Pallas interpreter: a contiguous and a paged row per prefix, each timed twice
    (interleaved), the paged output equal to the contiguous one up to the blocking's rounding."""
    for name, value in (("MIN_SETS", 1), ("MAX_SETS", 1), ("MIN_REPS", 1), ("MAX_REPS", 1), ("MIN_BENCH_S", 0.0)):
        monkeypatch.setattr(bench_kernels, name, value)
    sweep = bench_kernels.Sweep(batches=(2,), nodes=(3,), prefixes=(20, 40), r=32, dr=8, dtype="float32")
    rows = bench_kernels.bench_verify_attn(sweep, (2,), True, float("inf"), ("triton",), page=16)
    assert [(x["layout"], x["prefix"]) for x in rows] == [("contiguous", 20), ("paged16", 20), ("contiguous", 40),
                                                          ("paged16", 40)]
    for x in rows:
        assert x["capacity"] == 48 and len(x["ms_runs"]) == 2 and x["ms"] == min(x["ms_runs"]) > 0
        assert x["rel_err_row0"] < 1e-5 and x["diff_vs_contiguous"] < 1e-5
    assert "paged16" in bench_kernels.paged_table(rows)
