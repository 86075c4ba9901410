"""The target's log-probabilities of the tokens a request emits, and the top-k at each of their positions.

Raw, as vLLM's default `raw_logprobs`: log_softmax of the target's logits at the position, before temperature, top-k,
top-p and any output constraint's mask, so a token's value is the same whichever rule or grammar drew it. They come
from the logits the round already has (the verify pass's rows on the accepted path and the bonus, the AR step's row,
a prefill chunk's rows), and only programs compiled with `DecodeSpec.logprobs` compute them: the others carry no
buffer and do nothing extra.

A table's buffer (`LogprobRows`) holds one entry per generated token, at the token's generated index (its position
minus the prompt's length) modulo the buffer's width, so a serving step whose rounds commit at most W tokens keeps
them all in W entries, and a batch generation's buffer is as wide as its longest output.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # the widest top-k a request may ask for (OpenAI's top_logprobs cap, vLLM's default max_logprobs)


class TokenLogprob(NamedTuple):
    """One token's log-probability and the top-k at its position, as the host hands them out."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first

    def limited(self, k: int) -> TokenLogprob:
        """The same entry with its first k alternatives."""
        return self._replace(top=self.top[:k])


@flax.struct.dataclass
class LogprobRows:
    """Each request's emitted tokens' log-probabilities and top-k, one entry per generated token (modulo W)."""

    token: jax.Array  # [Bt, W] float32: log-probability of the emitted token
    top_ids: jax.Array  # [Bt, W, k] int32: the k most likely tokens at its position, most likely first
    top: jax.Array  # [Bt, W, k] float32: their log-probabilities

    @classmethod
    def zeros(cls, batch: int, width: int, k: int) -> LogprobRows:
        return cls(token=jnp.zeros((batch, width), jnp.float32), top_ids=jnp.zeros((batch, width, k), jnp.int32),
                   top=jnp.zeros((batch, width, k), jnp.float32))

    @property
    def width(self) -> int:
        return self.token.shape[1]


def of_tokens(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [..., V], tokens [...] -> (log-probability of each token [...], top-k ids [..., k] int32, their
    log-probabilities [..., k]), in float32 over the whole vocabulary. Ties in the top-k: lower id first."""
    x = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    token = jnp.take_along_axis(x, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0] - logz[..., 0]
    if k == 0:
        shape = (*tokens.shape, 0)
        return token, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    top, ids = jax.lax.top_k(x, k)
    return token, ids.astype(jnp.int32), top - logz


def write(rows: LogprobRows, logits: jax.Array, tokens: jax.Array, index: jax.Array, keep: jax.Array) -> LogprobRows:
    """Record tokens [Bt, T] drawn from logits [Bt, T, V] at generated indices index [Bt, T] (modulo the width)
    where keep [Bt, T]; the other entries stay."""
    token, ids, top = of_tokens(logits, tokens, rows.top_ids.shape[-1])
    w = rows.width
    at = jnp.where(keep, index % w, w)  # out of range: dropped
    b = jnp.arange(tokens.shape[0])[:, None]
    return LogprobRows(token=rows.token.at[b, at].set(token, mode="drop"),
                       top_ids=rows.top_ids.at[b, at].set(ids, mode="drop"),
                       top=rows.top.at[b, at].set(top, mode="drop"))


def read(rows: LogprobRows, start: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The n entries from generated index start [Bt] on: ([Bt, n], [Bt, n, k], [Bt, n, k])."""
    at = (start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]) % rows.width
    return (jnp.take_along_axis(rows.token, at, axis=1), jnp.take_along_axis(rows.top_ids, at[..., None], axis=1),
            jnp.take_along_axis(rows.top, at[..., None], axis=1))


def packed(token: jax.Array, ids: jax.Array, top: jax.Array) -> jax.Array:
    """[Bt, n], [Bt, n, k], [Bt, n, k] -> [Bt, n * (1 + 2k)] int32 (floats bitcast), for one transfer with a
    program's other int32 output; `unpack` on the host reads it back."""
    bt, n = token.shape
    bits = jax.lax.bitcast_convert_type
    return jnp.concatenate([bits(token, jnp.int32)[..., None], ids, bits(top, jnp.int32)], axis=-1).reshape(bt, -1)


def unpack(row: np.ndarray, tokens, k: int) -> list[TokenLogprob]:
    """One row of `packed` output (int32 numpy, at least len(tokens) entries) -> an entry per token."""
    entries = np.asarray(row, np.int32)[: len(tokens) * (1 + 2 * k)].reshape(len(tokens), 1 + 2 * k)
    lp = entries[:, 0].view(np.float32)
    ids, top = entries[:, 1: 1 + k], entries[:, 1 + k:].view(np.float32)
    return [TokenLogprob(int(t), float(lp[i]), tuple(zip(ids[i].tolist(), top[i].tolist())))
            for i, t in enumerate(tokens)]
