"""Pallas top-k log-probs (pallas_kernels/topk.py) vs the float64 reference and the XLA path, and Triton lowering."""
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.topk import FASTER_MAX_K, MAX_K, plan, preferred, topk_logprobs_pallas
from pallas_kernels.tree_build import topk_logprobs, topk_logprobs_xla
from pallas_kernels.tree_build_ref import topk_logprobs_ref

TOL = 1e-6  # lp: the logsumexp is summed in a different order than XLA's / float64
TRIALS = 2  # fresh logits per compiled shape
DEPTH = 15
# (Bt, D, V, k, chunk): multi-chunk with a ragged last chunk; one chunk smaller than the default; k = 1;
# k above the requested chunk (the chunk grows to hold k); k = V; many tiny chunks.
CASES = [(2, 3, 1000, 64, 128), (2, 2, 300, 16, None), (1, 3, 700, 1, 64), (1, 2, 515, 200, 64),
         (2, 1, 40, 40, 16), (1, 2, 96, 5, 16)]


def tied_logits(rng, shape):
    """Logits on a 0.1 grid (exact ties in every row and across chunks), some -inf, one row mostly -inf.

    `+ 0.0` turns rounding's -0.0 into +0.0: XLA's top_k orders -0.0 below +0.0, the float64 reference does not
    (test_negative_zero_follows_xla covers that case)."""
    x = (rng.standard_normal(shape) * 3).round(1).astype(np.float32) + np.float32(0.0)
    x[rng.random(shape) < 0.05] = -np.inf
    x[0, 0, rng.random(shape[-1]) < 0.9] = -np.inf
    return x


def check(x, k, lp, ids):
    lp, ids = np.asarray(lp), np.asarray(ids)
    want_lp, want_ids = topk_logprobs_ref(x, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(lp, want_lp, rtol=TOL, atol=TOL)
    xla_lp, xla_ids = topk_logprobs_xla(jnp.asarray(x), k)
    np.testing.assert_array_equal(ids, np.asarray(xla_ids))
    np.testing.assert_allclose(lp, np.asarray(xla_lp), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("bt,d,v,k,chunk", CASES)
def test_matches_reference_and_xla_with_ties(rng, interpret, bt, d, v, k, chunk):
    kw = {} if chunk is None else {"chunk": chunk}
    for _ in range(TRIALS):
        x = tied_logits(rng, (bt, d, v))
        lp, ids = topk_logprobs_pallas(jnp.asarray(x), k, interpret=interpret, **kw)
        check(x, k, lp, ids)


def kernels_in(text: str) -> list[str]:
    """Names of the top-k Pallas kernels a lowered program calls (Triton custom calls carry the kernel's name)."""
    return re.findall(r'name = "(topk_\w+)"', text)


def test_public_function_gives_the_reference_inside_jit(rng, interpret):
    x = tied_logits(rng, (2, 3, 300))
    lp, ids = jax.jit(functools.partial(topk_logprobs, interpret=interpret), static_argnames="k")(jnp.asarray(x), k=16)
    check(x, 16, lp, ids)


@pytest.mark.parametrize("v,k,kernels", [
    (300, 16, ["topk_single"]),  # one chunk: a single kernel
    (20000, 16, ["topk_chunk", "topk_merge"]),  # two chunks: both stages
    (163840, 256, ["topk_chunk", "topk_merge"]),  # k above FASTER_MAX_K, but the K2.6 vocabulary
    (300, FASTER_MAX_K + 1, []),  # XLA's top_k is faster here
    (20000, 256, []),
])
def test_public_function_uses_kernel_inside_jit(v, k, kernels):
    """Compiled (the GPU path), the jitted public function calls the kernel exactly where `preferred` chooses it."""
    assert preferred(v, k) == bool(kernels)
    fn = jax.jit(functools.partial(topk_logprobs, k=k, interpret=False))
    text = lower_for_h200(fn, jax.ShapeDtypeStruct((1, 2, v), jnp.float32)).as_text()
    assert kernels_in(text) == kernels
    assert ("__gpu$xla.gpu.triton" in text) == bool(kernels) and ("top_k" in text) == (not kernels)


def test_interpreter_runs_xla_top_k():
    """In the interpreter the public function is XLA's top_k (the kernel's k dependent steps only slow a CPU)."""
    x = jax.ShapeDtypeStruct((1, 2, 300), jnp.float32)
    assert "pallas_call" in str(jax.make_jaxpr(functools.partial(topk_logprobs_pallas, k=16, interpret=True))(x))
    assert "pallas_call" not in str(jax.make_jaxpr(functools.partial(topk_logprobs, k=16, interpret=True))(x))


def test_negative_zero_follows_xla(interpret):
    x = np.zeros((1, 1, 64), np.float32)
    x[..., 1::3] = -0.0
    x[..., 2::5] = -1.0
    lp, ids = topk_logprobs_pallas(jnp.asarray(x), 40, chunk=16, interpret=interpret)
    xla_lp, xla_ids = topk_logprobs_xla(jnp.asarray(x), 40)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(xla_ids))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(xla_lp), rtol=TOL, atol=TOL)


def test_every_output_is_written(rng, interpret):
    """Interpret mode starts float outputs as NaN (test_verify_attn.py::test_interpret_outputs_start_poisoned): a
    slot the kernels never wrote would show up as NaN or an id outside the vocab."""
    v = 1000
    x = rng.standard_normal((2, 3, v)).astype(np.float32)
    lp, ids = topk_logprobs_pallas(jnp.asarray(x), 64, chunk=128, interpret=interpret)
    assert np.isfinite(np.asarray(lp)).all()
    assert ((np.asarray(ids) >= 0) & (np.asarray(ids) < v)).all()


@pytest.mark.parametrize("k", [FASTER_MAX_K + 1, MAX_K + 1])
def test_large_k_runs_xla(rng, k):
    """Above FASTER_MAX_K (small vocab) topk_logprobs is XLA's (bit-identical lp; the kernel's logsumexp sums in
    another order)."""
    x = jnp.asarray(rng.standard_normal((1, 2, MAX_K + 8)).astype(np.float32))
    lp, ids = topk_logprobs(x, k)
    xla_lp, xla_ids = topk_logprobs_xla(x, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(xla_ids))
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(xla_lp))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="logits must be"):
        topk_logprobs(jnp.zeros((3, 8)), 2)
    with pytest.raises(ValueError, match="k=0"):
        topk_logprobs(jnp.zeros((1, 2, 8)), 0)
    with pytest.raises(ValueError, match="k=9"):
        topk_logprobs_pallas(jnp.zeros((1, 2, 8)), 9)
    with pytest.raises(ValueError, match="chunk=100"):
        plan(1000, 8, 100)


# ---- GPU shapes, checked without a GPU ------------------------------------------------------------------------------
K26 = (8, 163840, 256)  # batch, Kimi K2.6 vocabulary, k = budget
SHIPPED = (1, 4096, 32)


def _spec_fn(bt, v, k):
    fn = functools.partial(topk_logprobs_pallas, k=k, interpret=False)  # the kernel itself, whichever path k takes
    return fn, jax.ShapeDtypeStruct((bt, DEPTH, v), jnp.float32)


@pytest.mark.parametrize("bt,v,k", [K26, SHIPPED])
def test_lowers_for_h200(bt, v, k):
    text = lower_for_h200(*_spec_fn(bt, v, k)).as_text()
    assert "triton" in text.lower()


def test_k26_fits_and_does_not_spill():
    """sm_90 compile of both stages at K2.6 size (tests/test_kernel_resources.py does the same for other kernels)."""
    pytest.importorskip("triton", reason="the sm_90 compile needs the triton package")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from triton_report import SHARED_LIMIT, report

    kernels = report(*_spec_fn(*K26))
    assert {k.name for k in kernels} == {"topk_chunk", "topk_merge"}
    for k in kernels:
        assert k.shared_bytes <= SHARED_LIMIT, f"{k.name}: {k.shared_bytes} B of shared memory"
        assert not k.spills, f"{k.name}: {k.stack_bytes} B stack, {k.spill_loads} LDL"
