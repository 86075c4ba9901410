"""The paged cache's host-side manager (`kdtree_jax/serving/cache_manager.py`): unit tests with values, then a
hypothesis state machine that drives it like a scheduler (submit, grow, cancel, preempt the newest, a grow the pool
cannot serve) against an independent model of who owns which pages, in one data group or several. Then the
scheduler (`kdtree_jax/serving/scheduler.py`) over data groups: admission, prefill rows, preemption and compaction
each stay within a request's group."""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kdtree_jax.serving.cache_manager import CacheManager, OutOfPagesError
from kdtree_jax.serving.plan import Request
from kdtree_jax.serving.scheduler import Scheduler


# ---- unit tests ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_grow_free_and_page_table():
    m = CacheManager(num_pages=6, page_size=4, max_pages_per_request=3)
    assert (m.free_pages, m.used_pages, m.usage) == (6, 0, 0.0)
    assert m.grow("a", 5) == [0, 1]  # rows 0..4: two pages, lowest first
    assert m.grow("b", 4) == [2]
    assert m.grow("a", 8) == []  # two pages already hold 8 rows
    assert m.grow("a", 3) == []  # never shrinks
    assert m.grow("a", 9) == [3]
    assert m.pages("a") == [0, 1, 3] and m.num_rows("a") == 12 and m.num_rows("b") == 4
    assert (m.free_pages, m.used_pages, m.usage) == (2, 4, 4 / 6)
    assert m.owners() == {"a": (0, 1, 3), "b": (2,)}
    np.testing.assert_array_equal(m.page_table(["b", None, "a", "unknown"]),
                                  [[2, -1, -1], [-1, -1, -1], [0, 1, 3], [-1, -1, -1]])
    table = m.page_table(["b"], width=5)
    assert table.dtype == np.int32 and table.shape == (1, 5)
    with pytest.raises(ValueError, match="width 2"):
        m.page_table(["a"], width=2)
    m.check()

    assert m.free("a") == [0, 1, 3]
    assert m.free("a") == [] and m.free("never seen") == []
    assert m.pages("a") == [] and m.num_rows("a") == 0 and m.owners() == {"b": (2,)}
    assert m.grow("c", 12) == [0, 1, 3]  # the freed pages come back in the same order
    m.check()


@pytest.mark.timeout(10)
def test_allocation_is_deterministic():
    def run():
        m = CacheManager(8, 2, 4)
        out = [m.grow("x", 3), m.grow("y", 7), m.free("x"), m.grow("z", 8), m.free("y"), m.grow("x", 1)]
        return out, m.owners()

    assert run() == run()


@pytest.mark.timeout(10)
def test_out_of_pages_changes_nothing():
    m = CacheManager(num_pages=5, page_size=2, max_pages_per_request=5)
    assert m.grow("a", 5) == [0, 1, 2] and m.grow("c", 1) == [3]
    before = (m.owners(), m.free_pages, m.page_table(["a", "b", "c"]))
    assert not m.can_grow("b", 3) and not m.can_grow("a", 9) and m.can_grow("a", 8) and m.can_grow("b", 2)
    with pytest.raises(OutOfPagesError, match=r"needs 2 more pages, 1 of 5 are free") as err:
        m.grow("b", 3)
    assert (err.value.needed, err.value.free, err.value.rid) == (2, 1, "b")
    with pytest.raises(OutOfPagesError, match=r"request 'a' needs 2 more pages, 1 of 5 are free"):
        m.grow("a", 9)
    after = (m.owners(), m.free_pages, m.page_table(["a", "b", "c"]))
    assert before[:2] == after[:2] and np.array_equal(before[2], after[2])
    assert "b" not in m.owners()
    m.check()


@pytest.mark.timeout(10)
def test_max_pages_per_request():
    m = CacheManager(num_pages=10, page_size=4, max_pages_per_request=2)
    assert m.grow("a", 8) == [0, 1]
    assert not m.can_grow("a", 9)
    with pytest.raises(ValueError, match=r"9 rows need 3 pages .* max_pages_per_request 2"):
        m.grow("a", 9)
    with pytest.raises(ValueError, match="max_pages_per_request 2"):
        m.grow("b", 100)
    assert m.owners() == {"a": (0, 1)} and m.free_pages == 8


@pytest.mark.timeout(10)
def test_pages_for():
    m = CacheManager(num_pages=8, page_size=4, max_pages_per_request=8)
    assert [m.pages_for(n) for n in (0, 1, 3, 4, 5, 8, 9, 32)] == [0, 1, 1, 1, 2, 2, 3, 8]
    assert m.pages_for(np.int64(4)) == 1
    assert CacheManager(3, 1, 3).pages_for(3) == 3
    with pytest.raises(ValueError, match="n_rows"):
        m.pages_for(-1)
    assert m.grow("a", 0) == [] and m.owners() == {} and m.pages_needed("a", 0) == 0
    assert m.pages_needed("a", 5) == 2


@pytest.mark.timeout(10)
@pytest.mark.parametrize("args, name", [
    ((0, 4, 1), "num_pages"), ((-3, 4, 1), "num_pages"), ((2.0, 4, 1), "num_pages"), ((True, 4, 1), "num_pages"),
    ((4, 0, 1), "page_size"), ((4, "8", 1), "page_size"),
    ((4, 4, 0), "max_pages_per_request"), ((4, 4, 5), "max_pages_per_request"), ((4, 4, None), "max_pages_per_request"),
    ((6, 4, 1, 4), "multiple of groups"), ((6, 4, 1, 0), "groups"), ((6, 4, 4, 2), "max_pages_per_request"),
])
def test_bad_constructor_args(args, name):
    with pytest.raises(ValueError, match=name):
        CacheManager(*args)


@pytest.mark.timeout(10)
def test_bad_call_args():
    m = CacheManager(4, 2, 4)
    with pytest.raises(ValueError, match="None"):
        m.grow(None, 2)
    assert not m.can_grow(None, 2)
    with pytest.raises(ValueError, match="width"):
        m.page_table(["a"], width=0)
    assert m.page_table([]).shape == (0, 4)


@pytest.mark.timeout(10)
def test_check_names_the_page():
    m = CacheManager(4, 2, 4)
    m.grow("a", 4)
    m._tables["b"] = [1]  # corrupt on purpose: page 1 held twice
    with pytest.raises(AssertionError, match="page 1 "):
        m.check()
    m = CacheManager(4, 2, 4)
    m.grow("a", 4)
    m._tables["a"].pop()  # page 1 leaked: neither free nor listed
    with pytest.raises(AssertionError, match="page 1 "):
        m.check()


@pytest.mark.timeout(10)
def test_groups_own_contiguous_page_ranges():
    m = CacheManager(num_pages=8, page_size=4, max_pages_per_request=3, groups=2)
    assert [m.group_range(g) for g in range(2)] == [range(4), range(4, 8)]
    assert m.grow("a", 5, 1) == [4, 5] and m.grow("b", 4, 0) == [0]
    assert m.grow("a", 9) == [6]  # a known request grows in its own group without naming it
    assert (m.group_of("a"), m.group_of("b"), m.group_of("c")) == (1, 0, None)
    assert (m.free_in(0), m.free_in(1), m.free_pages) == (3, 1, 4)
    assert not m.can_grow("c", 8, 1) and m.can_grow("c", 8, 0)  # group 1 is short, the pool is not
    with pytest.raises(OutOfPagesError, match=r"needs 2 more pages, 1 of 4 are free"):
        m.grow("c", 8, 1)
    with pytest.raises(ValueError, match="holds pages of group 1, not of group 0"):
        m.grow("a", 12, 0)
    with pytest.raises(ValueError, match="name its group"):
        m.grow("c", 4)
    with pytest.raises(ValueError, match="group must be"):
        m.grow("c", 4, 2)
    m.check()
    assert m.free("a") == [4, 5, 6] and m.group_of("a") is None
    assert m.grow("a", 4, 0) == [1]  # freed, it may start again in another group
    m.check()


@pytest.mark.timeout(10)
def test_check_names_a_page_outside_its_requests_group():
    m = CacheManager(8, 2, 4, groups=2)
    m.grow("a", 4, 0)
    m._group["a"] = 1  # corrupt on purpose: a's pages 0, 1 are group 0's
    with pytest.raises(AssertionError, match="page 0 of request 'a' is outside its group 1"):
        m.check()
    m = CacheManager(8, 2, 4, groups=2)
    m._free[0].append(m._free[1].pop())  # a free page on the wrong group's stack
    with pytest.raises(AssertionError, match="free page 4 is on the stack of group 0"):
        m.check()


# ---- the state machine -----------------------------------------------------------------------------------------
class CacheMachine(RuleBasedStateMachine):
    """Drives a CacheManager as a scheduler would and keeps its own record of ownership: rid -> the pages grow
    returned to it (in order), the number of free pages and the order requests were created, computed from the
    page size alone, never from the manager's state."""

    @initialize(group_pages=st.integers(1, 12), groups=st.integers(1, 3), page_size=st.integers(1, 6),
                data=st.data())
    def setup(self, group_pages, groups, page_size, data):
        num_pages = group_pages * groups
        max_pages = data.draw(st.integers(1, group_pages), label="max_pages_per_request")
        self.m = CacheManager(num_pages, page_size, max_pages, groups)
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self.groups, self.group_pages = groups, group_pages
        self.owned: dict[int, list[int]] = {}
        self.group: dict[int, int] = {}  # rid -> the group it was submitted to (kept after it is freed)
        self.free_by_group = [group_pages] * groups
        self.live: list[int] = []  # live rids, oldest first
        self.next_rid = 0

    @property
    def free(self) -> int:
        return sum(self.free_by_group)

    def _pages(self, n_rows: int) -> int:
        return (n_rows + self.page_size - 1) // self.page_size

    def _grow(self, rid: int, n_rows: int) -> None:
        """Grow through the manager and check the outcome the model predicts: taken pages, OutOfPagesError or
        ValueError, the last two changing nothing."""
        have = len(self.owned.get(rid, []))
        total = self._pages(n_rows)
        needed = max(0, total - have)
        g = self.group[rid]
        free = self.free_by_group[g]
        ok = total <= self.max_pages and needed <= free
        assert self.m.can_grow(rid, n_rows, g) == ok
        if total > self.max_pages:
            event("grow: over max_pages_per_request")
            with pytest.raises(ValueError, match="max_pages_per_request"):
                self.m.grow(rid, n_rows, g)
            return
        if needed > free:
            event("grow: out of pages" + (" in its group, others free" if needed <= self.free else ""))
            with pytest.raises(OutOfPagesError, match=f"needs {needed} more pages, {free} of"):
                self.m.grow(rid, n_rows, g)
            return
        event("grow: takes pages" if needed else "grow: nothing to take")
        taken = self.m.grow(rid, n_rows, g if rid not in self.owned else None)  # a known request: its own group
        assert len(taken) == needed
        held = {p for pages in self.owned.values() for p in pages}
        mine = range(g * self.group_pages, (g + 1) * self.group_pages)
        assert all(p in mine and p not in held for p in taken), (taken, held, g)
        assert len(set(taken)) == len(taken)
        if taken:
            if rid not in self.owned:
                self.live.append(rid)
            self.owned.setdefault(rid, []).extend(taken)
            self.free_by_group[g] -= needed

    def _release(self, rid: int) -> None:
        freed = self.m.free(rid)
        assert freed == self.owned.pop(rid, [])
        if freed:
            self.free_by_group[self.group[rid]] += len(freed)
        if rid in self.live:
            self.live.remove(rid)

    @rule(data=st.data())
    def submit(self, data):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.group[rid] = data.draw(st.integers(0, self.groups - 1), label="group")
        n_rows = data.draw(st.integers(0, (self.max_pages + 1) * self.page_size), label="rows")
        self._grow(rid, n_rows)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        rid = data.draw(st.sampled_from(self.live), label="rid")
        extra = data.draw(st.integers(0, 3 * self.page_size), label="extra rows")
        self._grow(rid, len(self.owned[rid]) * self.page_size + extra)

    @rule(data=st.data())
    def cancel(self, data):
        """Free a live request, or one that is gone or never existed (a no-op)."""
        rid = data.draw(st.sampled_from(self.live) if self.live else st.integers(0, self.next_rid), label="rid")
        self._release(rid)

    @precondition(lambda self: self.live and self.groups > 1)
    @rule(data=st.data())
    def grow_in_another_group(self, data):
        """A request never takes a page outside its group: naming another is refused and changes nothing."""
        rid = data.draw(st.sampled_from(self.live), label="rid")
        other = data.draw(st.sampled_from([g for g in range(self.groups) if g != self.group[rid]]), label="group")
        before = self.m.owners()
        with pytest.raises(ValueError, match=f"holds pages of group {self.group[rid]}"):
            self.m.grow(rid, (len(self.owned[rid]) + 1) * self.page_size, other)
        assert self.m.owners() == before

    @precondition(lambda self: self.live)
    @rule()
    def preempt_newest(self):
        self._release(self.live[-1])

    @precondition(lambda self: min(self.free_by_group) < self.max_pages)
    @rule(data=st.data())
    def grow_past_free(self, data):
        """Ask for more pages than the group has free (from a live request or a new one), whatever the other groups
        have: must raise and change nothing."""
        g = data.draw(st.sampled_from([g for g in range(self.groups) if self.free_by_group[g] < self.max_pages]),
                      label="group")
        free = self.free_by_group[g]
        fits = [rid for rid in self.live if self.group[rid] == g and len(self.owned[rid]) + free < self.max_pages]
        rid = data.draw(st.sampled_from([*fits, self.next_rid]), label="rid")
        have = len(self.owned.get(rid, []))
        before = self.m.owners()
        with pytest.raises(OutOfPagesError):
            self.m.grow(rid, (have + free + 1) * self.page_size, g)
        assert self.m.owners() == before

    @invariant()
    def matches_model(self):
        m = self.m
        assert m.owners() == {rid: tuple(pages) for rid, pages in self.owned.items()}
        assert list(m.owners()) == self.live
        owned = sum(len(p) for p in self.owned.values())
        assert m.free_pages == self.free == self.num_pages - owned
        assert [m.free_in(g) for g in range(self.groups)] == self.free_by_group
        assert all(m.group_of(rid) == self.group[rid] for rid in self.live)
        assert m.used_pages == owned and m.usage == owned / self.num_pages
        every = [p for pages in self.owned.values() for p in pages]
        assert len(every) == len(set(every)), "a page owned twice"
        for rid, pages in self.owned.items():
            assert m.pages(rid) == pages and m.num_rows(rid) == len(pages) * self.page_size
        rids = [*self.live, None, self.next_rid]
        expect = np.full((len(rids), self.max_pages), -1, np.int32)
        for i, rid in enumerate(self.live):
            expect[i, :len(self.owned[rid])] = self.owned[rid]
        np.testing.assert_array_equal(m.page_table(rids), expect)
        m.check()

    @invariant()
    def free_pages_are_not_owned(self):
        """The pages new requests can take now in each group are exactly the group's pages nobody owns: probes take
        every free page (in requests of at most max_pages_per_request pages) and give them back, which leaves the
        state as it was."""
        owned = {p for pages in self.owned.values() for p in pages}
        probes = []
        for g, free in enumerate(self.free_by_group):
            taken = []
            for i in range(-(-free // self.max_pages)):
                probes.append(("probe", g, i))
                taken += self.m.grow(probes[-1], min(self.max_pages, free - len(taken)) * self.page_size, g)
            assert self.m.free_in(g) == 0
            mine = set(range(g * self.group_pages, (g + 1) * self.group_pages))
            assert sorted(taken) == sorted(mine - owned)
        assert self.m.free_pages == 0
        for rid in reversed(probes):
            self.m.free(rid)


CacheMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
test_cache_machine = pytest.mark.timeout(60)(CacheMachine.TestCase)


# ---- the scheduler over data groups -----------------------------------------------------------------------------
GROUPS = 2
SLOTS = 4  # two per group
PAGE = 4
GROUP_PAGES = 6
MAX_ROWS = 24  # a request's rows: GROUP_PAGES pages, so one request can fill its group
SLACK = 2
ROUNDS = 2  # rounds a step
ROUND_TOKENS = 2  # the most tokens a round commits


def _scheduler(chunk_tokens: int = 8) -> Scheduler:
    cache = CacheManager(GROUPS * GROUP_PAGES, PAGE, MAX_ROWS // PAGE, groups=GROUPS)
    return Scheduler(cache, max_slots=SLOTS, chunk_tokens=chunk_tokens, buckets=[4, 8], prefill_sizes=[1, 2],
                     row_slack=SLACK, max_rows=MAX_ROWS, rounds_per_step=ROUNDS, round_tokens=ROUND_TOKENS)


def _request(rid, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), None, (), 0, 0.0)


def _owned_within_groups(s: Scheduler) -> None:
    """Every page free or owned by an admitted request of the page's own group; each request's slot in its group."""
    s.check()
    admitted = {r.rid: r for r in s.prefilling + s.running}
    for rid, pages in s.cache.owners().items():
        group = admitted[rid].group
        assert all(p // GROUP_PAGES == group for p in pages), (rid, group, pages)
    for slot, r in enumerate(s.slots):
        assert r is None or slot // (SLOTS // GROUPS) == r.group, (slot, r.rid, r.group)


def _run_plan(s: Scheduler, steps: int = 1):
    """Plan one prefill and apply it as its program would; returns the plan's rows as (rid or None, group of the
    row's block)."""
    plan, _ = s.plan_prefill(steps)
    if plan is None:
        return []
    assert len(plan.rows) % GROUPS == 0
    block = len(plan.rows) // GROUPS
    out = []
    for i, chunk in enumerate(plan.rows):
        out.append((None if chunk is None else chunk.request.rid, i // block))
        if chunk is not None:
            assert chunk.request.group == i // block  # a row's pages are on its own data shard
            assert chunk.slot is None or chunk.slot in s.group_range(chunk.request.group)
            s.prefilled(chunk, running=True)
    _owned_within_groups(s)
    return out


@pytest.mark.timeout(10)
def test_requests_spread_over_groups_and_prefill_rows_go_by_group():
    s = _scheduler()
    for rid in "abcde":
        s.add(_request(rid, 3))
    # the least loaded group first; each group prefills up to chunk_tokens (two chunks of 4) in its own rows
    assert _run_plan(s) == [("a", 0), ("c", 0), ("b", 1), ("d", 1)]
    assert [r.rid if r else None for r in s.slots] == ["a", "c", "b", "d"]
    assert s.cache.pages("a") == [0] and s.cache.pages("b") == [6]
    assert [r.rid for r in s.waiting] == ["e"] and _run_plan(s) == []  # no slot left in any group
    assert s.step_slots(2) == [0, 2] and s.step_slots(4) == [0, 1, 2, 3] and s.busiest() == 2
    s.finish(2)  # b leaves group 1
    assert _run_plan(s) == [(None, 0), ("e", 1)]  # group 0 has no slot: a padding row keeps the blocks aligned
    assert s.slots[2].rid == "e" and s.cache.group_of("e") == 1


@pytest.mark.timeout(10)
def test_moves_compact_each_group_within_itself():
    s = _scheduler()
    for rid in "abcd":
        s.add(_request(rid, 3))
    _run_plan(s)
    s.finish(0)  # group 0: [None, c]; group 1: [b, d]
    s.finish(3)  # group 1: [b, None]
    assert s.moves() == [(1, 0)]  # c moves down within group 0; group 1 is compact already
    assert [r.rid if r else None for r in s.slots] == ["c", None, "b", None] and s.busiest() == 1
    _owned_within_groups(s)


@pytest.mark.timeout(10)
def test_preemption_takes_the_newest_request_of_the_short_group():
    s = _scheduler()
    for rid in ["old0", "old1", "new0", "new1"]:
        s.add(_request(rid, 4))
    assert _run_plan(s) == [("old0", 0), ("new0", 0), ("old1", 1), ("new1", 1)]
    for r in s.running:
        if r.group == 0:
            r.tokens += [7] * 10  # 14 rows + 2 expected + a round's 2 + slack: 5 pages; to run, 4. Group 0 has 6
    preempted = s.reserve(steps=1)  # group 1 needs 3 pages each: it has them
    # new1 is the newest overall, but only group 0 is short: its newest goes
    assert [r.rid for r in preempted] == ["new0"] and s.waiting[0].rid == "new0" and s.waiting[0].group is None
    assert {r.rid for r in s.running} == {"old0", "old1", "new1"} and len(s.cache.pages("old0")) == 5
    _owned_within_groups(s)


@pytest.mark.timeout(60)
def test_random_schedules_keep_every_page_in_its_group(rng):
    """Submit, prefill, grow, decode, finish, cancel and preempt at random; after every operation each page is free
    or held by an admitted request of its group, and each decoding request sits in a slot of its group."""
    s, next_rid, live = _scheduler(), 0, set()
    ops = 0
    while ops < 300 or (s.num_preemptions < 3 and ops < 5000):  # long enough to reach preemption on any seed
        ops += 1
        if rng.random() < 0.4:
            s.add(_request(next_rid, int(rng.integers(1, 15))))
            live.add(next_rid)
            next_rid += 1
        steps = int(rng.integers(1, 3))
        ahead = steps * ROUNDS * ROUND_TOKENS  # the most a step commits
        _run_plan(s, steps)
        s.reserve(steps)
        _owned_within_groups(s)
        for src, dst in s.moves():
            assert src // (SLOTS // GROUPS) == dst // (SLOTS // GROUPS), (src, dst)
        for g in range(GROUPS):
            used = [s.slots[i] is not None for i in s.group_range(g)]
            assert used == sorted(used, reverse=True), used  # the group's running requests in its lowest slots
        for slot, r in enumerate(s.slots):
            if r is None:
                continue
            r.tokens += [1] * int(rng.integers(0, ahead + 1))
            if r.known_len + ahead + SLACK >= MAX_ROWS or rng.random() < 0.1:
                s.finish(slot)
                live.discard(r.rid)
        if live and rng.random() < 0.1:
            rid = int(rng.choice(sorted(live)))
            assert s.remove(rid) is not None
            live.discard(rid)
        _owned_within_groups(s)
    assert next_rid > 50 and s.num_preemptions >= 3  # the schedule reached preemption, not only idle steps


# ---- prefix caching ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_prefix_hits_share_full_committed_pages():
    m = CacheManager(num_pages=8, page_size=4, max_pages_per_request=4, prefix_caching=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, size=13).tolist()
    m.grow("a", 13)
    assert m.match("b", prompt) == []  # nothing indexed yet
    assert m.publish("a", prompt, 13) == 3  # rows 0..12: three full pages
    assert m.publish("a", prompt, 13) == 0
    assert m.match("b", prompt) == [0, 1, 2]
    assert m.match("b", prompt[:12]) == [0, 1]  # at least the last token is computed
    other = list(prompt)
    other[5] += 1
    assert m.match("c", other) == [0]  # page 1 differs, so pages 1 and 2 are not the same rows
    hit = m.match("b", prompt)
    assert m.share_cost(hit, 14) == 1  # the hit pages are held by "a": only page 3 of "b" is new
    m.share("b", hit)
    m.grow("b", 14)
    assert m.pages("b") == [0, 1, 2, 4] and m.free_pages == 3
    m.check()
    assert m.free("a") == [0, 1, 2, 3] and m.free_pages == 4
    assert m.free("b") == [0, 1, 2, 4]
    assert (m.free_pages, m.cached_pages) == (8, 3)  # the indexed pages stay cached, and count as free
    assert m.share_cost(m.match("d", prompt), 13) == 4  # taking cached pages back costs them too
    m.check()
    with pytest.raises(ValueError, match="hold no pages"):
        m.grow("e", 1)
        m.share("e", [0])
    with pytest.raises(ValueError, match="not cached"):
        m.share("f", [3])


@pytest.mark.timeout(10)
def test_eviction_gives_up_the_least_recent_tail_first():
    m = CacheManager(num_pages=6, page_size=2, max_pages_per_request=6, prefix_caching=True)
    prompt = list(range(10, 19))  # 9 tokens: 4 full pages
    m.grow("a", 9)
    m.publish("a", prompt, 9)
    m.free("a")
    assert m.cached_pages == 4 and m.match("b", prompt) == [0, 1, 2, 3]
    assert m.grow("x", 8) == [4, 5, 3, 2]  # free pages first (its partial page 4 on top), then the tail
    assert m.match("b", prompt) == [0, 1] and m.cached_pages == 2
    m.check()
    m.clear_cache()  # the pool's contents were lost
    assert m.match("b", prompt) == [] and m.free_pages == 2 and m.cached_pages == 0
    m.check()


@pytest.mark.timeout(10)
def test_prefix_caching_off_shares_nothing():
    m = CacheManager(num_pages=4, page_size=2, max_pages_per_request=4)
    m.grow("a", 5)
    assert m.publish("a", [1, 2, 3, 4, 5], 5) == 0 and m.match("b", [1, 2, 3, 4, 5]) == []
    m.free("a")
    assert m.cached_pages == 0 and m.free_pages == 4


@pytest.mark.timeout(10)
def test_check_catches_a_shared_page_left_unindexed():
    m = CacheManager(num_pages=4, page_size=2, max_pages_per_request=4, prefix_caching=True)
    m.grow("a", 3)
    m._tables["b"], m._group["b"] = [0], 0  # listed twice, counted once and not indexed
    m._users[0] += 1
    with pytest.raises(AssertionError, match="page 0 is held by several requests but not cached"):
        m.check()


class PrefixMachine(RuleBasedStateMachine):
    """Requests over a two-token alphabet (so prefixes are shared often) submitted with a prefix lookup, committing
    tokens, finishing, cancelled, preempted, and a pool under pressure that evicts. The machine writes rows as the
    engine does, only at or past a request's committed length, and keeps its own record of each page's tokens and
    of each page's live users. It checks that a written page is never shared or cached, that every hit page holds
    exactly the request's own tokens (no stale rows after an eviction), and that user counts equal live users."""

    @initialize(group_pages=st.integers(2, 12), page_size=st.integers(1, 3), groups=st.integers(1, 2))
    def setup(self, group_pages, page_size, groups):
        num_pages = group_pages * groups
        self.m = CacheManager(num_pages, page_size, group_pages, groups, prefix_caching=True)
        self.P, self.num_pages, self.groups = page_size, num_pages, groups
        self.tokens: dict[int, list[int]] = {}  # live rid -> its context
        self.rows: dict[int, int] = {}  # live rid -> committed rows
        self.content: dict[int, list] = {}  # page -> the token each row holds (None: never written)
        self.next_rid = 0

    def _write(self, rid: int, start: int, stop: int) -> None:
        pages = self.m.pages(rid)
        for s in range(start, stop):
            page = pages[s // self.P]
            index = self.m._index[page // self.m.group_pages]
            assert self.m._users[page] == 1 and not index.indexed(page), f"row {s} written to shared {page}"
            self.content.setdefault(page, [None] * self.P)[s % self.P] = self.tokens[rid][s]

    def _grow(self, rid: int, n_rows: int, group: int | None = None) -> bool:
        if not self.m.can_grow(rid, n_rows, group):
            return False
        for page in self.m.grow(rid, n_rows, group):
            self.content[page] = [None] * self.P  # a fresh or evicted page: its old rows are garbage now
        return True

    @rule(data=st.data())
    def submit(self, data):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        tokens = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=4 * self.P + 2), label="context")
        group = data.draw(st.integers(0, self.groups - 1), label="group")
        hit = self.m.match(rid, tokens, group)
        event(f"submit: {len(hit)} pages hit")
        for j, page in enumerate(hit):  # the cached rows are exactly this request's tokens, in its group
            assert self.content[page] == tokens[j * self.P:(j + 1) * self.P], (page, j)
            assert page in self.m.group_range(group)
        if (self.m.share_cost(hit, len(tokens)) > self.m.free_in(group)
                or self.m.pages_for(len(tokens)) > self.m.max_pages_per_request):
            return
        self.m.share(rid, hit, group)
        start = len(hit) * self.P
        self.tokens[rid] = tokens
        assert self._grow(rid, len(tokens), group)
        self._write(rid, start, len(tokens))
        self.rows[rid] = len(tokens)
        self.m.publish(rid, tokens, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data):
        """A round: scratch rows past the committed length, then the accepted ones committed and published."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        new = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=2 * self.P), label="accepted")
        end = self.rows[rid] + len(new)
        if not self._grow(rid, end):
            return
        self.tokens[rid] += new
        self._write(rid, self.rows[rid], end)
        self.rows[rid] = end
        self.m.publish(rid, self.tokens[rid], end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def leave(self, data):
        """Finish, cancel or preempt: the same call to the manager; a preempted request comes back as a submit."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        self.m.free(rid)
        del self.tokens[rid], self.rows[rid]

    @rule(data=st.data())
    def pressure(self, data):
        """A request that takes every free page of a group, evicting its cached ones, then leaves."""
        group = data.draw(st.integers(0, self.groups - 1), label="group")
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        n = self.m.free_in(group)
        if n:
            self.tokens[rid] = [2] * (n * self.P)  # a token no context uses: never a hit
            assert self._grow(rid, n * self.P, group)
            self._write(rid, 0, n * self.P)
            self.m.free(rid)
            del self.tokens[rid]
            assert self.m._index[group].n_parked == 0

    @invariant()
    def counts_are_live_users(self):
        users = [0] * self.num_pages
        for rid in self.tokens:
            for page in self.m.pages(rid):
                users[page] += 1
        assert self.m._users == users
        assert self.m.free_pages == users.count(0)
        self.m.check()


PrefixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_prefix_machine = pytest.mark.timeout(60)(PrefixMachine.TestCase)


# ---- reservations -------------------------------------------------------------------------------------------------
def _admit(s: Scheduler) -> list:
    """One prefill plan (one group), applied as its program would; returns the rids it started."""
    plan, _ = s.plan_prefill(1)
    for chunk in () if plan is None else plan.chunks:
        s.prefilled(chunk, running=True)
    s.check()
    return [] if plan is None else [c.request.rid for c in plan.chunks]


@pytest.mark.timeout(10)
def test_a_reservation_is_expected_tokens_one_worst_round_and_scratch_capped_at_max_tokens():
    """8 rounds a step, 9 tokens at most a round, 10 rows of scratch, pages of 4: a request reserves its known
    tokens, 8 x its mean acceptance (every request's before it has rounds of its own), one round's 9 and the
    scratch; never more than its prompt + max_new_tokens + scratch."""
    cache = CacheManager(64, PAGE, 32)
    s = Scheduler(cache, max_slots=2, chunk_tokens=8, buckets=[8], prefill_sizes=[1], row_slack=10, max_rows=128,
                  rounds_per_step=8, round_tokens=9)
    long = Request("long", list(range(1, 7)), types.SimpleNamespace(max_new_tokens=90), (), 0, 0.0)
    short = Request("short", list(range(1, 7)), types.SimpleNamespace(max_new_tokens=3), (), 0, 0.0)
    for r in (long, short):
        s.add(r)
    assert _admit(s) + _admit(s) == ["long", "short"]
    for r in (long, short):
        r.tokens = [5]  # the prefill's token
    assert s.reserve(steps=1) == []
    rows = {r.rid: len(cache.pages(r.rid)) * PAGE for r in (long, short)}
    assert rows == {"long": 36, "short": 20}  # 7 + 8 x 1 + 9 + 10 = 34 rows: 9 pages; 6 + 3 + 10 = 19: 5 pages
    s.observe([3, 3, 4, 2])  # three tokens a round, over every request: the prior of long
    assert s.mean_acceptance(long) == 3.0
    long.accept_lengths = [4, 4]
    s.reserve(steps=2)  # a step in flight: two steps ahead
    assert len(cache.pages("long")) * PAGE == 92  # 7 + 2 x 8 x 4 + 9 + 10 = 90 rows


@pytest.mark.timeout(10)
def test_a_short_pool_still_gives_every_row_one_rounds_scratch_before_it_preempts():
    """Oldest first, each running request gets the rows of one more round (its known tokens plus the scratch), then
    grows toward its reservation as far as the pages go; only a group that lacks even one round preempts."""
    cache = CacheManager(20, PAGE, 20)
    s = Scheduler(cache, max_slots=2, chunk_tokens=8, buckets=[8], prefill_sizes=[1], row_slack=10, max_rows=128,
                  rounds_per_step=8, round_tokens=9)
    a, b = (Request(rid, list(range(1, 8)), types.SimpleNamespace(max_new_tokens=90), (), 0, 0.0) for rid in "ab")
    for r in (a, b):
        s.add(r)
    assert _admit(s) + _admit(s) == ["a", "b"]
    for r in (a, b):
        r.tokens = [5]  # 8 known tokens: a round needs 18 rows (5 pages), the reservation 35 (9 pages)
    cache.grow("hog", 6 * PAGE)  # 10 pages left for a and b
    assert s.reserve(steps=1) == []
    assert len(cache.pages("a")) == 9 and len(cache.pages("b")) == 5  # b runs, short of its 9 pages
    b.tokens += [5] * 4  # b needs 22 rows (6 pages) to run a round: a and b cannot both
    assert [r.rid for r in s.reserve(steps=1)] == ["b"]
    assert len(cache.pages("a")) == 9 and cache.pages("b") == []


@pytest.mark.timeout(10)
def test_admission_counts_the_first_reservation_of_every_request_it_starts():
    """Two requests from the queue in one plan: the second starts only where the pages leave the first one's
    reservation too, so the reservation after the prefill preempts neither."""
    cache = CacheManager(14, PAGE, 14)
    s = Scheduler(cache, max_slots=2, chunk_tokens=16, buckets=[8], prefill_sizes=[1, 2], row_slack=10,
                  max_rows=128, rounds_per_step=8, round_tokens=9)
    a, b = (Request(rid, list(range(1, 8)), types.SimpleNamespace(max_new_tokens=90), (), 0, 0.0) for rid in "ab")
    for r in (a, b):
        s.add(r)
    assert _admit(s) == ["a"]  # 9 pages each to start: 14 hold one
    a.tokens = [5]
    assert s.reserve(steps=1) == [] and len(cache.pages("a")) == 9
