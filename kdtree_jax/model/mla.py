"""Multi-head latent attention (MLA) over the latent cache, in its two exact forms.

Plain form (prefill): the latent rows c_kv are expanded per head through kv_b into k_nope / v — cheaper in FLOPs
for long T. Absorbed form (verify / decode): W_UK is folded into the query and W_UV applied after attention, so
the scores run over the 576-wide latent as MQA with one KV head — cheap for few query rows over a long cache.
Both return the new tokens' cache rows — c_kv (after kv_a_layernorm) | k_pe (after rope, in-place interleaved
layout, see layers.py), R + P values per token — and the model writes only those rows into the latent cache.

Axes: B batch, T/N new tokens, S cache rows, H heads, K nope dim, P rope dim, V value dim, R kv_lora_rank,
A = R + P latent width, D hidden size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.model import paged
from kdtree_jax.model.config import ModelConfig
from kdtree_jax.model.layers import apply_rope, init_norm_weight, init_normal, rms_norm
from kdtree_jax.parallel.sharding import verify_attn_on_mesh
from pallas_kernels.verify_attn import verify_attn

NEG_INF = -1e30  # finite "minus infinity": a fully masked row never turns into NaN


class MLA(nnx.Module):
    """MLA parameters, laid out for head sharding: q_b [R_q, H, K+P], w_uk [H, K, R], w_uv [H, V, R], o [H, V, D].

    qkv_a [D, R_q + A] holds q_a's columns (none without a q LoRA) then kv_a's: both read the same x, so they run as
    one matmul. Stored apart, XLA's dot merger joins them anyway and, when the joined matmul goes to cuBLAS,
    concatenates the two weights on every call (a 30 MB copy per layer at K2.6 width, BENCHMARKS.md §4b)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        d, h, r, p = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        dq, dn, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = nnx.Param(init_normal(rngs, (d, h, dq), d, param_dtype), axes=("embed", "heads", None))
            q_a = jnp.zeros((d, 0), param_dtype)
        else:
            rq = cfg.q_lora_rank
            q_a = init_normal(rngs, (d, rq), d, param_dtype)
            self.q_a_norm = nnx.Param(init_norm_weight(rngs, rq, param_dtype), axes=(None,))
            self.q_b = nnx.Param(init_normal(rngs, (rq, h, dq), rq, param_dtype), axes=(None, "heads", None))
        kv_a = init_normal(rngs, (d, r + p), d, param_dtype)
        self.qkv_a = nnx.Param(jnp.concatenate([q_a, kv_a], axis=1), axes=("embed", None))
        self.kv_a_norm = nnx.Param(init_norm_weight(rngs, r, param_dtype), axes=(None,))
        self.w_uk = nnx.Param(init_normal(rngs, (h, dn, r), r, param_dtype), axes=("heads", None, None))
        self.w_uv = nnx.Param(init_normal(rngs, (h, dv, r), r, param_dtype), axes=("heads", None, None))
        self.o_proj = nnx.Param(init_normal(rngs, (h, dv, d), h * dv, param_dtype), axes=("heads", None, "embed"))


def project(attn: MLA, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q_nope [B, T, H, K], q_pe [B, T, H, P] (roped), latent rows [B, T, A] = [rms(c_kv) | rope(k_pe)]
    in x's dtype."""
    cfg, dt = attn.cfg, x.dtype
    rq = cfg.q_lora_rank or 0
    down = x @ attn.qkv_a[...].astype(dt)  # [B, T, R_q + A]: q_a and kv_a in one matmul
    if cfg.q_lora_rank is None:
        q = jnp.einsum("btd,dhq->bthq", x, attn.q_proj[...].astype(dt))
    else:
        cq = rms_norm(down[..., :rq], attn.q_a_norm[...], cfg.rms_norm_eps)
        q = jnp.einsum("btr,rhq->bthq", cq, attn.q_b[...].astype(dt))
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    kva = down[..., rq:]  # [B, T, A]
    c_kv = rms_norm(kva[..., : cfg.kv_lora_rank], attn.kv_a_norm[...], cfg.rms_norm_eps)
    k_pe = apply_rope(kva[..., cfg.kv_lora_rank :], cos, sin)
    return q_nope, apply_rope(q_pe, cos, sin), jnp.concatenate([c_kv, k_pe], axis=-1)


def _output(attn: MLA, o: jax.Array) -> jax.Array:
    return jnp.einsum("bthv,hvd->btd", o, attn.o_proj[...].astype(o.dtype))  # [B, T, D]


def mla_prefill(attn: MLA, x: jax.Array, cos: jax.Array, sin: jax.Array, start, layer_cache: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """Plain MLA for T new tokens at positions start + t over layer_cache [B, S, A] (rows [0, start) valid).

    Returns (out [B, T, D], latent rows [B, T, A] in the cache dtype, for the caller to write at [start, start+T)).
    New tokens attend to their own rows after the cache-dtype round trip, so prefill and verify see identical
    values. With a Python-int `start` only rows [0, start) are expanded through kv_b; a traced start expands all S
    rows and masks those >= start.
    """
    cfg, dt = attn.cfg, x.dtype
    t_new, r = x.shape[1], cfg.kv_lora_rank
    q_nope, q_pe, rows = project(attn, x, cos, sin)
    rows = rows.astype(layer_cache.dtype)  # [B, T, A]
    prefix = layer_cache[:, :start] if isinstance(start, (int, np.integer)) else layer_cache  # [B, S', A]
    keys = jnp.concatenate([prefix, rows], axis=1)  # [B, S' + T, A]
    c_kv, k_pe = keys[..., :r].astype(dt), keys[..., r:].astype(dt)
    k_nope = jnp.einsum("bsr,hkr->bshk", c_kv, attn.w_uk[...].astype(dt))  # [B, S'+T, H, K]
    v = jnp.einsum("bsr,hvr->bshv", c_kv, attn.w_uv[...].astype(dt))  # [B, S'+T, H, V]
    f32 = jnp.float32
    scores = jnp.einsum("bthk,bshk->bhts", q_nope, k_nope, preferred_element_type=f32)
    scores += jnp.einsum("bthp,bsp->bhts", q_pe, k_pe, preferred_element_type=f32)
    in_prefix = jnp.broadcast_to(jnp.arange(prefix.shape[1]) < start, (t_new, prefix.shape[1]))  # [T, S']
    causal = jnp.arange(t_new)[None, :] <= jnp.arange(t_new)[:, None]  # [T, T]
    visible = jnp.concatenate([in_prefix, causal], axis=1)  # [T, S' + T]
    scores = jnp.where(visible, scores * cfg.softmax_scale, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)  # [B, H, T, S'+T]
    o = jnp.einsum("bhts,bshv->bthv", probs, v)
    return _output(attn, o), rows


def absorbed_attention_jnp(q: jax.Array, cache: jax.Array, prefix_len: jax.Array, tree_kv: jax.Array,
                           tree_mask: jax.Array, *, scale: float, kv_lora_rank: int) -> jax.Array:
    """Absorbed-MLA attention core (plain jnp twin of `pallas_kernels.verify_attn.verify_attn`).

    q [B, N, H, A] (= [q_nope·W_UK | q_pe]), cache [B, S, A], prefix_len [B], tree_kv [B, N, A], tree_mask [B, N, N]
    -> o_lat [B, N, H, R] float32. Row i sees cache rows [0, prefix_len_b) and tree rows j with tree_mask[b, i, j].
    """
    f32 = jnp.float32
    in_prefix = jnp.arange(cache.shape[1])[None, :] < prefix_len[:, None]  # [B, S]
    # rows past the prefix may hold anything, NaN included (another request's page, a failed request's rows): a
    # zero weight on them would still give 0 * NaN
    cache = jnp.where(in_prefix[..., None], cache, 0)
    s_cache = jnp.einsum("bnha,bsa->bnhs", q, cache.astype(q.dtype), preferred_element_type=f32) * scale
    s_cache = jnp.where(in_prefix[:, None, None, :], s_cache, NEG_INF)
    s_tree = jnp.einsum("bnha,bma->bnhm", q, tree_kv.astype(q.dtype), preferred_element_type=f32) * scale
    s_tree = jnp.where(tree_mask[:, :, None, :], s_tree, NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([s_cache, s_tree], axis=-1), axis=-1)  # [B, N, H, S + N]
    p_cache, p_tree = probs[..., : cache.shape[1]], probs[..., cache.shape[1] :]
    o = jnp.einsum("bnhs,bsr->bnhr", p_cache, cache[..., :kv_lora_rank].astype(f32))
    return o + jnp.einsum("bnhm,bmr->bnhr", p_tree, tree_kv[..., :kv_lora_rank].astype(f32))


def mla_verify(attn: MLA, x: jax.Array, cos: jax.Array, sin: jax.Array, start: jax.Array, mask: jax.Array,
               cache: jax.Array, *, use_pallas: bool = False, interpret: bool | None = None,
               attn_backend: str | None = None, page_table: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA for N new rows over the cache (rows [0, start_b) valid), new rows under `mask`.

    cache: this layer's [B, S, A], or with page_table [B, W] this layer's page pool [n_pages, P, A], which the kernel
    reads through the table in place.
    Returns (out [B, N, D], latent rows [B, N, A] in the cache dtype, for the caller to write at
    [start_b, start_b + N)). attn_backend: verify_attn's backend (None: its own choice by device and shape).
    """
    cfg, dt = attn.cfg, x.dtype
    q_nope, q_pe, tree_kv = project(attn, x, cos, sin)
    q_lat = jnp.einsum("bnhk,hkr->bnhr", q_nope, attn.w_uk[...].astype(dt))  # [B, N, H, R]
    q = jnp.concatenate([q_lat, q_pe], axis=-1).astype(cache.dtype)  # [B, N, H, A]
    tree_kv = tree_kv.astype(cache.dtype)  # [B, N, A]
    if use_pallas:
        kw = dict(scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank, interpret=interpret, backend=attn_backend)
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and mesh.size > 1:  # each device runs the kernel on its requests and heads
            o_lat = verify_attn_on_mesh(q, cache, start, tree_kv, mask, page_table=page_table, **kw)
        elif page_table is not None:
            o_lat = verify_attn(q, cache, start, tree_kv, mask, page_table=paged.readable(page_table), **kw)
        else:
            o_lat = verify_attn(q, cache, start, tree_kv, mask, **kw)
    else:
        layer_cache = cache if page_table is None else paged.gather_prefix(cache, page_table)
        o_lat = absorbed_attention_jnp(q, layer_cache, start, tree_kv, mask,
                                       scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank)
    o = jnp.einsum("bnhr,hvr->bnhv", o_lat.astype(dt), attn.w_uv[...].astype(dt))  # [B, N, H, V]
    return _output(attn, o), tree_kv
