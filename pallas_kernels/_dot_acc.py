"""`dot_acc(acc, a, b)` = acc + a @ b^T (fp32) as one Triton dot with an accumulator operand, inside Pallas kernels.

Why: Pallas' Triton lowering of `lax.dot_general` always starts the dot from zeros, so `acc + dot(a, b)` costs one
fp32 add per output element per dot, and on sm_90 a warpgroup MMA (wgmma) whose result feeds that add cannot chain
into the next one. `tt.dot(a, b, acc)` accumulates in the MMA itself. jax 0.11.2 has no public way to pass an
accumulator, so this registers one primitive with a Triton lowering rule through jax's private Pallas Triton
lowering module (`jax._src.pallas.triton.lowering`, pinned with jax in pyproject.toml); everywhere else (the Pallas
interpreter, XLA) it is the plain sum, at `lax.dot_general`'s precision.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax.extend import core as jex_core
from jax.interpreters import mlir

from pallas_kernels._pallas import dot_precision

_NT = (((1,), (1,)), ((), ()))  # a @ b.T

dot_acc_p = jex_core.Primitive("dot_acc")


def _reference(acc, a, b):
    return acc + lax.dot_general(a, b, _NT, precision=dot_precision(a.dtype), preferred_element_type=jnp.float32)


def _abstract(acc, a, b):
    if acc.dtype != jnp.float32 or acc.shape != (a.shape[0], b.shape[0]) or a.shape[1] != b.shape[1]:
        raise ValueError(f"dot_acc: acc f32 [{a.shape[0]}, {b.shape[0]}] += a {a.shape} @ b.T {b.shape}, got acc "
                         f"{acc.dtype} {acc.shape}")
    return jax.core.ShapedArray(acc.shape, acc.dtype)


dot_acc_p.def_impl(_reference)
dot_acc_p.def_abstract_eval(_abstract)
mlir.register_lowering(dot_acc_p, mlir.lower_fun(_reference, multiple_results=False))


@triton_lowering.register_lowering(dot_acc_p)
def _triton_lowering(ctx, acc, a, b):
    exact = dot_precision(ctx.avals_in[1].dtype) == lax.Precision.HIGHEST  # as `_reference`
    precision = tt_dialect.InputPrecision.IEEE if exact else None
    return tt_dialect.dot(a, tt_dialect.trans(b, (1, 0)), acc, input_precision=precision)


def dot_acc(acc: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """acc [M, N] f32 + a [M, K] @ b [N, K]^T, accumulated in the MMA when compiled."""
    return dot_acc_p.bind(acc, a, b)
