"""Small numeric building blocks of the DeepSeek-V3 / Kimi K2 target: RMSNorm, YaRN RoPE, SwiGLU.

RoPE layout: we rotate DeepSeek's interleaved pairs **in place** — pair (x[2i], x[2i+1]) is rotated by frequency i
and stays at positions (2i, 2i+1). HF instead emits [rotated evens | rotated odds]; both q_pe and the cached k_pe use
our layout, and q·k is invariant under the same permutation of both, so attention is exact either way. Anything
that reads k_pe from `LatentCache` must assume this in-place interleaved layout.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.model.config import ModelConfig

NORM_INIT_NOISE = 0.2  # random norm weights 1 + 0.2·N(0,1): a skipped or misplaced norm changes the output


def init_normal(rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    """N(0, 1/fan_in) weights (activations keep unit scale through the stack)."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)


def init_norm_weight(rngs, n: int, dtype) -> jax.Array:
    return (1.0 + NORM_INIT_NOISE * jax.random.normal(rngs.params(), (n,), jnp.float32)).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF DeepseekV3RMSNorm: normalise in fp32, cast back to x's dtype, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def yarn_correction_range(cfg: ModelConfig) -> tuple[int, int]:
    """(low, high) rotary-dim bounds of the YaRN ramp (DeepSeek `yarn_find_correction_range`)."""
    rs, dim, base = cfg.rope_scaling, cfg.qk_rope_head_dim, cfg.rope_theta

    def corr(n_rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(rs.beta_fast)), 0), min(math.ceil(corr(rs.beta_slow)), dim - 1)


def yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[Dr/2] float32 inverse frequencies; with factor 1 this is plain RoPE (inter == extra)."""
    dim, base, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling.factor
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    powers = np.power(np.float32(base), exponents, dtype=np.float32)
    inv_extra = (np.float32(1.0) / powers).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * powers)).astype(np.float32)
    low, high = yarn_correction_range(cfg)
    high_f = high + 0.001 if low == high else float(high)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high_f - low), 0, 1)
    extra_mask = (1.0 - ramp).astype(np.float32)
    return (inv_inter * (1 - extra_mask) + inv_extra * extra_mask).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, amplitude: float) -> tuple[jax.Array, jax.Array]:
    """Per-token cos/sin tables: positions [Bt, T] int -> two [Bt, T, Dr/2] float32 arrays (times the amplitude)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [Bt, T, Dr/2]
    return jnp.cos(angles) * amplitude, jnp.sin(angles) * amplitude


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs of x [Bt, T, ..., Dr] in place by cos/sin [Bt, T, Dr/2]; computed in fp32."""
    extra = x.ndim - cos.ndim  # head axes between T and Dr
    shape = cos.shape[:2] + (1,) * extra + cos.shape[2:]
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(x·Wg) ⊙ x·Wu) with w_gate_up [in, 2, I] = (Wg, Wu) stacked on axis 1 (one matmul) and w_down
    [I, out]; weights are cast to x's dtype."""
    dt = x.dtype
    gu = jnp.einsum("...d,dgi->...gi", x, w_gate_up.astype(dt))  # [..., 2, I]
    return (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]) @ w_down.astype(dt)
