"""The benchmark timing helper really runs the kernel once per argument set, and times something positive."""
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_util.py")
_spec = importlib.util.spec_from_file_location("_bench_util", _PATH)
bench_util = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_util)


def test_back_to_back_runs_every_set(rng):
    sets = [(jnp.asarray(rng.standard_normal((3, 4)) + (3.0 if i == 4 else 0.0), jnp.float32),) for i in range(5)]

    def fn(x):
        return {"a": x * 2.0, "b": x.sum(axis=0)}

    got = float(bench_util._back_to_back(fn)(sets))
    terms = [2.0 * float(x[0, 0]) + float(np.asarray(x).sum(axis=0)[0]) for (x,) in sets]
    scale = sum(abs(t) for t in terms)  # the sum itself may cancel to near zero: compare against its terms' size
    assert got == pytest.approx(sum(terms), abs=1e-5 * scale)
    assert got != pytest.approx(sum(terms[:-1]), abs=1e-5 * scale)  # the last set (shifted: term ~15) really ran
    assert bench_util.per_call_s(fn, sets, min_reps=2, max_reps=2) > 0.0
