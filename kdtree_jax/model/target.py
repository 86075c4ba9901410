"""The Kimi K2 / DeepSeek-V3 target model (Flax NNX) and its two forwards over the latent cache.

`forward_prefill` runs plain MLA (prompt chunks); `forward_verify` runs absorbed MLA (AR decode, chain and DDTree
verify) with per-token positions and an explicit mask over the new rows. Both are pure functions of
(model, arrays): the engine splits the model (`nnx.split`) and jits them with the graphdef closed over.

Axes: B batch, T/N new tokens, S cache rows, L layers, A latent width (R + P), D hidden, V vocab.
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.model.cache_update import write_cache_rows
from kdtree_jax.model.config import ModelConfig
from kdtree_jax.model.layers import init_norm_weight, init_normal, rms_norm, rope_cos_sin, yarn_inv_freq
from kdtree_jax.model.mla import MLA, mla_prefill, mla_verify
from kdtree_jax.model.moe import MLP, MoE


@flax.struct.dataclass
class LatentCache:
    """Absorbed-MLA cache: row s of request b in layer l = [c_kv after kv_a_layernorm | k_pe after rope].

    One array per layer, so that a layer's write never shares a buffer with another layer's reads: XLA then updates
    each in place instead of copying a stacked [L, ...] array around the write (docs/DESIGN.md, "Serving").
    Contiguous: latent[l] is [B, S, A], request b's rows in latent[l][b]. Paged: latent[l] is a pool [n_pages, P, A]
    and row s of request b lives in page page_table[b, s // P] (`kdtree_jax/model/paged.py`)."""

    latent: tuple[jax.Array, ...]  # valid length per request is tracked by the engine
    page_table: jax.Array | None = None  # [B, W] int32 (paged), -1 where the request owns no page

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> "LatentCache":
        return cls(latent=tuple(jnp.zeros((batch, capacity, cfg.latent_dim), dtype)
                                for _ in range(cfg.num_hidden_layers)))

    @classmethod
    def pool(cls, cfg: ModelConfig, n_pages: int, page_size: int, page_table: jax.Array,
             dtype=jnp.bfloat16) -> "LatentCache":
        return cls(latent=tuple(jnp.zeros((n_pages, page_size, cfg.latent_dim), dtype)
                                for _ in range(cfg.num_hidden_layers)), page_table=page_table)

    @classmethod
    def from_stacked(cls, latent: jax.Array, page_table: jax.Array | None = None) -> "LatentCache":
        """From one [L, ...] array (layer l = latent[l])."""
        return cls(latent=tuple(latent[i] for i in range(latent.shape[0])), page_table=page_table)

    def stacked(self) -> jax.Array:
        """All layers as one [L, ...] array (a copy: for reading, never inside a program that writes the cache)."""
        return jnp.stack(self.latent)

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def dtype(self):
        return self.latent[0].dtype

    @property
    def capacity(self) -> int:
        """Rows one request can hold."""
        return self.page_table.shape[1] * self.latent[0].shape[1] if self.paged else self.latent[0].shape[1]


@flax.struct.dataclass
class ForwardOut:
    logits: jax.Array  # [B, T, V] float32
    hidden: jax.Array  # [B, T, len(taps) * D]: outputs of decoder layers `taps` (HF hidden_states[l + 1])
    cache: LatentCache


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, param_dtype, expert_format: str,
                 moe_impl: str):
        d = cfg.hidden_size
        self.input_norm = nnx.Param(init_norm_weight(rngs, d, param_dtype), axes=(None,))
        self.attn = MLA(cfg, rngs=rngs, param_dtype=param_dtype)
        self.post_norm = nnx.Param(init_norm_weight(rngs, d, param_dtype), axes=(None,))
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs, param_dtype=param_dtype, expert_format=expert_format, impl=moe_impl)
        else:
            self.mlp = MLP(d, cfg.intermediate_size, rngs=rngs, param_dtype=param_dtype)


class KimiModel(nnx.Module):
    """Embedding, `num_hidden_layers` decoder layers (dense first, then MoE), final norm, untied lm_head.

    param_dtype: storage of float weights; dtype: activations / matmuls (router, norms, softmax, logits in fp32);
    cache_dtype: the latent cache the engine allocates. expert_format "int4" keeps routed experts packed.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 cache_dtype=None, expert_format: str = "float", moe_impl: str = "auto"):
        d, v = cfg.hidden_size, cfg.vocab_size
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.cache_dtype = jnp.dtype(cache_dtype or dtype)
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (v, d), jnp.float32).astype(param_dtype),
                               axes=("vocab", "embed"))
        self.layers = nnx.List([
            DecoderLayer(cfg, i, rngs=rngs, param_dtype=param_dtype, expert_format=expert_format, moe_impl=moe_impl)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = nnx.Param(init_norm_weight(rngs, d, param_dtype), axes=(None,))
        self.lm_head = nnx.Param(init_normal(rngs, (d, v), d, param_dtype), axes=("embed", "vocab"))

    def embed_table(self) -> jax.Array:
        """[V, D] token embeddings (shared with the drafter)."""
        return self.embed[...]

    def lm_head_table(self) -> jax.Array:
        """[D, V]: logits = rms(h) @ lm_head_table (shared with the drafter)."""
        return self.lm_head[...]


def _check_taps(cfg: ModelConfig, taps: Sequence[int]) -> tuple[int, ...]:
    taps = tuple(int(t) for t in taps)
    for t in taps:
        if not 0 <= t < cfg.num_hidden_layers:
            raise ValueError(f"taps: layer {t} is outside 0..{cfg.num_hidden_layers - 1}")
    return taps


def _run(model: KimiModel, tokens: jax.Array, positions: jax.Array, cache: LatentCache, taps: Sequence[int],
         attend, write, valid: jax.Array | None = None) -> ForwardOut:
    """Shared decoder stack. `attend(attn, x, cos, sin, layer_cache) -> (out, rows)` reads one layer's cache;
    `write(layer_cache, rows)` stores the new rows into it (only those rows are touched, so a donated cache updates
    in place)."""
    cfg, dt = model.cfg, model.dtype
    taps = _check_taps(cfg, taps)
    shapes = {x.shape for x in cache.latent}
    if len(cache.latent) != cfg.num_hidden_layers or len(shapes) != 1 or cache.latent[0].shape[-1] != cfg.latent_dim:
        rows = "n_pages, P" if cache.paged else "B, S"
        raise ValueError(f"cache: {len(cache.latent)} latent arrays of shapes {sorted(shapes)} do not fit "
                         f"{cfg.num_hidden_layers} x [{rows}, {cfg.latent_dim}]")
    cos, sin = rope_cos_sin(positions, yarn_inv_freq(cfg), cfg.rope_amplitude)  # [B, T, P/2]
    h = model.embed[...][tokens].astype(dt)  # [B, T, D]
    if valid is not None:  # padding rows start at 0, so they stay finite whatever the pad token's embedding holds
        h = jnp.where(valid[..., None], h, 0)
    latent, tapped = list(cache.latent), {}
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer{i}"):  # the scopes name each kernel's part in a profile
            with jax.named_scope("attn"):
                a, rows = attend(layer.attn, rms_norm(h, layer.input_norm[...], cfg.rms_norm_eps), cos, sin,
                                 latent[i])
                # the write consumes the barrier's copy of the layer's cache, which exists only once the attention
                # (its reads of that cache) is done: without it the write could run first, and XLA would keep the
                # old cache alive with a copy of the layer's whole cache
                a, rows, layer_cache = jax.lax.optimization_barrier((a, rows, latent[i]))
                latent[i] = write(layer_cache, rows)
            h = h + a
            with jax.named_scope("ffn"):
                h = h + layer.mlp(rms_norm(h, layer.post_norm[...], cfg.rms_norm_eps))
        if i in taps:
            tapped[i] = h
    hidden = jnp.concatenate([tapped[t] for t in taps], axis=-1) if taps else jnp.zeros(h.shape[:2] + (0,), dt)
    with jax.named_scope("head"):
        logits = jnp.einsum("btd,dv->btv", rms_norm(h, model.norm[...], cfg.rms_norm_eps),
                            model.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
    return ForwardOut(logits=logits, hidden=hidden, cache=cache.replace(latent=tuple(latent)))


def forward_prefill(model: KimiModel, tokens: jax.Array, start, cache: LatentCache, *,
                    taps: Sequence[int] = (), valid: jax.Array | None = None) -> ForwardOut:
    """Plain MLA over tokens [B, T] at positions start + t (start: int, or a traced int32 scalar).

    Token t attends to cache rows [0, start) and new tokens <= t; its latent is written at row start + t.
    A Python-int start lets the attention skip rows past start + T. valid [B, T] bool marks real (non-padding)
    tokens: padding rows are computed from a zero embedding, since masked keys still enter p @ V with weight 0.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))

    def attend(attn, x, cos, sin, layer_cache):
        return mla_prefill(attn, x, cos, sin, start, layer_cache)

    def write(layer_cache, rows):  # [B, T, A] at rows [start, start + T) of every request
        return jax.lax.dynamic_update_slice(layer_cache, rows, (0, start, 0))

    return _run(model, tokens, positions, cache, taps, attend, write, valid)


def forward_verify(model: KimiModel, tokens: jax.Array, positions: jax.Array, start: jax.Array, mask: jax.Array,
                   cache: LatentCache, *, taps: Sequence[int] = (), use_pallas: bool = False,
                   interpret: bool | None = None, valid: jax.Array | None = None,
                   attn_backend: str | None = None) -> ForwardOut:
    """Absorbed MLA over N new rows per request: tokens / positions [B, N], start [B], mask [B, N, N] bool.

    Row i attends to cache rows [0, start_b) and to new rows j with mask[b, i, j]; the N latents are written at
    rows [start_b, start_b + N) (the caller keeps start_b + N <= S). AR: N = 1, mask [[True]]; chain: causal;
    DDTree: ancestor-or-self mask with positions start + depth; a prompt chunk: causal, with `valid` [B, N] marking
    real tokens as in `forward_prefill`.
    """
    b, n = tokens.shape
    if positions.shape != (b, n) or mask.shape != (b, n, n) or start.shape != (b,):
        raise ValueError(f"forward_verify: tokens {tokens.shape} needs positions [{b}, {n}] (got {positions.shape}), "
                         f"start [{b}] (got {start.shape}), mask [{b}, {n}, {n}] (got {mask.shape})")
    start = start.astype(jnp.int32)
    mask = mask.astype(bool)

    def attend(attn, x, cos, sin, layer_cache):
        return mla_verify(attn, x, cos, sin, start, mask, layer_cache, use_pallas=use_pallas, interpret=interpret,
                          attn_backend=attn_backend, page_table=cache.page_table)

    def write(layer_cache, rows):  # [B, N, A] at rows [start_b, start_b + N): one scatter
        return write_cache_rows(layer_cache, cache.page_table, rows, start)

    return _run(model, tokens, positions, cache, taps, attend, write, valid)
