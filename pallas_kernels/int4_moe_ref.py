"""float64 numpy references for `int4_moe`: dequantize with `int4_layout.dequant_int4` (the exact HF decoding)
and loop over (token, expert) pairs — deliberately nothing like the kernel's sorted, block-padded layout."""
from __future__ import annotations

import numpy as np

from pallas_kernels.int4_layout import NIBBLES_PER_WORD, dequant_int4


def _dequant64(packed, scale) -> np.ndarray:
    """[E, N, K/8] i32 + [E, N, K/G] -> float64 [E, N, K]."""
    packed = np.asarray(packed)
    group = packed.shape[-1] * NIBBLES_PER_WORD // np.asarray(scale).shape[-1]
    return dequant_int4(packed, np.asarray(scale), group).astype(np.float64)


def int4_expert_matmul_ref(x, packed, scale, expert_ids) -> np.ndarray:
    """y[p] = x[p] @ W[expert_ids[p]]^T in float64: x [P, K] -> [P, N]."""
    w = _dequant64(packed, scale)
    x = np.asarray(x, np.float64)
    return np.stack([w[int(e)] @ x[p] for p, e in enumerate(np.asarray(expert_ids))])


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def int4_moe_ffn_ref(x, idx, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale
                     ) -> np.ndarray:
    """sum_k weights[m, k] * down(silu(gate(x_m)) * up(x_m)) of expert idx[m, k], float64: x [M, D] -> [M, D].

    Experts are dequantized one at a time (only the touched ones), so K2.6-sized layers fit in host memory.
    """
    x = np.asarray(x, np.float64)
    idx, weights = np.asarray(idx), np.asarray(weights, np.float64)
    y = np.zeros_like(x)
    for e in np.unique(idx):
        wg, wu, wd = (_dequant64(np.asarray(p[e])[None], np.asarray(s[e])[None])[0]
                      for p, s in ((gate_packed, gate_scale), (up_packed, up_scale), (down_packed, down_scale)))
        for m, j in zip(*np.nonzero(idx == e)):
            h = _silu(wg @ x[m]) * (wu @ x[m])
            y[m] += weights[m, j] * (wd @ h)
    return y
