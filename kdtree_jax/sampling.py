"""The target's decoding rule at every tree slot: argmax, or one draw from the filtered softmax.

DDTree stays lossless at T > 0 because only the target samples (ddtree_algorithm.md §4): each slot gets its own
draw, keyed by (request key, round, slot), so a run is reproducible and a request with its own seed draws the same
tokens alone or in any batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static decoding rule; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed entries become -inf.  # [..., V]"""
    x = logits.astype(jnp.float32) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if params.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < params.top_p  # the top token is always kept
        keep = _unsort(keep_sorted, order)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def _unsort(values: jax.Array, order: jax.Array) -> jax.Array:
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(values, inverse, axis=-1)


def slot_keys(request_keys: jax.Array, round_index: jax.Array, n_slots: int) -> jax.Array:
    """One PRNG key per (request, slot) for this round.  request_keys: [Bt] keys -> [Bt, n_slots] keys."""

    def per_request(key):
        key = jax.random.fold_in(key, round_index)
        return jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.arange(n_slots))

    return jax.vmap(per_request)(request_keys)


def choose(logits: jax.Array, params: SamplingParams, keys: jax.Array | None = None) -> jax.Array:
    """The target's token at each slot.  logits: [Bt, N, V], keys: [Bt, N] -> [Bt, N] int32."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filtered_logits(logits, params)
    draw = jax.vmap(jax.vmap(lambda k, row: jax.random.categorical(k, row)))(keys, x)
    return draw.astype(jnp.int32)
