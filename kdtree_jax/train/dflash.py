"""Training and evaluating the DFlash drafter: anchors, block labels, the position-decayed block cross entropy
(+ optional KL to the target), and the chain acceptance a drafter implies, per anchor and per decode round.

Axes: B batch, T sequence, V vocab, n anchors per sequence, L drafter block.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.model.drafter import train_logits
from kdtree_jax.model.target import KimiModel, LatentCache, forward_prefill
from kdtree_jax.train.target import token_nll


def dflash_position_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..L-1 -> [L-1] float32."""
    return np.exp(-np.arange(block_size - 1, dtype=np.float64) / gamma).astype(np.float32)


def sample_anchors(rng: np.random.Generator, lo: np.ndarray, hi: int, n: int) -> np.ndarray:
    """n distinct anchors per row, uniformly from [lo_b, hi] -> [B, n] int32 (sorted per row)."""
    out = np.empty((len(lo), n), np.int32)
    for b, low in enumerate(lo):
        if hi - low + 1 < n:
            raise ValueError(f"row {b}: anchor range [{low}, {hi}] holds fewer than n_anchors={n} positions")
        out[b] = np.sort(rng.choice(np.arange(low, hi + 1), size=n, replace=False))
    return out


def block_labels(tokens: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """True continuation tokens[a + k], k = 1..L-1: tokens [B, T], anchors [B, n] -> [B, n, L-1]."""
    idx = anchors[..., None] + jnp.arange(1, block_size, dtype=jnp.int32)  # [B, n, L-1]
    b = tokens.shape[0]
    return jnp.take_along_axis(tokens, idx.reshape(b, -1), axis=1).reshape(idx.shape)


def block_target_logits(target_logits: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """The target's predictive logits for block positions k = 1..L-1 (its row a + k - 1) -> [B, n, L-1, V]."""
    b, _, v = target_logits.shape
    idx = anchors[..., None] + jnp.arange(block_size - 1, dtype=jnp.int32)  # [B, n, L-1]
    rows = jnp.take_along_axis(target_logits, idx.reshape(b, -1)[..., None], axis=1)
    return rows.reshape(idx.shape + (v,))


def dflash_loss(draft_logits: jax.Array, labels: jax.Array, weights: jax.Array,
                target_logits: jax.Array | None = None, distill_weight: float = 0.0
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Position-weighted CE on draft logits [B, n, L-1, V] vs labels [B, n, L-1], plus optional
    distill_weight * KL(p_target || q_draft) with the same weights. Returns (loss, metrics)."""
    w = weights / weights.sum()  # [L-1]
    ce_k = token_nll(draft_logits, labels).mean(axis=(0, 1))  # [L-1]
    ce = (ce_k * w).sum()
    metrics = {"ce": ce, "ce_per_pos": ce_k,
               "acc_per_pos": (jnp.argmax(draft_logits, -1) == labels).mean(axis=(0, 1))}
    loss = ce
    if target_logits is not None and distill_weight > 0:
        logp_t = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
        kl_k = (jnp.exp(logp_t) * (logp_t - logq)).sum(-1).mean(axis=(0, 1))  # [L-1]
        kl = (kl_k * w).sum()
        metrics["kl"] = kl
        loss = loss + distill_weight * kl
    return loss, metrics


def chain_acceptance(draft_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """DFlash chain acceptance length per block (1 + leading matches), draft_ids / labels [..., L-1]."""
    return 1 + np.cumprod(draft_ids == labels, axis=-1).sum(-1)


def chain_walk(taus: np.ndarray, start: int) -> list[int]:
    """The acceptance lengths a chain decode takes over one sequence, given every anchor's acceptance `taus[a]`:
    each round's block starts where the last one's accepted tokens end (a -> a + taus[a]).

    Why: the mean of `taus` weighs every position once, but a decode spends one round per block, so a stretch of
    long acceptances is crossed in few rounds; the per-round mean is what the engine reports."""
    out, a = [], start
    while a < len(taus):
        out.append(int(taus[a]))
        a += int(taus[a])
    return out


def drafter_block_argmax_fn(tgraph, dgraph, taps: Sequence[int], block_size: int):
    """jitted (target_state, drafter_state, tokens [B, T], anchors [B, n]) -> drafter argmax ids [B, n, L-1]."""

    @jax.jit
    def run(tstate, dstate, tokens, anchors):
        target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
        cache = LatentCache.zeros(target.cfg, tokens.shape[0], tokens.shape[1], target.cache_dtype)
        out = forward_prefill(target, tokens, 0, cache, taps=taps)
        logits = train_logits(drafter, out.hidden, tokens, anchors, target.embed_table(), target.lm_head_table())
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return run


def drafter_agreement(target: KimiModel, drafter, seqs: np.ndarray, lo: int, stride: int, batch: int,
                      walk_from: int | None = None) -> dict[str, Any]:
    """Drafter top-1 vs the sequence's own continuation (for greedy target continuations: the target's choice)
    at every block position, anchors lo, lo + stride, ... <= T - L; plus the chain acceptance length it implies,
    per anchor and (stride 1, `walk_from` = the position of a decode's first round, i.e. the prompt length) per
    round of a chain decode over these sequences."""
    if walk_from is not None and (stride != 1 or walk_from < lo):
        raise ValueError(f"a chain walk needs stride 1 and walk_from >= lo (stride={stride}, lo={lo}, "
                         f"walk_from={walk_from})")
    L = drafter.cfg.block_size
    n_seq, t = seqs.shape
    anchors = np.arange(lo, t - L + 1, stride, dtype=np.int32)
    if len(anchors) == 0:
        raise ValueError(f"no anchor fits: lo={lo}, sequence length {t}, block {L}")
    tgraph, tstate = nnx.split(target)
    dgraph, dstate = nnx.split(drafter)
    fn = drafter_block_argmax_fn(tgraph, dgraph, tuple(drafter.cfg.target_layer_ids), L)
    hits, taus = [], []
    for s in range(0, n_seq, batch):
        chunk = seqs[s: s + batch]
        n = len(chunk)
        if n < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
        anc = np.broadcast_to(anchors, (batch, len(anchors)))
        ids = np.asarray(fn(tstate, dstate, jnp.asarray(chunk), jnp.asarray(anc)))[:n]
        labels = chunk[:n][:, anchors[:, None] + np.arange(1, L)]  # [n, n_anchors, L-1]
        hits.append((ids == labels).reshape(-1, L - 1))
        taus.append(chain_acceptance(ids, labels))
    hits, taus = np.concatenate(hits), np.concatenate(taus)  # taus [n_seq, n_anchors]
    res = {"acc_per_pos": hits.mean(0).tolist(), "chain_tau_mean": float(taus.mean()),
           "n_blocks": int(taus.size), "anchor_stride": stride}
    if walk_from is not None:
        rounds = [r for row in taus for r in chain_walk(row, walk_from - lo)]
        res.update(chain_tau_per_round=float(np.mean(rounds)), chain_rounds=len(rounds))
    return res
