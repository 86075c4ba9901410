"""Greedy constrained decoding, one step, in float64 numpy: the definition a device implementation is tested against.

Inputs are the `TokenAutomaton` tables (`kdtree_jax/constrain/automaton.py`) as plain arrays. Rule: tokens whose bit is clear
in `allowed[state]` are out; among the rest the highest logit wins, ties to the lowest token id; NaN counts as -inf.
If every allowed logit is -inf (or NaN) the lowest allowed id wins. A state with no allowed token is an error.
The next state is `default_next[state]` unless the token is one of the state's exceptions.
"""
from __future__ import annotations

import numpy as np

WORD_BITS = 32


def allowed_mask_ref(allowed_words: np.ndarray, vocab_size: int) -> np.ndarray:
    """[..., W] uint32 words -> [..., V] bool (bit t % 32 of word t // 32)."""
    bits = (allowed_words[..., :, None] >> np.arange(WORD_BITS, dtype=np.uint32)) & 1
    return bits.reshape(*allowed_words.shape[:-1], -1)[..., :vocab_size].astype(bool)


def next_state_ref(state: int, token: int, default_next: np.ndarray, exc_offsets: np.ndarray,
                   exc_tokens: np.ndarray, exc_next: np.ndarray) -> int:
    lo, hi = int(exc_offsets[state]), int(exc_offsets[state + 1])
    hits = np.flatnonzero(exc_tokens[lo:hi] == token)
    return int(exc_next[lo + hits[0]]) if hits.size else int(default_next[state])


def constrained_greedy_step_ref(logits: np.ndarray, states: np.ndarray, allowed: np.ndarray,
                                default_next: np.ndarray, exc_offsets: np.ndarray, exc_tokens: np.ndarray,
                                exc_next: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [B, V] (or [V]), states [B] (or scalar) -> (tokens [B], next states [B]) (scalars for [V])."""
    single = np.ndim(logits) == 1
    logits = np.atleast_2d(np.asarray(logits, np.float64))
    states = np.atleast_1d(np.asarray(states, np.int64))
    vocab = logits.shape[-1]
    mask = allowed_mask_ref(allowed[states], vocab)  # [B, V]
    if not mask.any(axis=-1).all():
        bad = states[~mask.any(axis=-1)]
        raise ValueError(f"states {bad.tolist()} allow no token")
    scores = np.where(mask & ~np.isnan(logits), logits, -np.inf)
    best = scores.max(axis=-1, keepdims=True)
    tokens = np.argmax(mask & (scores == best), axis=-1)  # first (lowest id) allowed token at the maximum
    nxt = np.array([next_state_ref(s, t, default_next, exc_offsets, exc_tokens, exc_next)
                    for s, t in zip(states.tolist(), tokens.tolist())], np.int64)
    return (int(tokens[0]), int(nxt[0])) if single else (tokens, nxt)
