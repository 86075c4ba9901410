"""The paged cache's host-side manager (`kdtree_jax/serving/cache_manager.py`): unit tests with values, then a
hypothesis state machine that drives it like a scheduler (submit, grow, cancel, preempt the newest, a grow the pool
cannot serve) against an independent model of who owns which pages."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kdtree_jax.serving.cache_manager import CacheManager, OutOfPagesError


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


# ---- the state machine -----------------------------------------------------------------------------------------
class CacheMachine(RuleBasedStateMachine):
    """Drives a CacheManager as a scheduler would and keeps its own record of ownership: rid -> the pages grow
    returned to it (in order), the number of free pages and the order requests were created, computed from the
    page size alone, never from the manager's state."""

    @initialize(num_pages=st.integers(1, 24), page_size=st.integers(1, 6), data=st.data())
    def setup(self, num_pages, page_size, data):
        max_pages = data.draw(st.integers(1, num_pages), label="max_pages_per_request")
        self.m = CacheManager(num_pages, page_size, max_pages)
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self.owned: dict[int, list[int]] = {}
        self.free = num_pages
        self.live: list[int] = []  # live rids, oldest first
        self.next_rid = 0

    def _pages(self, n_rows: int) -> int:
        return (n_rows + self.page_size - 1) // self.page_size

    def _grow(self, rid: int, n_rows: int) -> None:
        """Grow through the manager and check the outcome the model predicts: taken pages, OutOfPagesError or
        ValueError, the last two changing nothing."""
        have = len(self.owned.get(rid, []))
        total = self._pages(n_rows)
        needed = max(0, total - have)
        ok = total <= self.max_pages and needed <= self.free
        assert self.m.can_grow(rid, n_rows) == ok
        if total > self.max_pages:
            event("grow: over max_pages_per_request")
            with pytest.raises(ValueError, match="max_pages_per_request"):
                self.m.grow(rid, n_rows)
            return
        if needed > self.free:
            event("grow: out of pages")
            with pytest.raises(OutOfPagesError, match=f"needs {needed} more pages, {self.free} of"):
                self.m.grow(rid, n_rows)
            return
        event("grow: takes pages" if needed else "grow: nothing to take")
        taken = self.m.grow(rid, n_rows)
        assert len(taken) == needed
        held = {p for pages in self.owned.values() for p in pages}
        assert all(0 <= p < self.num_pages and p not in held for p in taken), (taken, held)
        assert len(set(taken)) == len(taken)
        if taken:
            if rid not in self.owned:
                self.live.append(rid)
            self.owned.setdefault(rid, []).extend(taken)
            self.free -= needed

    def _release(self, rid: int) -> None:
        freed = self.m.free(rid)
        assert freed == self.owned.pop(rid, [])
        self.free += len(freed)
        if rid in self.live:
            self.live.remove(rid)

    @rule(data=st.data())
    def submit(self, data):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
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

    @precondition(lambda self: self.live)
    @rule()
    def preempt_newest(self):
        self._release(self.live[-1])

    @precondition(lambda self: self.free < self.max_pages)
    @rule(data=st.data())
    def grow_past_free(self, data):
        """Ask for more pages than are free (from a live request or a new one): must raise and change nothing."""
        fits = [rid for rid in self.live if len(self.owned[rid]) + self.free < self.max_pages]
        rid = data.draw(st.sampled_from([*fits, self.next_rid]), label="rid")
        have = len(self.owned.get(rid, []))
        before = self.m.owners()
        with pytest.raises(OutOfPagesError):
            self.m.grow(rid, (have + self.free + 1) * self.page_size)
        assert self.m.owners() == before

    @invariant()
    def matches_model(self):
        m = self.m
        assert m.owners() == {rid: tuple(pages) for rid, pages in self.owned.items()}
        assert list(m.owners()) == self.live
        owned = sum(len(p) for p in self.owned.values())
        assert m.free_pages == self.free == self.num_pages - owned
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
        """The pages new requests can take now are exactly the ones nobody owns: probes take every free page (in
        requests of at most max_pages_per_request pages) and give them back, which leaves the state as it was."""
        taken = []
        probes = [("probe", i) for i in range(-(-self.free // self.max_pages))]
        for rid in probes:
            taken += self.m.grow(rid, min(self.max_pages, self.free - len(taken)) * self.page_size)
        assert self.m.free_pages == 0
        owned = {p for pages in self.owned.values() for p in pages}
        assert sorted(taken) == sorted(set(range(self.num_pages)) - owned)
        for rid in reversed(probes):
            self.m.free(rid)


CacheMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
test_cache_machine = pytest.mark.timeout(60)(CacheMachine.TestCase)
