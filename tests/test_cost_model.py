"""The verify cost model of benchmarks/bench_kimi_layer.py: non-negative coefficients, minimax relative error, and the
leave-one-out check, on synthetic measurements with known coefficients (fresh random shapes every run)."""
import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
from script_loader import load_script

from kdtree_jax.model.config import kimi_k2_6
from kdtree_jax.model.quant import quant_int4
from pallas_kernels.int4_moe_ref import int4_moe_ffn_ref

bench = load_script("benchmarks/bench_kimi_layer.py")

CFG = dataclasses.replace(kimi_k2_6(), num_hidden_layers=2)
TRUE = {"intercept": 1.4e-3, "attn_roofline": 1.7, "expert_bytes": 8.5e-13, "tokens": 5e-6}
BW, PEAK = 4.2e12, 670e12  # the run's copy rate and matmul peak


def attn_roofline(bt, n, prefix, cache_bytes, bw=BW, peak=PEAK):
    return max(cache_bytes / bw, bench.attn_flops(CFG, bt, n, prefix) / peak)


def synthetic_rows(rng, n_points=16, noise=0.0):
    rows = []
    for _ in range(n_points):
        bt, n = int(rng.choice([1, 8])), int(rng.choice([1, 17, 65, 257]))
        prefix = int(rng.integers(1000, 40000))
        expert_bytes = float(rng.uniform(8, 200)) * 24.77e6
        cache_bytes = bt * prefix * CFG.latent_dim * 2 * 2
        t = (TRUE["intercept"] + TRUE["attn_roofline"] * attn_roofline(bt, n, prefix, cache_bytes)
             + TRUE["expert_bytes"] * expert_bytes + TRUE["tokens"] * bt * n)
        t *= 1 + noise * rng.uniform(-1, 1)
        rows.append(dict(kind="verify", moe="kernel", batch=bt, nodes=n, prefix=prefix, ms=t * 1e3,
                         expert_bytes=expert_bytes, cache_bytes=cache_bytes))
    rows.append(dict(kind="verify", moe="as_is", batch=1, nodes=1, prefix=4096, ms=99.0, expert_bytes=1.0,
                     cache_bytes=1.0))  # not a kernel-MoE point: ignored
    return rows


def test_exact_data_recovers_the_coefficients(rng):
    rows = synthetic_rows(rng)
    fit = bench.fit_cost_model(rows, CFG, BW, PEAK)
    assert fit["points"] == 16
    assert fit["max_abs_rel_err"] < 1e-6 and fit["loo_max_abs_rel_err"] < 1e-5
    for name, want in TRUE.items():
        assert fit["terms"][name] == pytest.approx(want, rel=1e-3), name
    assert (fit["copy_gbps"], fit["matmul_tflops"]) == (BW / 1e9, PEAK / 1e12)
    assert "fit_ms" not in rows[-1]


def test_attention_roofline_uses_each_rows_own_rates(rng):
    """Rows of a refit carry their run's copy rate and peak: the roofline term takes those, not the fit's."""
    rows = synthetic_rows(rng)
    for r in rows[:-1]:  # rates this row's "run" measured; its time follows them
        bw, peak = BW * float(rng.uniform(0.9, 1.1)), PEAK * float(rng.uniform(0.9, 1.1))
        shift = TRUE["attn_roofline"] * (attn_roofline(r["batch"], r["nodes"], r["prefix"], r["cache_bytes"], bw, peak)
                                         - attn_roofline(r["batch"], r["nodes"], r["prefix"], r["cache_bytes"]))
        r.update(copy_gbps=bw / 1e9, matmul_tflops=peak / 1e12, ms=r["ms"] + shift * 1e3)
    fit = bench.fit_cost_model(rows, CFG, BW, PEAK)
    assert fit["max_abs_rel_err"] < 1e-6
    assert fit["terms"]["attn_roofline"] == pytest.approx(TRUE["attn_roofline"], rel=1e-3)


@pytest.mark.heavy
def test_noisy_data_error_is_what_the_fit_reports(rng):
    rows = synthetic_rows(rng, noise=0.1)
    fit = bench.fit_cost_model(rows, CFG, BW, PEAK)
    assert all(v >= 0 for v in fit["terms"].values())
    errs = [r["fit_ms"] / r["ms"] - 1 for r in rows if "fit_ms" in r]
    assert max(abs(e) for e in errs) == pytest.approx(fit["max_abs_rel_err"], rel=1e-9)
    assert fit["max_abs_rel_err"] <= 0.1 / 0.9 + 1e-9  # the true model's worst error: minimax can only do better
    assert fit["loo_max_abs_rel_err"] >= fit["max_abs_rel_err"] - 1e-9


def test_too_few_points_is_reported():
    assert "error" in bench.fit_cost_model(synthetic_rows(np.random.default_rng(0), n_points=3), CFG, BW, PEAK)


def test_expert_pool_folds_the_routed_ids(rng):
    """--expert-pools: the swapped kernel path runs (and records) expert ids mod P, so the distinct experts of a step
    can vary at a fixed token count; the output is the reference FFN of the folded routing, duplicates included."""
    e, d, inter, m, k, pool = 8, 64, 32, 6, 3, 3
    arrays = {}
    for name, (n_out, n_in) in zip(("gate", "up", "down"), ((inter, d), (inter, d), (d, inter))):
        packed, scale = quant_int4(rng.standard_normal((e, n_out, n_in)) / np.sqrt(n_in), 32)
        arrays[f"{name}_packed"], arrays[f"{name}_scale"] = jnp.asarray(packed), jnp.asarray(scale)
    x = rng.standard_normal((m, d)).astype(np.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(m)]).astype(np.int32)
    idx[0] = rng.permutation([0, pool, 1])  # experts 0 and P fold onto one
    weights = rng.uniform(0.2, 1.0, (m, k)).astype(np.float32)
    record = []
    with bench.moe_experts("kernel", record, interpret=True, expert_pool=pool):
        out = bench.moe_mod._experts_gather(types.SimpleNamespace(**arrays), jnp.asarray(x), jnp.asarray(weights),
                                            jnp.asarray(idx))
    folded = idx % pool
    np.testing.assert_array_equal(np.asarray(record[0]), folded)
    assert (folded[:, :, None] == folded[:, None, :]).sum() > m * k  # some token meets one expert twice
    want = int4_moe_ffn_ref(x, folded, weights, *(np.asarray(arrays[n]) for n in bench.ROUTED))
    got = np.asarray(out, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
