"""float64 numpy reference for `verify_attn`: absorbed-MLA attention of N tree rows over a latent prefix + the tree.

Written as the plain definition (one softmax over the visible keys of each row), with no blocking, so it shares
no structure with the kernel's online softmax.
"""
from __future__ import annotations

import numpy as np


def verify_attn_ref(q, cache, prefix_len, tree_kv, tree_mask, *, scale: float, kv_lora_rank: int) -> np.ndarray:
    """q [Bt, N, H, A], cache [Bt, S, A], prefix_len [Bt], tree_kv [Bt, N, A], tree_mask [Bt, N, N] -> [Bt, N, H, R].

    Row i of request b sees cache rows [0, prefix_len[b]) and tree rows j with tree_mask[b, i, j]; scores use all A
    dims, values are the first R = kv_lora_rank dims of each key. A row that sees nothing outputs 0.
    """
    q, cache, tree_kv = (np.asarray(x, np.float64) for x in (q, cache, tree_kv))
    prefix_len, tree_mask = np.asarray(prefix_len), np.asarray(tree_mask, bool)
    bt, n, h, _ = q.shape
    out = np.zeros((bt, n, h, kv_lora_rank))
    for b in range(bt):
        p = int(prefix_len[b])
        keys = np.concatenate([cache[b, :p], tree_kv[b]], axis=0)  # [P + N, A]
        visible = np.concatenate([np.ones((n, p), bool), tree_mask[b]], axis=1)  # [N, P + N]
        s = (q[b] @ keys.T) * scale  # [N, H, P + N] (BLAS matmul: the GPU tests run this at K2 sizes)
        s = np.where(visible[:, None, :], s, -np.inf)
        row_max = s.max(axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        e = np.where(visible[:, None, :], np.exp(s - row_max), 0.0)
        denom = e.sum(axis=-1, keepdims=True)
        probs = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
        out[b] = probs @ keys[:, :kv_lora_rank]
    return out


def verify_attn_paged_ref(q, pool, prefix_len, tree_kv, tree_mask, page_table, *, scale: float,
                          kv_lora_rank: int) -> np.ndarray:
    """`verify_attn_ref` over a paged cache: pool [n_pages, P, A], page_table [Bt, W] int; row s of request b is
    pool[page_table[b, s // P], s % P]. The rows [0, prefix_len[b]) are gathered into a contiguous cache first, so
    table entries past a prefix's last page are never looked at."""
    pool, page_table = np.asarray(pool), np.asarray(page_table)
    bt, width = page_table.shape
    _, page, a = pool.shape
    cache = np.zeros((bt, width * page, a), pool.dtype)
    for b in range(bt):
        p = int(prefix_len[b])
        rows = np.arange(p)
        cache[b, :p] = pool[page_table[b, rows // page], rows % page]
    return verify_attn_ref(q, cache, prefix_len, tree_kv, tree_mask, scale=scale, kv_lora_rank=kv_lora_rank)
