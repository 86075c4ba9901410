"""One scheduler step on the host (`Scheduler.schedule` -> `StepPlan`, `Scheduler.update` <- `StepOutput`), with the
device's rows written by hand: what the plan holds, what each request gains, and who keeps a slot and pages."""
from __future__ import annotations

import types

import numpy as np
import pytest

from kdtree_jax.decode.budget import StepKind
from kdtree_jax.decode.speculative import FINISH_LENGTH, FINISH_STOP, RUNNING
from kdtree_jax.serving.cache_manager import CacheManager
from kdtree_jax.serving.plan import Chunk, PrefillPlan, Request, StepOutput
from kdtree_jax.serving.programs import PAUSED, PrefillRow, StepRow
from kdtree_jax.serving.scheduler import Scheduler

PAGE = 4
KINDS = {1: StepKind("ddtree", 4), 2: StepKind("ar")}


def _scheduler() -> tuple[Scheduler, CacheManager]:
    cache = CacheManager(64, PAGE, 32)
    s = Scheduler(cache, max_slots=2, chunk_tokens=16, buckets=[8], prefill_sizes=[1, 2], row_slack=3, max_rows=64,
                  rounds_per_step=2, round_tokens=3, kinds=KINDS, widths=[1, 2])
    return s, cache


def _request(rid: str, n_prompt: int, max_new_tokens: int = 20) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), types.SimpleNamespace(max_new_tokens=max_new_tokens), (), 0,
                   0.0)


@pytest.mark.timeout(10)
def test_a_step_plans_prefill_and_decode_together_and_its_output_updates_each_request():
    """Two requests whose prompts end in one chunk take their slots when scheduled, so the step after the prefill
    runs over both (AR at two active). One ends at its first token: the update frees its slot and pages and drops
    the row the step carried it in; the other gains its first token, then the step's."""
    s, cache = _scheduler()
    a, b = _request("a", 6), _request("b", 5)
    s.add(a)
    s.add(b)
    plan = s.schedule(steps=1)
    assert [c.request.rid for c in plan.prefill.chunks] == ["a", "b"] and plan.prefill.bucket == 8
    assert all(c.last for c in plan.prefill.chunks) and s.prefilling == [] and s.slots == [a, b]
    assert (plan.kind, plan.width, plan.active) == (StepKind("ar"), 2, 2)
    assert [r.rid for r, _ in plan.rows] == ["a", "b"] and plan.released == () and plan.moves == ()
    np.testing.assert_array_equal(plan.prefill_pages, cache.page_table(["a", "b"]))
    # each holds its context, its first token and one round's scratch at least: 6 + 1 + 3 rows, 5 + 1 + 3 rows
    assert len(cache.pages("a")) * PAGE >= 10 and len(cache.pages("b")) * PAGE >= 9

    chunk_a, chunk_b = plan.prefill.chunks
    out = StepOutput(time=2.0, prefill_time=1.0,
                     prefill=((chunk_a, PrefillRow(7, RUNNING)), (chunk_b, PrefillRow(9, FINISH_STOP))),
                     decoded=((plan.rows[0], StepRow(RUNNING, (2, 1), (1, 2, 3))),
                              (plan.rows[1], StepRow(FINISH_STOP, (), ()))), n_draft=4)
    updates = s.update(out)
    assert [(u.request.rid, u.tokens, u.reason, u.started, u.time) for u in updates] == [
        ("a", (7,), None, True, 1.0), ("b", (9,), "stop", False, 1.0), ("a", (1, 2, 3), None, False, 2.0)]
    assert s.slots == [a, None] and cache.pages("b") == [] and a.prefilled == 6 and b.prefilled == 5
    assert a.tokens == [7, 1, 2, 3] and a.accept_lengths == [2, 1] and a.num_draft_tokens == 8
    assert a.first_token_time == 1.0 and b.tokens == [9]
    s.check()

    plan = s.schedule(steps=1)  # a alone: the one-slot kind over the narrowest width
    assert plan.prefill is None and (plan.kind, plan.width, plan.active) == (StepKind("ddtree", 4), 1, 1)


@pytest.mark.timeout(10)
def test_an_update_skips_rows_of_requests_preempted_since_and_counts_paused_rows():
    """With overlap a step's rows are read during the next step. A row whose request was preempted after it was
    queued brings nothing, even where the request is back in a slot by then (a new epoch): those tokens are
    recomputed. A paused row still runs; a row that ended frees its request's slot and pages."""
    s, cache = _scheduler()
    a, b = _request("a", 6), _request("b", 5)
    s.add(a)
    s.add(b)
    plan = s.schedule(steps=1)
    s.update(StepOutput(time=1.0, prefill=tuple((c, PrefillRow(5, RUNNING)) for c in plan.prefill.chunks)))
    queued = s.schedule(steps=2)
    s._preempt(b)  # as a schedule does where pages run out
    again = s.schedule(steps=2)  # b is readmitted: its context (prompt + its token) prefilled again, into slot 1
    assert [c.request.rid for c in again.prefill.chunks] == ["b"] and s.slots == [a, b] and b.epoch == 1
    out = StepOutput(time=2.0, prefill_time=2.0, prefill=((again.prefill.chunks[0], PrefillRow(8, RUNNING)),),
                     decoded=((queued.rows[0], StepRow(PAUSED, (), ())),
                              (queued.rows[1], StepRow(RUNNING, (1,), (4,)))))
    assert [(u.request.rid, u.tokens, u.reason) for u in s.update(out)] == [("b", (8,), None), ("a", (), None)]
    assert s.num_paused == 1 and b.tokens == [5, 8] and b.num_preemptions == 1
    ended = s.schedule(steps=1)
    update = s.update(StepOutput(time=3.0, decoded=((ended.rows[0], StepRow(FINISH_LENGTH, (2,), (6, 7))),)))
    assert [(u.request.rid, u.tokens, u.reason) for u in update] == [("a", (6, 7), "length")]
    assert s.slots == [None, b] and cache.pages("a") == []
    s.check()


@pytest.mark.timeout(10)
def test_chunks_of_requests_preempted_in_the_same_step_become_padding():
    a, b = _request("a", 6), _request("b", 5)
    plan = PrefillPlan(8, (Chunk(a, 0, 6, 0), None, Chunk(b, 0, 5, 1), None))
    assert plan.without([b]).rows == (plan.rows[0], None, None, None)
    assert plan.without([a, b]) is None and plan.without([]) is plan
