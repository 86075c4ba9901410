"""`commit()` on hand-built DecodeStates: where a request stops (stop ids, max_new_tokens, non-finite logits), what it
counts, and what a finished request keeps. Expected values are written out per row below."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from kdtree_jax.decode.params import RequestParams
from kdtree_jax.decode.speculative import (
    FINISH_LENGTH,
    FINISH_NONFINITE,
    FINISH_STOP,
    RUNNING,
    DecodeState,
    RequestRows,
    commit,
    is_stop_token,
)

CAPACITY = 16  # cache rows per request
WIDTH = 5  # emitted tokens per round: root, up to D = 3 accepted drafts, the new bonus
ROUNDS = 4  # accept_len columns
N_STOP = 3  # stop-id table width; shorter lists are padded with -1
ROUND = 2  # the round being committed (columns 0 and 1 hold earlier rounds)
PAD = -1


@dataclasses.dataclass
class Row:
    """One request before the round and the round's output for it."""

    emitted: list[int]  # [WIDTH]: the root (last round's bonus), accepted drafts, the new bonus, then root copies
    n_accepted: int  # accepted drafts + the new bonus (>= 1)
    stop: tuple[int, ...] = (9,)
    max_new: int = 10
    n_generated: int = 1
    length: int = 4  # the root's position
    finish: int = RUNNING
    nonfinite: bool = False


# (before, expected n_generated, expected finish); the rule each row checks is its comment
ROWS = [
    # the root is a stop id but not fresh (counted last round); the first fresh stop (j = 2) ends the request, the
    # one after it (j = 4) does not count: 2 new tokens, the stop token included
    (Row([9, 4, 9, 5, 9], 4), 1 + 2, FINISH_STOP),
    # only the root and the root copies past the bonus (j > n_accepted) are stop ids: nothing stops, 3 new tokens
    (Row([9, 4, 5, 6, 9], 3), 1 + 3, RUNNING),
    # several stop ids, -1 padded: the earliest position wins (8 at j = 2), whichever id it is
    (Row([3, 5, 8, 7, 2], 4, stop=(7, 8)), 1 + 2, FINISH_STOP),
    # no stop id at all (an all -1 row): every accepted token counts
    (Row([3, 5, 6, 7, 2], 4, stop=()), 1 + 4, RUNNING),
    # max_new_tokens cuts mid-round: room for 2 of the 4 accepted tokens
    (Row([3, 5, 6, 7, 2], 4, max_new=5, n_generated=3), 5, FINISH_LENGTH),
    # a stop id past the room (j = 3 > 2) is cut off: the request ends at its length, not at the stop
    (Row([3, 5, 6, 9, 2], 4, max_new=5, n_generated=3), 5, FINISH_LENGTH),
    # a stop id exactly at the room's last token: a stop
    (Row([3, 5, 9, 7, 2], 4, max_new=5, n_generated=3), 5, FINISH_STOP),
    # a request that finished earlier is carried unchanged, whatever the round emitted for it
    (Row([3, 9, 6, 7, 2], 4, n_generated=6, length=9, finish=FINISH_LENGTH), 6, FINISH_LENGTH),
    # non-finite logits: no token of the round counts, whatever it holds (a stop id at j = 1 included)
    (Row([3, 9, 6, 7, 2], 4, nonfinite=True), 1, FINISH_NONFINITE),
]


def build(rows: list[Row]):
    """The state before the round and commit()'s other arguments, as numpy arrays."""
    bt = len(rows)
    tokens = np.full((bt, CAPACITY), 0, np.int32)
    for b, r in enumerate(rows):
        tokens[b, : r.length] = 100 + b  # prompt and earlier tokens
        tokens[b, r.length] = r.emitted[0]  # the root sits at the root's position
    accept_len = np.tile(np.array([3, 2, 0, 0], np.int32), (bt, 1))  # rounds 0 and 1 already committed
    params = RequestRows.of([RequestParams(max_new_tokens=r.max_new) for r in rows], [r.stop for r in rows], N_STOP)
    state = DecodeState(
        tokens=tokens,
        length=np.array([r.length for r in rows], np.int32),
        prompt_len=np.full((bt,), 3, np.int32),
        n_generated=np.array([r.n_generated for r in rows], np.int32),
        finish=np.array([r.finish for r in rows], np.int32),
        cache=None, draft_cache=None,
        draft_lp=np.zeros((bt, 3, 2), np.float32), draft_ids=np.zeros((bt, 3, 2), np.int32),
        keys=np.zeros((bt, 2), np.uint32),
        params=params,
        round=np.int32(ROUND),
        accept_len=accept_len,
    )
    emitted = np.array([r.emitted for r in rows], np.int32)
    n_accepted = np.array([r.n_accepted for r in rows], np.int32)
    nonfinite = np.array([r.nonfinite for r in rows], bool)
    return state, emitted, n_accepted, nonfinite


commit_jit = jax.jit(commit)


def test_stop_table_pads_with_minus_one():
    params = build([r for r, *_ in ROWS])[0].params
    np.testing.assert_array_equal(np.asarray(params.stop_ids)[:4],
                                  [[9, PAD, PAD], [9, PAD, PAD], [7, 8, PAD], [PAD, PAD, PAD]])
    with pytest.raises(ValueError, match="request 0 has 4 stop ids; the table holds 3"):
        RequestRows.of([RequestParams(max_new_tokens=4)], [(1, 2, 3, 4)], N_STOP)


def test_padding_never_matches_a_token():
    """A -1 in the table is no stop id, even against a -1 token (which a real round never emits)."""
    tokens = np.array([[-1, 7, 8, 9], [-1, 7, 8, 9]], np.int32)
    stop = np.array([[8, PAD], [PAD, PAD]], np.int32)
    np.testing.assert_array_equal(np.asarray(is_stop_token(tokens, stop)),
                                  [[False, False, True, False], [False, False, False, False]])


def test_commit_counts_stops_and_cuts_each_row():
    rows = [r for r, *_ in ROWS]
    state, emitted, n_accepted, nonfinite = build(rows)
    new = jax.tree.map(np.asarray, commit_jit(state, emitted, n_accepted, nonfinite))
    for b, (row, n_generated, finish) in enumerate(ROWS):
        assert (int(new.n_generated[b]), int(new.finish[b])) == (n_generated, finish), (b, row)


def test_commit_writes_tokens_advances_length_and_records_accept_len():
    """Running rows (non-finite ones included) get the round's tokens at the root's position and their length moves
    to the new bonus; the round's accept_len column is n_accepted for rows that counted tokens and 0 for the done and
    non-finite ones; earlier columns and everything of a done row stay as they were."""
    rows = [r for r, *_ in ROWS]
    state, emitted, n_accepted, nonfinite = build(rows)
    new = jax.tree.map(np.asarray, commit_jit(state, emitted, n_accepted, nonfinite))
    assert int(new.round) == ROUND + 1
    for b, row in enumerate(rows):
        done = row.finish != RUNNING
        want_tokens = state.tokens[b].copy()
        if not done:
            want_tokens[row.length: row.length + WIDTH] = row.emitted
        np.testing.assert_array_equal(new.tokens[b], want_tokens, err_msg=str(b))
        assert int(new.length[b]) == row.length + (0 if done else row.n_accepted), b
        want_accept = [3, 2, 0 if done or row.nonfinite else row.n_accepted, 0]
        np.testing.assert_array_equal(new.accept_len[b], want_accept, err_msg=str(b))
    # the bonus read back from the new state is the round's new bonus
    np.testing.assert_array_equal(np.asarray(new.bonus)[:2], [emitted[0, 4], emitted[1, 3]])
    np.testing.assert_array_equal(new.prompt_len, state.prompt_len)
    np.testing.assert_array_equal(new.params.stop_ids, state.params.stop_ids)


def test_finished_rows_are_carried_unchanged_by_later_rounds():
    """The next round emits a stop id into every row: rows that finished (stop, length, non-finite) keep their
    tokens, length, count and finish; the one that kept running stops now."""
    rows = [r for r, *_ in ROWS]
    state, emitted, n_accepted, nonfinite = build(rows)
    first = commit_jit(state, emitted, n_accepted, nonfinite)
    bonus = np.asarray(first.bonus)
    again = np.stack([bonus, np.full_like(bonus, 9), bonus, bonus, bonus], axis=1)
    second = jax.tree.map(np.asarray, commit_jit(first, again, np.full_like(n_accepted, 2), np.zeros_like(nonfinite)))
    first = jax.tree.map(np.asarray, first)
    for b, (row, n_generated, finish) in enumerate(ROWS):
        if finish != RUNNING:
            for field in ("tokens", "length", "n_generated", "finish"):
                np.testing.assert_array_equal(getattr(second, field)[b], getattr(first, field)[b], err_msg=field)
            assert int(second.accept_len[b, ROUND + 1]) == 0
        elif row.stop == (9,):
            assert (int(second.n_generated[b]), int(second.finish[b])) == (n_generated + 1, FINISH_STOP), b
            assert int(second.accept_len[b, ROUND + 1]) == 2
        else:  # no stop ids: both tokens count
            assert (int(second.n_generated[b]), int(second.finish[b])) == (n_generated + 2, RUNNING), b
    assert int(second.round) == ROUND + 2
