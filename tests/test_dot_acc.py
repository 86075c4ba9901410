"""`dot_acc` (acc + a @ b^T inside a Pallas kernel) vs float64 numpy, interpreted on CPU and compiled on GPU, its
shape check, and its Triton lowering for an abstract H200."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._dot_acc import dot_acc
from pallas_kernels._pallas import lower_for_h200, pallas_call, resolve_interpret

TOL = {np.float32: 1e-6, jnp.bfloat16: 1e-6}  # bf16 inputs: exact products, fp32 sums


def _kernel(acc_ref, a_ref, b_ref, o_ref):
    acc = acc_ref[...]
    for t in range(2):  # two chained dots, as the INT4 K loop chains its nibble planes
        acc = dot_acc(acc, a_ref[t], b_ref[t])
    o_ref[...] = acc


def _call(acc, a, b, interpret=None):
    out = jax.ShapeDtypeStruct(acc.shape, jnp.float32)
    return pallas_call(_kernel, interpret=resolve_interpret(interpret), out_shape=out)(acc, a, b)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_dot_acc_matches_float64(rng, interpret, dtype):
    m, n, k = 16, 64, 32
    a = jnp.asarray(rng.standard_normal((2, m, k)), dtype)
    b = jnp.asarray(rng.standard_normal((2, n, k)), dtype)
    acc = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    f64 = lambda v: np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)  # noqa: E731
    want = f64(acc) + sum(f64(a)[t] @ f64(b)[t].T for t in range(2))
    out = np.asarray(_call(acc, a, b, interpret))
    assert np.isfinite(out).all()
    rel = np.abs(out - want).max() / np.abs(want).max()
    assert rel <= TOL[dtype] * k, f"{dtype}: max rel err {rel:.2e}"


def test_dot_acc_names_bad_shapes():
    with pytest.raises(ValueError, match=r"dot_acc: acc f32 \[16, 64\]"):
        jax.eval_shape(dot_acc, jax.ShapeDtypeStruct((16, 32), jnp.float32),
                       jax.ShapeDtypeStruct((16, 8), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8), jnp.bfloat16))


def test_dot_acc_lowers_for_h200():
    spec = jax.ShapeDtypeStruct
    text = lower_for_h200(lambda acc, a, b: _call(acc, a, b, interpret=False), spec((16, 64), jnp.float32),
                          spec((2, 16, 32), jnp.bfloat16), spec((2, 64, 32), jnp.bfloat16)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
