"""FP8-block and INT4 pack-quantized weight formats: the exact HF decoding, shared by loader, model and writer.

INT4 (compressed-tensors "pack-quantized", K2-Thinking / K2.5 / K2.6): `weight_packed` int32 [out, in/8] holds
8 offset-binary nibbles per word along the input dim (nibble k of word j = column 8j+k, bits [4k, 4k+4));
`weight_scale` bf16 [out, in/group]; W = (nibble - 8) * scale. FP8 (K2, DeepSeek-V3): float8_e4m3fn [out, in]
with `weight_scale_inv` f32 [ceil(out/bo), ceil(in/bi)] that *multiplies* each (bo, bi) tile (ragged edges cropped).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

NIBBLES_PER_WORD = 8  # 32-bit word / 4-bit values
INT4_OFFSET = 8  # offset binary: stored nibble = q + 8, q in [-8, 7]
INT4_QMAX = 7  # symmetric quantizer: s = absmax / 7 (level -8 unused by the writer)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@dataclasses.dataclass(frozen=True)
class Int4Packed:
    """One INT4 pack-quantized Linear weight, kept packed (the model dequantizes inside its expert matmul).

    `packed` int32 [..., out, in/8], `scale` bfloat16 [..., out, in/group]; `shape` = (out, in) of one matrix
    (leading dims, e.g. stacked experts, are allowed on the arrays). A JAX pytree: arrays are leaves.
    """

    packed: np.ndarray
    scale: np.ndarray
    shape: tuple[int, int]
    group_size: int

    def __post_init__(self):
        out, n_in = self.shape
        if n_in % NIBBLES_PER_WORD or n_in % self.group_size:
            raise ValueError(f"Int4Packed: in_features {n_in} must be a multiple of 8 and of group_size "
                             f"{self.group_size}")
        want_p, want_s = (out, n_in // NIBBLES_PER_WORD), (out, n_in // self.group_size)
        if tuple(self.packed.shape[-2:]) != want_p or tuple(self.scale.shape[-2:]) != want_s:
            raise ValueError(f"Int4Packed: shape {self.shape} with group {self.group_size} needs packed [..., "
                             f"{want_p[0]}, {want_p[1]}] and scale [..., {want_s[0]}, {want_s[1]}], got "
                             f"{tuple(self.packed.shape)} and {tuple(self.scale.shape)}")

    def dequant(self) -> np.ndarray:
        """float32 [..., out, in]."""
        return dequant_int4(np.asarray(self.packed), np.asarray(self.scale), self.group_size)


jax.tree_util.register_dataclass(Int4Packed, data_fields=["packed", "scale"], meta_fields=["shape", "group_size"])


def stack_int4(weights: list[Int4Packed]) -> Int4Packed:
    """Stack same-shaped packed weights (e.g. one layer's routed experts) into [E, out, in/8] / [E, out, in/group]."""
    if not weights:
        raise ValueError("stack_int4: no weights given")
    first = weights[0]
    for i, w in enumerate(weights):
        if (w.shape, w.group_size) != (first.shape, first.group_size):
            raise ValueError(f"stack_int4: weight {i} has shape {w.shape} group {w.group_size}, weight 0 has "
                             f"{first.shape} group {first.group_size}")
    return Int4Packed(np.stack([np.asarray(w.packed) for w in weights]),
                      np.stack([np.asarray(w.scale) for w in weights]), first.shape, first.group_size)


# ---- INT4 ----------------------------------------------------------------------------------------------------
def _check_int4(packed_shape, scale_shape, group_size: int) -> int:
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


# ---- FP8 block -----------------------------------------------------------------------------------------------
def fp8_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out/bo), ceil(in/bi)]."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequant_fp8_block(w8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """w8 float8_e4m3fn [out, in], scale_inv f32 [ceil(out/bo), ceil(in/bi)] -> f32 W[i,j] = W8[i,j] S[i//bo, j//bi]."""
    if w8.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D [out, in], got shape {tuple(w8.shape)}")
    bo, bi = block
    want = fp8_scale_shape(w8.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"FP8 weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(w8.shape)} with block {tuple(block)} (want {want})")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)
    return np.asarray(w8).astype(np.float32) * s[: w8.shape[0], : w8.shape[1]]


def quant_fp8_block(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (float8_e4m3fn [out, in], scale_inv f32 [ceil(out/bo), ceil(in/bi)]), tile absmax -> 448."""
    w = np.asarray(w, dtype=np.float64)
    bo, bi = block
    ro, ri = fp8_scale_shape(w.shape, block)
    pad = np.zeros((ro * bo, ri * bi))
    pad[: w.shape[0], : w.shape[1]] = np.abs(w)
    amax = pad.reshape(ro, bo, ri, bi).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)  # [ro, ri]
    s = np.repeat(np.repeat(scale.astype(np.float64), bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
    w8 = np.clip(w / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return w8, scale
