"""Timing helpers shared by the benchmark scripts: synchronised medians, per-call device time with the host's
dispatch cost amortised, and the two measured ceilings."""
from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=None)
def _back_to_back(fn):
    """One jit that runs fn on every argument set in turn and keeps each output alive (a scalar from each)."""

    def many(arg_sets):
        acc = jnp.float32(0)
        for args in arg_sets:
            for leaf in jax.tree.leaves(fn(*args)):
                acc = acc + jnp.ravel(leaf)[0].astype(jnp.float32)
        return acc

    return jax.jit(many)


def per_call_s(fn, arg_sets, **median_kw) -> float:
    """Median seconds per call of fn(*args), the calls for all `arg_sets` issued back to back inside one jit.

    A single jitted call pays tens of µs of host dispatch, more than a small kernel runs; the engine issues its
    kernels from one compiled loop, so that cost is not the kernel's. The sets must differ (XLA merges identical
    calls); cycling through several large inputs also keeps a call from reading what the previous left in L2.
    Keep `fn` the same object across calls so one compile serves every set of the same shapes.
    """
    return median_s(lambda: _back_to_back(fn)(list(arg_sets)), **median_kw) / len(arg_sets)


def copy_ceiling(nbytes: int) -> float:
    """Bytes/s of a large device elementwise copy (x * s with a runtime s = 1): read + write counted."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)  # never time on zeros
    f = jax.jit(lambda x, s: x * s)
    return 2 * x.nbytes / median_s(lambda: f(x, jnp.asarray(1.0, jnp.bfloat16)))


def matmul_peak(n: int) -> float:
    """FLOP/s of an n^3 bf16 matmul through XLA."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / median_s(lambda: f(a))
