"""Timing helpers shared by the benchmark scripts: synchronised medians and the two measured ceilings."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_s(fn, min_reps: int = 5, max_reps: int = 30, min_total_s: float = 0.2) -> float:
    """Median wall time of fn() after two warm-up calls, each call synchronised with block_until_ready."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    while len(times) < min_reps or (sum(times) < min_total_s and len(times) < max_reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_ceiling(nbytes: int) -> float:
    """Bytes/s of a large device elementwise copy (x * s with a runtime s = 1): read + write counted."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x, s: x * s)
    return 2 * x.nbytes / median_s(lambda: f(x, jnp.asarray(1.0, jnp.bfloat16)))


def matmul_peak(n: int) -> float:
    """FLOP/s of an n^3 bf16 matmul through XLA."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / median_s(lambda: f(a))
