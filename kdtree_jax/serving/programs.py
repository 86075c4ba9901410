"""The serving runner's device programs: prefill a chunk of prompts into slots, run k rounds for the first w slots,
move a slot, release a slot.

The table is one `DecodeState` whose batch rows are request slots (tokens, lengths, draft lists, rules, keys) over
one page pool per cache: the target's latent and the drafter's context, both addressed by the same page table
(`kdtree_jax/model/paged.py`). The host's cache manager owns the pages, and every program takes its page table as an
argument, so pages change hands without touching the device's rows. Every program takes the table and gives it
back (donated), so a request joins or leaves between steps by writing its own row and its own pages. Per-request
values (prompt length, sampling rule, token limit, stop ids, seed) are rows of the table, so no request compiles
anything.

Widths. The host keeps the running requests in the lowest rows (`move` fills a hole left by a finished request:
one row of small state, never the cache), so a step runs over only the first w rows for the smallest compiled width
w that holds them: one request pays for a batch of one, not for the whole table. On a mesh whose data axis splits
the rows into G groups (group g's rows on data shard g, over its own pages), a step of width w runs over the first
w / G rows of each group, so every shard keeps its rows and reads only its own pages.

Budgets. A table may be stepped by several programs (plain AR and DDTree at a few budgets) chosen per step. They
share one state: the drafter's top-K lists keep the largest budget's K (`DecodeSpec.draft_k`; a smaller budget
reads their sorted prefix) and the host grows each request's pages to the largest scratch any program writes. An
AR step on a table with a drafter keeps the drafter's context whole: it collects the target features of the k
tokens it commits and ends with one drafter pass over them, so the next tree step finds the same drafter state it
would have after k rounds of its own (docs/DESIGN.md, "Serving").

Constraints. Every prefill and step program takes the constraint tables (`constrain_device.AutomatonTables`, one
global state space padded to fixed caps, no slot axis) as an argument, and each row holds its automaton state in
`constraint_state` (`FREE_STATE`: unconstrained). The host lays the live requests' automata out in the tables and
hands a prefill each request's start state, so a schema is data: nothing compiles for it, and a round whose rows
are all free skips the masks.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.constrain import device as cd
from kdtree_jax.decode import logprobs as lp_mod
from kdtree_jax.decode import sampling
from kdtree_jax.decode.speculative import (
    FINISH_LENGTH,
    FINISH_NONFINITE,
    FINISH_REASONS,
    RUNNING,
    DecodeSpec,
    DecodeState,
    RequestRows,
    choose_tokens,
    drafter_pass,
    first_token_finish,
    root_only_tree,
    speculative_round,
    verify_and_commit,
)
from kdtree_jax.model import cache_update, paged
from kdtree_jax.model.drafter import DrafterCache
from kdtree_jax.model.target import LatentCache, forward_verify


def empty_table(target, drafter, *, slots: int, capacity: int, n_pages: int, page_size: int, n_stop: int,
                depth: int, draft_k: int, rounds: int, logprobs: int | None = None) -> DecodeState:
    """A table of free slots over an empty page pool. A free slot is a finished row: every round carries it
    unchanged. The page table in it is a placeholder: every program takes the host's table as an argument. With
    `logprobs` (the top-k of programs that keep log-probabilities) it holds one step's tokens' entries per slot."""
    cfg = target.cfg
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    params = RequestRows(
        sampling=sampling.SamplingRows(temperature=jnp.zeros((slots,), jnp.float32), top_k=zeros((slots,)),
                                       top_p=jnp.ones((slots,), jnp.float32)),
        max_new_tokens=zeros((slots,)), stop_ids=jnp.full((slots, max(n_stop, 1)), -1, jnp.int32))
    table = jnp.full((slots, pages_per_request(capacity, page_size)), paged.UNOWNED, jnp.int32)
    return DecodeState(
        tokens=zeros((slots, capacity)),
        length=zeros((slots,)),
        prompt_len=zeros((slots,)),
        n_generated=zeros((slots,)),
        finish=jnp.full((slots,), FINISH_LENGTH, jnp.int32),
        cache=LatentCache.pool(cfg, n_pages, page_size, table, target.cache_dtype),
        draft_cache=None if drafter is None else DrafterCache.pool(drafter.cfg, n_pages, page_size, table,
                                                                   drafter.compute_dtype),
        draft_lp=jnp.zeros((slots, max(depth, 1), draft_k), jnp.float32),
        draft_ids=zeros((slots, max(depth, 1), draft_k)),
        keys=jnp.zeros((slots, 2), jnp.uint32),
        params=params,
        round=jnp.int32(0),
        accept_len=zeros((slots, rounds)),
        constraint_state=jnp.full((slots,), cd.FREE_STATE, jnp.int32),
        logprobs=None if logprobs is None else lp_mod.LogprobRows.zeros(slots, rounds * (depth + 1), logprobs),
    )


def pages_per_request(capacity: int, page_size: int) -> int:
    """Page-table width: the pages that hold `capacity` rows."""
    return -(-capacity // page_size)


def with_pages(table: DecodeState, page_table: jax.Array) -> DecodeState:
    """The table addressed by the host's page table [slots, W] (both caches share it)."""
    dc = table.draft_cache
    return table.replace(cache=table.cache.replace(page_table=page_table),
                         draft_cache=None if dc is None else dc.replace(page_table=page_table))


class PrefillBatch(NamedTuple):
    """A prefill chunk's inputs, one row per request (`prefill_chunk` says what each means)."""

    page_rows: jax.Array  # [n, W] int32
    tokens: jax.Array  # [n, T] int32
    slots: jax.Array  # [n] int32
    start: jax.Array  # [n] int32
    n_valid: jax.Array  # [n] int32
    prompt_len: jax.Array  # [n] int32
    n_prev: jax.Array  # [n] int32
    seeds: jax.Array  # [n] uint32
    params: RequestRows
    start_state: jax.Array  # [n] int32
    next_token: jax.Array  # [n] int32: the context token after the chunk; -1 where the chunk ends the context

    @classmethod
    def example(cls, n: int, bucket: int, page_width: int, params: RequestRows) -> PrefillBatch:
        """A batch of n rows of `bucket` tokens to compile with (its values are never run)."""
        ints = np.zeros((n,), np.int32)
        return cls(np.zeros((n, page_width), np.int32), np.zeros((n, bucket), np.int32), ints, ints, ints + 1, ints,
                   ints, np.zeros((n,), np.uint32), params, ints, ints - 1)


def prefill_chunk(spec: DecodeSpec, target, drafter, table: DecodeState, tables: cd.AutomatonTables,
                  batch: PrefillBatch):
    """One chunk of n requests' contexts: tokens [n, T] at positions start[i] + t, the first n_valid[i] real,
    written into request i's pages page_rows[i] ([n, W]); the drafter's context takes the chunk's features.

    A request's context is its prompt, or for a request resumed after preemption its prompt and the n_prev tokens
    it had generated (prompt_len stays its own prompt's length); start_state[i] is its automaton state after that
    context (`cd.FREE_STATE` without a constraint), which the first token obeys. Where slots[i] is a slot (< the
    table's rows), this
    chunk ends the context: the target's next token is drawn with the key of its position (as every later token
    is), and row slots[i] starts running with it as its bonus. A chunk that does not end its context has no row
    (slots[i] out of range): its writes to the table's rows are dropped.

    Returns (table, [n, 2] int32 of first token and finish code; meaningful where the context ended). A program with
    `spec.logprobs` appends each row's entries (`lp_mod.packed`) for the tokens its T rows predict: row t the
    context token at start + t + 1, the last valid row `next_token`, or where the chunk ends the context the first
    token (the entries past n_valid are padding)."""
    rows, tokens, slots, start, n_valid, prompt_len, n_prev, seeds, params, start_state, next_token = batch
    n, t = tokens.shape
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_valid[:, None]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (n, t, t))
    out = forward_verify(target, tokens, positions, start, causal, table.cache.replace(page_table=rows),
                         taps=spec.taps, use_pallas=spec.use_pallas, valid=valid, attn_backend=spec.attn_backend)
    last_logits = jnp.take_along_axis(out.logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    keys = jax.random.key_data(jax.vmap(jax.random.key)(seeds))
    first_keys = sampling.position_keys(jax.random.wrap_key_data(keys), (start + n_valid - 1)[:, None])
    first = choose_tokens(last_logits[:, None, :], params.sampling, first_keys, spec.top_k_cap, tables,
                          start_state[:, None])[:, 0]
    state_after = cd.next_state(tables, start_state, first)
    context = start + n_valid
    finish = first_token_finish(last_logits, first, params, n_prev)
    nonfinite = finish == FINISH_NONFINITE

    def put(field, value):  # row slots[i] of a per-slot field := value[i] where the context ended
        return field.at[slots].set(value.astype(field.dtype), mode="drop")

    draft_cache = table.draft_cache
    lp = jnp.zeros((n, *table.draft_lp.shape[1:]), jnp.float32)
    ids = jnp.zeros((n, *table.draft_ids.shape[1:]), jnp.int32)
    if draft_cache is not None:  # the chunk's context rows; where this chunk ends the context, the next block too
        mine = draft_cache.replace(length=start, page_table=rows)
        lp, ids, mine = drafter_pass(spec, drafter, target, mine, out.hidden, n_valid, first,
                                     cd.allowed_mask(tables, state_after))
        draft_cache = draft_cache.replace(k=mine.k, v=mine.v, length=put(draft_cache.length, mine.length))

    token_rows = jnp.concatenate([tokens, jnp.zeros((n, 1), jnp.int32)], axis=1)
    token_rows = jnp.where(jnp.arange(t + 1)[None, :] == n_valid[:, None], first[:, None], token_rows)
    context_tokens = cache_update.write_rows(jnp.zeros((n, table.tokens.shape[1]), jnp.int32), token_rows, start)
    table = table.replace(
        tokens=put(table.tokens, context_tokens),
        length=put(table.length, context),
        prompt_len=put(table.prompt_len, prompt_len),
        n_generated=put(table.n_generated, jnp.where(nonfinite, n_prev, n_prev + 1)),
        finish=put(table.finish, finish),
        cache=out.cache.replace(page_table=table.cache.page_table),
        draft_cache=None if draft_cache is None else draft_cache.replace(page_table=table.cache.page_table),
        draft_lp=put(table.draft_lp, lp),
        draft_ids=put(table.draft_ids, ids),
        keys=put(table.keys, keys),
        params=jax.tree.map(put, table.params, params),
        accept_len=put(table.accept_len, jnp.zeros((n, table.accept_len.shape[1]), jnp.int32)),
        constraint_state=put(table.constraint_state, state_after),
    )
    head = jnp.stack([first, finish], axis=1)
    if spec.logprobs is None:
        return table, head
    follow = jnp.where(next_token >= 0, next_token, first)
    targets = jnp.where(jnp.arange(t)[None, :] == (n_valid - 1)[:, None], follow[:, None], token_rows[:, 1:])
    entries = lp_mod.packed(*lp_mod.of_tokens(out.logits, targets, spec.logprobs))
    return table, jnp.concatenate([head, entries], axis=1)


NO_SLOTS = -1  # `slot_axes` of a leaf without a slot axis (the round counter)
POOL = -2  # `slot_axes` of a page pool's leaves (one per layer): pages on axis 0, no slot axis


def slot_axes(table: DecodeState) -> DecodeState:
    """The slot (batch) axis of every leaf of the table; `POOL` for the page pools' leaves, `NO_SLOTS` for the
    round. Negative: the leaf has no slot axis."""
    axes = jax.tree.map(lambda _: 0, table)
    pool = functools.partial(jax.tree.map, lambda _: POOL)
    dc = axes.draft_cache
    if dc is not None:
        dc = dc.replace(k=pool(dc.k), v=pool(dc.v))
    return axes.replace(cache=axes.cache.replace(latent=pool(axes.cache.latent)), draft_cache=dc, round=NO_SLOTS)


def pools(table: DecodeState) -> list[jax.Array]:
    """Every page pool leaf of the table (each layer of the latent and the drafter's K and V)."""
    return [x for axis, x in zip(jax.tree.leaves(slot_axes(table)), jax.tree.leaves(table)) if axis == POOL]


def slice_rows(state: DecodeState, start: int, size: int, groups: int = 1) -> DecodeState:
    """Rows [start, start + size / groups) of each of `groups` equal blocks of a state's rows (static bounds), as a
    state of `size` requests, block by block."""
    def cut(axis, x):
        if axis < 0:
            return x
        part = jax.lax.slice_in_dim(_blocks(x, axis, groups), start, start + size // groups, axis=axis + 1)
        return part.reshape(*x.shape[:axis], size, *x.shape[axis + 1:])

    return jax.tree.map(cut, slot_axes(state), state)


def put_rows(table: DecodeState, part: DecodeState, start, groups: int = 1) -> DecodeState:
    """The table with rows [start, start + n / groups) of each of `groups` equal blocks := `part`, a state of n
    requests block by block (`slice_rows`' inverse); the pools and the round counter are part's."""

    def put(axis, big, small):
        if axis < 0:
            return small
        out = jax.lax.dynamic_update_slice_in_dim(_blocks(big, axis, groups),
                                                  _blocks(small.astype(big.dtype), axis, groups), start, axis + 1)
        return out.reshape(big.shape)

    return jax.tree.map(put, slot_axes(table), table, part)


def _blocks(x: jax.Array, axis: int, groups: int) -> jax.Array:
    """[..., S, ...] -> [..., groups, S / groups, ...] at `axis`: the rows of each data group as one block."""
    return x.reshape(*x.shape[:axis], groups, x.shape[axis] // groups, *x.shape[axis + 1:])


def move(table: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Row `dst` := row `src` (the request's tokens, lengths, draft lists, rule, key; its pages stay where they are:
    the host moves its page-table row), then `src` is free."""

    def copy(axis, x):
        if axis < 0:
            return x
        return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis), dst, axis)

    return release(jax.tree.map(copy, slot_axes(table), table), src)


def release(table: DecodeState, slot: jax.Array) -> DecodeState:
    """Mark row `slot` finished and unconstrained, so that rounds carry it unchanged (and skip the masks for it)
    until another request is prefilled there."""
    return table.replace(finish=table.finish.at[slot].set(FINISH_LENGTH),
                         constraint_state=table.constraint_state.at[slot].set(cd.FREE_STATE))


PAUSED = 4  # a step's finish code for a running row whose pages held no further round: it idled, still running


def step(spec: DecodeSpec, target, drafter, table: DecodeState, tables: cd.AutomatonTables, page_table: jax.Array,
         rounds: int, groups: int = 1, row_slack: int | None = None):
    """Up to `rounds` rounds for the first `spec.batch / groups` slots of each of the `groups` data groups (fewer
    rounds once all of them are done) over the host's page table [slots, W]; the other rows are not touched.

    Each row's pages are its budget: a round runs for a row only while its pages hold the round's rows, the
    committed ones and `row_slack` rows of scratch past its last token (the host's `Scheduler` counts rows the same
    way). A row out of pages idles for the rest of the step: it emits nothing and keeps its state, its random
    stream (keyed by position) and its draft, so the host can reserve what a step is expected to write rather than
    its worst case, and grow the row before the next step.

    Returns (table, packed) with packed [spec.batch, 2 + rounds + rounds * L] int32, one transfer for the host: per
    slot, group by group, the tokens committed this step, its finish code (`PAUSED` where it idled), each round's
    acceptance length (0: did not run) and the tokens themselves (L = the most tokens one round commits); with
    `spec.logprobs`, then the tokens' entries (`lp_mod.packed`)."""
    table = with_pages(table, page_table)
    slack = spec.slack if row_slack is None else row_slack
    part, packed = _rounds(spec, target, drafter, slice_rows(table, 0, spec.batch, groups), tables, rounds, slack)
    return put_rows(table, part, 0, groups), packed


def owned_rows(cache: LatentCache) -> jax.Array:
    """[B] rows each request's pages hold (its page-table entries are a prefix: pages are only ever appended)."""
    page_size = cache.latent[0].shape[1]
    return jnp.sum(cache.page_table != paged.UNOWNED, axis=1, dtype=jnp.int32) * page_size


def _rounds(spec: DecodeSpec, target, drafter, table: DecodeState, tables: cd.AutomatonTables, rounds: int,
            row_slack: int):
    before = table.n_generated
    owned = owned_rows(table.cache)

    def pause(s):  # rows whose next round could write past their pages: known tokens + scratch > owned rows
        out = (s.finish == RUNNING) & (s.length + 1 + row_slack > owned)
        return s.replace(finish=jnp.where(out, PAUSED, s.finish).astype(s.finish.dtype))

    state = pause(table.replace(round=jnp.int32(0), accept_len=jnp.zeros_like(table.accept_len)))

    def more(s):
        return (s.round < rounds) & jnp.any(~s.done)

    if spec.mode == "ar" and drafter is not None:
        state = _ar_rounds_keeping_the_draft(spec, target, drafter, state, tables, more, rounds, pause)
    else:
        one = functools.partial(speculative_round, spec, target, drafter, tables=tables)
        state = jax.lax.while_loop(more, lambda s: pause(one(s)), state)
    reported = state.finish
    state = state.replace(finish=jnp.where(reported == PAUSED, RUNNING, reported).astype(reported.dtype))
    width = rounds * (spec.depth + 1)
    first = state.prompt_len + before  # the first token this step committed
    index = jnp.clip(first[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], 0, state.tokens.shape[1] - 1)
    new_tokens = jnp.take_along_axis(state.tokens, index, axis=1)
    parts = [(state.n_generated - before)[:, None], reported[:, None], state.accept_len, new_tokens]
    if spec.logprobs is not None:
        parts.append(lp_mod.packed(*lp_mod.read(state.logprobs, before, width)))
    return state, jnp.concatenate(parts, axis=1)


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One row of a step's packed output, as the host reads it."""

    finish: int  # its finish code: RUNNING, PAUSED or why it ended
    accept: tuple[int, ...]  # each round's acceptance length, for the rounds that ran
    tokens: tuple[int, ...]  # the tokens it committed this step
    logprobs: tuple[lp_mod.TokenLogprob, ...] = ()  # theirs, from a program with log-probabilities

    @property
    def paused(self) -> bool:
        """It idled: its pages held no further round (it still runs)."""
        return self.finish == PAUSED

    @property
    def reason(self) -> str | None:
        """Why it ended; None while it runs."""
        return None if self.finish in (RUNNING, PAUSED) else FINISH_REASONS[self.finish]


def unpack_step(packed: np.ndarray, rounds: int, logprobs: int | None = None) -> list[StepRow]:
    """The rows of `step`'s packed output [rows, 2 + rounds + rounds * L (+ its entries)], in order; `logprobs`: the
    top-k of a program with log-probabilities."""
    packed = np.asarray(packed)
    per_token = 1 if logprobs is None else 2 + 2 * logprobs
    width = (packed.shape[1] - 2 - rounds) // per_token
    rows = []
    for raw, row in zip(packed, packed.tolist()):
        n_new, finish = row[0], row[1]
        tokens = tuple(row[2 + rounds: 2 + rounds + n_new])
        entries = () if logprobs is None else tuple(lp_mod.unpack(raw[2 + rounds + width:], tokens, logprobs))
        rows.append(StepRow(finish, tuple(a for a in row[2: 2 + rounds] if a > 0), tokens, entries))
    return rows


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    """One row of a prefill chunk's output: its first generated token and finish code (meaningful on a request's
    last chunk)."""

    first: int
    finish: int
    # from a program with log-probabilities: the entries of the context tokens at start + 1 .. start + n_valid - 1,
    # then of the token after the chunk (the first generated token where the chunk ends the context)
    logprobs: tuple[lp_mod.TokenLogprob, ...] = ()

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token it emits: none where its logits were not finite."""
        return () if self.finish == FINISH_NONFINITE else (self.first,)

    @property
    def reason(self) -> str | None:
        """Why the request ended at its first token; None: it decodes on."""
        return None if self.finish == RUNNING else FINISH_REASONS[self.finish]


def unpack_prefill(packed: np.ndarray, batch: PrefillBatch | None = None, logprobs: int | None = None
                   ) -> list[PrefillRow]:
    """The rows of `prefill_chunk`'s packed output [rows, 2 (+ entries)], in order; `logprobs`: the top-k of a
    program with log-probabilities, whose entries name the tokens of `batch`."""
    packed = np.asarray(packed)
    rows = []
    for i, (first, finish) in enumerate(packed[:, :2].tolist()):
        entries = ()
        if logprobs is not None:
            n = int(batch.n_valid[i])
            follow = int(batch.next_token[i])
            targets = [*np.asarray(batch.tokens[i, 1:n]).tolist(), first if follow < 0 else follow]
            entries = tuple(lp_mod.unpack(packed[i, 2:], targets, logprobs))
        rows.append(PrefillRow(first, finish, entries))
    return rows


def _ar_rounds_keeping_the_draft(spec, target, drafter, state: DecodeState, tables: cd.AutomatonTables, more,
                                 rounds: int, pause) -> DecodeState:
    """AR rounds that collect each committed token's target features, then one drafter pass over all of them: the
    drafter context ends as it would after the same tokens committed by tree rounds, and its top-K lists are fresh.
    A row that committed nothing keeps its lists (`pause` idles rows between rounds)."""
    slots = state.tokens.shape[0]
    feats = jnp.zeros((slots, rounds, drafter.cfg.feature_dim), target.dtype)
    count = jnp.zeros((slots,), jnp.int32)

    def body(carry):
        s, feats, count = carry
        running = ~s.done
        new, out, _ = verify_and_commit(spec, target, s, root_only_tree(s.bonus), tables, s.constraint_state[:, None])
        at = jnp.where(running, count, rounds)  # rows of finished slots land out of range: dropped
        feats = feats.at[jnp.arange(slots), at].set(out.hidden[:, 0].astype(feats.dtype), mode="drop")
        return pause(new), feats, count + running.astype(jnp.int32)

    state, feats, count = jax.lax.while_loop(lambda c: more(c[0]), body, (state, feats, count))
    lp, ids, draft_cache = drafter_pass(spec, drafter, target, state.draft_cache, feats, count, state.bonus,
                                        cd.allowed_mask(tables, state.constraint_state))
    fresh = (count > 0)[:, None, None]
    return state.replace(draft_cache=draft_cache, draft_lp=jnp.where(fresh, lp, state.draft_lp),
                         draft_ids=jnp.where(fresh, ids, state.draft_ids))
