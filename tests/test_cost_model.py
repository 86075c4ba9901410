"""The verify cost model of benchmarks/bench_kimi_layer.py: non-negative coefficients, minimax relative error, and the
leave-one-out check, on synthetic measurements with known coefficients (fresh random shapes every run)."""
import dataclasses
import importlib.util
import os
import sys

import numpy as np
import pytest

from kdtree_jax.config import kimi_k2_6

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_kimi_layer.py")
_spec = importlib.util.spec_from_file_location("_bench_kimi_layer", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

CFG = dataclasses.replace(kimi_k2_6(), num_hidden_layers=2)
TRUE = {"intercept": 1.4e-3, "attn_flops": 1.3e-14, "expert_bytes": 8.5e-13, "tokens": 5e-6}


def synthetic_rows(rng, n_points=16, noise=0.0):
    rows = []
    for _ in range(n_points):
        bt, n = int(rng.choice([1, 8])), int(rng.choice([1, 17, 65, 257]))
        prefix = int(rng.integers(1000, 40000))
        expert_bytes = float(rng.uniform(8, 200)) * 24.77e6
        t = (TRUE["intercept"] + TRUE["attn_flops"] * bench.attn_flops(CFG, bt, n, prefix)
             + TRUE["expert_bytes"] * expert_bytes + TRUE["tokens"] * bt * n)
        t *= 1 + noise * rng.uniform(-1, 1)
        rows.append(dict(kind="verify", moe="kernel", batch=bt, nodes=n, prefix=prefix, ms=t * 1e3,
                         expert_bytes=expert_bytes, cache_bytes=bt * prefix * CFG.latent_dim * 2 * 2))
    rows.append(dict(kind="verify", moe="as_is", batch=1, nodes=1, prefix=4096, ms=99.0, expert_bytes=1.0,
                     cache_bytes=1.0))  # not a kernel-MoE point: ignored
    return rows


def test_exact_data_recovers_the_coefficients(rng):
    rows = synthetic_rows(rng)
    fit = bench.fit_cost_model(rows, CFG)
    assert fit["points"] == 16
    assert fit["max_abs_rel_err"] < 1e-6 and fit["loo_max_abs_rel_err"] < 1e-5
    for name, want in TRUE.items():
        assert fit["terms"][name] == pytest.approx(want, rel=1e-3), name
    assert fit["terms"].get("cache_bytes", 0.0) == pytest.approx(0.0, abs=1e-15)
    assert "fit_ms" not in rows[-1]


@pytest.mark.heavy
def test_noisy_data_error_is_what_the_fit_reports(rng):
    rows = synthetic_rows(rng, noise=0.1)
    fit = bench.fit_cost_model(rows, CFG)
    assert all(v >= 0 for v in fit["terms"].values())
    errs = [r["fit_ms"] / r["ms"] - 1 for r in rows if "fit_ms" in r]
    assert max(abs(e) for e in errs) == pytest.approx(fit["max_abs_rel_err"], rel=1e-9)
    assert fit["max_abs_rel_err"] <= 0.1 / 0.9 + 1e-9  # the true model's worst error: minimax can only do better
    assert fit["loo_max_abs_rel_err"] >= fit["max_abs_rel_err"] - 1e-9


def test_too_few_points_is_reported():
    assert "error" in bench.fit_cost_model(synthetic_rows(np.random.default_rng(0), n_points=3), CFG)
