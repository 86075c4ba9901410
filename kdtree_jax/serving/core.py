"""The serving engine: requests over a paged latent cache, stepped by a fixed set of compiled programs.

Three roles, as vLLM v1 and nano-vllm separate them:
- the scheduler (`scheduler.py`, host) picks what runs in each step: one chunk of prefill, then k rounds for the
  running requests, preempting the newest request when pages run out;
- the cache manager (`cache_manager.py`, host) owns the pages and the page tables;
- the runner (`runner.py`, device) holds the table and runs its compiled programs.
`ServingEngine` joins them: requests in, token deltas and final records out. Each `step()` prefills one chunk,
grows every running request's pages (preempting if it must), keeps the running requests in the lowest slots, picks
the step program for the number of running requests (the budget follows the load, `kdtree_jax/decode/budget.py`) and the
narrowest compiled width that holds them, and runs k rounds. With `overlap` the step runs on a device thread while
the host reads the previous step's tokens. Everything a request asks for is runtime data, so after `warm_up()`
nothing compiles.

On a mesh whose data axis has G > 1 devices the slots and the pages split into G data groups, each on its own data
shard (`scheduler.py`, `cache_manager.py`): slot, page and program row counts are multiples of G, and a program's
rows are laid out group by group so that each shard computes its own requests over its own pages.

A request may carry a constraint (`RequestParams.constraint`: a regex, JSON schema, choice, or a tool-call section).
It is compiled to a token automaton on a worker thread (`ConstraintCompiler`, cached by the constraint's text) while
the request waits outside the scheduler, so a new schema never stalls the running streams. At its last prefill chunk
its automaton is placed in the device's constraint tables (`constrain_device.TableLayout`: a live automaton keeps
its states, a new one takes a free range and the tables are uploaded again) and its row starts at the automaton's
start state, advanced over any tokens it had generated before a preemption; its record frees the placement.

`kdtree_jax/serving/frontend.py` puts an async front on it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import TokenAutomaton
from kdtree_jax.decode import budget as budget_mod
from kdtree_jax.decode import sampling
from kdtree_jax.decode.engine import Engine
from kdtree_jax.decode.speculative import FINISH_NONFINITE, FINISH_REASONS, MODES, RUNNING, aligned_rows
from kdtree_jax.serving import memory_plan, programs
from kdtree_jax.serving.cache_manager import CacheManager
from kdtree_jax.serving.programs import StepKind
from kdtree_jax.serving.request import (
    EngineClosedError,
    QueueFullError,
    RequestLimits,
    RequestParams,
    RequestRecord,
    TokenDelta,
    check_request,
    request_rows,
)
from kdtree_jax.serving.runner import ModelRunner, prefill_batch
from kdtree_jax.serving.scheduler import Chunk, PrefillPlan, Request, Scheduler
from pallas_kernels.verify_attn import PAGE_SIZES

log = logging.getLogger(__name__)

# ---- configuration and requests --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the serving engine is compiled for; fixed for its life."""

    max_slots: int = 4  # the most requests decoding at once (vLLM's max_num_seqs)
    max_context: int = 1024  # prompt + generated tokens of one request
    mode: str = "ddtree"  # "ar" | "chain" | "ddtree"
    # ddtree: B, "auto" (per step, from the budget profile and the number of active slots), or a table
    # {active slots: B or "ar"} (missing counts take the nearest smaller entry)
    budget: int | str | Mapping[int, int | str] = "auto"
    rounds_per_step: int = 8  # k: rounds per step; tokens come back to the host once per step
    # prefill chunks of one bucket run together in one program of up to this many rows per data group (a program
    # per power of two up to it): one launch instead of one per request when many join at once
    prefill_batch: int = 4
    top_k_cap: int = sampling.TOP_K_CAP  # the largest per-request top_k
    max_stop_ids: int = 8  # stop-id table width per slot (the model's own stop ids included)
    min_prompt_bucket: int = 16  # prefill chunks pad to powers of two from here
    max_queue: int = 1024  # waiting requests beyond this are refused
    # step programs run over the first w slots, for each w here (None: powers of two, then max_slots; on a mesh
    # that splits data over G devices, G times those of max_slots / G, and every w a multiple of G: the first w / G
    # slots of each data group); a step takes the narrowest that holds the running requests
    step_widths: tuple[int, ...] | None = None
    # run each step on a device thread and read the last step's tokens meanwhile, so the device waits only for
    # admission and dispatch; tokens, finishes and faults reach the host one step later (a finished row rides
    # that step at no cost)
    overlap: bool = True
    page_size: int = 64  # cache rows per page (vLLM's block size)
    # pages in the pool; None: from gpu_memory_utilization on a device that reports its memory, else max_slots
    # requests of max_context (the bytes a slot table would take)
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9  # the share of device memory weights, activations and pages may use
    # prompt tokens prefilled per step (one chunk program); None: the engine's prefill chunk
    max_num_batched_tokens: int | None = None
    # full pages of committed rows are indexed by their tokens and shared by later requests with the same prefix
    # (`serving/prefix_cache.py`); off: every request computes its whole context
    enable_prefix_caching: bool = True
    # the device's constraint tables: global automaton states (the free state included; V / 8 bytes each) and
    # transition exceptions, shared by every constrained request running at once
    constraint_states: int = cd.STATES_CAP
    constraint_exceptions: int = cd.EXCEPTIONS_CAP

    @property
    def constraint_caps(self) -> cd.TableCaps:
        return cd.TableCaps(self.constraint_states, self.constraint_exceptions)

    def __post_init__(self):
        for name in ("max_slots", "max_context", "rounds_per_step", "max_stop_ids", "min_prompt_bucket",
                     "prefill_batch", "page_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("num_pages", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES} (what the verify kernels read), "
                             f"got {self.page_size!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.step_widths is not None:
            w = self.step_widths
            if not w or not all(isinstance(x, int) and 1 <= x <= self.max_slots for x in w) \
                    or self.max_slots not in w:
                raise ValueError(f"step_widths must be integers in [1, max_slots] including max_slots "
                                 f"{self.max_slots}, got {w!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.top_k_cap < 0 or self.max_queue < 0:
            raise ValueError(f"top_k_cap and max_queue must be >= 0, got {self.top_k_cap}, {self.max_queue}")
        self.constraint_caps  # noqa: B018  (TableCaps checks the caps)


@dataclasses.dataclass
class _InFlight:
    """A step whose packed output the host has not read yet: its `future` (the device thread's, or one already
    finished without overlap) until `_settle` takes the table back, then its packed output."""

    kind: StepKind
    owners: list  # (request, epoch) in each of its rows when it was queued (rows move; requests end meanwhile)
    packed: jax.Array | None = None
    future: concurrent.futures.Future | None = None  # -> (table, packed)


@dataclasses.dataclass
class StepReport:
    """What one `step()` did: the host-side view a benchmark or a metrics endpoint reads."""

    events: list  # TokenDelta and RequestRecord, in order
    kind: StepKind | None  # the step program this call ran (None: nothing was running)
    active: int  # slots that were running when it started
    admitted: int  # requests whose prefill finished before it (they joined the running ones)
    width: int = 0  # the rows it ran over
    prefill_tokens: int = 0  # context tokens the step's chunk prefilled
    preempted: int = 0  # requests preempted in it



# ---- the engine ------------------------------------------------------------------------------------------------
class ServingEngine:
    """Requests over a paged latent cache: scheduler + cache manager (host) + runner (device); single-threaded
    (see frontend.py)."""

    def __init__(self, engine: Engine, config: ServeConfig = ServeConfig()):
        self.engine = engine
        self.config = config
        cfg = engine.target.cfg
        if config.mode != "ar" and engine.drafter is None:
            raise ValueError(f"mode {config.mode!r} needs a drafter; load one or serve mode 'ar'")
        if config.max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {config.max_context} exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        mesh = engine.mesh
        self.groups = 1 if mesh is None else int(mesh.shape.get("data", 1))  # data groups: slots and pages split
        self.group_slots = config.max_slots // self.groups
        self._check_groups()
        self.plan = self._budget_plan()
        self.kinds = sorted(set(self.plan.values()))
        self.widths = sorted(set(config.step_widths or
                                 [self.groups * w for w in _powers_of_two(self.group_slots)]))
        # the step programs: each width with the kinds its active counts (the ones it is the narrowest for, given how
        # many of them the busiest group holds) need
        self.step_keys = sorted({(self.plan[a], self.width_for(a, m)) for a in range(1, config.max_slots + 1)
                                 for m in range(-(-a // self.groups), min(a, self.group_slots) + 1)},
                                key=lambda kw: (kw[1], kw[0]))
        self.uses_drafter = engine.drafter is not None and config.mode != "ar"
        budgets = [k.budget for k in self.kinds if k.mode == "ddtree"]
        self._prefill_kind = (StepKind("ddtree", max(budgets)) if budgets
                              else StepKind(config.mode if config.mode != "ddtree" else "chain"))
        self.specs = {(k, w): self._spec(k, batch=w) for k, w in self.step_keys}
        prefill_spec = self._spec(self._prefill_kind)
        self.draft_k = prefill_spec.top_k
        self.chunk_tokens = min(config.max_num_batched_tokens or engine.prefill_chunk, config.max_context)
        self.buckets = self._buckets()
        self.prefill_sizes = _powers_of_two(min(config.prefill_batch, self.group_slots))  # chunks per group
        self.prefill_specs = {(b, self.groups * n): dataclasses.replace(self._spec(self._prefill_kind, prompt_len=b),
                                                                        batch=self.groups * n)
                              for b in self.buckets for n in self.prefill_sizes}
        self.row_slack = max(s.slack for s in [*self.specs.values(), prefill_spec])
        self.capacity = aligned_rows(config.max_context + self.row_slack)
        self.pages_per_request = programs.pages_per_request(self.capacity, config.page_size)
        self.depth = max(s.depth for s in [*self.specs.values(), *self.prefill_specs.values()])
        self.stop_ids = tuple(engine.stop_ids)
        if len(self.stop_ids) > config.max_stop_ids:
            raise ValueError(f"max_stop_ids {config.max_stop_ids} is below the model's {len(self.stop_ids)} stop ids")
        self.limits = RequestLimits(cfg.vocab_size, config.max_context, config.top_k_cap, config.max_stop_ids,
                                    self.stop_ids)
        self.layout = cd.TableLayout(cfg.vocab_size, config.constraint_caps)
        self.pool_plan: memory_plan.PoolPlan | None = None  # the planner's figures, where the device reports memory
        self.num_pages = self._num_pages()
        self.cache = CacheManager(self.num_pages, config.page_size, self.pages_per_request, self.groups,
                                  prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.cache, max_slots=config.max_slots, chunk_tokens=self.chunk_tokens,
                                   buckets=self.buckets, prefill_sizes=self.prefill_sizes, row_slack=self.row_slack,
                                   max_rows=self.capacity, rounds_per_step=config.rounds_per_step,
                                   round_tokens=self.depth + 1)
        self.runner = self._runner(self._new_table, self.prefill_specs, self.specs, config.overlap)
        self._tables_version = self.layout.version
        self._compiler_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdtree-constraint")
        self._compiling: list[tuple[Request, concurrent.futures.Future]] = []  # waiting for their automaton
        self._automata: dict = {}  # rid -> TokenAutomaton of a constrained request in the scheduler
        self._placed: set = set()  # rids whose automaton is placed in the tables
        self._rng = np.random.default_rng()
        self._next_id = 0
        self._in_flight: _InFlight | None = None
        self._faults: list[RequestRecord] = []  # records of a fault found outside step(), for its next report
        self.n_moves = 0  # rows moved to keep the running requests in the lowest slots
        self.n_paused = 0  # rows a step idled because their pages held no further round
        self.prefill_calls: dict[int, int] = {}  # prefill programs run, by rows
        self._closed = False

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page: the target's latent rows and the drafter's context rows, every layer."""
        t, c = self.engine.target, self.config
        latent = t.cfg.num_hidden_layers * c.page_size * t.cfg.latent_dim * np.dtype(t.cache_dtype).itemsize
        if not self.uses_drafter:
            return latent
        d = self.engine.drafter
        k = d.cfg.num_hidden_layers * d.cfg.num_key_value_heads * c.page_size * d.cfg.head_dim
        return latent + 2 * k * np.dtype(d.compute_dtype).itemsize

    def _runner(self, new_table, prefill_specs: dict, step_specs: dict, overlap: bool) -> ModelRunner:
        c = self.config
        return ModelRunner(
            self.engine, uses_drafter=self.uses_drafter, new_table=new_table, prefill_specs=prefill_specs,
            step_specs=step_specs, rounds=c.rounds_per_step, page_table_width=self.pages_per_request,
            max_slots=c.max_slots, overlap=overlap, groups=self.groups,
            rows_for=lambda n: request_rows([RequestParams()] * n, [self.stop_ids] * n, c.max_stop_ids),
            constraint_tables=self.layout.tables(), row_slack=self.row_slack)

    def probe_programs(self) -> dict[str, memory_plan.ProgramMemory]:
        """The widest step and the largest prefill chunk compiled over a probe pool of one request per data
        group: their memory does not depend on the pool's size (`memory_plan`)."""
        n = self.groups * self.pages_per_request
        step = max(self.specs, key=lambda kw: (kw[1], kw[0]))
        prefill = max(self.prefill_specs)
        probe = self._runner(lambda: self._new_table(n), {prefill: self.prefill_specs[prefill]},
                             {step: self.specs[step]}, overlap=False)
        try:
            return {f"step {step[0].name} x{step[1]}": memory_plan.ProgramMemory.of(probe.step_program(step)),
                    f"prefill {prefill[0]} x{prefill[1]}": memory_plan.ProgramMemory.of(
                        probe.prefill_program(prefill))}
        finally:
            probe.shutdown()

    def _num_pages(self) -> int:
        """The pool: --num-pages, else what `gpu_memory_utilization` of the device leaves after what is in use
        (weights), the programs' peak (`probe_programs`) and a margin on each data shard
        (`memory_plan.plan_pool`), else (no memory figures, e.g. a CPU) max_slots requests of max_context. A pool
        whose data group cannot hold one request of max_context is refused."""
        c, g = self.config, self.groups
        n = c.num_pages
        if n is None:
            stats = _memory_stats()
            if stats is not None:  # each data shard holds its group's pages, every head's rows of them
                peak = max(m.peak for m in self.probe_programs().values())
                self.pool_plan = memory_plan.plan_pool(
                    bytes_limit=int(stats["bytes_limit"]), bytes_in_use=int(stats["bytes_in_use"]),
                    utilization=c.gpu_memory_utilization, programs_peak=peak, page_bytes=self.page_bytes, groups=g,
                    pages_per_request=self.pages_per_request)
                n = self.pool_plan.pages
            else:
                n = c.max_slots * self.pages_per_request
        elif n % g:
            raise ValueError(f"num_pages (--num-pages) {n} must be a multiple of the mesh's data size {g}: each data "
                             f"group owns an equal range of pages")
        if n // g < self.pages_per_request:
            raise ValueError(
                f"the page pool holds {n} pages of {c.page_size} tokens ({n // g} per data group), fewer than the "
                f"{self.pages_per_request} one request of max_context {c.max_context} needs (with {self.row_slack} "
                f"rows of scratch): raise --num-pages or --gpu-memory-utilization, or lower --max-context")
        return int(n)

    def _check_groups(self) -> None:
        """Slot counts that split evenly over the data groups."""
        c, g = self.config, self.groups
        if c.max_slots % g:
            raise ValueError(f"max_slots (--max-slots) {c.max_slots} must be a multiple of the mesh's data size {g}: "
                             f"each data group owns an equal share of the slots")
        if c.step_widths is not None and any(w % g for w in c.step_widths):
            raise ValueError(f"step_widths (--step-widths) {c.step_widths} must be multiples of the mesh's data size "
                             f"{g}: a step runs over the same number of slots in each data group")

    def capacity_summary(self) -> str:
        """The pool in words, for the start-up log."""
        c = self.config
        tokens = self.num_pages * c.page_size
        size = self.num_pages * self.page_bytes
        size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        groups = f" in {self.groups} data groups" if self.groups > 1 else ""
        per_group = self.num_pages // self.groups // self.pages_per_request
        return (f"{self.num_pages} pages of {c.page_size} tokens ({tokens} tokens, {size_text}){groups}; "
                f"{self.groups * per_group} requests of max_context {c.max_context} at once "
                f"(up to {c.max_slots} slots)")

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def weight_bytes(self) -> int:
        t, d = self.engine.weights
        return sum(x.nbytes for x in jax.tree.leaves((t, d if self.uses_drafter else None)))

    def memory_report(self) -> dict:
        """Per compiled program its temp, argument, output and alias bytes (`compiled.memory_analysis()`), with the
        pool's and the weights' bytes: the figures a GPU compile will want, on any backend."""
        return {"programs": {desc: dataclasses.asdict(memory_plan.ProgramMemory.of(program))
                             for desc, program in self.runner.programs_by_desc().items()},
                "pool_bytes": self.pool_bytes, "weight_bytes": self.weight_bytes}

    def memory_summary(self) -> str:
        """The start-up line: weights / programs' peak / pool / requests of max_context. On a device that reports
        its memory these are the planner's figures; elsewhere the compiled programs' (after `warm_up`)."""
        requests = self.groups * (self.num_pages // self.groups // self.pages_per_request)
        plan = self.pool_plan
        if plan is None:
            peak = max((memory_plan.ProgramMemory.of(p).peak for p in self.runner.programs_by_desc().values()),
                       default=0)
            plan = memory_plan.PoolPlan(pages=self.num_pages, weights=self.weight_bytes, programs_peak=peak,
                                        margin=0, page_bytes=self.page_bytes)
        return plan.summary(requests, self.config.max_context)

    # ---- programs -------------------------------------------------------------------------------------------
    def _budget_plan(self) -> dict[int, StepKind]:
        """The step program for each count of active slots."""
        cfg, n = self.config, self.config.max_slots
        if cfg.mode != "ddtree":
            return {a: StepKind(cfg.mode) for a in range(1, n + 1)}
        budget = cfg.budget
        if isinstance(budget, str):
            if budget != "auto":
                raise ValueError(f"budget must be an integer, 'auto' or a table, got {budget!r}")
            profile = budget_mod.profile_for(self.engine.budget_profile, self.engine.profile_key())
            if profile is None:
                return {a: StepKind("ddtree", budget_mod.DEFAULT_BUDGET) for a in range(1, n + 1)}
            return {a: (StepKind("ddtree", budget_mod.choose_budget(profile, a))
                        if budget_mod.speculation_pays(profile, a) else StepKind("ar")) for a in range(1, n + 1)}
        if isinstance(budget, Mapping):
            table = {int(a): b for a, b in budget.items()}
            if not table or min(table) > 1:
                raise ValueError(f"a budget table needs an entry for 1 active slot, got {sorted(table)}")
            plan = {}
            for a in range(1, n + 1):
                b = table[max(k for k in table if k <= a)]
                plan[a] = StepKind("ar") if b == "ar" else StepKind("ddtree", _budget_int(b))
            return plan
        return {a: StepKind("ddtree", _budget_int(budget)) for a in range(1, n + 1)}

    def width_for(self, active: int, busiest: int | None = None) -> int:
        """The narrowest compiled width that holds `active` running requests, at most `busiest` of them in one data
        group (default: as many as one group holds); each group keeps its own in its lowest slots."""
        per_group = min(active, self.group_slots) if busiest is None else busiest
        return next(w for w in self.widths if w // self.groups >= per_group)

    def _spec(self, kind: StepKind, prompt_len: int = 1, batch: int | None = None):
        eng, cfg = self.engine, self.config
        budgets = [k.budget for k in self.plan.values() if k.mode == "ddtree"]
        draft_k = max((min(b, eng.target.cfg.vocab_size) for b in budgets), default=0) or 0
        spec = eng.spec_for(mode=kind.mode, batch=batch or cfg.max_slots, prompt_len=prompt_len, max_new_tokens=1,
                            budget=kind.budget, top_k_cap=cfg.top_k_cap, draft_k=max(draft_k, 1))
        if kind.mode == "ar" and self.uses_drafter:  # keeps the drafter's state: needs the target's features
            d = eng.drafter.cfg
            spec = dataclasses.replace(spec, taps=tuple(d.target_layer_ids), mask_token_id=d.mask_token_id)
        return spec

    def _buckets(self) -> list[int]:
        """Padded chunk lengths, one prefill program each: powers of two from min_prompt_bucket, then the chunk."""
        n, out = self.config.min_prompt_bucket, set()
        while n < self.chunk_tokens:
            out.add(n)
            n *= 2
        return sorted(out | {self.chunk_tokens})

    def bucket_for(self, prompt_len: int) -> int:
        """The bucket of a prompt's first chunk."""
        return self.scheduler.bucket_for(min(prompt_len, self.chunk_tokens))

    def _new_table(self, n_pages: int | None = None):
        cfg = self.config
        return programs.empty_table(self.engine.target, self.engine.drafter if self.uses_drafter else None,
                                    slots=cfg.max_slots, capacity=self.capacity, n_pages=n_pages or self.num_pages,
                                    page_size=cfg.page_size, n_stop=cfg.max_stop_ids, depth=self.depth,
                                    draft_k=self.draft_k, rounds=cfg.rounds_per_step)

    def warm_up(self, on_program=None) -> dict[str, float]:
        """Compile every program: one prefill chunk per (bucket, rows), one step per (budget, width), move and
        release; `on_program(desc, seconds)` after each. Returns the seconds each took (near zero where JAX's
        persistent compilation cache had it)."""
        return self.runner.warm_up(on_program)

    @property
    def warmup_s(self) -> dict[str, float]:
        return self.runner.warmup_s

    @property
    def _programs(self) -> dict:
        return self.runner._programs

    # ---- requests -------------------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: RequestParams) -> tuple[list[int], tuple[int, ...], int]:
        """Validate a request without touching the engine: (prompt ids, stop ids, seed). Raises RequestError."""
        return check_request(prompt, params, self.limits, self._rng)

    def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams(), *,
               request_id: int | None = None) -> int:
        """Queue a request; returns its id. Bad input raises RequestError and changes nothing."""
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
            compiler = self.engine.constraint_compiler()
            self._compiling.append((request, self._compiler_thread.submit(compiler.compile, params.constraint)))
        return rid

    def _take_compiled(self, wait: bool) -> list[RequestRecord]:
        """Queue the constrained requests whose automaton is ready (waiting for the first one when `wait`); a
        constraint that does not compile, or can never fit the tables, ends its request with "error"."""
        if wait and self._compiling:
            concurrent.futures.wait([f for _, f in self._compiling], return_when=concurrent.futures.FIRST_COMPLETED)
        records, pending = [], []
        for r, future in self._compiling:
            if not future.done():
                pending.append((r, future))
                continue
            try:
                automaton = future.result()
                problem = self.layout.fits_alone(automaton)
            except ValueError as e:
                automaton, problem = None, str(e)
            if problem is not None:
                records.append(self._record(r, "error", error=f"constraint: {problem}"))
                continue
            self._automata[r.rid] = automaton
            self.scheduler.add(r)
        self._compiling = pending
        return records

    def cancel(self, request_id: int) -> RequestRecord | None:
        """Drop a waiting, prefilling or running request; its pages and slot are free for the next step. Returns
        its record: "cancelled", or "error" where the step it was in had failed; None if it is not here."""
        self._faults += self._settle()  # the table is back from the device thread
        for i, rec in enumerate(self._faults):
            if rec.request_id == request_id:
                return self._faults.pop(i)
        for i, (r, future) in enumerate(self._compiling):
            if r.rid == request_id:
                del self._compiling[i]
                future.cancel()
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
        self._compiler_thread.shutdown(wait=False)
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
        return len(self.scheduler.waiting) + len(self._compiling)

    @property
    def n_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens of every request's first admission (vLLM's prefix_cache_queries), and the ones found in
        the cache: they add up against the prompts admitted, however often a request is preempted."""
        return self.scheduler.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler.prefix_hits

    @property
    def resumed_prefix_hits(self) -> int:
        """Context tokens preempted requests found in the prefix cache when readmitted (not recomputed)."""
        return self.scheduler.resumed_hits

    @property
    def has_work(self) -> bool:
        s = self.scheduler
        return (bool(s.waiting) or bool(s.prefilling) or s.n_running > 0 or self._in_flight is not None
                or bool(self._compiling))

    def running_ids(self) -> list[int]:
        return [r.rid for r in self.scheduler.prefilling] + [r.rid for r in self.scheduler.running]

    def waiting_ids(self) -> list[int]:
        return [r.rid for r, _ in self._compiling] + [r.rid for r in self.scheduler.waiting]

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Prefill one chunk, grow the running requests' pages (preempting the newest where the pool is short),
        move the running ones into the lowest slots, run one step (k rounds) over the narrowest width that holds
        them, and hand back what the host learnt: this step's tokens, or with `overlap` the previous step's, read
        while this one runs."""
        events = self._settle()
        s = self.scheduler
        idle = not (s.waiting or s.prefilling or s.n_running or self._in_flight is not None)
        events += self._take_compiled(wait=idle)  # nothing else to do: wait for a constraint rather than spin
        steps = 2 if self._in_flight is not None else 1  # the step in flight writes too, unread
        plan, preempted = s.plan_prefill(steps)
        self._release(preempted)
        admitted, prefill_tokens = 0, 0
        if plan is not None:
            prefill_events, admitted = self._prefill(plan)
            events += prefill_events
            prefill_tokens = sum(c.n_valid for c in plan.chunks)
        before = list(s.slots)
        more = s.reserve(steps)
        self._release(more, before)
        for src, dst in s.moves():
            self.runner.move(src, dst)
            self.n_moves += 1
        active = s.n_running
        kind = self.plan[active] if active else None
        width = self.width_for(active, s.busiest()) if active else 0
        done, self._in_flight = self._in_flight, None
        if active:
            future = self.runner.queue_step((kind, width), s.page_table())
            rows = [s.slots[i] for i in s.step_slots(width)]  # a width may pass the running
            owners = [(r, 0 if r is None else r.epoch) for r in rows]
            self._in_flight = _InFlight(kind, owners, future=future)
            if not self.runner.overlap:  # this step is the one to read, now
                events += self._settle()
                done, self._in_flight = self._in_flight, None  # None where it failed: _settle ended its requests
        if done is not None:
            events += self._read(done)
        return StepReport(events, kind, active, admitted, width, prefill_tokens, len(preempted) + len(more))

    def _release(self, preempted: list[Request], slots: list | None = None) -> None:
        """The device rows of preempted requests that were decoding are finished."""
        slots = self.scheduler.slots if slots is None else slots
        for r in preempted:
            if r in slots:
                self.runner.release(slots.index(r))

    def _settle(self) -> list:
        """Wait for the queued step and take its table back (its tokens are read later); returns the records of a
        fault found now or earlier outside step()."""
        step = self._in_flight
        if step is not None and step.future is not None:
            future, step.future = step.future, None
            try:
                step.packed = self.runner.settle(future)
            except Exception as e:  # the table was donated to the failed program: every running request fails
                self._faults += self._fail_all(e)
        events, self._faults = self._faults, []
        return events

    def _read(self, step: _InFlight) -> list:
        """Token deltas and final records from a step's packed output (waits for that step only)."""
        try:
            packed = np.asarray(jax.device_get(step.packed))
        except Exception as e:  # raised on the device: the table that step wrote is lost too
            self._in_flight = None
            return self._fail_all(e)
        now = time.perf_counter()
        n_draft = self.specs[(step.kind, len(step.owners))].n_slots - 1
        events = []
        for (r, epoch), out in zip(step.owners, programs.unpack_step(packed, self.config.rounds_per_step)):
            if r is None or r.ended or r.epoch != epoch:  # ended, or preempted: its tokens will be recomputed
                continue
            acc = _emitted_lengths(list(out.accept), len(out.tokens))
            r.accept_lengths += acc
            self.scheduler.observe(acc)
            finish = out.finish
            if finish == programs.PAUSED:  # its pages held no further round: grown before its next step
                self.n_paused += 1
                finish = RUNNING
            r.num_draft_tokens += n_draft * len(acc)
            if out.tokens:
                r.tokens += out.tokens
                events.append(TokenDelta(r.rid, list(out.tokens), now))
                self.scheduler.committed(r)
            if finish != RUNNING:
                self.scheduler.finish(self.scheduler.slots.index(r))  # its row is finished on the device already
                events.append(self._record(r, FINISH_REASONS[finish]))
        return events

    def _prefill(self, plan: PrefillPlan) -> tuple[list, int]:
        """Run the plan's chunk program; requests whose context it ended start decoding (or end at once). A padding
        row (a data group with fewer chunks than the others) has no pages and no slot: its writes are dropped."""
        c, bucket = self.config, plan.bucket
        reqs = [ch.request for ch in plan.chunks]
        n = len(plan.rows)
        pad = Chunk(Request(None, [0], RequestParams(), self.stop_ids, 0, 0.0, context=[0]), 0, 1, None)  # rid None:
        rows = [pad if ch is None else ch for ch in plan.rows]  # a page-table row of UNOWNED
        row_reqs = [ch.request for ch in rows]
        self.prefill_calls[n] = self.prefill_calls.get(n, 0) + 1
        start_state, refused = self._start_states(rows)
        batch = prefill_batch(rows, bucket, self.cache.page_table([r.rid for r in row_reqs]), c.max_slots,
                              c.max_stop_ids, start_state)
        try:
            out = self.runner.prefill(batch)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            failed = [r for r in reqs if r in self.scheduler.prefilling]
            events = self._fail_all(e)
            return [*events, *(self._record(r, "error", error=error) for r in failed if not r.ended)], 0
        now = time.perf_counter()
        events, admitted = [], 0
        for ch, row in zip(plan.rows, out):
            if ch is None:
                continue
            first, finish = row.first, row.finish
            r = ch.request
            if not ch.last:
                self.scheduler.prefilled(ch, running=False)
                continue
            if r.rid in refused:  # its row ran unconstrained: it never decodes
                self.scheduler.prefilled(ch, running=False)
                self.runner.release(ch.slot)
                events.append(self._record(r, "error", error=f"constraint: {refused[r.rid]}"))
                continue
            if r.first_token_time is None:
                r.first_token_time = now
            if finish != FINISH_NONFINITE:
                r.tokens.append(first)
                events.append(TokenDelta(r.rid, [first], now))
            self.scheduler.prefilled(ch, running=finish == RUNNING)
            if finish == RUNNING:
                admitted += 1
            else:
                events.append(self._record(r, FINISH_REASONS[finish]))
        return events, admitted

    def _start_states(self, rows: list[Chunk]) -> tuple[np.ndarray, dict]:
        """Each row's automaton state after its context (`cd.FREE_STATE` where unconstrained or not a last chunk),
        placing the automata of requests that start decoding; uploads the tables when a placement changed them.
        Returns (states, {rid: why} of requests whose automaton found no room)."""
        states = np.full(len(rows), cd.FREE_STATE, np.int32)
        refused = {}
        for i, ch in enumerate(rows):
            r = ch.request
            automaton = self._automata.get(r.rid)
            if automaton is None or not ch.last:
                continue
            try:
                base = self.layout.place(automaton.spec, automaton)
            except cd.ConstraintTooLarge as e:
                refused[r.rid] = str(e)
                continue
            if r.rid in self._placed:  # placed at an earlier admission (then preempted)
                self.layout.release(automaton.spec)
            self._placed.add(r.rid)
            states[i] = base + _walk(automaton, r.tokens)
        if self.layout.version != self._tables_version:
            self.runner.set_tables(self.layout.tables())
            self._tables_version = self.layout.version
        return states, refused

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
        automaton = self._automata.pop(r.rid, None)
        if r.rid in self._placed:
            self._placed.discard(r.rid)
            self.layout.release(automaton.spec)
        return RequestRecord(request_id=r.rid, token_ids=list(r.tokens), finish_reason=reason,
                             prompt_tokens=len(r.prompt), accept_lengths=list(r.accept_lengths),
                             num_draft_tokens=r.num_draft_tokens, error=error, num_preemptions=r.num_preemptions,
                             cached_tokens=r.cached_tokens,
                             submit_time=r.submit_time, first_token_time=r.first_token_time,
                             finish_time=time.perf_counter())


def _walk(automaton: TokenAutomaton, tokens: Sequence[int]) -> int:
    """The automaton's local state after `tokens` (a resumed request's generated tokens) from its start."""
    state = 0
    for t in tokens:
        state = automaton.next_state(state, int(t))
    return state


def _emitted_lengths(accept: list[int], n_new: int) -> list[int]:
    """Each round's tokens as far as the step emitted them: a request that ended at a stop or at max_new_tokens
    mid-round committed fewer than its round accepted, and rounds past that emitted none."""
    out, left = [], n_new
    for a in accept:
        if left <= 0:
            break
        out.append(min(a, left))
        left -= out[-1]
    return out


def _memory_stats() -> dict | None:
    """The first device's memory limit and use, where it reports them (GPUs do; a CPU does not)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (a backend without memory figures)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n."""
    return [*(1 << i for i in range(max(n - 1, 0).bit_length()) if 1 << i < n), n]


def _budget_int(b) -> int:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
        raise ValueError(f"a DDTree budget must be an integer >= 1 or 'ar', got {b!r}")
    return int(b)
