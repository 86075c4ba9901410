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

Data groups. On a mesh whose data axis has G > 1 devices the device pool is split by pages over data, so group g's
pages are the contiguous range [g * num_pages / G, (g + 1) * num_pages / G) on data shard g. A request belongs to
the group it took its first page in and only ever takes pages of that group, so every page a data shard's rows
address lies in its own shard. Each group has its own free stack; with G = 1 there is one group, the whole pool.
"""
from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence

import numpy as np

from kdtree_jax.paged import UNOWNED


class OutOfPagesError(RuntimeError):
    """A grow needs more pages than its group of the pool has free (`num_pages`: the group's size); nothing was
    changed, so the caller can preempt and retry."""

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
    """Pages of one pool handed to requests (any hashable id but None) and taken back, in `groups` equal ranges.

    Free pages sit on one stack per group, lowest index on top at the start, so allocation is deterministic: the same
    calls give the same pages. A request is known while it holds pages; `free` forgets it. Requests never shrink:
    `grow` to fewer rows than they hold is a no-op."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_request: int, groups: int = 1):
        self.num_pages = _count("num_pages", num_pages, 1)
        self.page_size = _count("page_size", page_size, 1)
        self.max_pages_per_request = _count("max_pages_per_request", max_pages_per_request, 1)
        self.groups = _count("groups", groups, 1)
        if self.num_pages % self.groups:
            raise ValueError(f"num_pages ({num_pages}) must be a multiple of groups ({groups}): each data group "
                             f"owns an equal range of pages")
        self.group_pages = self.num_pages // self.groups  # pages of one group
        if self.max_pages_per_request > self.group_pages:
            # a request the empty pool cannot hold would be preempted and readmitted forever
            raise ValueError(f"max_pages_per_request ({max_pages_per_request}) must be <= num_pages / groups "
                             f"({num_pages} / {groups})")
        self._users = [0] * self.num_pages  # page -> number of requests holding it; 0: free
        # per group, a stack of its pages with no user; pop() takes the top
        self._free = [list(reversed(self.group_range(g))) for g in range(self.groups)]
        self._tables: dict[Hashable, list[int]] = {}  # rid -> its pages in row order; only requests holding pages
        self._group: dict[Hashable, int] = {}  # rid -> the group its pages are in; the same requests as _tables

    # ---- the pool ------------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return sum(map(len, self._free))

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1 (the kv_cache_usage_perc metric)."""
        return self.used_pages / self.num_pages

    def pages_for(self, n_rows: int) -> int:
        """Pages that hold rows [0, n_rows)."""
        return -(-_count("n_rows", n_rows, 0) // self.page_size)

    # ---- groups --------------------------------------------------------------------------------------------------
    def group_range(self, group: int) -> range:
        """The pages of a group: a contiguous range, the group's shard of the device pool."""
        return range(group * self.group_pages, (group + 1) * self.group_pages)

    def free_in(self, group: int) -> int:
        """Free pages of a group."""
        return len(self._free[self._check_group(group)])

    def group_of(self, rid: Hashable) -> int | None:
        """The group of a request holding pages; None for one holding none."""
        return self._group.get(rid)

    def _check_group(self, group) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.groups:
            raise ValueError(f"group must be an integer in [0, {self.groups}), got {group!r}")
        return group

    def _resolve(self, rid: Hashable, group: int | None) -> int:
        """The group a grow of `rid` takes pages from: its own, else `group` (which one group may leave out)."""
        known = self._group.get(rid)
        if group is None:
            if known is not None:
                return known
            if self.groups == 1:
                return 0
            raise ValueError(f"request {rid!r} holds no pages yet: name its group (0..{self.groups - 1})")
        group = self._check_group(group)
        if known is not None and known != group:
            raise ValueError(f"request {rid!r} holds pages of group {known}, not of group {group}")
        return group

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

    def can_grow(self, rid: Hashable, n_rows: int, group: int | None = None) -> bool:
        """Whether `grow(rid, n_rows, group)` would succeed now."""
        return (rid is not None and self.pages_for(n_rows) <= self.max_pages_per_request
                and self.pages_needed(rid, n_rows) <= len(self._free[self._resolve(rid, group)]))

    def grow(self, rid: Hashable, n_rows: int, group: int | None = None) -> list[int]:
        """Make the request's pages cover rows [0, n_rows), taking pages for a request not seen yet; returns the
        pages newly taken, in row order. A request takes pages of its own group only: a request not seen yet
        takes them in `group` (which a single-group pool may leave out), and a `group` other than a known
        request's is a ValueError. All or nothing: when the group lacks pages it raises OutOfPagesError and
        changes nothing; rows past max_pages_per_request pages are a ValueError."""
        if rid is None:
            raise ValueError("rid must not be None (None marks an empty row of page_table)")
        group = self._resolve(rid, group)
        total = self.pages_for(n_rows)
        if total > self.max_pages_per_request:
            raise ValueError(f"{n_rows} rows need {total} pages of {self.page_size} rows, over "
                             f"max_pages_per_request {self.max_pages_per_request}")
        needed = self.pages_needed(rid, n_rows)
        free = len(self._free[group])
        if needed > free:
            raise OutOfPagesError(rid, needed, free, self.group_pages)
        if needed == 0:
            return []
        taken = [self._take(group) for _ in range(needed)]
        self._tables.setdefault(rid, []).extend(taken)
        self._group[rid] = group
        return taken

    def free(self, rid: Hashable) -> list[int]:
        """Release all of the request's pages (finished, cancelled or preempted) and forget it; returns its page
        table. An unknown request is a no-op, so a cancel racing a finish is harmless."""
        pages = self._tables.pop(rid, [])
        self._group.pop(rid, None)
        for page in reversed(pages):  # the stack then hands them out again in the same order
            self._drop(page)
        return pages

    # ---- the user counts: the only code that changes them or the free stack ---------------------------------------
    def _take(self, group: int) -> int:
        page = self._free[group].pop()
        self._users[page] += 1
        return page

    def _drop(self, page: int) -> None:
        self._users[page] -= 1
        if self._users[page] == 0:
            self._free[page // self.group_pages].append(page)

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
        """Verify the state: every page is either free (on its own group's stack once, no user) or listed by exactly
        one request's table, which its user count matches, and every page a request lists is of the request's
        group. Raises AssertionError naming the first page (or request) that is not."""
        holders: dict[int, list[Hashable]] = {}
        for rid, pages in self._tables.items():
            if not 0 < len(pages) <= self.max_pages_per_request:
                raise AssertionError(f"request {rid!r} holds {len(pages)} pages, outside "
                                     f"[1, {self.max_pages_per_request}]")
            for page in pages:
                if not 0 <= page < self.num_pages:
                    raise AssertionError(f"page {page} of request {rid!r} is outside the pool of {self.num_pages}")
                group = self._group.get(rid)
                if group is not None and page not in self.group_range(group):
                    raise AssertionError(f"page {page} of request {rid!r} is outside its group {group} "
                                         f"({self.group_range(group)})")
                holders.setdefault(page, []).append(rid)
        on_stack = [0] * self.num_pages
        for group, stack in enumerate(self._free):
            for page in stack:
                if page not in self.group_range(group):
                    raise AssertionError(f"free page {page} is on the stack of group {group} "
                                         f"({self.group_range(group)})")
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
        if set(self._group) != set(self._tables):
            raise AssertionError(f"the requests with a group, {sorted(map(repr, self._group))}, are not those "
                                 f"holding pages, {sorted(map(repr, self._tables))}")
