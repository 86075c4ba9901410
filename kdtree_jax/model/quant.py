"""FP8-block and INT4 pack-quantized weight formats: the exact HF decoding, shared by loader, model and writer.

INT4 (compressed-tensors "pack-quantized", K2-Thinking / K2.5 / K2.6): `weight_packed` int32 [out, in/8] holds
8 offset-binary nibbles per word along the input dim (nibble k of word j = column 8j+k, bits [4k, 4k+4));
`weight_scale` bf16 [out, in/group]; W = (nibble - 8) * scale. Its math lives in `pallas_kernels.int4_layout`
(the kernels read the same layout and import nothing from kdtree_jax) and is imported from there.
FP8 (K2, DeepSeek-V3): float8_e4m3fn [out, in] with `weight_scale_inv` f32 [ceil(out/bo), ceil(in/bi)] that
*multiplies* each (bo, bi) tile (ragged edges cropped).
"""
from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

from pallas_kernels.int4_layout import (
    INT4_OFFSET,
    INT4_QMAX,
    NIBBLES_PER_WORD,
    dequant_int4,
    dequant_int4_jnp,
    quant_int4,
)

__all__ = ["FP8_MAX", "INT4_OFFSET", "INT4_QMAX", "NIBBLES_PER_WORD", "Int4Packed", "dequant_fp8_block",
           "dequant_int4", "dequant_int4_jnp", "fp8_scale_shape", "quant_fp8_block", "quant_int4", "stack_int4"]

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
