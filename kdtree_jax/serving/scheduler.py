"""The serving scheduler: which requests prefill, which decode, and who gives their pages back when they run out.

Host only (no jax), over the cache manager's pages:
- **Chunked prefill.** Each step prefills at most one chunk program: up to `chunk_tokens` prompt tokens, from
  requests that are part-way through their prompts first, then from the queue. A long prompt thus joins over several
  steps, and the running streams wait at most one chunk per step for it.
- **Prefix hits.** A request from the queue first shares the cached pages its context starts with (the cache
  manager's `match`, in the data group where the hit is longest) and prefills from their end; as its rows are
  computed and committed, its full pages are indexed for later requests (`publish`).
- **Admission by pages.** A waiting request starts prefilling when its first chunk's pages are free and a slot will
  be free for it when its prompt is done (running + prefilling <= slots); it takes pages chunk by chunk.
- **Preemption.** Before each step every running request grows its pages to the rows that step may write. When the
  pool is short, the newest request (the one admitted last) is preempted: its pages and slot are freed and it goes
  back to the head of the queue with the tokens it has, to be recomputed later (prompt + its tokens prefilled as
  one context). Its output is unchanged: each token is drawn from the key of its position, whoever computes it.

One call a step: `schedule()` returns the `StepPlan` (the chunk, the pages, the rows to release, the `moves` that
keep running requests in the lowest slots, the step program and the narrowest width that holds them) and
`update()` takes the device's `StepOutput` back. A request's rows: a slot row of small state while it decodes, and
its pages, which hold both caches.

Data groups (a mesh whose data axis has G > 1 devices): slots and pages split into G equal groups, group g's slots
`[g * max_slots / G, (g + 1) * max_slots / G)` and its pages (the cache manager's group g) both on data shard g. A
request is admitted to one group (the least loaded that has room for it) and stays there until it leaves or is
preempted: it grows, is preempted and is compacted (`moves`) within its group, and each group has its own prefill
budget per step, as a data-parallel rank of vLLM schedules its own requests. With G = 1 every rule above reads as
written.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from kdtree_jax.decode.budget import StepKind
from kdtree_jax.serving.cache_manager import CacheManager
from kdtree_jax.serving.plan import Chunk, PrefillPlan, Request, RequestUpdate, StepOutput, StepPlan


class Scheduler:
    """Queue, prefill progress, slots and preemption over one `CacheManager`, in its data groups."""

    def __init__(self, cache: CacheManager, *, max_slots: int, chunk_tokens: int, buckets: Sequence[int],
                 prefill_sizes: Sequence[int], row_slack: int, max_rows: int, rounds_per_step: int = 1,
                 round_tokens: int = 1, kinds: Mapping[int, StepKind] | None = None,
                 widths: Sequence[int] | None = None):
        if max_slots % cache.groups:
            raise ValueError(f"max_slots ({max_slots}) must be a multiple of the data groups ({cache.groups})")
        self.cache = cache
        self.groups = cache.groups
        self.group_slots = max_slots // cache.groups  # slots of one group
        self.max_slots = max_slots
        # the step program for each count of running requests (`budget.step_kinds`), and the compiled widths
        self.kinds = dict(kinds or {a: StepKind("ar") for a in range(1, max_slots + 1)})
        self.widths = sorted(widths or [max_slots])
        self.chunk_tokens = chunk_tokens
        self.buckets = sorted(buckets)
        self.prefill_sizes = sorted(prefill_sizes)  # chunks of one group in one program
        self.row_slack = row_slack  # rows past the last committed token one round may write
        self.max_rows = max_rows  # a slot's rows: max_context plus the largest scratch
        self.rounds_per_step = rounds_per_step
        self.round_tokens = round_tokens  # the most tokens one round commits (a tree's depth + 1)
        self.accepted = [0, 0]  # tokens and rounds the device reported, every request: the prior of a new one
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []  # admitted, their context not all in their pages yet
        self.slots: list[Request | None] = [None] * max_slots
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens of first admissions, and how many of them were prefix hits
        self.prefix_hits = 0
        self.resumed_hits = 0  # context tokens preempted requests found cached when readmitted (not recomputed)
        self.num_paused = 0  # rows a step idled because their pages held no further round
        self._vacated: list[int] = []  # slots preempted requests left in the step being scheduled

    # ---- one step -----------------------------------------------------------------------------------------------
    def schedule(self, steps: int) -> StepPlan:
        """Plan one step, for the rows the next `steps` steps write (2 while a step is in flight, unread): a prefill
        chunk (`plan_prefill`), whose last chunks' requests take their slots at once; every running request's pages
        (`reserve`, preempting the newest where a group is short; a chunk of a request preempted so becomes padding);
        the moves into the lowest slots; and the step program and width for the running requests."""
        self._vacated = []
        prefill, preempted = self.plan_prefill(steps)
        preempted += self.reserve(steps)
        prefill = prefill.without(preempted) if prefill is not None else None
        released = tuple(dict.fromkeys(i for i in self._vacated if self.slots[i] is None))
        moves = tuple(self.moves())
        active = self.n_running
        width = self.width_for(active, self.busiest()) if active else 0
        return StepPlan(
            prefill=prefill,
            prefill_pages=None if prefill is None else self.cache.page_table(
                [None if c is None else c.request.rid for c in prefill.rows]),
            released=released, moves=moves, kind=self.kinds[active] if active else None, width=width,
            rows=tuple((r, 0 if r is None else r.epoch) for r in (self.slots[i] for i in self.step_slots(width))),
            page_table=self.page_table(), preempted=tuple(preempted))

    def update(self, out: StepOutput) -> list[RequestUpdate]:
        """Take a step's output back: prefilled rows enter the pages (and the prefix cache), read tokens are
        committed, and requests that ended free their slots and pages. Returns what each request gained."""
        updates = [self._prefilled(chunk, row, out.refused.get(chunk.request.rid), out.prefill_time)
                   for chunk, row in out.prefill]
        held = {id(r) for r in self.running}  # not: ended (at its first token too), or preempted (recomputed)
        updates += [self._decoded(r, row, out.n_draft, out.time) for (r, epoch), row in out.decoded
                    if id(r) in held and r.epoch == epoch]
        return [u for u in updates if u is not None]

    def width_for(self, active: int, busiest: int | None = None) -> int:
        """The narrowest compiled width for `active` running requests (`step_width`)."""
        return step_width(self.widths, self.groups, self.group_slots, active, busiest)

    def _place(self, chunk: Chunk) -> None:
        """A chunk that ends its request's context puts the request in its slot: it decodes in this step."""
        self.prefilling.remove(chunk.request)
        self.slots[chunk.slot] = chunk.request

    def _prefilled(self, chunk: Chunk, row, refused: str | None, now: float) -> RequestUpdate | None:
        r = chunk.request
        ends = refused is not None or row.reason is not None
        self.prefilled(chunk, running=not ends)
        k = _prompt_logprobs(r)
        if k is not None:  # row t's entry is the context token at start + 1 + t; the prompt's are kept
            for p, entry in enumerate(row.logprobs, chunk.start + 1):
                if p < len(r.prompt):
                    r.prompt_logprobs[p] = entry.limited(k)
        if not chunk.last:
            return None
        if refused is not None:
            return RequestUpdate(r, now, reason="error", error=f"constraint: {refused}")
        r.first_token_time = now if r.first_token_time is None else r.first_token_time
        prompt = None
        if _prompt_logprobs(r) is not None and not r.tokens:  # its first token: the prompt's entries with it
            prompt = [None, *(r.prompt_logprobs.get(p) for p in range(1, len(r.prompt)))]
        r.tokens += row.tokens
        logprobs = _asked(getattr(r.params, "logprobs", None), row.logprobs[-1:] if row.tokens else ())
        return RequestUpdate(r, now, row.tokens, row.reason, started=not ends, logprobs=logprobs,
                             prompt_logprobs=prompt)

    def _decoded(self, r: Request, row, n_draft: int, now: float) -> RequestUpdate:
        accepted = _emitted_lengths(row.accept, len(row.tokens))
        r.accept_lengths += accepted
        self.observe(accepted)
        self.num_paused += row.paused  # its pages held no further round: grown before its next step
        r.num_draft_tokens += n_draft * len(accepted)
        if row.tokens:
            r.tokens += row.tokens
            self.committed(r)
        if row.reason is not None:
            self.finish(self.slots.index(r))  # its row is finished on the device already
        logprobs = _asked(getattr(r.params, "logprobs", None), row.logprobs)
        return RequestUpdate(r, now, row.tokens, row.reason, logprobs=logprobs)

    # ---- bookkeeping ------------------------------------------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def n_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def group_range(self, group: int) -> range:
        """The slots of a data group."""
        return range(group * self.group_slots, (group + 1) * self.group_slots)

    def busiest(self) -> int:
        """The most requests decoding in one group: a step's width must hold that many in every group."""
        return max(sum(self.slots[i] is not None for i in self.group_range(g)) for g in range(self.groups))

    def step_slots(self, width: int) -> list[int]:
        """The slots a step program of `width` rows runs over, in its row order: the lowest width / groups slots of
        each group (rows [g * width / groups, (g + 1) * width / groups) are group g's, on data shard g)."""
        return [i for g in range(self.groups) for i in self.group_range(g)[: width // self.groups]]

    def add(self, r: Request, *, front: bool = False) -> None:
        r.context, r.prefilled, r.group = list(r.prompt) + list(r.tokens), 0, None
        if front:
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def remove(self, rid: Hashable) -> Request | None:
        """Take a request out wherever it is (waiting, prefilling, decoding) and free its pages and slot."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                self.cache.free(rid)  # holds no pages; forgets the keys a prefix match computed
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

    def check(self) -> None:
        """Verify the groups over the cache manager's own check: a decoding request sits in a slot of its group, an
        admitted request holds pages of its group only, a waiting one holds none and has no group. Raises
        AssertionError naming the request."""
        self.cache.check()
        for slot, r in enumerate(self.slots):
            if r is not None and slot not in self.group_range(r.group if r.group is not None else -1):
                raise AssertionError(f"request {r.rid!r} of group {r.group} decodes in slot {slot}, outside its group")
        for r in self.prefilling + self.running:
            if self.cache.group_of(r.rid) != r.group:
                raise AssertionError(f"request {r.rid!r} of group {r.group} holds pages of group "
                                     f"{self.cache.group_of(r.rid)}")
        for r in self.waiting:
            if r.group is not None or self.cache.group_of(r.rid) is not None:
                raise AssertionError(f"waiting request {r.rid!r} has group {r.group} and holds "
                                     f"{self.cache.pages(r.rid)}")

    # ---- prefill ----------------------------------------------------------------------------------------------
    def plan_prefill(self, steps: int) -> tuple[PrefillPlan | None, list[Request]]:
        """This step's prefill chunk: requests part-way through their context first, then the queue in order,
        each taking the pages of its chunk. Per group at most `chunk_tokens` tokens (one bucket); one program for
        all groups. A request from the queue starts in the least loaded group where the pages its chunk takes leave
        what that group's running requests reserve for their next `steps` steps (`_decode_rows`), and where the
        chunk ends its context, its own first reservation too (else the reservation that follows would preempt it
        again at once). The oldest request part-way through in each group preempts newer ones of its group when its
        next chunk lacks pages (else prefills could hold the group's pages between them and none finish). A request
        whose last chunk is planned takes its slot now (`_place`). Returns the plan and the requests preempted for
        it."""
        preempted = []
        for g in range(self.groups):
            oldest = next((r for r in self.prefilling if r.group == g), None)
            if oldest is None:
                continue
            need = oldest.prefilled + min(len(oldest.context) - oldest.prefilled, self.chunk_tokens)
            while not self.cache.can_grow(oldest.rid, need) and self._newest(g) is not oldest:
                preempted.append(self._newest(g))
                self._preempt(preempted[-1])
        candidates = list(self.prefilling)
        room = self.max_slots - self.n_running - len(self.prefilling)
        candidates += list(self.waiting)[: max(room, 0)]
        if not candidates:
            return None, preempted
        groups = range(self.groups)
        first = candidates[0]
        start = first.prefilled if first not in self.waiting else max(self._hit_rows(first, g) for g in groups)
        bucket = self.bucket_for(min(len(first.context) - start, self.chunk_tokens))
        free_slots = [[i for i in self.group_range(g) if self.slots[i] is None] for g in groups]
        load = [sum(r.group == g for r in self.running + self.prefilling) for g in groups]
        headroom = [0] * self.groups
        for r in self.running:
            headroom[r.group] += self.cache.pages_needed(r.rid, self._decode_rows(r, steps))
        oldest = [next((r for r in self.prefilling if r.group == g), None) for g in groups]
        chunks: list[list[Chunk]] = [[] for _ in groups]
        blocked = [False] * self.groups  # its oldest chunk waits for pages rather than be overtaken forever

        def full(g: int) -> bool:
            n = len(chunks[g])
            return blocked[g] or n == self.prefill_sizes[-1] or (n + 1) * bucket > max(self.chunk_tokens, bucket)

        def start_in(r: Request, g: int) -> tuple[list[int], int, int, bool] | None:
            """A request from the queue starting in group g: (its prefix hit there, first row, chunk tokens, whether
            the chunk ends its context), or None when g cannot take it now (slots, pages, this step's tokens)."""
            hit = self._match(r, g)
            start = len(hit) * self.cache.page_size
            n = min(len(r.context) - start, bucket)
            last = start + n == len(r.context)
            rows = self._first_rows(r, steps) if last else start + n
            ok = (not full(g) and load[g] < self.group_slots and (free_slots[g] or not last)
                  and self.cache.pages_for(start + n) <= self.cache.max_pages_per_request
                  and self.cache.share_cost(hit, rows) + headroom[g] <= self.cache.free_in(g))
            return (hit, start, n, last) if ok else None

        started: list[Request] = []
        for r in candidates:
            if all(map(full, groups)):
                break
            fresh = r in self.waiting
            if fresh:  # the group with the longest prefix hit, then the least loaded
                options = {g: o for g in groups if (o := start_in(r, g)) is not None}
                g = min(options, key=lambda g: (-options[g][1], load[g], -self.cache.free_in(g), g), default=None)
                if g is None:
                    continue
                hit, start, n, last = options[g]
                if last:  # the pages its first reservation takes after this chunk: none for the next request
                    headroom[g] += self.cache.pages_for(self._first_rows(r, steps)) - self.cache.pages_for(start + n)
                self.cache.share(r.rid, hit, g)
                r.prefilled = start
                if r.num_preemptions == 0:  # first admission only: a recompute is no new query of the cache
                    self.prefix_queries += len(r.context)
                    self.prefix_hits += start
                    r.cached_tokens = start
                else:
                    self.resumed_hits += start
                started.append(r)
            else:
                n = min(len(r.context) - r.prefilled, bucket)
                last = r.prefilled + n == len(r.context)
                g = r.group
                if full(g) or (last and not free_slots[g]):
                    continue
                if not self.cache.can_grow(r.rid, self._first_rows(r, steps) if last else r.prefilled + n):
                    if r is oldest[g]:
                        blocked[g] = True
                    continue
            self.cache.grow(r.rid, r.prefilled + n, g)
            if fresh:
                r.group = g
                load[g] += 1
                self.waiting.remove(r)
                self.prefilling.append(r)
            chunks[g].append(Chunk(r, r.prefilled, n, free_slots[g].pop(0) if last else None))
        dropped = []
        for mine in chunks:
            while mine and len(mine) not in self.prefill_sizes:  # a compiled row count: the rest wait a step
                dropped.append(mine.pop())
        for chunk in sorted(dropped, key=lambda c: candidates.index(c.request), reverse=True):
            r = chunk.request
            if r in started:  # not started after all: back to the queue, pages, counts and all
                self.cache.free(r.rid)
                self.prefilling.remove(r)
                if r.num_preemptions == 0:
                    self.prefix_queries -= len(r.context)
                    self.prefix_hits -= r.prefilled
                    r.cached_tokens = 0
                else:
                    self.resumed_hits -= r.prefilled
                r.group, r.prefilled = None, 0
                self.waiting.appendleft(r)
        size = max(map(len, chunks))
        if not size:
            return None, preempted
        rows = tuple(c for mine in chunks for c in [*mine, *[None] * (size - len(mine))])
        for chunk in rows:
            if chunk is not None and chunk.last:
                self._place(chunk)
        return PrefillPlan(bucket, rows), preempted

    def prefilled(self, chunk: Chunk, running: bool) -> None:
        """A chunk's program ran: its rows are in the pages; a last chunk's request decodes from its slot (taken
        when it was planned, `_place`), or has ended already (`running` False) and leaves."""
        r = chunk.request
        r.prefilled = chunk.start + chunk.n_valid
        self.cache.publish(r.rid, r.context, r.prefilled)
        if chunk.last and not running:
            self.finish(self.slots.index(r))

    def _hit_rows(self, r: Request, group: int) -> int:
        """Rows of a waiting request's context that the group's prefix cache holds now."""
        return len(self._match(r, group)) * self.cache.page_size

    def _match(self, r: Request, group: int) -> list:
        """The cached pages a waiting request's context starts with in a group; none for a request that asks for
        its prompt's log-probabilities, which only a prefill of the whole prompt computes."""
        if _prompt_logprobs(r) is not None:
            return []
        return self.cache.match(r.rid, r.context, group)

    # ---- decode -----------------------------------------------------------------------------------------------
    def committed(self, r: Request) -> None:
        """The host has read the request's tokens: the rows before its last token are committed (the last one, the
        next round's root, has no row yet), and its full pages among them enter the prefix cache."""
        self.cache.publish(r.rid, [*r.prompt, *r.tokens], r.known_len - 1)

    def observe(self, accept_lengths: Sequence[int]) -> None:
        """Tokens committed by rounds the device ran (for the prior of requests with no rounds of their own)."""
        self.accepted[0] += sum(accept_lengths)
        self.accepted[1] += len(accept_lengths)

    def reserve(self, steps: int) -> list[Request]:
        """Grow every running request's pages for its next `steps` steps (`_decode_rows`). Oldest first, each
        gets the rows of one more round (`_round_rows`), preempting the newest while a group is short; then each
        grows toward its reservation as far as its group's pages go. A step idles a row that its pages cannot
        take further (`programs.step`), so a reservation short of what the step writes costs time, never tokens.
        Returns the preempted requests, already back at the head of the queue."""
        preempted = []
        age = self._ages()
        order = sorted(self.running, key=lambda r: age[r.rid])
        for r in order:
            if r not in self.slots:
                continue  # preempted for an older one meanwhile
            while not self.cache.can_grow(r.rid, self._round_rows(r)):
                victim = self._newest(r.group)
                preempted.append(victim)
                self._preempt(victim)
                if victim is r:
                    break
            if r in self.slots:
                self.cache.grow(r.rid, self._round_rows(r))
        for r in order:
            if r in self.slots:
                self.cache.grow(r.rid, self._affordable(r, self._decode_rows(r, steps)))
        return preempted

    def mean_acceptance(self, r: Request) -> float:
        """Tokens a round commits for the request: its own mean, else every request's, else one."""
        tokens, rounds = (sum(r.accept_lengths), len(r.accept_lengths)) if r.accept_lengths else self.accepted
        return tokens / rounds if rounds else 1.0

    def _decode_rows(self, r: Request, steps: int, known: int | None = None) -> int:
        """Rows to reserve for a running request (`known` tokens, its prompt and the ones read) over its next
        `steps` steps: what they are expected to commit (rounds x its mean acceptance), one round's worst case and
        its scratch; never past what the request can still write (prompt + max tokens, plus scratch)."""
        known = self._known(r) if known is None else known
        expected = math.ceil(steps * self.rounds_per_step * self.mean_acceptance(r))
        return min(known + expected + self.round_tokens + self.row_slack, self._final_rows(r), self.max_rows)

    def _first_rows(self, r: Request, steps: int) -> int:
        """The reservation of a request whose context ends now: its context, the token its prefill draws, and
        its first steps."""
        return self._decode_rows(r, steps, known=len(r.context) + 1)

    def _round_rows(self, r: Request) -> int:
        """The least a running request needs to run: one round's scratch past its known tokens."""
        return min(self._known(r) + self.row_slack, self._final_rows(r), self.max_rows)

    @staticmethod
    def _known(r: Request) -> int:
        """The tokens a running request's rows follow: those the host has read, and the first token of a request
        whose last chunk this step prefills (`_place`)."""
        return r.known_len + (r.prefilled < len(r.context))

    def _final_rows(self, r: Request) -> int:
        """Rows the request can ever write: its last round starts before its last token."""
        limit = getattr(r.params, "max_new_tokens", None)
        return self.max_rows if limit is None else len(r.prompt) + limit + self.row_slack

    def _affordable(self, r: Request, rows: int) -> int:
        """`rows`, or as many of them as the request's pages and its group's free pages cover."""
        have = len(self.cache.pages(r.rid)) + self.cache.free_in(r.group)
        return min(rows, have * self.cache.page_size, self.cache.max_pages_per_request * self.cache.page_size)

    def _ages(self) -> dict:
        """rid -> its place in the order requests took their first page (every admitted request holds pages)."""
        return {rid: i for i, rid in enumerate(self.cache.owners())}

    def _newest(self, group: int) -> Request:
        """The request of a group that took its first page last, decoding or prefilling."""
        age = self._ages()
        return max((r for r in self.prefilling + self.running if r.group == group), key=lambda r: age[r.rid])

    def _preempt(self, r: Request) -> None:
        if r in self.prefilling:
            self.prefilling.remove(r)
            self.cache.free(r.rid)
        else:
            self._vacated.append(self.slots.index(r))
            self.finish(self._vacated[-1])
        r.num_preemptions += 1
        r.epoch += 1
        self.num_preemptions += 1
        self.add(r, front=True)

    def moves(self) -> list[tuple[int, int]]:
        """(src, dst) row moves that put each group's running requests in its lowest slots, applied to the host's
        slots; a request never leaves its group."""
        out = []
        for g in range(self.groups):
            while True:
                free = [i for i in self.group_range(g) if self.slots[i] is None]
                used = [i for i in self.group_range(g) if self.slots[i] is not None]
                if not free or not used or free[0] > used[-1]:
                    break
                src, dst = used[-1], free[0]
                self.slots[dst], self.slots[src] = self.slots[src], None
                out.append((src, dst))
        return out


def step_width(widths: Sequence[int], groups: int, group_slots: int, active: int, busiest: int | None = None) -> int:
    """The narrowest of `widths` that holds `active` running requests, at most `busiest` of them in one of `groups`
    data groups (default: as many as one group holds)."""
    per_group = min(active, group_slots) if busiest is None else busiest
    return next(w for w in sorted(widths) if w // groups >= per_group)


def _prompt_logprobs(r: Request) -> int | None:
    """The top-k of its prompt's log-probabilities a request asks for; None: none."""
    return getattr(r.params, "prompt_logprobs", None)


def _asked(k: int | None, entries) -> tuple:
    """The entries with a request's k alternatives each; none where it did not ask (k None)."""
    return () if k is None else tuple(e.limited(k) for e in entries)


def _emitted_lengths(accept: Sequence[int], n_new: int) -> list[int]:
    """Each round's tokens as far as the step emitted them: a request that ended at a stop or at max_new_tokens
    mid-round committed fewer than its round accepted, and rounds past that emitted none."""
    out, left = [], n_new
    for a in accept:
        if left <= 0:
            break
        out.append(min(a, left))
        left -= out[-1]
    return out
