"""Golden float64 numpy forward of the DeepSeek-V3 / Kimi K2 text model (HF `modeling_deepseek.py` semantics).

Written from the math of HF's reference code (`modeling_deepseek.py`, shipped with the Kimi K2 checkpoints),
deliberately sharing no code with the JAX model: plain MLA with causal attention, YaRN rope applied the way HF
does it (de-interleave permutation + NeoX rotate_half), noaux_tc sigmoid routing. Slow and simple; meant for
tiny configs in tests.
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_jax.checkpoint.hf import HFCheckpoint, expected_shapes
from kdtree_jax.model.config import ModelConfig

GROUP_TOP = 2  # noaux_tc group score = sum of the top-2 biased scores in the group
NORM_EPS = 1e-20  # HF's denominator guard in norm_topk_prob


def reference_weights(ckpt: HFCheckpoint) -> dict[str, np.ndarray]:
    """Every tensor the forward needs, dequantized to float64 (FP8 blocks and INT4 groups decoded)."""
    return {name: ckpt.get_float(name, np.float64) for name in expected_shapes(ckpt.config)}


# ---- numerics ------------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(cfg: ModelConfig) -> tuple[int, int]:
    """(low, high) ramp bounds: corr(beta) = dim ln(orig / (2 pi beta)) / (2 ln theta), floor / ceil, clamped."""
    rs, dim = cfg.rope_scaling, cfg.qk_rope_head_dim

    def corr(beta: float) -> float:
        rotations = rs.original_max_position_embeddings / (beta * 2 * math.pi)
        return dim * math.log(rotations) / (2 * math.log(cfg.rope_theta))

    return max(math.floor(corr(rs.beta_fast)), 0), min(math.ceil(corr(rs.beta_slow)), dim - 1)


def yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[Dr/2] DeepSeek YaRN inverse frequencies (plain RoPE when factor == 1)."""
    rs, dim = cfg.rope_scaling, cfg.qk_rope_head_dim
    extra = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inter = extra / rs.factor
    low, high = yarn_correction_range(cfg)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 = keep the extrapolated (original) frequency
    return inter * (1.0 - keep) + extra * keep


def softmax_scale(cfg: ModelConfig) -> float:
    """(Dn + Dr)^-0.5 * m^2, m = 0.1 mscale_all_dim ln(factor) + 1."""
    rs = cfg.rope_scaling
    m = _mscale(rs.factor, rs.mscale_all_dim) if rs.mscale_all_dim else 1.0
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * m * m


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """x [T, ..., Dr] -> rotated, in HF's output layout [rotated evens | rotated odds].

    HF reshapes Dr to [Dr/2, 2], transposes and flattens (de-interleave), then applies NeoX rotate_half with
    cat(freqs, freqs): pair (x[2i], x[2i+1]) turns by frequency i.
    """
    rs = cfg.rope_scaling
    amp = _mscale(rs.factor, rs.mscale) / _mscale(rs.factor, rs.mscale_all_dim)
    freqs = np.outer(positions.astype(np.float64), yarn_inv_freq(cfg))  # [T, Dr/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, Dr]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
    cos, sin = (np.cos(emb) * amp).reshape(shape), (np.sin(emb) * amp).reshape(shape)
    dr = x.shape[-1]
    x = x.reshape(*x.shape[:-1], dr // 2, 2).swapaxes(-1, -2).reshape(x.shape)  # de-interleave
    return x * cos + _rotate_half(x) * sin


# ---- blocks --------------------------------------------------------------------------------------------------
def mla_attention(cfg: ModelConfig, w: dict[str, np.ndarray], p: str, x: np.ndarray,
                  positions: np.ndarray) -> np.ndarray:
    """Plain (non-absorbed) MLA over x [T, d] with a causal mask; returns [T, d]."""
    t = x.shape[0]
    h, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    if cfg.q_lora_rank is None:
        q = x @ w[p + "q_proj.weight"].T
    else:
        cq = rms_norm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = cq @ w[p + "q_b_proj.weight"].T
    q = q.reshape(t, h, dn + dr)  # [T, H, Dn+Dr]
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kva = x @ w[p + "kv_a_proj_with_mqa.weight"].T  # [T, R+Dr]
    c_kv = rms_norm(kva[:, :r], w[p + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = kva[:, r:]  # [T, Dr], one rope key shared by every head
    kv = (c_kv @ w[p + "kv_b_proj.weight"].T).reshape(t, h, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    q_pe = apply_rope(q_pe, positions, cfg)
    k_pe = apply_rope(k_pe, positions, cfg)
    scores = (np.einsum("thd,uhd->htu", q_nope, k_nope) + np.einsum("thd,ud->htu", q_pe, k_pe)) * softmax_scale(cfg)
    causal = np.tril(np.ones((t, t), dtype=bool))
    scores = np.where(causal, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)  # [H, T, T]
    out = np.einsum("htu,uhd->thd", probs, v).reshape(t, h * dv)
    return out @ w[p + "o_proj.weight"].T


def route(cfg: ModelConfig, x: np.ndarray, gate: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """x [T, d] -> (expert ids [T, k], weights [T, k]) with HF DeepseekV3 `noaux_tc` semantics.

    The correction bias only chooses experts; weights come from the unbiased scores, normalised (norm_topk_prob)
    then scaled by routed_scaling_factor. Experts outside the kept groups are masked to 0.0 (as HF's masked_fill),
    not -inf. Ties break toward the lower expert id; order within the k is by descending selection score.
    """
    logits = x @ gate.T  # [T, E]
    if cfg.scoring_func == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = e / e.sum(axis=-1, keepdims=True)
    choice = scores + bias if (cfg.topk_method == "noaux_tc" and bias is not None) else scores.copy()
    t, n_exp = scores.shape
    if cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1:
        grouped = choice.reshape(t, cfg.n_group, n_exp // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_score = -np.sort(-grouped, axis=-1)[..., :GROUP_TOP].sum(axis=-1)  # [T, G]
        else:
            group_score = grouped.max(axis=-1)
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, : cfg.topk_group]
        mask = np.zeros((t, cfg.n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, n_exp // cfg.n_group, axis=-1), choice, 0.0)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]  # [T, k]
    weights = np.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + NORM_EPS)
    return idx, weights * cfg.routed_scaling_factor


def moe(cfg: ModelConfig, w: dict[str, np.ndarray], p: str, x: np.ndarray) -> np.ndarray:
    idx, weights = route(cfg, x, w[p + "gate.weight"], w.get(p + "gate.e_score_correction_bias"))
    out = np.zeros_like(x)
    for tok in range(x.shape[0]):
        for e, g in zip(idx[tok], weights[tok]):
            ep = f"{p}experts.{e}."
            out[tok] += g * swiglu(x[tok], w[ep + "gate_proj.weight"], w[ep + "up_proj.weight"],
                                   w[ep + "down_proj.weight"])
    if cfg.n_shared_experts:
        sp = p + "shared_experts."
        out += swiglu(x, w[sp + "gate_proj.weight"], w[sp + "up_proj.weight"], w[sp + "down_proj.weight"])
    return out


def decoder_layer(cfg: ModelConfig, w: dict[str, np.ndarray], layer: int, x: np.ndarray,
                  positions: np.ndarray) -> np.ndarray:
    p = f"layers.{layer}."
    eps = cfg.rms_norm_eps
    h = x + mla_attention(cfg, w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"], eps), positions)
    y = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    m = p + "mlp."
    ffn = moe(cfg, w, m, y) if cfg.is_moe_layer(layer) else swiglu(
        y, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
    return h + ffn


def reference_forward(cfg: ModelConfig, weights: dict[str, np.ndarray], tokens, *, positions=None,
                      return_hidden: bool = False):
    """tokens [T] -> logits [T, V] float64 (causal over the T tokens; positions default 0..T-1).

    With `return_hidden`, also returns [L, T, d]: decoder layer l's output (HF `hidden_states[l+1]` before the
    final norm).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D [T], got shape {tokens.shape}")
    if tokens.size and not (0 <= tokens.min() and tokens.max() < cfg.vocab_size):
        raise ValueError(f"tokens must lie in [0, {cfg.vocab_size}), got range [{tokens.min()}, {tokens.max()}]")
    positions = np.arange(tokens.size) if positions is None else np.asarray(positions)
    if positions.shape != tokens.shape:
        raise ValueError(f"positions shape {positions.shape} must equal tokens shape {tokens.shape}")
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    x = w["embed_tokens.weight"][tokens]  # [T, d]
    hidden = []
    for layer in range(cfg.num_hidden_layers):
        x = decoder_layer(cfg, w, layer, x, positions)
        hidden.append(x)
    logits = rms_norm(x, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
    if return_hidden:
        return logits, np.stack(hidden)
    return logits
