"""Sanity of the float64 golden forward: YaRN constants, rope layout, causality, routing, MLA forms, quantized load."""
import dataclasses
import math

import numpy as np
import pytest

from kdtree_jax.checkpoint.hf import HFCheckpoint
from kdtree_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kdtree_jax.model.config import RopeScaling, kimi_k2_6, tiny
from kdtree_jax.oracles.reference import (
    apply_rope,
    mla_attention,
    moe,
    reference_forward,
    reference_weights,
    rms_norm,
    route,
    softmax_scale,
    yarn_correction_range,
    yarn_inv_freq,
)

K2_ROPE = RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                      mscale_all_dim=1.0)


def _weights(tmp_path, rng, cfg=None, fmt="bf16"):
    cfg = cfg or tiny()
    eff = write_synthetic_checkpoint(tmp_path, cfg, fmt=fmt, seed=int(rng.integers(0, 2**31)))
    ck = HFCheckpoint.open(tmp_path)
    return ck.config, eff, ck


# ---- constants -------------------------------------------------------------------------------------------------
def test_yarn_constants_kimi():
    k26 = kimi_k2_6()
    k2 = dataclasses.replace(k26, rope_scaling=K2_ROPE)
    assert softmax_scale(k2) == pytest.approx(0.1308608, abs=5e-8)
    assert softmax_scale(k26) == pytest.approx(0.1446796, abs=5e-8)
    assert softmax_scale(k2) == pytest.approx(k2.softmax_scale, rel=1e-14)
    assert softmax_scale(k26) == pytest.approx(k26.softmax_scale, rel=1e-14)
    assert yarn_correction_range(k2) == (19, 20)
    assert yarn_correction_range(k26) == (8, 20)
    for cfg, low, high in ((k2, 19, 20), (k26, 8, 20)):
        inv = yarn_inv_freq(cfg)
        extra = 50000.0 ** (-np.arange(0, 64, 2) / 64)
        np.testing.assert_allclose(inv[: low + 1], extra[: low + 1], rtol=1e-14)  # ramp 0: original frequency
        np.testing.assert_allclose(inv[high:], extra[high:] / cfg.rope_scaling.factor, rtol=1e-14)  # interpolated
        if high - low > 1:
            mid = low + 1
            ramp = (mid - low) / (high - low)
            assert inv[mid] == pytest.approx(extra[mid] * (1 - ramp) + extra[mid] / cfg.rope_scaling.factor * ramp)


def test_plain_rope_when_no_scaling(rng):
    cfg = tiny(rope_scaling=RopeScaling())
    dr = cfg.qk_rope_head_dim
    np.testing.assert_allclose(yarn_inv_freq(cfg), cfg.rope_theta ** (-np.arange(0, dr, 2) / dr), rtol=1e-14)
    assert softmax_scale(cfg) == pytest.approx((cfg.qk_nope_head_dim + dr) ** -0.5)


def test_rope_rotates_interleaved_pairs(rng):
    cfg = tiny()
    t, dr = 7, cfg.qk_rope_head_dim
    x = rng.standard_normal((t, 3, dr))
    pos = rng.integers(0, 400, size=t)
    got = apply_rope(x, pos, cfg)
    inv = yarn_inv_freq(cfg)
    want = np.empty_like(x)
    for i in range(dr // 2):
        ang = pos[:, None] * inv[i]
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        want[..., i] = x0 * np.cos(ang) - x1 * np.sin(ang)  # HF output layout: [rotated evens | rotated odds]
        want[..., dr // 2 + i] = x0 * np.sin(ang) + x1 * np.cos(ang)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_rope_dot_depends_on_distance_only(rng):
    cfg = tiny()
    q, k = rng.standard_normal((1, cfg.qk_rope_head_dim)), rng.standard_normal((1, cfg.qk_rope_head_dim))
    dots = [(apply_rope(q, np.array([p + 9]), cfg) @ apply_rope(k, np.array([p]), cfg).T).item() for p in (0, 5, 300)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)
    assert abs(dots[0] - (q @ k.T).item()) > 1e-6


# ---- whole forward ---------------------------------------------------------------------------------------------
def test_causal_and_prefix_consistent(tmp_path, rng):
    cfg, w, _ = _weights(tmp_path, rng)
    tokens = rng.integers(0, cfg.vocab_size, size=9)
    logits, hidden = reference_forward(cfg, w, tokens, return_hidden=True)
    assert logits.shape == (9, cfg.vocab_size) and hidden.shape == (cfg.num_hidden_layers, 9, cfg.hidden_size)
    assert np.isfinite(logits).all() and logits.std() > 0.1
    changed = tokens.copy()
    changed[6:] = (changed[6:] + 1 + rng.integers(0, cfg.vocab_size - 1, size=3)) % cfg.vocab_size
    other = reference_forward(cfg, w, changed)
    np.testing.assert_allclose(other[:6], logits[:6], rtol=1e-12, atol=1e-12)
    assert np.abs(other[6:] - logits[6:]).max() > 1e-3
    np.testing.assert_allclose(reference_forward(cfg, w, tokens[:4]), logits[:4], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rms_norm(hidden[-1], w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T,
                               logits, rtol=1e-12, atol=1e-12)


def test_position_shift_invariance(tmp_path, rng):
    """Rope is the only position signal, so shifting all positions by a constant leaves the logits unchanged."""
    cfg, w, _ = _weights(tmp_path, rng)
    tokens = rng.integers(0, cfg.vocab_size, size=6)
    base = reference_forward(cfg, w, tokens)
    shifted = reference_forward(cfg, w, tokens, positions=np.arange(6) + 37)
    np.testing.assert_allclose(shifted, base, rtol=1e-9, atol=1e-9)
    spread = reference_forward(cfg, w, tokens, positions=np.arange(6) * 3)
    assert np.abs(spread[1:] - base[1:]).max() > 1e-6


def test_quantized_checkpoints_feed_reference(tmp_path, rng):
    for fmt in ("fp8", "int4"):
        cfg, eff, ck = _weights(tmp_path / fmt, rng, fmt=fmt)
        w = reference_weights(ck)
        assert set(w) == set(eff)
        for name in eff:
            np.testing.assert_array_equal(w[name], eff[name], err_msg=name)
        tokens = rng.integers(0, cfg.vocab_size, size=4)
        assert np.isfinite(reference_forward(cfg, w, tokens)).all()


# ---- routing ---------------------------------------------------------------------------------------------------
def _route_brute(cfg, x, gate, bias):
    """Per token, straight from the definition: keep the topk_group groups by sum of top-2 biased scores,
    then the k best biased scores among kept experts (others count as 0.0, as HF's masked_fill)."""
    n_exp = gate.shape[0]
    per = n_exp // cfg.n_group
    ids, ws = [], []
    for row in x:
        s = np.array([1 / (1 + math.exp(-float(row @ g))) for g in gate])
        b = s + bias
        gscore = [sorted(b[g * per:(g + 1) * per])[-2:] for g in range(cfg.n_group)]
        gscore = [sum(v) for v in gscore]
        kept = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[: cfg.topk_group]
        masked = [b[e] if e // per in kept else 0.0 for e in range(n_exp)]
        top = sorted(range(n_exp), key=lambda e: -masked[e])[: cfg.num_experts_per_tok]
        wt = s[top] / s[top].sum() * cfg.routed_scaling_factor
        ids.append(top)
        ws.append(wt)
    return np.array(ids), np.array(ws)


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1), (2, 1)])
def test_routing_matches_definition(rng, n_group, topk_group):
    cfg = tiny(n_group=n_group, topk_group=topk_group)
    x = rng.standard_normal((12, cfg.hidden_size))
    gate = rng.standard_normal((cfg.n_routed_experts, cfg.hidden_size)) / 8
    bias = rng.uniform(-0.2, 0.5, size=cfg.n_routed_experts)
    idx, wts = route(cfg, x, gate, bias)
    want_idx, want_w = _route_brute(cfg, x, gate, bias)
    order, want_order = np.argsort(idx, axis=1), np.argsort(want_idx, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(idx, order, 1), np.take_along_axis(want_idx, want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(wts, order, 1), np.take_along_axis(want_w, want_order, 1),
                               rtol=1e-12)
    np.testing.assert_allclose(wts.sum(axis=1), cfg.routed_scaling_factor, rtol=1e-12)
    per = cfg.n_routed_experts // n_group
    chosen_biased = np.take_along_axis(1 / (1 + np.exp(-(x @ gate.T))) + bias, idx, 1)
    positive = (chosen_biased > 0).all(axis=1)  # else HF's 0.0 fill may pull in an expert from a dropped group
    assert positive.mean() > 0.5
    assert all(len(set(row // per)) <= topk_group for row in idx[positive])


def test_dropped_groups_fill_zero_like_hf():
    """HF masks experts of dropped groups with 0.0 (not -inf): a dropped expert beats a kept negative score."""
    cfg = tiny(n_group=4, topk_group=2, num_experts_per_tok=2, routed_scaling_factor=1.0)
    e = cfg.n_routed_experts  # 8 experts, groups {0,1} {2,3} {4,5} {6,7}
    target = np.array([0.9, 0.8, 0.7, 0.05, 0.1, 0.1, 0.1, 0.1])  # sigmoid scores we want
    bias = np.array([0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0])  # expert 3 biased score = -0.45
    gate = np.zeros((e, cfg.hidden_size))
    gate[:, 0] = np.log(target / (1 - target))  # x = e_0 -> logits = logit(target)
    x = np.zeros((1, cfg.hidden_size))
    x[0, 0] = 1.0
    idx, _ = route(cfg, x, gate, bias)
    # group sums: {0,1} 1.7, {2,3} 0.25, others 0.2 -> keep groups 0 and 1; experts 0 and 1 win outright
    np.testing.assert_array_equal(np.sort(idx[0]), [0, 1])
    cfg1 = dataclasses.replace(cfg, num_experts_per_tok=4, topk_group=2)
    idx4, _ = route(cfg1, x, gate, bias)
    # kept {0,1,2,3}: biased 0.9, 0.8, 0.7, -0.45; the 4th pick is a dropped expert at 0.0 (lowest id: 4)
    np.testing.assert_array_equal(np.sort(idx4[0]), [0, 1, 2, 4])


def test_bias_selects_but_does_not_weight(rng):
    cfg = tiny(n_group=1, topk_group=1)
    x = rng.standard_normal((5, cfg.hidden_size))
    gate = rng.standard_normal((cfg.n_routed_experts, cfg.hidden_size)) / 8
    bias = np.zeros(cfg.n_routed_experts)
    bias[3] = 10.0  # forces expert 3 in, but its weight must still come from its unbiased sigmoid score
    idx, wts = route(cfg, x, gate, bias)
    assert (idx == 3).any(axis=1).all()
    s = 1 / (1 + np.exp(-(x @ gate.T)))
    np.testing.assert_allclose(wts, np.take_along_axis(s, idx, 1) / np.take_along_axis(s, idx, 1).sum(1, keepdims=True)
                               * cfg.routed_scaling_factor, rtol=1e-12)
    idx0, _ = route(cfg, x, gate, np.zeros(cfg.n_routed_experts))
    np.testing.assert_array_equal(np.sort(idx0, 1), np.sort(np.argsort(-s, 1)[:, : cfg.num_experts_per_tok], 1))


def test_moe_equals_dense_combination(tmp_path, rng):
    """Sparse per-token expert loop == all experts computed densely, combined with a [T, E] gate matrix."""
    cfg, w, _ = _weights(tmp_path, rng)
    p = "layers.1.mlp."
    x = rng.standard_normal((6, cfg.hidden_size))
    idx, wts = route(cfg, x, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"])
    combine = np.zeros((6, cfg.n_routed_experts))
    np.put_along_axis(combine, idx, wts, axis=1)
    outs = []
    for e in range(cfg.n_routed_experts):
        q = f"{p}experts.{e}."
        hid = x @ w[q + "gate_proj.weight"].T
        outs.append((hid / (1 + np.exp(-hid)) * (x @ w[q + "up_proj.weight"].T)) @ w[q + "down_proj.weight"].T)
    sp = p + "shared_experts."
    hid = x @ w[sp + "gate_proj.weight"].T
    shared = (hid / (1 + np.exp(-hid)) * (x @ w[sp + "up_proj.weight"].T)) @ w[sp + "down_proj.weight"].T
    want = np.einsum("te,etd->td", combine, np.stack(outs)) + shared
    np.testing.assert_allclose(moe(cfg, w, p, x), want, rtol=1e-12, atol=1e-12)


# ---- MLA -------------------------------------------------------------------------------------------------------
def test_plain_mla_equals_absorbed(tmp_path, rng):
    """doc §3.6: attention over the 576-wide latent (W_UK folded into q, W_UV after) equals the plain form."""
    cfg, w, _ = _weights(tmp_path, rng)
    p = "layers.0.self_attn."
    t = 7
    h, dn, dr, dv, r = 4, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    x = rng.standard_normal((t, cfg.hidden_size))
    pos = np.arange(t) + 5
    plain = mla_attention(cfg, w, p, x, pos)
    cq = rms_norm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (cq @ w[p + "q_b_proj.weight"].T).reshape(t, h, dn + dr)
    kva = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    c_kv = rms_norm(kva[:, :r], w[p + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
    latent = np.concatenate([c_kv, apply_rope(kva[:, r:], pos, cfg)], axis=-1)  # [T, R+Dr]
    wkv_b = w[p + "kv_b_proj.weight"].reshape(h, dn + dv, r)
    w_uk, w_uv = wkv_b[:, :dn], wkv_b[:, dn:]  # [H, Dn, R], [H, Dv, R]
    q_lat = np.concatenate([np.einsum("thd,hdr->thr", q[..., :dn], w_uk), apply_rope(q[..., dn:], pos, cfg)], -1)
    s = np.einsum("tha,ua->htu", q_lat, latent) * cfg.softmax_scale
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o_lat = np.einsum("htu,ur->thr", prob, c_kv)
    o = np.einsum("thr,hvr->thv", o_lat, w_uv).reshape(t, h * dv)
    np.testing.assert_allclose(plain, o @ w[p + "o_proj.weight"].T, rtol=1e-10, atol=1e-12)


def test_bad_tokens_rejected(tmp_path, rng):
    cfg, w, _ = _weights(tmp_path, rng)
    with pytest.raises(ValueError, match="tokens must lie"):
        reference_forward(cfg, w, np.array([0, cfg.vocab_size]))
