"""The TMA-fed INT4 matmul of `benchmarks/bench_int4_tma.py`: its product matches float64 in Mosaic GPU's interpreter
(programs walking several tiles through one wrapping ring of stages, and idle programs), every mode lowers for an
abstract H200 at K2.6 widths, and a shape it cannot tile is refused by name."""
import functools

import jax
import jax.numpy as jnp
import pytest
from script_loader import load_script

from pallas_kernels._pallas import lower_for_h200

tma = load_script("benchmarks/bench_int4_tma.py")


@pytest.mark.parametrize("experts,n,k,rows,tk,stages,programs", [
    (2, 128, 512, 16, 256, 2, 3),  # one tile each, one program idle
    (3, 256, 512, 8, 128, 3, 4),  # 6 tiles over 4 programs (2, 2, 1, 1): 4 K steps wrap a 3-stage ring
])
def test_interpreted_matches_float64(experts, n, k, rows, tk, stages, programs):
    wi, scale, x = tma.random_problem(experts, n, k, rows, seed=experts)
    y = tma.tma_int4_matmul(wi.astype(jnp.int4), scale, x, tk=tk, stages=stages, programs=programs, interpret=True)
    assert tma.max_rel_err(y, tma.reference(wi, scale, x)) <= 1e-5


@pytest.mark.parametrize("mode", tma.MODES)
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])  # K2.6 gate/up and down
def test_lowers_for_h200(mode, n, k):
    spec = jax.ShapeDtypeStruct
    fn = functools.partial(tma.tma_int4_matmul, tk=512, stages=4, mode=mode)
    text = lower_for_h200(fn, spec((135, n, k), jnp.int4), spec((135, k // tma.GROUP, n), jnp.bfloat16),
                          spec((135, 16, k), jnp.bfloat16)).as_text()
    assert "mosaic_gpu" in text


def test_refuses_untiled_shape():
    wi, scale, x = tma.random_problem(1, 128, 512, 16)
    with pytest.raises(ValueError, match="tk=384"):
        tma.tma_int4_matmul(wi.astype(jnp.int4), scale, x, tk=384, interpret=True)
