"""Building blocks of the target model against float64 numpy: norm, YaRN rope, SwiGLU, router, experts, MLA core."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.checkpoint.weights import init_random, random_hf_weights
from kdtree_jax.model.config import RopeScaling, kimi_k2_6, tiny
from kdtree_jax.model.layers import apply_rope, rms_norm, rope_cos_sin, swiglu, yarn_correction_range, yarn_inv_freq
from kdtree_jax.model.mla import absorbed_attention_jnp, mla_verify
from kdtree_jax.model.moe import route
from kdtree_jax.model.quant import Int4Packed
from kdtree_jax.oracles import reference


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---- norm / swiglu ---------------------------------------------------------------------------------------------
def test_rms_norm_matches_numpy(rng):
    x = (3 * rng.standard_normal((3, 5, 64))).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
    f = jax.jit(rms_norm, static_argnums=2)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6) * w
    assert _rel(f(x, w, 1e-6), want) < 1e-6
    got_bf16 = f(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), 1e-6)
    assert got_bf16.dtype == jnp.bfloat16
    assert _rel(got_bf16, want) < 2e-2


def test_swiglu_matches_numpy(rng):
    x, wg, wu, wd = (rng.standard_normal(s).astype(np.float32) for s in ((4, 16), (16, 24), (16, 24), (24, 16)))
    want = (lambda a: a / (1 + np.exp(-a)))(x @ wg.astype(np.float64)) * (x @ wu.astype(np.float64)) @ wd
    assert _rel(jax.jit(swiglu)(x, np.stack([wg, wu], axis=1), wd), want) < 1e-5


# ---- YaRN rope -------------------------------------------------------------------------------------------------
def test_yarn_ramp_bounds_and_scale_constants():
    k26 = kimi_k2_6()
    assert yarn_correction_range(k26) == (8, 20)  # beta_fast 32 (K2.5 / K2.6)
    k2 = dataclasses.replace(k26, rope_scaling=dataclasses.replace(k26.rope_scaling, beta_fast=1.0, factor=32.0))
    assert yarn_correction_range(k2) == (19, 20)  # beta_fast 1 (K2, K2-Thinking)
    assert k26.softmax_scale == pytest.approx(0.1446796, rel=1e-6)
    assert k2.softmax_scale == pytest.approx(0.1308608, rel=1e-6)
    assert k26.rope_amplitude == 1.0


@pytest.mark.parametrize("rope_scaling", [
    RopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=1.0),
    RopeScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=8.0, beta_slow=2.0,
                mscale=0.8, mscale_all_dim=0.5),
    RopeScaling(),
])
def test_yarn_inv_freq_matches_float64_formula(rope_scaling):
    cfg = tiny(qk_rope_head_dim=64, rope_scaling=rope_scaling)
    dim, base, rs = 64, cfg.rope_theta, rope_scaling
    i = np.arange(dim // 2)
    extra = base ** (-2.0 * i / dim)

    def corr(beta):
        return dim * np.log(rs.original_max_position_embeddings / (2 * np.pi * beta)) / (2 * np.log(base))

    low, high = max(np.floor(corr(rs.beta_fast)), 0), min(np.ceil(corr(rs.beta_slow)), dim - 1)
    ramp = np.clip((i - low) / (high - low if high > low else 0.001), 0, 1)
    want = extra / rs.factor * ramp + extra * (1 - ramp)
    got = yarn_inv_freq(cfg)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6)


@functools.partial(jax.jit, static_argnums=3)
def _rope(x, positions, inv_freq, amplitude):
    cos, sin = rope_cos_sin(positions, inv_freq, amplitude)
    return apply_rope(x, cos, sin)


def test_rope_rotates_interleaved_pairs(rng):
    cfg = tiny()
    x = rng.standard_normal((2, 5, 3, cfg.qk_rope_head_dim)).astype(np.float32)
    pos = rng.integers(0, 500, (2, 5))
    inv = yarn_inv_freq(cfg)
    amp = 1.3
    z = x[..., 0::2] + 1j * x[..., 1::2]  # pair i as a complex number
    rot = z * amp * np.exp(1j * pos[:, :, None, None] * inv.astype(np.float64))
    want = np.stack([rot.real, rot.imag], axis=-1).reshape(x.shape)
    assert _rel(_rope(x, pos, inv, amp), want) < 1e-5


def test_rope_equals_hf_layout_up_to_the_pair_permutation(rng):
    """HF emits [rotated evens | rotated odds]; we keep pairs in place — same values, permuted."""
    cfg = tiny()
    dr = cfg.qk_rope_head_dim
    x = rng.standard_normal((6, 2, dr))
    pos = rng.integers(0, 300, 6)
    ours = np.asarray(_rope(x[None].astype(np.float32), pos[None], yarn_inv_freq(cfg), cfg.rope_amplitude))[0]
    hf = reference.apply_rope(x, pos, cfg)
    perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
    assert _rel(ours[..., perm], hf) < 1e-5


def test_rope_scores_depend_only_on_relative_position(rng):
    cfg = tiny()
    q, k = (rng.standard_normal((1, 4, cfg.qk_rope_head_dim)).astype(np.float32) for _ in range(2))
    pos = rng.integers(0, 100, (1, 4))
    shift = int(rng.integers(1, 200))
    inv = yarn_inv_freq(cfg)
    s0 = np.einsum("btd,bsd->bts", _rope(q, pos, inv, 1.0), _rope(k, pos, inv, 1.0))
    s1 = np.einsum("btd,bsd->bts", _rope(q, pos + shift, inv, 1.0), _rope(k, pos + shift, inv, 1.0))
    np.testing.assert_allclose(s1, s0, rtol=2e-4, atol=2e-4)


# ---- router / experts ------------------------------------------------------------------------------------------
ROUTER_CFGS = {
    "noaux_grouped": tiny(),
    "greedy_softmax": tiny(topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
                           num_experts_per_tok=3, routed_scaling_factor=1.0),
    "group_limited": tiny(topk_method="group_limited_greedy", n_group=2, topk_group=1, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", list(ROUTER_CFGS))
def test_route_matches_reference(rng, name):
    cfg = ROUTER_CFGS[name]
    x = rng.standard_normal((40, cfg.hidden_size))
    gate = rng.standard_normal((cfg.n_routed_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)
    bias = 0.3 * rng.standard_normal(cfg.n_routed_experts) if cfg.topk_method == "noaux_tc" else None
    want_idx, want_w = reference.route(cfg, x, gate, bias)
    logits = (x @ gate.T).astype(np.float32)
    f = jax.jit(lambda lg, b: route(lg, b, cfg))
    weights, idx = f(logits, None if bias is None else bias.astype(np.float32))
    order, want_order = np.argsort(np.asarray(idx), -1), np.argsort(want_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(want_idx, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_w, want_order, -1), rtol=1e-5)


def _dequantized(weights: dict) -> dict:
    return {k: v.dequant().astype(np.float64) if isinstance(v, Int4Packed) else np.asarray(v, np.float64)
            for k, v in weights.items()}


@pytest.mark.parametrize("expert_format", ["float", "int4"])
def test_moe_dense_and_gather_match_reference(rng, expert_format):
    cfg = tiny(n_shared_experts=2)
    seed = int(rng.integers(1 << 31))
    model = init_random(cfg, seed, expert_format=expert_format)
    hf = _dequantized(random_hf_weights(cfg, seed, int4_experts=expert_format == "int4"))
    moe = model.layers[1].mlp
    x = rng.standard_normal((6, cfg.hidden_size)).astype(np.float32)
    want = reference.moe(cfg, hf, "layers.1.mlp.", x.astype(np.float64))
    for impl in ("dense", "gather"):
        moe.impl = impl
        assert _rel(jax.jit(lambda a: moe(a))(x), want) < 1e-5, impl


# ---- absorbed attention core -----------------------------------------------------------------------------------
def test_absorbed_attention_core_matches_numpy(rng):
    b, n, h, s, r, p = 2, 5, 3, 12, 16, 8
    a = r + p
    q = rng.standard_normal((b, n, h, a)).astype(np.float32)
    cache = rng.standard_normal((b, s, a)).astype(np.float32)
    tree_kv = rng.standard_normal((b, n, a)).astype(np.float32)
    prefix = np.array([0, 7])
    mask = (rng.random((b, n, n)) < 0.5) | np.eye(n, dtype=bool)
    scale = 0.37
    got = jax.jit(functools.partial(absorbed_attention_jnp, scale=scale, kv_lora_rank=r))(
        q, cache, prefix, tree_kv, mask)
    want = np.zeros((b, n, h, r))
    for bi in range(b):
        keys = np.concatenate([cache[bi, : prefix[bi]], tree_kv[bi]]).astype(np.float64)  # [S', A]
        for i in range(n):
            vis = np.concatenate([np.ones(prefix[bi], bool), mask[bi, i]])
            sc = q[bi, i].astype(np.float64) @ keys[vis].T * scale  # [H, S']
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            want[bi, i] = (pr / pr.sum(-1, keepdims=True)) @ keys[vis, :r]
    assert _rel(got, want) < 1e-5


def test_mla_verify_pallas_kernel_matches_jnp_core(rng, interpret):
    """The Pallas verify kernel slots into absorbed MLA (one layer; the model-level check is GPU-marked)."""
    pytest.importorskip("pallas_kernels.verify_attn")
    cfg = tiny()
    attn = init_random(cfg, int(rng.integers(1 << 31))).layers[0].attn
    b, n, s = 2, 5, 16
    x = rng.standard_normal((b, n, cfg.hidden_size)).astype(np.float32)
    start = np.array([4, 9])
    positions = start[:, None] + rng.integers(0, 3, (b, n))
    mask = (rng.random((b, n, n)) < 0.5) | np.eye(n, dtype=bool)
    layer_cache = rng.standard_normal((b, s, cfg.latent_dim)).astype(np.float32)

    @functools.partial(jax.jit, static_argnames=("use_pallas",))
    def run(x, positions, start, mask, layer_cache, use_pallas):
        cos, sin = rope_cos_sin(positions, yarn_inv_freq(cfg), cfg.rope_amplitude)
        return mla_verify(attn, x, cos, sin, start, mask, layer_cache, use_pallas=use_pallas, interpret=interpret)

    want_out, want_rows = run(x, positions, start, mask, layer_cache, False)
    got_out, got_rows = run(x, positions, start, mask, layer_cache, True)
    assert _rel(got_out, want_out) < 1e-4
    np.testing.assert_array_equal(got_rows, want_rows)  # the latents do not depend on the attention core
