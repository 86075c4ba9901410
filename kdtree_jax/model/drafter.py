"""DFlash block-diffusion drafter (Flax NNX): one non-causal pass over [bonus, MASK x (L-1)] conditioned on target
features injected as extra K/V in every layer (DFlash, arXiv 2602.06036; z-lab/dflash `dflash/model.py`).

Layout of one `draft` call for request b (positions = cache rows):
    context rows  [0, length[b])                    cached K/V (post k_norm, post rope)
    new context   [length[b], length[b] + n_ctx[b]) K/V from hidden_norm(fc(ctx_hidden)), written to the cache
    block         length_new[b] + arange(L)         queries; their K/V are used and thrown away
The token embedding and lm_head belong to the target and are passed in; the z-lab HF layout is read and written in
`kdtree_jax.checkpoint.drafter`.

Axes: Bt batch, C new context rows, S cache capacity, L block, H hidden, F feature width, Hq / Hk query / kv
heads, G = Hq / Hk, Dh head dim, V vocab.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.model import paged
from kdtree_jax.model.drafter_config import DrafterConfig

Embed = jax.Array | Callable[[jax.Array], jax.Array]  # [V, H] table or tokens -> [..., H]
Head = jax.Array | Callable[[jax.Array], jax.Array]  # [H, V] matrix or [..., H] -> [..., V]
_F32 = jnp.float32
_NEG = float(np.finfo(np.float32).min)


# ---- modules -------------------------------------------------------------------------------------------------
class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] (HF stores weight [out, in]); fp32 accumulation."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, param_dtype: Any, compute_dtype: Any):
        init = jax.random.normal(rngs.params(), (d_in, d_out), _F32) * d_in**-0.5
        self.kernel = nnx.Param(init.astype(param_dtype))
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x.astype(self.compute_dtype), self.kernel[...].astype(self.compute_dtype),
                       preferred_element_type=_F32)
        return y.astype(self.compute_dtype)


class RMSNorm(nnx.Module):
    """Qwen3RMSNorm: normalise in fp32, cast back, scale by weight."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(_F32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.weight[...].astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, param_dtype: Any, compute_dtype: Any):
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        hq, hk, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, hq * dh, **kw)
        self.k_proj = Linear(cfg.hidden_size, hk * dh, **kw)
        self.v_proj = Linear(cfg.hidden_size, hk * dh, **kw)
        self.o_proj = Linear(hq * dh, cfg.hidden_size, **kw)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.n_heads, self.n_kv, self.head_dim = hq, hk, dh

    def kv(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """x [Bt, T, H] -> K (k_norm, rope) and V, each [Bt, T, Hk, Dh]."""
        k = self.k_proj(x).reshape(*x.shape[:-1], self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(*x.shape[:-1], self.n_kv, self.head_dim)
        return apply_rope(self.k_norm(k), *rope), v

    def __call__(self, h: jax.Array, rope_q: tuple[jax.Array, jax.Array], ctx_k: jax.Array, ctx_v: jax.Array,
                 visible: jax.Array) -> jax.Array:
        """h [Bt, Lq, H] block rows; ctx_k/v [Bt, Hk, S, Dh] (heads-major, the cache's layout: the products take it
        as it is, no per-round transpose of the cache); visible [Bt, Lq, S + Lq] over [ctx ; block] keys.

        One softmax over the context and block keys, computed on the two parts apart: concatenating the block
        K/V to the context would copy the whole context cache (every layer, every round)."""
        bt, lq, _ = h.shape
        s_len = ctx_k.shape[2]
        q = apply_rope(self.q_norm(self.q_proj(h).reshape(bt, lq, self.n_heads, self.head_dim)), *rope_q)
        kb, vb = self.kv(h, rope_q)
        q = q.reshape(bt, lq, self.n_kv, self.n_heads // self.n_kv, self.head_dim)  # [Bt, Lq, Hk, G, Dh]

        def scores(k, vis):  # k [Bt, Hk, K, Dh] -> [Bt, Hk, G, Lq, K] scaled, masked
            s = jnp.einsum("bqhgd,bhsd->bhgqs", q, k.astype(kb.dtype), preferred_element_type=_F32)
            return jnp.where(vis[:, None, None], s * self.head_dim**-0.5, _NEG)

        kb, vb = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)  # [Bt, Hk, Lq, Dh]
        s_ctx, s_blk = scores(ctx_k, visible[..., :s_len]), scores(kb, visible[..., s_len:])
        m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))
        p_ctx, p_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
        denom = p_ctx.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)  # >= 1: the max term is exp(0)
        o = (jnp.einsum("bhgqs,bhsd->bhgqd", p_ctx.astype(vb.dtype), ctx_v.astype(vb.dtype),
                        preferred_element_type=_F32)
             + jnp.einsum("bhgqs,bhsd->bhgqd", p_blk.astype(vb.dtype), vb, preferred_element_type=_F32)) / denom
        o = o.transpose(0, 3, 1, 2, 4)  # [Bt, Lq, Hk, G, Dh]
        return self.o_proj(o.reshape(bt, lq, self.n_heads * self.head_dim).astype(h.dtype))


class MLP(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, param_dtype: Any, compute_dtype: Any):
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, param_dtype: Any, compute_dtype: Any):
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.self_attn = Attention(cfg, **kw)
        self.mlp = MLP(cfg, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, x, rope_q, ctx_k, ctx_v, visible):
        x = x + self.self_attn(self.input_layernorm(x), rope_q, ctx_k, ctx_v, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nnx.Module):
    """Own weights of a z-lab `DFlashDraftModel`; attribute names mirror the HF tensor names."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32,
                 compute_dtype: Any = jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.fc = Linear(cfg.feature_dim, cfg.hidden_size, **kw)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, **kw) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)

    def context(self, target_hidden: jax.Array) -> jax.Array:
        """[..., F] target features -> [..., H] injected context, shared by all layers."""
        return self.hidden_norm(self.fc(target_hidden.astype(self.compute_dtype)))

    def embed_block(self, tokens: jax.Array, embed: Embed) -> jax.Array:
        x = embed(tokens) if callable(embed) else jnp.take(embed, tokens, axis=0)
        return (x.astype(_F32) * self.cfg.input_embedding_scale).astype(self.compute_dtype)

    def logits(self, h: jax.Array, lm_head: Head) -> jax.Array:
        """Final norm + the target's lm_head (+ optional multiplier / softcap from dflash_config), fp32."""
        h = self.norm(h)
        if callable(lm_head):
            out = lm_head(h).astype(_F32)
        else:
            out = jnp.einsum("...h,hv->...v", h, lm_head.astype(h.dtype), preferred_element_type=_F32)
        out = out * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return jnp.tanh(out / cap) * cap if cap else out


# ---- rotary --------------------------------------------------------------------------------------------------
def rope_tables(cfg: DrafterConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [...] int -> cos, sin [..., Dh] fp32 (NeoX halves, YaRN amplitude folded in)."""
    inv_freq = jnp.asarray(cfg.inv_freq, _F32)  # [Dh/2]
    angles = positions.astype(_F32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * cfg.rope_amplitude, jnp.sin(angles) * cfg.rope_amplitude


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [Bt, T, heads, Dh]; cos/sin [Bt, T, Dh]. HF `rotate_half` convention."""
    half = x.shape[-1] // 2
    x32 = x.astype(_F32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _window_mask(cfg: DrafterConfig, layer: int, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array | None:
    """Per-layer position rule, q_pos [Bt, Lq], k_pos [Bt, K] -> [Bt, Lq, K] or None (all visible).

    Sliding layer with window W: key visible iff q - W < k < q + W (flash-attn window (W-1, W-1), which is what
    the reference drafter runs; the upper bound only bites inside the block when W < L). Causal layers add k <= q.
    """
    window, causal = cfg.window(layer), cfg.layer_causal(layer)
    if window is None and not causal:
        return None
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    ok = jnp.ones(jnp.broadcast_shapes(q.shape, k.shape), bool)
    if window is not None:
        ok &= k > q - window
        if not causal:
            ok &= k < q + window
    if causal:
        ok &= k <= q
    return ok


def _run_layers(drafter: DFlashDrafter, x: jax.Array, q_pos: jax.Array, block_visible: jax.Array,
                block_pos: jax.Array, ctx_kv: Callable[[int], tuple[jax.Array, ...]]) -> jax.Array:
    """The decoder stack over block rows x [Bt, Lq, H] at positions q_pos [Bt, Lq]. block_visible [Bt, Lq, Lq] is
    the block-on-block mask, block_pos [Bt, Lq] the block keys' positions. ctx_kv(i) gives layer i's context:
    K and V [Bt, Hk, S_i, Dh], their positions [Bt, S_i] and which are visible (broadcastable to [Bt, Lq, S_i]);
    S_i may differ per layer (a sliding layer reads only its window)."""
    rope_q = rope_tables(drafter.cfg, q_pos)
    bt, lq = q_pos.shape
    for i, layer in enumerate(drafter.layers):
        ctx_k, ctx_v, ctx_pos, ctx_ok = ctx_kv(i)
        visible = jnp.concatenate([jnp.broadcast_to(ctx_ok, (bt, lq, ctx_pos.shape[1])), block_visible], axis=-1)
        rule = _window_mask(drafter.cfg, i, q_pos, jnp.concatenate([ctx_pos, block_pos], axis=1))
        x = layer(x, rope_q, ctx_k, ctx_v, visible if rule is None else visible & rule)
    return x


# ---- inference: context cache + one block ---------------------------------------------------------------------
@flax.struct.dataclass
class DrafterCache:
    """The drafter's context K/V, one array per layer (as `LatentCache`: no layer's write shares a buffer with
    another's reads). Contiguous: k[l] is [Bt, Hk, S, Dh]. Paged: k[l] is a pool [n_pages, Hk, P, Dh] addressed by
    the target cache's page table, so one request's pages hold both caches' rows for its positions."""

    k: tuple[jax.Array, ...]  # context keys after k_norm and rope; row = position
    v: tuple[jax.Array, ...]  # context values
    length: jax.Array  # [Bt] int32 committed context rows (= committed tokens, bonus excluded)
    page_table: jax.Array | None = None  # [Bt, W] int32 (paged), -1 where the request owns no page

    @classmethod
    def zeros(cls, cfg: DrafterConfig, batch: int, capacity: int, dtype: Any = jnp.bfloat16) -> "DrafterCache":
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        return cls(k=_layers(cfg, shape, dtype), v=_layers(cfg, shape, dtype), length=jnp.zeros((batch,), jnp.int32))

    @classmethod
    def pool(cls, cfg: DrafterConfig, n_pages: int, page_size: int, page_table: jax.Array,
             dtype: Any = jnp.bfloat16) -> "DrafterCache":
        shape = (n_pages, cfg.num_key_value_heads, page_size, cfg.head_dim)
        return cls(k=_layers(cfg, shape, dtype), v=_layers(cfg, shape, dtype),
                   length=jnp.zeros((page_table.shape[0],), jnp.int32), page_table=page_table)

    @classmethod
    def from_stacked(cls, k: jax.Array, v: jax.Array, length: jax.Array,
                     page_table: jax.Array | None = None) -> "DrafterCache":
        """From [n_layers, ...] K and V arrays (layer l = k[l])."""
        return cls(k=tuple(k[i] for i in range(k.shape[0])), v=tuple(v[i] for i in range(v.shape[0])),
                   length=length, page_table=page_table)

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def capacity(self) -> int:
        """Rows one request can hold."""
        return self.page_table.shape[1] * self.k[0].shape[2] if self.paged else self.k[0].shape[2]

    def locate(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(page, offset) of logical rows [Bt, R] (paged only); rows a request does not own give an out-of-range page."""
        return paged.locate(self.page_table, rows, self.k[0].shape[2], self.k[0].shape[0])


def _layers(cfg: DrafterConfig, shape: tuple[int, ...], dtype) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))


def draft(drafter: DFlashDrafter, cache: DrafterCache, ctx_hidden: jax.Array, n_ctx: jax.Array, bonus: jax.Array,
          embed: Embed, lm_head: Head, *, mask_token_id: int | None = None) -> tuple[jax.Array, DrafterCache]:
    """One drafter pass: commit n_ctx[b] new context rows, draft depths 1..L-1.

    ctx_hidden [Bt, C, F] (rows >= n_ctx[b] are padding: never written, never seen), n_ctx [Bt], bonus [Bt].
    Returns logits [Bt, L-1, V] fp32 and the cache with length + n_ctx (block K/V are not stored). Rows that would
    land at or past the cache capacity are dropped, so the engine must keep length + n_ctx <= capacity.
    """
    cfg = drafter.cfg
    mask_id = cfg.mask_token_id if mask_token_id is None else mask_token_id
    bt, c, _ = ctx_hidden.shape
    L, cap = cfg.block_size, cache.capacity
    n_ctx = n_ctx.astype(jnp.int32)
    length_new = cache.length + n_ctx  # [Bt]

    offs = jnp.arange(c, dtype=jnp.int32)
    ctx_pos = cache.length[:, None] + offs  # [Bt, C]
    rows = jnp.where(offs < n_ctx[:, None], ctx_pos, cap)  # padding rows -> out of range -> dropped
    batch_idx = jnp.arange(bt)[:, None]
    ctx = drafter.context(ctx_hidden)  # [Bt, C, H]
    rope_ctx = rope_tables(cfg, ctx_pos)

    new_k, new_v = [], []
    for i, layer in enumerate(drafter.layers):
        # XLA merges products that share an operand by concatenating their weights; in the decode loop that copied
        # every layer's K and V weights each round (2 x 73 MB at K2.6 width). A barrier per layer gives each
        # product an operand of its own; it costs nothing at run time.
        ctx_i = jax.lax.optimization_barrier((ctx, jnp.int32(i)))[0]
        k, v = layer.self_attn.kv(ctx_i, rope_ctx)  # [Bt, C, Hk, Dh]
        new_k.append(k)
        new_v.append(v)
    # each layer's [Bt, C, Hk, Dh] (the advanced-index dims first) scattered to rows length[b] + j of its
    # [Bt, Hk, S, Dh] cache (pool: [n_pages, Hk, P, Dh]); padding rows are dropped
    where = cache.locate(rows) if cache.paged else (batch_idx, rows)

    def put(old, new):
        return old.at[where[0], :, where[1]].set(new.astype(old.dtype), mode="drop")

    ks, vs = tuple(map(put, cache.k, new_k)), tuple(map(put, cache.v, new_v))

    block_pos = length_new[:, None] + jnp.arange(L, dtype=jnp.int32)  # [Bt, L]
    tokens = jnp.concatenate([bonus.astype(jnp.int32)[:, None], jnp.full((bt, L - 1), mask_id, jnp.int32)], 1)
    x = drafter.embed_block(tokens, embed)
    h = _run_layers(drafter, x, block_pos, jnp.ones((bt, L, L), bool), block_pos,
                    lambda i: _context_view(cfg, i, cache.replace(k=ks, v=vs), length_new))
    return drafter.logits(h[:, 1:], lm_head), cache.replace(k=ks, v=vs, length=length_new)


def _context_view(cfg: DrafterConfig, layer: int, cache: DrafterCache, length: jax.Array):
    """Layer `layer`'s context for a block at positions length, length + 1, ...: (K, V, positions, visible).

    A sliding layer with window W sees only context rows > length - W, so it reads a W - 1 row slice per request
    instead of the whole cache (5 of the 6 K2.6-DFlash layers: 2047 rows instead of the context length)."""
    bt, cap = length.shape[0], cache.capacity
    window = cfg.window(layer)
    if window is None or not 0 < window - 1 < cap:  # no window, W = 1 (no context row), or W - 1 >= the cache
        pos = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (bt, cap))
    else:
        start = jnp.clip(length - (window - 1), 0, cap - (window - 1))  # [Bt]
        pos = start[:, None] + jnp.arange(window - 1, dtype=jnp.int32)
    visible = (pos < length[:, None])[:, None]
    k, v = cache.k[layer], cache.v[layer]
    if cache.paged:  # the rows through the page table: [n_pages, Hk, P, Dh] -> [Bt, Hk, rows, Dh]
        page, offset = cache.locate(pos)
        page = jnp.minimum(page, k.shape[0] - 1)  # unowned rows are past `length`: never visible

        def rows(a):  # rows past `length` may be another request's, NaN included: 0 * NaN would leak through
            return jnp.where(visible[..., None], jnp.moveaxis(a[page, :, offset], 2, 1), 0)

        return rows(k), rows(v), pos, visible
    if pos.shape[1] == cap:
        return k, v, pos, visible

    def cut(a):
        return jax.vmap(lambda a_b, s: jax.lax.dynamic_slice_in_dim(a_b, s, pos.shape[1], axis=1))(a, pos[:, 0])

    return cut(k), cut(v), pos, visible


# ---- training forward -----------------------------------------------------------------------------------------
def train_logits(drafter: DFlashDrafter, target_hidden: jax.Array, tokens: jax.Array, anchors: jax.Array,
                 embed: Embed, lm_head: Head, mask_token_id: int | None = None) -> jax.Array:
    """All blocks of a sequence in one pass: target_hidden [Bt, T, F], tokens [Bt, T], anchors [Bt, n] ->
    logits [Bt, n, L-1, V] fp32. Block j = [tokens[a_j], MASK x (L-1)] at positions a_j..a_j+L-1; it sees context
    features at positions < a_j and its own rows, never other blocks (equal to `draft` with a cache of [0, a_j))."""
    cfg = drafter.cfg
    mask_id = cfg.mask_token_id if mask_token_id is None else mask_token_id
    bt, t, _ = target_hidden.shape
    n, L = anchors.shape[1], cfg.block_size
    anchors = anchors.astype(jnp.int32)

    block_tok = jnp.concatenate([jnp.take_along_axis(tokens.astype(jnp.int32), anchors, axis=1)[..., None],
                                 jnp.full((bt, n, L - 1), mask_id, jnp.int32)], axis=-1).reshape(bt, n * L)
    block_pos = (anchors[..., None] + jnp.arange(L, dtype=jnp.int32)).reshape(bt, n * L)
    block_id = jnp.repeat(jnp.arange(n), L)  # [n*L]
    ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bt, t))
    row_anchor = jnp.repeat(anchors, L, axis=1)  # [Bt, n*L]
    ctx_ok = ctx_pos[:, None, :] < row_anchor[:, :, None]  # [Bt, n*L, T]
    same_block = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (bt, n * L, n * L))

    ctx = drafter.context(target_hidden)
    rope_ctx = rope_tables(cfg, ctx_pos)
    x = drafter.embed_block(block_tok, embed)

    def ctx_kv(i):
        k, v = drafter.layers[i].self_attn.kv(ctx, rope_ctx)  # [Bt, T, Hk, Dh]
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), ctx_pos, ctx_ok

    h = _run_layers(drafter, x, block_pos, same_block, block_pos, ctx_kv)
    h = h.reshape(bt, n, L, -1)[:, :, 1:]
    return drafter.logits(h, lm_head)
