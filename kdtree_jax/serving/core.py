"""The serving engine: requests over a paged latent cache, stepped by a fixed set of compiled programs.

Three roles, as vLLM v1 and nano-vllm separate them:
- the scheduler (`scheduler.py`, host) decides each step: one chunk of prefill, the pages every running request
  grows to (preempting the newest when pages run out), the moves into the lowest slots, and the step program and
  width for the running requests (the budget follows the load, `kdtree_jax/decode/budget.py`);
- the cache manager (`cache_manager.py`, host) owns the pages and the page tables;
- the runner (`runner.py`, device) holds the table and runs its compiled programs.
`ServingEngine` joins them: requests in, token deltas and final records out. Each `step()` is schedule → run →
update: `Scheduler.schedule` returns a `StepPlan`, the runner applies it, and `Scheduler.update` takes the
`StepOutput` back. With `overlap` the step runs on a device thread while the host reads the previous step's tokens.
Everything a request asks for is runtime data, so after `warm_up()` nothing compiles.

On a mesh whose data axis has G > 1 devices the slots and the pages split into G data groups, each on its own data
shard (`scheduler.py`, `cache_manager.py`): slot, page and program row counts are multiples of G, and a program's
rows are laid out group by group so that each shard computes its own requests over its own pages.

A request may carry a constraint (`RequestParams.constraint`: a regex, JSON schema, choice, or a tool-call section):
its token automaton is compiled and placed in the device's tables by `automata.py`.

`kdtree_jax/serving/frontend.py` puts an async front on it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from kdtree_jax.decode import budget as budget_mod
from kdtree_jax.decode.budget import StepKind
from kdtree_jax.decode.engine import Engine
from kdtree_jax.decode.speculative import RequestRows, aligned_rows
from kdtree_jax.serving import memory_plan, programs
from kdtree_jax.serving.automata import Automata
from kdtree_jax.serving.cache_manager import CacheManager
from kdtree_jax.serving.config import ServeConfig
from kdtree_jax.serving.plan import Request, StepOutput, StepPlan
from kdtree_jax.serving.request import (
    EngineClosedError,
    QueueFullError,
    RequestLimits,
    RequestParams,
    RequestRecord,
    TokenDelta,
    check_request,
)
from kdtree_jax.serving.runner import ModelRunner, prefill_batch
from kdtree_jax.serving.scheduler import Scheduler, step_width

log = logging.getLogger(__name__)

__all__ = ["ServingEngine", "StepReport"]


@dataclasses.dataclass
class _InFlight:
    """A step whose packed output the host has not read yet: its `future` (the device thread's, or one already
    finished without overlap) until `_settle` takes the table back, then its packed output."""

    kind: StepKind
    owners: tuple  # (request, epoch) in each of its rows when it was queued (rows move; requests end meanwhile)
    packed: jax.Array | None = None
    future: concurrent.futures.Future | None = None  # -> (table, packed)


@dataclasses.dataclass
class StepReport:
    """What one `step()` did: the host-side view a benchmark or a metrics endpoint reads."""

    deltas: list[TokenDelta]  # tokens the host read, in order
    records: list[RequestRecord]  # requests that ended (after their last delta)
    kind: StepKind | None  # the step program this call ran (None: nothing was running)
    active: int  # slots that were running when it started
    admitted: int  # requests whose prefill finished in it (they joined the running ones)
    width: int = 0  # the rows it ran over
    prefill_tokens: int = 0  # context tokens the step's chunk prefilled
    preempted: int = 0  # requests preempted in it


def _counter(name: str, doc: str) -> property:
    """A read-only view of one of the scheduler's counters."""
    return property(lambda self: getattr(self.scheduler, name), doc=doc)


class ServingEngine:
    """Requests over a paged latent cache: scheduler + cache manager (host) + runner (device); single-threaded
    (see frontend.py)."""

    def __init__(self, engine: Engine, config: ServeConfig = ServeConfig()):
        self.engine = engine
        self.config = c = config
        cfg = engine.target.cfg
        if c.mode != "ar" and engine.drafter is None:
            raise ValueError(f"mode {c.mode!r} needs a drafter; load one or serve mode 'ar'")
        if c.max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {c.max_context} exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        mesh = engine.mesh
        self.groups = 1 if mesh is None else int(mesh.shape.get("data", 1))  # data groups: slots and pages split
        self.group_slots = c.max_slots // self.groups
        self._check_groups()
        self.uses_drafter = engine.drafter is not None and c.mode != "ar"
        kinds = budget_mod.step_kinds(c.mode, c.budget, c.max_slots, lambda: budget_mod.profile_for(
            engine.budget_profile, engine.profile_key()))
        self.widths = sorted(set(c.step_widths or [self.groups * w for w in _powers_of_two(self.group_slots)]))
        # the step programs: each width with the kinds its active counts (the ones it is the narrowest for, given how
        # many of them the busiest group holds) need
        self.step_keys = sorted({(kinds[a], step_width(self.widths, self.groups, self.group_slots, a, m))
                                 for a in range(1, c.max_slots + 1)
                                 for m in range(-(-a // self.groups), min(a, self.group_slots) + 1)},
                                key=lambda kw: (kw[1], kw[0]))
        budgets = sorted({k.budget for k in kinds.values() if k.mode == "ddtree"})
        # the drafter's top-K lists keep the largest budget's K, shared by every program (`programs.py`, "Budgets")
        self._draft_k = max(max((min(b, cfg.vocab_size) for b in budgets), default=0), 1)
        prefill_kind = (StepKind("ddtree", max(budgets)) if budgets
                        else StepKind(c.mode if c.mode != "ddtree" else "chain"))
        self.specs = {(k, w): self._spec(k, batch=w) for k, w in self.step_keys}
        prefill_spec = self._spec(prefill_kind)
        self.draft_k = prefill_spec.top_k
        self.chunk_tokens = min(c.max_num_batched_tokens or engine.prefill_chunk, c.max_context)
        self.buckets = _buckets(c.min_prompt_bucket, self.chunk_tokens)
        self.prefill_sizes = _powers_of_two(min(c.prefill_batch, self.group_slots))  # chunks per group
        # a program per bucket and rows a step's prefill can fill: n chunks of one bucket take n * bucket of a data
        # group's chunk_tokens (the scheduler's rule), so e.g. a chunk-sized bucket runs one row at a time
        self.prefill_specs = {(b, self.groups * n): dataclasses.replace(self._spec(prefill_kind, prompt_len=b),
                                                                        batch=self.groups * n)
                              for b in self.buckets for n in self.prefill_sizes
                              if n == 1 or n * b <= self.chunk_tokens}
        self.row_slack = max(s.slack for s in [*self.specs.values(), prefill_spec])
        self.capacity = aligned_rows(c.max_context + self.row_slack)
        self.pages_per_request = programs.pages_per_request(self.capacity, c.page_size)
        self.depth = max(s.depth for s in [*self.specs.values(), *self.prefill_specs.values()])
        self.stop_ids = tuple(engine.stop_ids)
        if len(self.stop_ids) > c.max_stop_ids:
            raise ValueError(f"max_stop_ids {c.max_stop_ids} is below the model's {len(self.stop_ids)} stop ids")
        self.limits = RequestLimits(cfg.vocab_size, c.max_context, c.top_k_cap, c.max_stop_ids, self.stop_ids,
                                    c.max_logprobs)
        self.automata = Automata(cfg.vocab_size, c.constraint_caps, engine.constraint_compiler)
        self.page_bytes = memory_plan.page_bytes(engine.target, engine.drafter if self.uses_drafter else None,
                                                 c.page_size)
        self._probe: ModelRunner | None = None  # the probe's programs, kept where the plan's pool is theirs
        self.num_pages, self.pool_plan = memory_plan.pool_pages(
            c, groups=self.groups, pages_per_request=self.pages_per_request, row_slack=self.row_slack,
            page_bytes=self.page_bytes, programs_peak=self._probe_peak)
        self.cache = CacheManager(self.num_pages, c.page_size, self.pages_per_request, self.groups,
                                  prefix_caching=c.enable_prefix_caching)
        self.scheduler = Scheduler(self.cache, max_slots=c.max_slots, chunk_tokens=self.chunk_tokens,
                                   buckets=self.buckets, prefill_sizes=self.prefill_sizes, row_slack=self.row_slack,
                                   max_rows=self.capacity, rounds_per_step=c.rounds_per_step,
                                   round_tokens=self.depth + 1, kinds=kinds, widths=self.widths)
        self.runner = self._runner(self._new_table, self.prefill_specs, self.specs, c.overlap)
        if self._probe is not None and self.runner.compiles_like(self._probe):
            self.runner.adopt(self._probe)
        self._probe = None
        self._rng = np.random.default_rng()
        self._next_id = 0
        self._in_flight: _InFlight | None = None
        self._faults: list[RequestRecord] = []  # records of a fault found outside step(), for its next report
        self.n_moves = 0  # rows moved to keep the running requests in the lowest slots
        self.prefill_calls: dict[int, int] = {}  # prefill programs run, by rows
        self._closed = False

    # ---- programs and memory --------------------------------------------------------------------------------
    def _check_groups(self) -> None:
        """Slot counts that split evenly over the data groups."""
        c, g = self.config, self.groups
        if c.max_slots % g:
            raise ValueError(f"max_slots (--max-slots) {c.max_slots} must be a multiple of the mesh's data size {g}: "
                             f"each data group owns an equal share of the slots")
        if c.step_widths is not None and any(w % g for w in c.step_widths):
            raise ValueError(f"step_widths (--step-widths) {c.step_widths} must be multiples of the mesh's data size "
                             f"{g}: a step runs over the same number of slots in each data group")

    def _spec(self, kind: StepKind, prompt_len: int = 1, batch: int | None = None):
        eng, cfg = self.engine, self.config
        spec = eng.spec_for(mode=kind.mode, batch=batch or cfg.max_slots, prompt_len=prompt_len, max_new_tokens=1,
                            budget=kind.budget, top_k_cap=cfg.top_k_cap, draft_k=self._draft_k,
                            logprobs=cfg.max_logprobs)
        if kind.mode == "ar" and self.uses_drafter:  # keeps the drafter's state: needs the target's features
            d = eng.drafter.cfg
            spec = dataclasses.replace(spec, taps=tuple(d.target_layer_ids), mask_token_id=d.mask_token_id)
        return spec

    def _new_table(self, n_pages: int | None = None):
        cfg = self.config
        return programs.empty_table(self.engine.target, self.engine.drafter if self.uses_drafter else None,
                                    slots=cfg.max_slots, capacity=self.capacity, n_pages=n_pages or self.num_pages,
                                    page_size=cfg.page_size, n_stop=cfg.max_stop_ids, depth=self.depth,
                                    draft_k=self.draft_k, rounds=cfg.rounds_per_step, logprobs=cfg.max_logprobs)

    def _runner(self, new_table, prefill_specs: dict, step_specs: dict, overlap: bool,
                allocate: bool = True) -> ModelRunner:
        c = self.config
        return ModelRunner(
            self.engine, uses_drafter=self.uses_drafter, new_table=new_table, prefill_specs=prefill_specs,
            step_specs=step_specs, rounds=c.rounds_per_step, page_table_width=self.pages_per_request,
            max_slots=c.max_slots, overlap=overlap, groups=self.groups,
            rows_for=lambda n: RequestRows.of([RequestParams()] * n, [self.stop_ids] * n, c.max_stop_ids),
            constraint_tables=self.automata.layout.tables(), row_slack=self.row_slack, allocate=allocate)

    def probe_programs(self, n_pages: int | None = None) -> dict[str, memory_plan.ProgramMemory]:
        """The widest step and the largest prefill chunk, compiled (both at once, allocating nothing) over a pool of
        n_pages (default: one request per data group): their memory does not depend on the pool's size
        (`memory_plan`). The compiled programs stay with the engine until its runner takes them."""
        n = n_pages or self.groups * self.pages_per_request
        step = max(self.specs, key=lambda kw: (kw[1], kw[0]))
        prefill = max(self.prefill_specs)
        self._probe = probe = self._runner(lambda: self._new_table(n), {prefill: self.prefill_specs[prefill]},
                                           {step: self.specs[step]}, overlap=False, allocate=False)
        probe.warm_up(only=[("step", step), ("prefill", prefill)])
        return {desc: memory_plan.ProgramMemory.of(program) for desc, program in probe.programs_by_desc().items()}

    def _probe_peak(self, n_pages: int) -> int:
        return max(m.peak for m in self.probe_programs(n_pages).values())

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def weight_bytes(self) -> int:
        t, d = self.engine.weights
        return sum(x.nbytes for x in jax.tree.leaves((t, d if self.uses_drafter else None)))

    @property
    def requests_at_max_context(self) -> int:
        """Requests of max_context the pool holds at once, each within its data group's pages."""
        return self.groups * (self.num_pages // self.groups // self.pages_per_request)

    def capacity_summary(self) -> str:
        """The pool in words, for the start-up log."""
        c, size = self.config, self.pool_bytes
        size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        groups = f" in {self.groups} data groups" if self.groups > 1 else ""
        return (f"{self.num_pages} pages of {c.page_size} tokens ({self.num_pages * c.page_size} tokens, "
                f"{size_text}){groups}; {self.requests_at_max_context} requests of max_context {c.max_context} at "
                f"once (up to {c.max_slots} slots)")

    def memory_report(self) -> dict:
        """Per compiled program its temp, argument, output and alias bytes (`compiled.memory_analysis()`), with the
        pool's and the weights' bytes: the figures a GPU compile will want, on any backend."""
        return {"programs": {desc: dataclasses.asdict(memory_plan.ProgramMemory.of(program))
                             for desc, program in self.runner.programs_by_desc().items()},
                "pool_bytes": self.pool_bytes, "weight_bytes": self.weight_bytes}

    def memory_summary(self) -> str:
        """The start-up line: weights / programs' peak / pool / requests of max_context. On a device that reports
        its memory these are the planner's figures; elsewhere the compiled programs' (after `warm_up`)."""
        plan = self.pool_plan
        if plan is None:
            peak = max((memory_plan.ProgramMemory.of(p).peak for p in self.runner.programs_by_desc().values()),
                       default=0)
            plan = memory_plan.PoolPlan(pages=self.num_pages, weights=self.weight_bytes, programs_peak=peak,
                                        margin=0, page_bytes=self.page_bytes)
        return plan.summary(self.requests_at_max_context, self.config.max_context)

    def bucket_for(self, prompt_len: int) -> int:
        """The bucket of a prompt's first chunk."""
        return self.scheduler.bucket_for(min(prompt_len, self.chunk_tokens))

    def warm_up(self, on_program=None) -> dict[str, float]:
        """Compile every program: one prefill chunk per (bucket, rows), one step per (budget, width), move and
        release; `on_program(desc, seconds)` after each. Returns the seconds each took (near zero where JAX's
        persistent compilation cache had it)."""
        return self.runner.warm_up(on_program)

    @property
    def warmup_s(self) -> dict[str, float]:
        return self.runner.warmup_s

    # ---- requests -------------------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: RequestParams) -> tuple[list[int], tuple[int, ...], int]:
        """Validate a request without touching the engine: (prompt ids, stop ids, seed). Raises RequestError."""
        return check_request(prompt, params, self.limits, self._rng)

    def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams(), *,
               request_id: int | None = None) -> int:
        """Queue a request; returns its id. Bad input raises RequestError and changes nothing. A constrained one
        waits outside the scheduler until its automaton is compiled."""
        if self._closed:
            raise EngineClosedError("the serving engine is shut down; no new requests")
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting "
                                 f"(max_queue {self.config.max_queue})")
        ids, stop, seed = self.check(prompt, params)
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        request = Request(rid, ids, params, stop, seed, time.perf_counter())
        if params.constraint is None:
            self.scheduler.add(request)
        else:
            self.automata.submit(request)
        return rid

    def cancel(self, request_id: int) -> RequestRecord | None:
        """Drop a waiting, prefilling or running request; its pages and slot are free for the next step. Returns
        its record: "cancelled", or "error" where the step it was in had failed; None if it is not here."""
        self._faults += self._settle()  # the table is back from the device thread
        for i, rec in enumerate(self._faults):
            if rec.request_id == request_id:
                return self._faults.pop(i)
        r = self.automata.cancel(request_id)
        if r is not None:
            return self._record(r, "cancelled")
        slots = self.scheduler.slots
        slot = next((i for i, r in enumerate(slots) if r is not None and r.rid == request_id), None)
        r = self.scheduler.remove(request_id)
        if r is None:
            return None
        if slot is not None:
            self.runner.release(slot)
        return self._record(r, "cancelled")

    def shutdown(self) -> list[RequestRecord]:
        """Refuse new requests and cancel every waiting, prefilling and running one."""
        self._closed = True
        s = self.scheduler
        ids = self.waiting_ids() + [r.rid for r in s.prefilling] + [r.rid for r in s.running]
        records = [rec for rec in map(self.cancel, ids) if rec is not None]
        self._in_flight = None  # every request it ran has ended
        self.runner.shutdown()  # idle: cancel settled its last step
        self.automata.shutdown()
        return records

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def n_running(self) -> int:
        """Requests decoding, plus those part-way through their prefill."""
        return self.scheduler.n_running + len(self.scheduler.prefilling)

    @property
    def n_waiting(self) -> int:
        """Requests queued, those whose constraint is still compiling included."""
        return len(self.scheduler.waiting) + len(self.automata.compiling)

    n_preemptions = _counter("num_preemptions", "Requests preempted so far (each time counts).")
    n_paused = _counter("num_paused", "Rows a step idled because their pages held no further round.")
    prefix_cache_queries = _counter("prefix_queries", """Prompt tokens of every request's first admission (vLLM's
        prefix_cache_queries); with prefix_cache_hits, the ones found in the cache, they add up against the prompts
        admitted, however often a request is preempted.""")
    prefix_cache_hits = _counter("prefix_hits", "Prompt tokens of first admissions found in the prefix cache.")
    resumed_prefix_hits = _counter("resumed_hits", """Context tokens preempted requests found in the prefix cache
        when readmitted (not recomputed).""")

    @property
    def has_work(self) -> bool:
        return self._busy or bool(self.automata.compiling)

    @property
    def _busy(self) -> bool:
        """Something to step besides constraints compiling."""
        s = self.scheduler
        return bool(s.waiting or s.prefilling or s.n_running or self._in_flight is not None)

    def running_ids(self) -> list[int]:
        return [r.rid for r in self.scheduler.prefilling] + [r.rid for r in self.scheduler.running]

    def waiting_ids(self) -> list[int]:
        return [r.rid for r in self.automata.compiling] + [r.rid for r in self.scheduler.waiting]

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Schedule, run, update: the scheduler plans one chunk of prefill, the pages and moves, and one step (k
        rounds) over the narrowest width that holds the running requests; the runner applies the plan; the
        scheduler takes back what the host read: this step's tokens, or with `overlap` the previous step's, read
        while this one runs."""
        faults = self._settle() + self._take_compiled(wait=not self._busy)  # idle: wait for a constraint
        plan = self.scheduler.schedule(steps=2 if self._in_flight is not None else 1)
        output, failed = self._run(plan)
        updates = self.scheduler.update(output)
        deltas = [TokenDelta(u.request.rid, list(u.tokens), u.time, list(u.logprobs) if u.logprobs else None,
                             u.prompt_logprobs) for u in updates if u.tokens]
        records = [*faults, *failed, *(self._record(u.request, u.reason, u.error) for u in updates if u.reason)]
        prefill_tokens = sum(c.n_valid for c in plan.prefill.chunks) if plan.prefill is not None else 0
        return StepReport(deltas, records, plan.kind, plan.active, sum(u.started for u in updates), plan.width,
                          prefill_tokens, len(plan.preempted))

    def _take_compiled(self, wait: bool) -> list[RequestRecord]:
        """Queue the constrained requests whose automaton is ready; one that cannot be served ends with "error"."""
        ready, failed = self.automata.take(wait)
        for r in ready:
            self.scheduler.add(r)
        return [self._record(r, "error", error=f"constraint: {why}") for r, why in failed]

    def _run(self, plan: StepPlan) -> tuple[StepOutput, list[RequestRecord]]:
        """Apply the plan on the device: the prefill chunk, the releases, the moves, then queue the step and read
        the one it follows (or, without overlap, this one). Returns what the device reported, and the records of
        requests a failed program ended."""
        prefill, refused, failed = self._run_prefill(plan)
        prefill_time = time.perf_counter()
        if failed:  # the table went with the failed program: nothing else of the plan stands
            return StepOutput(prefill_time), failed
        for slot in plan.released:
            self.runner.release(slot)
        for src, dst in plan.moves:
            self.runner.move(src, dst)
        self.n_moves += len(plan.moves)
        for rid in refused:  # its row ran unconstrained: it never decodes
            self.runner.release(next(i for i, r in enumerate(self.scheduler.slots) if r is not None and r.rid == rid))
        done, self._in_flight = self._in_flight, None
        if plan.kind is not None:
            future = self.runner.queue_step((plan.kind, plan.width), plan.page_table)
            self._in_flight = _InFlight(plan.kind, plan.rows, future=future)
            if not self.runner.overlap:  # this step is the one to read, now
                failed += self._settle()
                done, self._in_flight = self._in_flight, None  # None where it failed: _settle ended its requests
        decoded, n_draft = (), 0
        if done is not None:
            decoded, n_draft, faults = self._read(done)
            failed += faults
        return StepOutput(time.perf_counter(), prefill_time, prefill, refused, decoded, n_draft), failed

    def _run_prefill(self, plan: StepPlan) -> tuple[tuple, dict, list[RequestRecord]]:
        """The plan's chunk program, its rows' automata placed first. Returns ((chunk, row) of each chunk, {rid: why}
        of requests whose automaton found no room, records of a failure)."""
        if plan.prefill is None:
            return (), {}, []
        rows = plan.prefill.rows
        self.prefill_calls[len(rows)] = self.prefill_calls.get(len(rows), 0) + 1
        start_state, refused, tables = self.automata.start_states(rows)
        if tables is not None:
            self.runner.set_tables(tables)
        c = self.config
        batch = prefill_batch(rows, plan.prefill.bucket, plan.prefill_pages, c.max_slots, c.max_stop_ids,
                              start_state)
        try:
            out = self.runner.prefill(batch)
        except Exception as e:  # noqa: BLE001  (every prefilling and running request ends with its error)
            return (), {}, self._fail_all(e)
        return tuple((ch, row) for ch, row in zip(rows, out) if ch is not None), refused, []

    def _settle(self) -> list[RequestRecord]:
        """Wait for the queued step and take its table back (its tokens are read later); returns the records of a
        fault found now or earlier outside step()."""
        step = self._in_flight
        if step is not None and step.future is not None:
            future, step.future = step.future, None
            try:
                step.packed = self.runner.settle(future)
            except Exception as e:  # the table was donated to the failed program: every running request fails
                self._faults += self._fail_all(e)
        records, self._faults = self._faults, []
        return records

    def _read(self, step: _InFlight) -> tuple[tuple, int, list[RequestRecord]]:
        """A step's rows with their owners, and the draft tokens each of its rounds verified per row (waits for
        that step only); or the records of a fault the device raised."""
        try:
            packed = np.asarray(jax.device_get(step.packed))
        except Exception as e:  # raised on the device: the table that step wrote is lost too
            self._in_flight = None
            return (), 0, self._fail_all(e)
        n_draft = self.specs[(step.kind, len(step.owners))].n_slots - 1
        rows = programs.unpack_step(packed, self.config.rounds_per_step, self.config.max_logprobs)
        return tuple(zip(step.owners, rows)), n_draft, []

    def _fail_all(self, error: Exception) -> list[RequestRecord]:
        """A program raised: its donated table is gone, and so is any step queued after it. Every prefilling and
        running request ends with "error" and the table starts empty again; waiting requests stay queued."""
        log.error("serving step failed: %s: %s", type(error).__name__, error)
        records = [self._record(r, "error", error=f"{type(error).__name__}: {error}")
                   for r in self.scheduler.clear() if not r.ended]
        self.cache.clear_cache()  # the pool went with the table: no cached page holds its rows any more
        self._in_flight = None
        self.runner.reset()
        return records

    def _record(self, r: Request, reason: str, error: str | None = None) -> RequestRecord:
        r.ended = True
        self.automata.release(r.rid)
        return RequestRecord(request_id=r.rid, token_ids=list(r.tokens), finish_reason=reason,
                             prompt_tokens=len(r.prompt), accept_lengths=list(r.accept_lengths),
                             num_draft_tokens=r.num_draft_tokens, error=error, num_preemptions=r.num_preemptions,
                             cached_tokens=r.cached_tokens,
                             submit_time=r.submit_time, first_token_time=r.first_token_time,
                             finish_time=time.perf_counter())


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n."""
    return [*(1 << i for i in range(max(n - 1, 0).bit_length()) if 1 << i < n), n]


def _buckets(smallest: int, chunk_tokens: int) -> list[int]:
    """Padded chunk lengths, one prefill program each: powers of two from `smallest`, then the chunk."""
    n, out = smallest, set()
    while n < chunk_tokens:
        out.add(n)
        n *= 2
    return sorted(out | {chunk_tokens})
