"""The host side of a paged latent cache: which pages of the device's pool each request holds.

The device keeps a pool of `num_pages` pages of `page_size` cache rows each (per layer). A request holds an ordered
list of pages, its page table: its row s lives in page `pages[s // page_size]` at offset `s % page_size`, so a
request takes memory for the rows it has, not for the longest context, and a finished or preempted request gives
its pages straight back to the pool. The manager only deals in page indices; the scheduler asks it before each step
to grow each running request to the rows that step may write, admits a new request only when its pages are free,
and preempts (frees) the newest request when they run out. The device reads `page_table()`.

Pure state, no device and no jax: every change goes through `grow` and `free`, and `check` verifies the whole
state, so the scheduler and its tests can drive it directly.

Ownership lives in one place, the per-page user count `_users`: every page a request's table lists counts that
request once. With prefix caching (`serving/prefix_cache.py`) a full page of committed rows is indexed by the tokens
up to its end, and a later request whose context starts with the same tokens shares it (`match`, `share`) instead of
computing it: the page then counts one user per request. A page whose count drops to 0 is free, or, when indexed,
cached: it keeps its rows for a later hit until a page is needed and the least recently used cached page is given
up. Cached pages count as free for admission. Every page is in exactly one state: held (count > 0), cached (count
0, indexed) or free (count 0, on its group's free stack).

Data groups. On a mesh whose data axis has G > 1 devices the device pool is split by pages over data, so group g's
pages are the contiguous range [g * num_pages / G, (g + 1) * num_pages / G) on data shard g. A request belongs to
the group it took its first page in and only ever takes pages of that group, so every page a data shard's rows
address lies in its own shard. Each group has its own free stack and its own prefix index (a hit is a page of the
request's own shard); with G = 1 there is one group, the whole pool.
"""
from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence

import numpy as np

from kdtree_jax.model.paged import UNOWNED
from kdtree_jax.serving.prefix_cache import ROOT, PrefixIndex, page_keys


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
    `grow` to fewer rows than they hold is a no-op. With `prefix_caching` off, `match` finds nothing and `publish`
    indexes nothing, so no page is ever shared or cached."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_request: int, groups: int = 1, *,
                 prefix_caching: bool = False):
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
        self.prefix_caching = bool(prefix_caching)
        self._index = [PrefixIndex(self.page_size) for _ in range(self.groups)]
        self._keys: dict[Hashable, list[bytes]] = {}  # rid -> keys of its context's full pages, as far as computed
        self._published: dict[Hashable, int] = {}  # rid -> how many of its first pages are indexed or were offered

    # ---- the pool ------------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages a grow can take: free ones, then cached ones (least recently used first)."""
        return sum(self.free_in(g) for g in range(self.groups))

    @property
    def cached_pages(self) -> int:
        """Indexed pages no request holds."""
        return sum(index.n_parked for index in self._index)

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
        """Pages a grow can take in a group: free, then cached."""
        group = self._check_group(group)
        return len(self._free[group]) + self._index[group].n_parked

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
                and self.pages_needed(rid, n_rows) <= self.free_in(self._resolve(rid, group)))

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
        free = self.free_in(group)
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
        table. An unknown request is a no-op, so a cancel racing a finish is harmless. Its indexed pages stay cached."""
        pages = self._tables.pop(rid, [])
        self._group.pop(rid, None)
        self._keys.pop(rid, None)
        self._published.pop(rid, None)
        for page in reversed(pages):  # the stack then hands them out again in the same order; cached: tail first
            self._drop(page)
        return pages

    # ---- prefix caching ------------------------------------------------------------------------------------------
    def match(self, rid: Hashable, tokens: Sequence[int], group: int = 0) -> list[int]:
        """Cached pages of `group` a request holding no pages could start from: its context's longest indexed run of
        full pages, leaving at least one token to compute (the next token's logits come from the last one)."""
        group = self._check_group(group)
        if not self.prefix_caching or rid in self._tables:
            return []
        n_full = min((len(tokens) - 1) // self.page_size, self.max_pages_per_request)
        return self._index[group].match(self._chain(rid, tokens, n_full))

    def share_cost(self, pages: Sequence[int], n_rows: int) -> int:
        """Pages taken from the group's `free_in` by `share(rid, pages, group)` then `grow(rid, n_rows)`: the cached
        ones among `pages`, then the new ones past them."""
        return sum(self._users[p] == 0 for p in pages) + max(0, self.pages_for(n_rows) - len(pages))

    def share(self, rid: Hashable, pages: Sequence[int], group: int = 0) -> None:
        """A request holding no pages starts from `pages`, a `match` in `group` made since the last change."""
        group = self._check_group(group)
        if rid is None or rid in self._tables:
            raise ValueError(f"request {rid!r} must hold no pages to share cached ones")
        index = self._index[group]
        for page in pages:
            if not index.indexed(page):
                raise ValueError(f"page {page} is not cached in group {group}: match again after a change")
        for page in pages:
            if self._users[page] == 0:
                index.unpark(page)
            self._users[page] += 1
        if pages:
            self._tables[rid] = list(pages)
            self._group[rid] = group
            self._published[rid] = len(pages)

    def publish(self, rid: Hashable, tokens: Sequence[int], n_rows: int) -> int:
        """Index the request's full pages among its first `n_rows` rows, whose contents are `tokens[:n_rows]`,
        committed and final: a later request with the same tokens can then share them. A page whose tokens are
        indexed already (another request computed the same rows) stays the request's own. Returns pages indexed."""
        if not self.prefix_caching or rid not in self._tables:
            return 0
        table = self._tables[rid]
        n_full = min(n_rows // self.page_size, len(table))
        done = self._published.get(rid, 0)
        if n_full <= done:
            return 0
        keys, index = self._chain(rid, tokens, n_full), self._index[self._group[rid]]
        added = sum(index.add(keys[j], table[j]) for j in range(done, n_full))
        self._published[rid] = n_full
        return added

    def indexed_pages(self) -> dict[int, bytes]:
        """page -> key of every page in the prefix cache, held or not (a snapshot)."""
        return {page: key for index in self._index for page, key in index.pages().items()}

    def clear_cache(self) -> None:
        """Forget every indexed page (the device's pool was lost): cached pages become free, held ones private."""
        for group, index in enumerate(self._index):
            self._free[group].extend(sorted(index.clear(), reverse=True))
        self._keys.clear()
        self._published = {rid: len(t) for rid, t in self._tables.items()}  # their rows are gone: never index them

    def _chain(self, rid: Hashable, tokens: Sequence[int], n_full: int) -> list[bytes]:
        """Keys of the first n_full pages of the request's context, extending the ones computed before."""
        keys = self._keys.setdefault(rid, [])
        if n_full > len(keys):
            start = len(keys) * self.page_size
            keys += page_keys(tokens[start:], self.page_size, n_full - len(keys), keys[-1] if keys else ROOT)
        return keys[:n_full]

    # ---- the user counts: the only code that changes them or the free stack ---------------------------------------
    def _take(self, group: int) -> int:
        page = self._free[group].pop() if self._free[group] else self._index[group].evict()
        self._users[page] += 1
        return page

    def _drop(self, page: int) -> None:
        self._users[page] -= 1
        if self._users[page] == 0:
            group = page // self.group_pages
            if self._index[group].indexed(page):
                self._index[group].park(page)
            else:
                self._free[group].append(page)

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
        """Verify the state: every page is held (its user count is the number of tables listing it; a page listed by
        several is indexed and at the same place in each, as its key fixes its position), cached (no user, indexed)
        or free (no user, not indexed, on its own group's stack once), and every page a request lists or a group
        indexes is of that group. Raises AssertionError naming the first page (or request) that is not."""
        holders: dict[int, list[Hashable]] = {}
        place: dict[int, int] = {}
        for rid, pages in self._tables.items():
            if not 0 < len(pages) <= self.max_pages_per_request:
                raise AssertionError(f"request {rid!r} holds {len(pages)} pages, outside "
                                     f"[1, {self.max_pages_per_request}]")
            group = self._group.get(rid)
            for j, page in enumerate(pages):
                if not 0 <= page < self.num_pages:
                    raise AssertionError(f"page {page} of request {rid!r} is outside the pool of {self.num_pages}")
                if group is not None and page not in self.group_range(group):
                    raise AssertionError(f"page {page} of request {rid!r} is outside its group {group} "
                                         f"({self.group_range(group)})")
                holders.setdefault(page, []).append(rid)
                if place.setdefault(page, j) != j:
                    raise AssertionError(f"page {page} is page {place[page]} of one request and {j} of {rid!r}")
        on_stack = [0] * self.num_pages
        for group, stack in enumerate(self._free):
            for page in stack:
                if page not in self.group_range(group):
                    raise AssertionError(f"free page {page} is on the stack of group {group} "
                                         f"({self.group_range(group)})")
                on_stack[page] += 1
        for group, index in enumerate(self._index):
            stray = [page for page in index.pages() if page not in self.group_range(group)]
            if stray:
                raise AssertionError(f"pages {stray} are indexed by group {group} ({self.group_range(group)})")
        for page in range(self.num_pages):
            users = holders.get(page, [])
            index = self._index[page // self.group_pages]
            indexed, parked = index.indexed(page), index.parked(page)
            if self._users[page] != len(users):
                raise AssertionError(f"page {page} counts {self._users[page]} users, held by {users!r}")
            if len(users) > 1 and not indexed:
                raise AssertionError(f"page {page} is held by several requests but not cached: {users!r}")
            if parked != (indexed and not users):
                raise AssertionError(f"page {page}: cached {parked}, indexed {indexed}, held by {users!r}")
            if on_stack[page] != (0 if users or indexed else 1):
                state = f"held by {users!r}" if users else ("cached" if indexed else "held by no request")
                raise AssertionError(f"page {page} is on the free stack {on_stack[page]} times and {state}")
        if set(self._group) != set(self._tables):
            raise AssertionError(f"the requests with a group, {sorted(map(repr, self._group))}, are not those "
                                 f"holding pages, {sorted(map(repr, self._tables))}")
