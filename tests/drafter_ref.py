"""Float64 numpy DFlash drafter, written from the z-lab `DFlashDraftModel` math, independently of kdtree_jax.model.drafter.

It recomputes everything from scratch per request (no cache): context row j sits at position j, the block at
positions n .. n+L-1, so a cached drafter must match it after any sequence of calls. Weights come as z-lab HF
tensors ([out, in]).
"""
from __future__ import annotations

import math

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w


def inv_freq(head_dim: int, theta: float, yarn: dict | None) -> np.ndarray:
    """HF rotary frequencies; with YaRN, blend interpolated/extrapolated frequencies over a linear ramp."""
    half = head_dim // 2
    base = np.array([theta ** (-2.0 * i / head_dim) for i in range(half)])
    if yarn is None:
        return base
    factor, orig = yarn["factor"], yarn["original_max_position_embeddings"]

    def dim_for(rotations):  # dimension index whose wavelength fits `rotations` turns in the original context
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(dim_for(yarn["beta_fast"])), 0)
    hi = min(math.ceil(dim_for(yarn["beta_slow"])), head_dim - 1)
    if hi == lo:
        hi = hi + 0.001
    out = np.empty(half)
    for i in range(half):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep original freq, 1: divide by factor
        out[i] = base[i] * (1.0 - ramp) + base[i] / factor * ramp
    return out


def amplitude(yarn: dict | None, mode: str) -> float:
    if yarn is None:
        return 1.0
    f = yarn["factor"]

    def m(scale):
        return 1.0 if f <= 1 else 0.1 * scale * math.log(f) + 1.0

    if mode == "legacy":
        return m(1.0)
    if yarn.get("mscale") and yarn.get("mscale_all_dim"):
        return m(yarn["mscale"]) / m(yarn["mscale_all_dim"])
    return m(1.0)


def rotate(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, amp: float) -> np.ndarray:
    """x [T, heads, Dh]; dims i and i + Dh/2 form one rotating pair (NeoX / rotate_half)."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for i in range(half):
            c, s = math.cos(pos[t] * freqs[i]) * amp, math.sin(pos[t] * freqs[i]) * amp
            a, b = x[t, :, i], x[t, :, i + half]
            out[t, :, i] = a * c - b * s
            out[t, :, i + half] = b * c + a * s
    return out


def ref_draft(cfg: dict, w: dict[str, np.ndarray], feats: np.ndarray, bonus: int, embed: np.ndarray,
              lm_head: np.ndarray, *, amp_mode: str = "hf") -> np.ndarray:
    """cfg: plain dict of the config values; feats [n, F] every context row so far -> logits [L-1, V] float64."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps, L = cfg["rms_norm_eps"], cfg["block_size"]
    hq, hk, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = feats.shape[0]
    freqs = inv_freq(dh, cfg["rope_theta"], cfg["rope_scaling"])
    amp = amplitude(cfg["rope_scaling"], amp_mode)
    ctx = rms_norm(np.asarray(feats, np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [n, H]
    x = np.asarray(embed, np.float64)[[bonus] + [cfg["mask_token_id"]] * (L - 1)]  # [L, H]
    q_pos = np.arange(n, n + L)
    k_pos = np.arange(n + L)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rms_norm((h @ w[p + "self_attn.q_proj.weight"].T).reshape(L, hq, dh), w[p + "self_attn.q_norm.weight"], eps)
        q = rotate(q, q_pos, freqs, amp)
        src = np.concatenate([ctx, h])  # context rows never pass through input_layernorm
        k = (src @ w[p + "self_attn.k_proj.weight"].T).reshape(n + L, hk, dh)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        k = rotate(k, k_pos, freqs, amp)
        v = (src @ w[p + "self_attn.v_proj.weight"].T).reshape(n + L, hk, dh)
        window = cfg["sliding_window"] if cfg["layer_types"][i] == "sliding_attention" else None
        causal = cfg["causal"][i]
        allowed = np.ones((L, n + L), bool)
        for r in range(L):
            for j in range(n + L):
                if window is not None and not (q_pos[r] - window < k_pos[j] < q_pos[r] + window):
                    allowed[r, j] = False
                if causal and k_pos[j] > q_pos[r]:
                    allowed[r, j] = False
        o = np.empty((L, hq, dh))
        for head in range(hq):
            kv = head // (hq // hk)
            s = q[:, head] @ k[:, kv].T / math.sqrt(dh)
            s = np.where(allowed, s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            o[:, head] = (e / e.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + o.reshape(L, hq * dh) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(x, w["norm.weight"], eps)[1:]
    return h @ np.asarray(lm_head, np.float64)
