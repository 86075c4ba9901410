"""The target's decoding rule at every tree slot: argmax, or one draw from the filtered softmax.

Every request carries its own rule as runtime data (`SamplingRows`), so changing temperature, top-k or top-p
compiles nothing. DDTree stays lossless at T > 0 because only the target samples (docs/DESIGN.md, "Sampling"): the
token that follows position p is drawn with the key fold_in(request key, p). Each emitted token is then the same
function of its key and its true prefix whichever round, tree or budget reaches it, so a request's output is that of
autoregressive sampling with those keys: the target's distribution, and reproducible from its seed in every mode
and alongside any other requests.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.decode.params import RequestParams

TOP_K_CAP = 64  # the largest per-request top_k a compiled program accepts unless it is built with another cap


@flax.struct.dataclass
class SamplingRows:
    """Per-request decoding rules as device data, one entry per batch row."""

    temperature: jax.Array  # [Bt] float32; 0 = greedy
    top_k: jax.Array  # [Bt] int32; 0 = off, else <= the program's top_k_cap
    top_p: jax.Array  # [Bt] float32 in (0, 1]; 1 = off

    @classmethod
    def of(cls, params: list[RequestParams]) -> "SamplingRows":
        return cls(temperature=np.array([p.temperature for p in params], np.float32),
                   top_k=np.array([p.top_k for p in params], np.int32),
                   top_p=np.array([p.top_p for p in params], np.float32))


def _per_row(values: jax.Array, like: jax.Array) -> jax.Array:
    """[Bt] -> broadcastable against `like` [Bt, ..., V]."""
    return values.reshape(values.shape + (1,) * (like.ndim - 1))


def filtered_logits(logits: jax.Array, rows: SamplingRows, top_k_cap: int) -> jax.Array:
    """Temperature, then top-k, then top-p (nucleus) filtering, per row; removed entries become -inf.

    logits [Bt, ..., V]. Greedy rows are scaled by 1 (their draw is replaced by the argmax). Top-k keeps every entry
    tied with the k-th value. Each filter runs only when some row asks for it: top-p sorts the whole vocabulary at
    every tree slot, which on a CPU costs more than the round's forward passes, and top-k takes the top `top_k_cap`
    at every slot. One `lax.switch` on the rows picks the filters (runtime data, so nothing recompiles): one branch
    point rather than one per filter, since on a GPU XLA copies each branch index to the host and waits for it."""
    temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
    x = logits.astype(jnp.float32) / _per_row(temp, logits)
    vocab = x.shape[-1]
    cap = min(top_k_cap, vocab)
    top_k_on = (rows.top_k > 0) & (rows.top_k < vocab)

    def top_k(x):
        top = jax.lax.top_k(x, cap)[0]  # [Bt, ..., cap] descending
        k = _per_row(jnp.clip(rows.top_k, 1, cap) - 1, logits)
        kth = jnp.take_along_axis(top, jnp.broadcast_to(k, top.shape[:-1] + (1,)), axis=-1)
        return jnp.where(_per_row(top_k_on, logits) & (x < kth), -jnp.inf, x)

    def nucleus(x):
        order, sorted_x = _sort_descending(x)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        top_p = _per_row(rows.top_p, logits)
        keep_sorted = (mass_before < top_p) | (top_p >= 1.0)  # the top token is always kept
        return jnp.where(_unsort(keep_sorted, order), x, -jnp.inf)

    def filters(with_top_k: bool, with_top_p: bool):
        def apply(x):
            x = top_k(x) if with_top_k and cap > 0 else x
            return nucleus(x) if with_top_p else x
        return apply

    branch = jnp.any(top_k_on).astype(jnp.int32) + 2 * jnp.any(rows.top_p < 1.0).astype(jnp.int32)
    return jax.lax.switch(branch, [filters(k, p) for p in (False, True) for k in (False, True)], x)


def _sort_descending(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(order, x[order]) along the last axis, largest first and ties in index order: `jnp.argsort(-x)` and the
    gather by it, from the one sort that argsort runs (negation is exact, so -(-x) is x bit for bit)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    negated, order = jax.lax.sort((-x, iota), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    return order, -negated


def _unsort(values: jax.Array, order: jax.Array) -> jax.Array:
    """values[inverse of order] along the last axis: a scatter through `order`, where inverting the permutation by
    argsort would take a second full-vocabulary sort."""
    flat_values, flat_order = values.reshape(-1, values.shape[-1]), order.reshape(-1, order.shape[-1])
    rows = jnp.arange(flat_values.shape[0])[:, None]
    out = jnp.zeros_like(flat_values).at[rows, flat_order].set(flat_values, unique_indices=True)
    return out.reshape(values.shape)


def position_keys(request_keys: jax.Array, positions: jax.Array) -> jax.Array:
    """The key of the token that follows each position.  request_keys: [Bt] keys, positions [Bt, N] -> [Bt, N]."""
    return jax.vmap(lambda key, pos: jax.vmap(lambda p: jax.random.fold_in(key, p))(pos))(request_keys, positions)


def choose(logits: jax.Array, rows: SamplingRows, keys: jax.Array, top_k_cap: int) -> jax.Array:
    """The target's token at each slot.  logits: [Bt, N, V], keys: [Bt, N] -> [Bt, N] int32.

    A batch of greedy requests takes the argmax alone; otherwise each sampling row draws and each greedy row keeps
    its argmax."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        x = filtered_logits(logits, rows, top_k_cap)
        draw = jax.vmap(jax.vmap(lambda k, row: jax.random.categorical(k, row)))(keys, x).astype(jnp.int32)
        return jnp.where(_per_row(rows.temperature > 0, draw), draw, greedy)

    return jax.lax.cond(jnp.all(rows.temperature == 0), lambda _: greedy, sample, None)
