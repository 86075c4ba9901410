"""The serving scheduler: which requests prefill, which decode, and who gives their pages back when they run out.

Host only (no jax), over the cache manager's pages:
- **Chunked prefill.** Each step prefills at most one chunk program: up to `chunk_tokens` prompt tokens, from
  requests that are part-way through their prompts first, then from the queue. A long prompt thus joins over several
  steps, and the running streams wait at most one chunk per step for it.
- **Admission by pages.** A waiting request starts prefilling when its first chunk's pages are free and a slot will
  be free for it when its prompt is done (running + prefilling <= slots); it takes pages chunk by chunk.
- **Preemption.** Before each step every running request grows its pages to the rows that step may write. When the
  pool is short, the newest request (the one admitted last) is preempted: its pages and slot are freed and it goes
  back to the head of the queue with the tokens it has, to be recomputed later (prompt + its tokens prefilled as
  one context). Its output is unchanged: each token is drawn from the key of its position, whoever computes it.

A request's rows: a slot row of small state while it decodes (tokens, lengths, draft lists), and its pages, which
hold both caches. Running requests sit in the lowest slots (`moves` fills holes), so a step runs over the narrowest
width that holds them.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from kdtree_jax.serving.cache_manager import CacheManager


@dataclasses.dataclass
class Request:
    """One request's host state, from submit to its record."""

    rid: Hashable
    prompt: list[int]
    params: object  # RequestParams
    stop_ids: tuple[int, ...]
    seed: int
    submit_time: float
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    num_draft_tokens: int = 0
    first_token_time: float | None = None
    ended: bool = False  # its record was handed out: results of a step still in flight are dropped
    context: list[int] = dataclasses.field(default_factory=list)  # what its prefill computes: prompt + tokens
    prefilled: int = 0  # rows of `context` in its pages
    num_preemptions: int = 0
    epoch: int = 0  # bumped at each preemption: a step queued before it carries tokens that will be recomputed

    @property
    def known_len(self) -> int:
        """Prompt + generated tokens the host has read."""
        return len(self.prompt) + len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Chunk:
    request: Request
    start: int  # first context row of the chunk
    n_valid: int  # its tokens (the rest of the bucket is padding)
    slot: int | None  # where the request decodes: set on the chunk that ends its context

    @property
    def last(self) -> bool:
        return self.slot is not None

    def tokens(self, bucket: int) -> np.ndarray:
        out = np.zeros((bucket,), np.int32)
        out[: self.n_valid] = self.request.context[self.start: self.start + self.n_valid]
        return out


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    bucket: int  # padded chunk length: the program's T
    chunks: tuple[Chunk, ...]


class Scheduler:
    """Queue, prefill progress, slots and preemption over one `CacheManager`."""

    def __init__(self, cache: CacheManager, *, max_slots: int, chunk_tokens: int, buckets: Sequence[int],
                 prefill_sizes: Sequence[int], row_slack: int, max_rows: int):
        self.cache = cache
        self.max_slots = max_slots
        self.chunk_tokens = chunk_tokens
        self.buckets = sorted(buckets)
        self.prefill_sizes = sorted(prefill_sizes)
        self.row_slack = row_slack  # rows past the last committed token one round may write
        self.max_rows = max_rows  # a slot's rows: max_context plus the largest scratch
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []  # admitted, their context not all in their pages yet
        self.slots: list[Request | None] = [None] * max_slots
        self.num_preemptions = 0

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def n_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def add(self, r: Request, *, front: bool = False) -> None:
        r.context, r.prefilled = list(r.prompt) + list(r.tokens), 0
        if front:
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def remove(self, rid: Hashable) -> Request | None:
        """Take a request out wherever it is (waiting, prefilling, decoding) and free its pages and slot."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                return r
        for r in self.prefilling:
            if r.rid == rid:
                self.prefilling.remove(r)
                self.cache.free(rid)
                return r
        for slot, r in enumerate(self.slots):
            if r is not None and r.rid == rid:
                self.finish(slot)
                return r
        return None

    def finish(self, slot: int) -> Request:
        """The request in `slot` has ended: its slot and pages are free."""
        r, self.slots[slot] = self.slots[slot], None
        self.cache.free(r.rid)
        return r

    def clear(self) -> list[Request]:
        """Every prefilling and decoding request leaves (a failed program lost the table); returns them."""
        out = self.prefilling + self.running
        for r in out:
            self.cache.free(r.rid)
        self.prefilling, self.slots = [], [None] * self.max_slots
        return out

    def page_table(self) -> np.ndarray:
        """[max_slots, W] int32 for the step programs: each slot's request's pages."""
        return self.cache.page_table([None if r is None else r.rid for r in self.slots])

    # ---- prefill ----------------------------------------------------------------------------------------------
    def plan_prefill(self, tokens_ahead: int) -> tuple[PrefillPlan | None, list[Request]]:
        """This step's prefill chunk: requests part-way through their context first, then the queue in order,
        each taking the pages of its chunk. At most `chunk_tokens` tokens (one bucket), one program. A request from
        the queue starts only where the pages its chunk takes leave what the running requests need for their next
        `tokens_ahead` tokens (else it would be preempted again at once). The oldest request part-way through
        preempts newer ones when its next chunk lacks pages (else prefills could hold the whole pool between them
        and none finish). Returns the plan and the requests preempted for it."""
        preempted = []
        if self.prefilling:
            oldest = self.prefilling[0]
            need = oldest.prefilled + min(len(oldest.context) - oldest.prefilled, self.chunk_tokens)
            while not self.cache.can_grow(oldest.rid, need) and self._newest() is not oldest:
                preempted.append(self._newest())
                self._preempt(preempted[-1])
        candidates = list(self.prefilling)
        room = self.max_slots - self.n_running - len(self.prefilling)
        candidates += list(self.waiting)[: max(room, 0)]
        if not candidates:
            return None, preempted
        first = candidates[0]
        bucket = self.bucket_for(min(len(first.context) - first.prefilled, self.chunk_tokens))
        free_slots = [i for i, r in enumerate(self.slots) if r is None]
        headroom = sum(self.cache.pages_needed(r.rid, self._decode_rows(r, tokens_ahead)) for r in self.running)
        chunks: list[Chunk] = []
        for r in candidates:
            if len(chunks) == self.prefill_sizes[-1] or (len(chunks) + 1) * bucket > max(self.chunk_tokens, bucket):
                break
            n = min(len(r.context) - r.prefilled, bucket)
            last = r.prefilled + n == len(r.context)
            if last and not free_slots:
                continue
            fresh = r in self.waiting
            if not self.cache.can_grow(r.rid, r.prefilled + n) or (
                    fresh and self.cache.pages_needed(r.rid, r.prefilled + n) + headroom > self.cache.free_pages):
                if r is first and not fresh:
                    break  # the oldest chunk waits for pages rather than be overtaken forever
                continue
            self.cache.grow(r.rid, r.prefilled + n)
            if fresh:
                self.waiting.remove(r)
                self.prefilling.append(r)
            chunks.append(Chunk(r, r.prefilled, n, free_slots.pop(0) if last else None))
        while chunks and len(chunks) not in self.prefill_sizes:  # a compiled row count: the rest wait a step
            dropped = chunks.pop()
            if dropped.start == 0:  # not started after all: back to the queue, pages and all
                self.cache.free(dropped.request.rid)
                self.prefilling.remove(dropped.request)
                self.waiting.appendleft(dropped.request)
        return (PrefillPlan(bucket, tuple(chunks)) if chunks else None), preempted

    def prefilled(self, chunk: Chunk, running: bool) -> None:
        """A chunk's program ran: its rows are in the pages; a last chunk's request decodes from its slot (or has
        ended already, `running` False, and leaves)."""
        r = chunk.request
        r.prefilled = chunk.start + chunk.n_valid
        if not chunk.last:
            return
        self.prefilling.remove(r)
        if running:
            self.slots[chunk.slot] = r
        else:
            self.cache.free(r.rid)

    # ---- decode -----------------------------------------------------------------------------------------------
    def reserve(self, tokens_ahead: int) -> list[Request]:
        """Grow every running request's pages to the rows the next `tokens_ahead` committed tokens (and one
        round's scratch past them) may write; preempt the newest requests while the pool is short. Returns the
        preempted ones, already back at the head of the queue."""
        preempted = []
        age = self._ages()
        for r in sorted(self.running, key=lambda r: age[r.rid]):
            if r not in self.slots:
                continue  # preempted for an older one meanwhile
            need = self._decode_rows(r, tokens_ahead)
            while not self.cache.can_grow(r.rid, need):
                victim = self._newest()
                preempted.append(victim)
                self._preempt(victim)
                if victim is r:
                    break
            if r in self.slots:
                self.cache.grow(r.rid, need)
        return preempted

    def _decode_rows(self, r: Request, tokens_ahead: int) -> int:
        """Rows a running request may write in its next `tokens_ahead` committed tokens, one round's scratch past
        them included."""
        return min(r.known_len + tokens_ahead + self.row_slack, self.max_rows)

    def _ages(self) -> dict:
        """rid -> its place in the order requests took their first page (every admitted request holds pages)."""
        return {rid: i for i, rid in enumerate(self.cache.owners())}

    def _newest(self) -> Request:
        """The request that took its first page last, decoding or prefilling."""
        age = self._ages()
        return max(self.prefilling + self.running, key=lambda r: age[r.rid])

    def _preempt(self, r: Request) -> None:
        if r in self.prefilling:
            self.prefilling.remove(r)
            self.cache.free(r.rid)
        else:
            self.finish(self.slots.index(r))
        r.num_preemptions += 1
        r.epoch += 1
        self.num_preemptions += 1
        self.add(r, front=True)

    def moves(self) -> list[tuple[int, int]]:
        """(src, dst) row moves that put the running requests in the lowest slots, applied to the host's slots."""
        out = []
        while True:
            free = [i for i, r in enumerate(self.slots) if r is None]
            used = [i for i, r in enumerate(self.slots) if r is not None]
            if not free or not used or free[0] > used[-1]:
                return out
            src, dst = used[-1], free[0]
            self.slots[dst], self.slots[src] = self.slots[src], None
            out.append((src, dst))
