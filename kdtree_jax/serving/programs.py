"""The slot table's device programs: prefill requests into slots, run k rounds for the first w slots, move a slot,
release a slot.

The table is one `DecodeState` whose batch rows are request slots, allocated once with a fixed context capacity.
Every program takes the table and gives it back (donated), so a request joins or leaves between steps by writing
its own row. Per-request values (prompt length, sampling rule, token limit, stop ids, seed) are rows of the table,
so no request compiles anything.

Widths. The host keeps the running requests in the lowest rows (`move` fills a hole left by a finished request),
so a step runs over only the first w rows for the smallest compiled width w that holds them: one request pays for a
batch of one, not for the whole table.

Budgets. A table may be stepped by several programs (plain AR and DDTree at a few budgets) chosen per step. They
share one state: the drafter's top-K lists keep the largest budget's K (`DecodeSpec.draft_k`; a smaller budget
reads their sorted prefix) and the caches hold the largest scratch any program writes. An AR step on a table with
a drafter keeps the drafter's context whole: it collects the target features of the k tokens it commits and ends
with one drafter pass over them, so the next tree step finds the same drafter state it would have after k rounds
of its own (docs/DESIGN.md, "Serving").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kdtree_jax import sampling
from kdtree_jax.drafter import DrafterCache
from kdtree_jax.engine import prefill
from kdtree_jax.model import LatentCache
from kdtree_jax.speculative import (
    FINISH_LENGTH,
    DecodeSpec,
    DecodeState,
    RequestRows,
    drafter_pass,
    root_only_tree,
    speculative_round,
    verify_and_commit,
)


@dataclasses.dataclass(frozen=True, order=True)
class StepKind:
    """Which round a step runs: "ar", "chain" or "ddtree" with its budget B."""

    mode: str
    budget: int = 0

    @property
    def name(self) -> str:
        return f"ddtree-{self.budget}" if self.mode == "ddtree" else self.mode


def empty_table(target, drafter, *, slots: int, capacity: int, n_stop: int, depth: int, draft_k: int,
                rounds: int) -> DecodeState:
    """A table of free slots. A free slot is a finished row: every round carries it unchanged."""
    cfg = target.cfg
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    params = RequestRows(
        sampling=sampling.SamplingRows(temperature=jnp.zeros((slots,), jnp.float32), top_k=zeros((slots,)),
                                       top_p=jnp.ones((slots,), jnp.float32)),
        max_new_tokens=zeros((slots,)), stop_ids=jnp.full((slots, max(n_stop, 1)), -1, jnp.int32))
    return DecodeState(
        tokens=zeros((slots, capacity)),
        length=zeros((slots,)),
        prompt_len=zeros((slots,)),
        n_generated=zeros((slots,)),
        finish=jnp.full((slots,), FINISH_LENGTH, jnp.int32),
        cache=LatentCache.zeros(cfg, slots, capacity, target.cache_dtype),
        draft_cache=None if drafter is None else DrafterCache.zeros(drafter.cfg, slots, capacity,
                                                                    drafter.compute_dtype),
        draft_lp=jnp.zeros((slots, max(depth, 1), draft_k), jnp.float32),
        draft_ids=zeros((slots, max(depth, 1), draft_k)),
        keys=jnp.zeros((slots, 2), jnp.uint32),
        params=params,
        round=jnp.int32(0),
        accept_len=zeros((slots, rounds)),
    )


def prefill_into_slots(spec: DecodeSpec, target, drafter, table: DecodeState, prompts: jax.Array,
                       prompt_len: jax.Array, seeds: jax.Array, params: RequestRows, slots: jax.Array):
    """Prefill n requests together (prompts [n, prompt_cap], prompt_len [n], seeds [n] uint32) and write request i
    into row slots[i].

    Returns (table, [n, 2] int32 of first token and finish): the first tokens come back with the prefill."""
    keys = jax.random.key_data(jax.vmap(jax.random.key)(seeds))
    many = prefill(spec, target, drafter, prompts, prompt_len, keys, params)
    for i in range(prompts.shape[0]):
        table = insert(table, slice_rows(many, i, 1), slots[i])
    return table, jnp.stack([many.bonus, many.finish], axis=1)


def insert(table: DecodeState, one: DecodeState, slot: jax.Array) -> DecodeState:
    """Row `slot` of the table := the one-request state `one`, whose cache rows may be fewer (a shorter bucket):
    rows past them keep what an earlier request left, which no round reads (every read stops at `length`). The
    table keeps its round counter, and the row's acceptance lengths start empty."""
    one = one.replace(accept_len=jnp.zeros((1, *table.accept_len.shape[1:]), table.accept_len.dtype),
                      round=table.round)
    return put_rows(table, one, slot)


def _slot_axes(table: DecodeState) -> DecodeState:
    """The slot (batch) axis of every leaf of the table; -1 for the one leaf without (the round counter)."""
    axes = jax.tree.map(lambda _: 0, table)
    dc = axes.draft_cache
    if dc is not None:
        dc = dc.replace(k=1, v=1)
    return axes.replace(cache=LatentCache(latent=1), draft_cache=dc, round=-1)


def slice_rows(state: DecodeState, start: int, size: int) -> DecodeState:
    """Rows [start, start + size) of a state (static bounds), as a state of `size` requests."""
    return jax.tree.map(lambda axis, x: x if axis < 0 else jax.lax.slice_in_dim(x, start, start + size, axis=axis),
                        _slot_axes(state), state)


def put_rows(table: DecodeState, part: DecodeState, start) -> DecodeState:
    """The table with rows [start, start + n) := `part`, a state of n requests (cast to the table's dtypes; its
    leaves may be shorter along other axes, e.g. fewer cache rows); the round counter is part's."""

    def put(axis, big, small):
        return small if axis < 0 else jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), start, axis)

    return jax.tree.map(put, _slot_axes(table), table, part)


def move(table: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Row `dst` := row `src` (the whole request: tokens, caches, draft lists, rule, key), then `src` is free."""

    def copy(axis, x):
        if axis < 0:
            return x
        return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis), dst, axis)

    return release(jax.tree.map(copy, _slot_axes(table), table), src)


def release(table: DecodeState, slot: jax.Array) -> DecodeState:
    """Mark row `slot` finished, so that rounds carry it unchanged until another request is inserted there."""
    return table.replace(finish=table.finish.at[slot].set(FINISH_LENGTH))


def step(spec: DecodeSpec, target, drafter, table: DecodeState, rounds: int):
    """Up to `rounds` rounds for the first `spec.batch` slots (fewer once all of them are done); the other rows are
    not touched.

    Returns (table, packed) with packed [spec.batch, 2 + rounds + rounds * L] int32, one transfer for the host: per
    slot the tokens committed this step, its finish code, each round's acceptance length (0: did not run) and the
    tokens themselves (L = the most tokens one round commits)."""
    part, packed = _rounds(spec, target, drafter, slice_rows(table, 0, spec.batch), rounds)
    return put_rows(table, part, 0), packed


def _rounds(spec: DecodeSpec, target, drafter, table: DecodeState, rounds: int):
    before = table.n_generated
    state = table.replace(round=jnp.int32(0), accept_len=jnp.zeros_like(table.accept_len))

    def more(s):
        return (s.round < rounds) & jnp.any(~s.done)

    if spec.mode == "ar" and drafter is not None:
        state = _ar_rounds_keeping_the_draft(spec, target, drafter, state, more, rounds)
    else:
        state = jax.lax.while_loop(more, functools.partial(speculative_round, spec, target, drafter), state)
    width = rounds * (spec.depth + 1)
    first = state.prompt_len + before  # the first token this step committed
    index = jnp.clip(first[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], 0, state.tokens.shape[1] - 1)
    new_tokens = jnp.take_along_axis(state.tokens, index, axis=1)
    packed = jnp.concatenate([(state.n_generated - before)[:, None], state.finish[:, None], state.accept_len,
                              new_tokens], axis=1)
    return state, packed


def _ar_rounds_keeping_the_draft(spec, target, drafter, state: DecodeState, more, rounds: int) -> DecodeState:
    """AR rounds that collect each committed token's target features, then one drafter pass over all of them: the
    drafter context ends as it would after the same tokens committed by tree rounds, and its top-K lists are fresh."""
    slots = state.tokens.shape[0]
    feats = jnp.zeros((slots, rounds, drafter.cfg.feature_dim), target.dtype)
    count = jnp.zeros((slots,), jnp.int32)

    def body(carry):
        s, feats, count = carry
        running = ~s.done
        new, out, _ = verify_and_commit(spec, target, s, root_only_tree(s.bonus))
        at = jnp.where(running, count, rounds)  # rows of finished slots land out of range: dropped
        feats = feats.at[jnp.arange(slots), at].set(out.hidden[:, 0].astype(feats.dtype), mode="drop")
        return new, feats, count + running.astype(jnp.int32)

    state, feats, count = jax.lax.while_loop(lambda c: more(c[0]), body, (state, feats, count))
    lp, ids, draft_cache = drafter_pass(spec, drafter, target, state.draft_cache, feats, count, state.bonus)
    return state.replace(draft_cache=draft_cache, draft_lp=lp, draft_ids=ids)
