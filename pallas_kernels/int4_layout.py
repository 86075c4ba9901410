"""The INT4 pack-quantized weight layout, the one place its math lives: the kernels read it, the loader, model
and synthetic writer (`kdtree_jax.model.quant`) import it from here.

compressed-tensors "pack-quantized" (Kimi K2-Thinking / K2.5 / K2.6 routed experts; the checkpoints'
`quantization_config`): `weight_packed` int32 [out, in/8] holds 8 offset-binary nibbles per word along the input
dim (nibble k of word j = column 8j+k, bits [4k, 4k+4)); `weight_scale` bf16 [out, in/group];
W = (nibble - 8) * scale. The writer's quantizer is symmetric: s = absmax(group) / 7, level -8 unused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

NIBBLES_PER_WORD = 8  # 32-bit word / 4-bit values
INT4_OFFSET = 8  # offset binary: stored nibble = q + 8, q in [-8, 7]
INT4_QMAX = 7  # symmetric quantizer: s = absmax / 7 (level -8 unused by the writer)


def _check_int4(packed_shape, scale_shape, group_size: int) -> int:
    """The input width of packed [..., out, in/8] words with scales [..., out, in/group]; ValueError on a mismatch."""
    if group_size <= 0 or group_size % NIBBLES_PER_WORD:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size}")
    n_in = packed_shape[-1] * NIBBLES_PER_WORD
    if tuple(scale_shape[:-1]) != tuple(packed_shape[:-1]) or scale_shape[-1] * group_size != n_in:
        raise ValueError(f"INT4 scale shape {tuple(scale_shape)} does not match packed shape {tuple(packed_shape)} "
                         f"with group_size {group_size} (want [..., {n_in // group_size}])")
    return n_in


def dequant_int4(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """packed int32 [..., out, in/8], scale bf16 [..., out, in/group] -> float32 [..., out, in] (exact)."""
    n_in = _check_int4(packed.shape, scale.shape, group_size)
    words = np.ascontiguousarray(packed).view(np.uint32)  # [..., out, in/8]
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    nib = (words[..., None] >> shifts) & 0xF  # [..., out, in/8, 8]
    q = nib.reshape(*packed.shape[:-1], n_in).astype(np.float32) - INT4_OFFSET
    s = np.repeat(np.asarray(scale).astype(np.float32), group_size, axis=-1)  # [..., out, in]
    return q * s


def quant_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """w [..., out, in] -> (packed int32 [..., out, in/8], scale bf16 [..., out, in/group]); s = absmax/7 in bf16."""
    w = np.asarray(w, dtype=np.float64)
    n_in = w.shape[-1]
    if n_in % group_size or group_size % NIBBLES_PER_WORD:
        raise ValueError(f"in_features {n_in} must be a multiple of group_size {group_size} (itself a multiple of 8)")
    g = w.reshape(*w.shape[:-1], n_in // group_size, group_size)
    scale = (np.abs(g).max(axis=-1) / INT4_QMAX).astype(ml_dtypes.bfloat16)  # [..., out, in/group]
    s = scale.astype(np.float64)[..., None]
    q = np.clip(np.round(np.divide(g, s, out=np.zeros_like(g), where=s > 0)), -INT4_OFFSET, INT4_QMAX)
    nib = (q + INT4_OFFSET).astype(np.uint32).reshape(*w.shape[:-1], n_in // NIBBLES_PER_WORD, NIBBLES_PER_WORD)
    shifts = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4
    words = np.bitwise_or.reduce(nib << shifts, axis=-1).astype(np.uint32)
    return words.view(np.int32), scale


def dequant_int4_jnp(packed: jax.Array, scale: jax.Array, group_size: int, dtype=jnp.bfloat16) -> jax.Array:
    """jit-friendly INT4 dequant: packed int32 [..., out, in/8], scale [..., out, in/group] -> dtype [..., out, in].

    The product is formed in f32 (exact: 4-bit int x bf16) and cast once, so f32 output matches `dequant_int4`.
    """
    n_in = _check_int4(packed.shape, scale.shape, group_size)
    shifts = jnp.arange(NIBBLES_PER_WORD, dtype=jnp.int32) * 4
    nib = jnp.right_shift(packed[..., None], shifts) & 0xF  # arithmetic shift; the mask drops sign fill
    q = nib.reshape(*packed.shape[:-1], n_in).astype(jnp.float32) - INT4_OFFSET
    g = q.reshape(*packed.shape[:-1], n_in // group_size, group_size) * scale.astype(jnp.float32)[..., None]
    return g.reshape(*packed.shape[:-1], n_in).astype(dtype)
