"""The host side of a paged latent cache: which pages of the device's pool each request holds.

The device keeps a pool of `num_pages` pages of `page_size` cache rows each (per layer). A request holds an ordered
list of pages, its page table: its row s lives in page `pages[s // page_size]` at offset `s % page_size`, so a
request takes memory for the rows it has, not for the longest context, and a finished or preempted request gives
its pages straight back to the pool. The manager only deals in page indices; the scheduler asks it before each step
to grow each running request to the rows that step may write, admits a new request only when its pages are free,
and preempts (frees) the newest request when they run out. The device reads `page_table()`.

Pure state, no device and no jax: every change goes through `grow` and `free`, and `check` verifies the whole
state, so the scheduler and its tests can drive it directly.

Ownership lives in one place, the per-page user count `_users`: 0 means free, and every page a request's table
lists counts that request once. Today a page has at most one user; a prefix cache will share full pages between
requests by counting more than one, and a page returns to the pool only when its count drops to 0.
"""
from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence

import numpy as np

from kdtree_jax.paged import UNOWNED


class OutOfPagesError(RuntimeError):
    """A grow needs more pages than the pool has free; nothing was changed, so the caller can preempt and retry."""

    def __init__(self, rid: Hashable, needed: int, free: int, num_pages: int):
        super().__init__(f"request {rid!r} needs {needed} more pages, {free} of {num_pages} are free")
        self.rid = rid
        self.needed = needed
        self.free = free


def _count(name: str, value, minimum: int) -> int:
    """`value` as an int >= minimum (numpy integers too, bools not), else a ValueError naming the argument."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return n


class CacheManager:
    """Pages of one pool handed to requests (any hashable id but None) and taken back.

    Free pages sit on a stack, lowest index on top at the start, so allocation is deterministic: the same calls
    give the same pages. A request is known while it holds pages; `free` forgets it. Requests never shrink:
    `grow` to fewer rows than they hold is a no-op."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_request: int):
        self.num_pages = _count("num_pages", num_pages, 1)
        self.page_size = _count("page_size", page_size, 1)
        self.max_pages_per_request = _count("max_pages_per_request", max_pages_per_request, 1)
        if self.max_pages_per_request > self.num_pages:
            # a request the empty pool cannot hold would be preempted and readmitted forever
            raise ValueError(f"max_pages_per_request ({max_pages_per_request}) must be <= num_pages ({num_pages})")
        self._users = [0] * self.num_pages  # page -> number of requests holding it; 0: free
        self._free = list(range(self.num_pages - 1, -1, -1))  # stack of the pages with no user; pop() takes the top
        self._tables: dict[Hashable, list[int]] = {}  # rid -> its pages in row order; only requests holding pages

    # ---- the pool ------------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1 (the kv_cache_usage_perc metric)."""
        return self.used_pages / self.num_pages

    def pages_for(self, n_rows: int) -> int:
        """Pages that hold rows [0, n_rows)."""
        return -(-_count("n_rows", n_rows, 0) // self.page_size)

    # ---- one request ---------------------------------------------------------------------------------------------
    def num_rows(self, rid: Hashable) -> int:
        """Rows the request's pages hold (whole pages; the valid length is the scheduler's); 0 if it holds none."""
        return len(self._tables.get(rid, ())) * self.page_size

    def pages(self, rid: Hashable) -> list[int]:
        """A copy of the request's page table; [] if it holds no pages."""
        return list(self._tables.get(rid, ()))

    def pages_needed(self, rid: Hashable, n_rows: int) -> int:
        """Pages `grow(rid, n_rows)` would take from the pool (0 when the request already covers the rows)."""
        return max(0, self.pages_for(n_rows) - len(self._tables.get(rid, ())))

    def can_grow(self, rid: Hashable, n_rows: int) -> bool:
        """Whether `grow(rid, n_rows)` would succeed now."""
        return (rid is not None and self.pages_for(n_rows) <= self.max_pages_per_request
                and self.pages_needed(rid, n_rows) <= self.free_pages)

    def grow(self, rid: Hashable, n_rows: int) -> list[int]:
        """Make the request's pages cover rows [0, n_rows), taking pages for a request not seen yet; returns the
        pages newly taken, in row order. All or nothing: when the pool lacks pages it raises OutOfPagesError and
        changes nothing; rows past max_pages_per_request pages are a ValueError."""
        if rid is None:
            raise ValueError("rid must not be None (None marks an empty row of page_table)")
        total = self.pages_for(n_rows)
        if total > self.max_pages_per_request:
            raise ValueError(f"{n_rows} rows need {total} pages of {self.page_size} rows, over "
                             f"max_pages_per_request {self.max_pages_per_request}")
        needed = self.pages_needed(rid, n_rows)
        if needed > self.free_pages:
            raise OutOfPagesError(rid, needed, self.free_pages, self.num_pages)
        if needed == 0:
            return []
        taken = [self._take() for _ in range(needed)]
        self._tables.setdefault(rid, []).extend(taken)
        return taken

    def free(self, rid: Hashable) -> list[int]:
        """Release all of the request's pages (finished, cancelled or preempted) and forget it; returns its page
        table. An unknown request is a no-op, so a cancel racing a finish is harmless."""
        pages = self._tables.pop(rid, [])
        for page in reversed(pages):  # the stack then hands them out again in the same order
            self._drop(page)
        return pages

    # ---- the user counts: the only code that changes them or the free stack ---------------------------------------
    def _take(self) -> int:
        page = self._free.pop()
        self._users[page] += 1
        return page

    def _drop(self, page: int) -> None:
        self._users[page] -= 1
        if self._users[page] == 0:
            self._free.append(page)

    # ---- views -----------------------------------------------------------------------------------------------------
    def owners(self) -> dict[Hashable, tuple[int, ...]]:
        """rid -> its pages, a snapshot of every request holding pages, in the order they first took one."""
        return {rid: tuple(pages) for rid, pages in self._tables.items()}

    def page_table(self, rids: Sequence[Hashable | None], width: int | None = None) -> np.ndarray:
        """int32 [len(rids), width] for the device, width max_pages_per_request by default: row i is the page table
        of rids[i] padded with `paged.UNOWNED`, and a rid of None (an empty slot) or one holding no pages is a row of
        UNOWNED. The device drops writes to UNOWNED entries, so a request's scratch rows never reach another's page."""
        width = self.max_pages_per_request if width is None else _count("width", width, 1)
        table = np.full((len(rids), width), UNOWNED, np.int32)
        for i, rid in enumerate(rids):
            pages = self._tables.get(rid, ()) if rid is not None else ()
            if len(pages) > width:
                raise ValueError(f"request {rid!r} holds {len(pages)} pages, over the page table width {width}")
            table[i, :len(pages)] = pages
        return table

    def check(self) -> None:
        """Verify the state: every page is either free (on the stack once, no user) or listed by exactly one
        request's table, which its user count matches. Raises AssertionError naming the first page that is not."""
        holders: dict[int, list[Hashable]] = {}
        for rid, pages in self._tables.items():
            if not 0 < len(pages) <= self.max_pages_per_request:
                raise AssertionError(f"request {rid!r} holds {len(pages)} pages, outside "
                                     f"[1, {self.max_pages_per_request}]")
            for page in pages:
                if not 0 <= page < self.num_pages:
                    raise AssertionError(f"page {page} of request {rid!r} is outside the pool of {self.num_pages}")
                holders.setdefault(page, []).append(rid)
        on_stack = [0] * self.num_pages
        for page in self._free:
            if not 0 <= page < self.num_pages:
                raise AssertionError(f"free page {page} is outside the pool of {self.num_pages}")
            on_stack[page] += 1
        for page in range(self.num_pages):
            users = holders.get(page, [])
            if len(users) > 1:
                raise AssertionError(f"page {page} is held by several requests: {users!r}")
            if self._users[page] != len(users):
                raise AssertionError(f"page {page} counts {self._users[page]} users, held by {users!r}")
            if on_stack[page] != (0 if users else 1):
                state = f"held by {users[0]!r}" if users else "held by no request"
                raise AssertionError(f"page {page} is on the free stack {on_stack[page]} times and {state}")
