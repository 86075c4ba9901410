"""What the scheduler works over and hands out: each request's host state, the chunks of a prefill, and one step's
plan (`StepPlan`, what the runner applies, in order) and output (`StepOutput`, what the device reported, for
`Scheduler.update`). Host only: the device rows these name are read into them by the engine (`programs.unpack_step`,
`programs.unpack_prefill`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from kdtree_jax.decode.budget import StepKind
from kdtree_jax.decode.params import RequestParams


@dataclasses.dataclass
class Request:
    """One request's host state, from submit to its record."""

    rid: Hashable
    prompt: list[int]
    params: RequestParams
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
    cached_tokens: int = 0  # context tokens its first admission found in the prefix cache
    epoch: int = 0  # bumped at each preemption: a step queued before it carries tokens that will be recomputed
    group: int | None = None  # the data group it was admitted to; None while it waits
    # position -> the entry of that prompt token, as its chunks compute them (`RequestParams.prompt_logprobs`)
    prompt_logprobs: dict = dataclasses.field(default_factory=dict)

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
    # the program's rows: data group g's chunks in rows [g * n, (g + 1) * n) for the same n in every group, so a
    # row's pages are on its own data shard; None: a padding row (no pages, its writes dropped)
    rows: tuple[Chunk | None, ...]

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(c for c in self.rows if c is not None)

    def without(self, requests: Sequence[Request]) -> PrefillPlan | None:
        """The plan with the chunks of `requests` (preempted since: their pages are gone) turned into padding rows;
        None where no chunk is left."""
        gone = {id(r) for r in requests}
        if not gone:
            return self
        rows = tuple(None if c is None or id(c.request) in gone else c for c in self.rows)
        return PrefillPlan(self.bucket, rows) if any(rows) else None


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step as the scheduler decided it. The runner applies it in this order: the prefill chunk, the releases,
    the moves, then the step program over `rows`."""

    prefill: PrefillPlan | None  # this step's chunk program; None: nothing to prefill
    prefill_pages: np.ndarray | None  # [rows, W] int32: each prefill row's pages (UNOWNED for a padding row)
    released: tuple[int, ...]  # rows of requests preempted in it that nobody holds now: finished on the device
    moves: tuple[tuple[int, int], ...]  # (src, dst): the running requests into the lowest slots of their groups
    kind: StepKind | None  # the step program; None: nothing is running
    width: int  # the rows it runs over (0 with no kind)
    rows: tuple[tuple[Request | None, int], ...]  # (request, epoch) in each of its rows, None where a row is free
    page_table: np.ndarray  # [max_slots, W] int32 for the step program
    preempted: tuple[Request, ...]  # back at the head of the queue

    @property
    def active(self) -> int:
        return sum(r is not None for r, _ in self.rows)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What the device reported for a plan: its prefill rows, and the rows of the step read back (this one's, or
    with overlap the one before), each with the owner it was queued for."""

    time: float  # when the host read the step's rows
    prefill_time: float = 0.0  # when the prefill's rows came back
    prefill: tuple[tuple[Chunk, object], ...] = ()  # (chunk, programs.PrefillRow) of each chunk that ran
    refused: Mapping[Hashable, str] = dataclasses.field(default_factory=dict)  # rid -> why its automaton found no
    # room: its row ran unconstrained, so it ends with "error" and never decodes
    decoded: tuple[tuple[tuple[Request | None, int], object], ...] = ()  # ((request, epoch), programs.StepRow)
    n_draft: int = 0  # draft tokens each of the read step's rounds verified per row


@dataclasses.dataclass(frozen=True)
class RequestUpdate:
    """What one request gained from a step: tokens, and where it ended, why."""

    request: Request
    time: float  # when the host learnt it
    tokens: tuple[int, ...] = ()
    reason: str | None = None  # its finish reason; None: it goes on
    error: str | None = None
    started: bool = False  # its prefill ended and it decodes from its slot
    logprobs: tuple = ()  # the tokens' entries (`TokenLogprob`), where the request asked for them
    prompt_logprobs: list | None = None  # with its first token, where it asked: one per prompt token (None first)
