"""One place that decides how a Pallas kernel runs: interpret on CPU, Triton-compiled on GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def default_interpret() -> bool:
    """Kernels compile only on GPU; everywhere else they run in the Pallas interpreter."""
    return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else bool(interpret)


def pallas_call(body, *, interpret: bool, num_warps: int = 4, num_stages: int = 2, **kw):
    """`pl.pallas_call` with Triton compiler params when compiled, none when interpreted."""
    params = None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(body, interpret=interpret, compiler_params=params, **kw)


def lower_for_h200(fn, *specs):
    """Lower `fn` (kernels called with interpret=False) for an abstract H200 on a CPU-only machine.

    Runs the Pallas -> Triton IR lowering, so non-power-of-two blocks, missing lowering rules or scratch use
    fail here rather than on the GPU.
    """
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


def dot_precision(dtype) -> lax.Precision:
    """A kernel dot's precision: fp32 inputs multiply exactly (not in tf32), 16-bit ones at the MMA's own."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
