"""The prefix cache's index: full pages of cache rows, keyed by every token up to the page's end.

A page of a request's pages holds the target's latent rows and the drafter's context rows of `page_size` positions.
Both are functions of the tokens at and before those positions only (causal attention; the drafter's context rows
are projections of the target's hidden states at the same positions), so two requests whose token sequences agree
up to the end of a page need the same page, and the second can skip computing it. The key of page j of a sequence
is a hash chain, `key_j = sha256(key_{j-1} || tokens[j*P:(j+1)*P])`, as vLLM's block hashes: one dict lookup per
page, and a match means the whole prefix matches (sha256: no practical collisions, so no stale rows).

Only full pages are indexed, and only rows a request has committed. A request writes only at positions at or past
its committed length (prefill chunks, tree scratch, the compacted path), so an indexed page is never written again
while it is shared.

This class only keeps the index and the order in which unreferenced indexed pages are given up; the cache manager
owns the user counts and asks it. A page is in exactly one of three states there: held (users > 0, indexed or not),
cached (no user, indexed: parked here, evictable), free (no user, not indexed).
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

ROOT = b""  # the key before the first page


def page_keys(tokens: Sequence[int], page_size: int, n_pages: int, parent: bytes = ROOT) -> list[bytes]:
    """Keys of the first `n_pages` full pages of `tokens` (after `parent`, the key of the page before them)."""
    if n_pages * page_size > len(tokens):
        raise ValueError(f"{n_pages} pages of {page_size} need {n_pages * page_size} tokens, got {len(tokens)}")
    data = np.asarray(tokens[: n_pages * page_size], dtype="<i8").reshape(n_pages, page_size)
    keys = []
    for row in data:
        parent = hashlib.sha256(parent + row.tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    """Key -> page for full pages, and an LRU of the indexed pages no request holds (the evictable ones)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page: dict[bytes, int] = {}  # key -> page
        self._key: dict[int, bytes] = {}  # page -> key
        self._parked: collections.OrderedDict[int, None] = collections.OrderedDict()  # unheld indexed pages, LRU first

    def __len__(self) -> int:
        return len(self._page)

    @property
    def n_parked(self) -> int:
        return len(self._parked)

    def indexed(self, page: int) -> bool:
        return page in self._key

    def parked(self, page: int) -> bool:
        return page in self._parked

    def pages(self) -> dict[int, bytes]:
        """page -> key of every indexed page (a snapshot)."""
        return dict(self._key)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest run of `keys` from the first that are all indexed."""
        out = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def add(self, key: bytes, page: int) -> bool:
        """Index `page` (held by a request) under `key`. False, and nothing changes, when the key is indexed already
        (another request computed the same rows: that copy stays, this page stays private) or the page is."""
        if key in self._page or page in self._key:
            return False
        self._page[key], self._key[page] = page, key
        return True

    def park(self, page: int) -> None:
        """The last user of an indexed page let go: it stays cached, most recently used last."""
        self._parked[page] = None
        self._parked.move_to_end(page)

    def unpark(self, page: int) -> None:
        """A hit took a parked page back."""
        del self._parked[page]

    def evict(self) -> int:
        """Forget the least recently used parked page and return it (now free). Pages are parked tail first when a
        request lets go, so a page's later pages go before it and a chain is never cut in its middle."""
        page, _ = self._parked.popitem(last=False)
        del self._page[self._key.pop(page)]
        return page

    def clear(self) -> list[int]:
        """Forget every page (the pool's contents are lost); returns the parked ones, now free."""
        parked = list(self._parked)
        self._page.clear()
        self._key.clear()
        self._parked.clear()
        return parked
