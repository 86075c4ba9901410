"""The serving engine's host side: a table of request slots stepped by a fixed set of compiled programs.

Requests wait in a queue, are prefilled into free slots between steps, and leave when they finish or are
cancelled. Each `step()` admits what fits, keeps the running requests in the lowest slots, picks the step program
for the number of active slots (the budget follows the load, `kdtree_jax/budget.py`) and the narrowest compiled
width that holds them, runs k rounds and hands back token deltas and final records. With `overlap` the step runs
on a device thread while the host reads the previous step's tokens, so the device waits little for the host.
Everything a request asks for is runtime data, so after `warm_up()` nothing compiles.

The interface follows JetStream's engine API (prefill / insert / generate over slots), with a DDTree round as the
generate step. `kdtree_jax/serving/frontend.py` puts an async front on it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax._src import xla_bridge

from kdtree_jax import budget as budget_mod
from kdtree_jax import sampling
from kdtree_jax.engine import ContextTooLongError, Engine
from kdtree_jax.serving import programs
from kdtree_jax.serving.programs import StepKind
from kdtree_jax.speculative import FINISH_NONFINITE, FINISH_REASONS, MODES, RUNNING, RequestRows, aligned_rows

log = logging.getLogger(__name__)

SEED_LIMIT = 1 << 32  # seeds are 32-bit: the request key is jax.random.key(seed)
_TABLE_IDS = itertools.count()  # Engine.compile keys of a table's programs: id() recurs once a table is freed
CACHE_ENV = "KDTREE_COMPILATION_CACHE"  # directory of JAX's persistent compilation cache; "off" disables it
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
LOOP_GRAPHS_FLAG = f"{COMMAND_BUFFER_FLAG}=+WHILE,+CONDITIONAL"  # XLA's default command buffer types and these two


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Use JAX's persistent compilation cache so a restart loads the warm-up's programs instead of compiling them.

    Directory: `path`, else $KDTREE_COMPILATION_CACHE, else ~/.cache/kdtree-jax/xla; "off" disables. Every program
    is cached, however quickly it compiled. Call before the first compile."""
    path = path or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kdtree-jax", "xla")
    if path == "off":
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def enable_loop_graphs() -> bool:
    """Have XLA put while loops and conditionals into its CUDA graphs (command buffers) too, so that a step program's
    call returns once its rounds are queued instead of after the last one.

    By default XLA on a GPU copies every loop and branch predicate to the host and waits for it, so the call of a step
    program blocks for the whole step, and the host can only prepare the next step once the device is idle. Measured
    on one H200 with the shipped pair (ar, one request, 8 rounds per step): the call returned after 4.2 ms of its
    4.8 ms by default and after 1.4 ms with loop graphs, and the serving loop went from 0.72x to 1.00x the tokens/s
    of `Engine.generate` in the same process. A GPU-only setting; it must run before JAX creates its GPU client. An
    XLA_FLAGS that already chooses command buffers is left alone. Returns whether it set the flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if COMMAND_BUFFER_FLAG in flags:
        return False
    if xla_bridge.backends_are_initialized():
        log.warning("loop graphs not enabled: JAX's backends are initialised already (call enable_loop_graphs first)")
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {LOOP_GRAPHS_FLAG}".strip()
    return True


# ---- configuration and requests --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the slot table is compiled for; fixed for the life of a serving engine."""

    max_slots: int = 4
    max_context: int = 1024  # prompt + generated tokens of one request
    mode: str = "ddtree"  # "ar" | "chain" | "ddtree"
    # ddtree: B, "auto" (per step, from the budget profile and the number of active slots), or a table
    # {active slots: B or "ar"} (missing counts take the nearest smaller entry)
    budget: int | str | Mapping[int, int | str] = "auto"
    rounds_per_step: int = 8  # k: rounds per step; tokens come back to the host once per step
    # requests of one prompt bucket admitted together prefill in one program of up to this many rows (a program per
    # power of two up to it; no padding): one launch instead of one per request when many join at once
    prefill_batch: int = 4
    top_k_cap: int = sampling.TOP_K_CAP  # the largest per-request top_k
    max_stop_ids: int = 8  # stop-id table width per slot (the model's own stop ids included)
    min_prompt_bucket: int = 16  # prompt lengths pad to powers of two from here (then whole prefill chunks)
    max_queue: int = 1024  # waiting requests beyond this are refused
    # step programs run over the first w slots, for each w here (None: powers of two, then max_slots); a step
    # takes the narrowest that holds the running requests
    step_widths: tuple[int, ...] | None = None
    # run each step on a device thread and read the last step's tokens meanwhile, so the device waits only for
    # admission and dispatch; tokens, finishes and faults reach the host one step later (a finished row rides
    # that step at no cost)
    overlap: bool = True

    def __post_init__(self):
        for name in ("max_slots", "max_context", "rounds_per_step", "max_stop_ids", "min_prompt_bucket",
                     "prefill_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
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


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's parameters; all of them are runtime data."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: drawn from the engine's own generator
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's stop ids
    ignore_eos: bool = False  # do not stop at the model's own stop ids


class RequestError(ValueError):
    """A request refused before it reaches a slot; `field` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLongError(RequestError, ContextTooLongError):
    """Prompt plus max_new_tokens over the table's max_context."""


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests."""


class EngineClosedError(RuntimeError):
    """The serving engine was shut down."""


@dataclasses.dataclass(frozen=True)
class TokenDelta:
    request_id: int
    token_ids: list[int]
    time: float  # perf_counter when the host received them


@dataclasses.dataclass
class RequestRecord:
    """A finished request: its tokens, why it ended and its speculative statistics."""

    request_id: int
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error" | "nonfinite"
    prompt_tokens: int
    accept_lengths: list[int]  # tokens committed by each round (accepted drafts + 1)
    num_draft_tokens: int  # tokens drafted and verified (B per DDTree round, L - 1 per chain round)
    error: str | None = None
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens the target accepted (each round's bonus token is not a draft)."""
        return int(sum(a - 1 for a in self.accept_lengths))


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: RequestParams
    stop_ids: tuple[int, ...]
    seed: int
    submit_time: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    num_draft_tokens: int = 0
    first_token_time: float | None = None
    ended: bool = False  # its record was handed out: results of a step still in flight are dropped


@dataclasses.dataclass
class _InFlight:
    """A step whose packed output the host has not read yet: its `future` (the device thread's, or one already
    finished without overlap) until `_settle` takes the table back, then its packed output."""

    kind: StepKind
    owners: list  # the request in each of its rows when it was queued (rows move; requests end meanwhile)
    packed: jax.Array | None = None
    future: concurrent.futures.Future | None = None  # -> (table, packed)


@dataclasses.dataclass
class StepReport:
    """What one `step()` did: the host-side view a benchmark or a metrics endpoint reads."""

    events: list  # TokenDelta and RequestRecord, in order
    kind: StepKind | None  # the step program this call ran (None: nothing was running)
    active: int  # slots that were running when it started
    admitted: int  # requests prefilled into slots before it
    width: int = 0  # the rows it ran over


# ---- the engine ------------------------------------------------------------------------------------------------
class ServingEngine:
    """A fixed table of request slots over an `Engine`'s target and drafter; single-threaded (see frontend.py)."""

    def __init__(self, engine: Engine, config: ServeConfig = ServeConfig()):
        self.engine = engine
        self.config = config
        cfg = engine.target.cfg
        if config.mode != "ar" and engine.drafter is None:
            raise ValueError(f"mode {config.mode!r} needs a drafter; load one or serve mode 'ar'")
        if config.max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {config.max_context} exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        self.plan = self._budget_plan()
        self.kinds = sorted(set(self.plan.values()))
        self.widths = sorted(set(config.step_widths or _powers_of_two(config.max_slots)))
        # the step programs: each width with the kinds its active counts (the ones it is the narrowest for) need
        self.step_keys = sorted({(self.plan[a], self.width_for(a)) for a in range(1, config.max_slots + 1)},
                                key=lambda kw: (kw[1], kw[0]))
        self.uses_drafter = engine.drafter is not None and config.mode != "ar"
        budgets = [k.budget for k in self.kinds if k.mode == "ddtree"]
        self._prefill_kind = (StepKind("ddtree", max(budgets)) if budgets
                              else StepKind(config.mode if config.mode != "ddtree" else "chain"))
        self.specs = {(k, w): self._spec(k, batch=w) for k, w in self.step_keys}
        prefill_spec = self._spec(self._prefill_kind)
        self.draft_k = prefill_spec.top_k
        self.buckets = self._buckets()
        self.prefill_sizes = _powers_of_two(min(config.prefill_batch, config.max_slots))
        self.prefill_specs = {(b, n): dataclasses.replace(self._spec(self._prefill_kind, prompt_len=b), batch=n)
                              for b in self.buckets for n in self.prefill_sizes}
        slack = max(s.slack for s in [*self.specs.values(), prefill_spec])
        self.capacity = max(aligned_rows(config.max_context + slack),
                            *(s.capacity for s in self.prefill_specs.values()))
        self.stop_ids = tuple(engine.stop_ids)
        if len(self.stop_ids) > config.max_stop_ids:
            raise ValueError(f"max_stop_ids {config.max_stop_ids} is below the model's {len(self.stop_ids)} stop ids")
        self._programs: dict = {}
        self._uid = next(_TABLE_IDS)
        self._rng = np.random.default_rng()
        self._next_id = 0
        self._waiting: collections.deque[_Request] = collections.deque()
        self._slots: list[_Request | None] = [None] * config.max_slots
        self._in_flight: _InFlight | None = None
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdtree-step") \
            if config.overlap else None
        self._faults: list[RequestRecord] = []  # records of a fault found outside step(), for its next report
        self.n_moves = 0  # rows moved to keep the running requests in the lowest slots
        self.prefill_calls: collections.Counter[int] = collections.Counter()  # prefill programs run, by rows
        self._closed = False
        self.table = self._new_table()
        # the weights as one flat list: a plain list of arrays is the cheapest argument to pass on every call
        self._weight_leaves, self._weight_def = jax.tree.flatten(self._weights())
        self.warmup_s: dict[str, float] = {}

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

    def width_for(self, active: int) -> int:
        """The narrowest compiled width that holds `active` running requests (they sit in the lowest slots)."""
        return next(w for w in self.widths if w >= active)

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
        """Padded prompt lengths, one prefill program each: powers of two from min_prompt_bucket, each padded as
        `Engine.prompt_bucket` pads (whole prefill chunks past the chunk), up to what max_context - 1 tokens need."""
        longest, n, out = self.config.max_context - 1, self.config.min_prompt_bucket, set()
        while True:
            out.add(self.engine.prompt_bucket(min(n, longest))[1])
            if n >= longest:
                return sorted(out)
            n *= 2

    def bucket_for(self, prompt_len: int) -> int:
        return next(b for b in self.buckets if b >= prompt_len)

    def _new_table(self):
        cfg = self.config
        depth = max(s.depth for s in [*self.specs.values(), *self.prefill_specs.values()])
        return programs.empty_table(self.engine.target, self.engine.drafter if self.uses_drafter else None,
                                    slots=cfg.max_slots, capacity=self.capacity, n_stop=cfg.max_stop_ids,
                                    depth=depth, draft_k=self.draft_k, rounds=cfg.rounds_per_step)

    def _weights(self):
        t, d = self.engine.weights
        return t, (d if self.uses_drafter else None)

    def _program(self, name: str, key):
        """The compiled program `name` for `key` ((bucket, rows) or (StepKind, width)), compiled on first use."""
        if (name, key) in self._programs:
            return self._programs[(name, key)]
        eng, uses = self.engine, self.uses_drafter

        def modules(w):
            return eng.merged(*jax.tree.unflatten(self._weight_def, w), uses)

        if name == "prefill":
            spec, (bucket, n) = self.prefill_specs[key], key

            def fn(w, table, prompts, prompt_len, seeds, rows, slots):
                return programs.prefill_into_slots(spec, *modules(w), table, prompts, prompt_len, seeds, rows, slots)

            rows = _rows([RequestParams()] * n, [self.stop_ids] * n, self.config.max_stop_ids)
            args = (np.zeros((n, bucket), np.int32), np.ones((n,), np.int32), np.zeros((n,), np.uint32), rows,
                    np.zeros((n,), np.int32))
        elif name == "step":
            spec, rounds = self.specs[key], self.config.rounds_per_step

            def fn(w, table):
                return programs.step(spec, *modules(w), table, rounds)

            args = ()
        elif name == "move":
            def fn(w, table, src, dst):
                return programs.move(table, src, dst)

            args = (np.int32(0), np.int32(0))
        else:
            def fn(w, table, slot):
                return programs.release(table, slot)

            args = (np.int32(0),)
        if key is None:
            desc = name
        else:
            desc = f"{name} {key[0].name if name == 'step' else key[0]} x{key[1]}"
        compiled, seconds = eng.compile(fn, (self._weight_leaves, self.table, *args), ("serve", self._uid, name, key),
                                        desc=desc, donate=(1,))
        self.warmup_s[desc] = seconds
        self._programs[(name, key)] = compiled
        return compiled

    def warm_up(self) -> dict[str, float]:
        """Compile every program the table can run: one prefill per (prompt bucket, rows), one step per (budget,
        width), move and release. Returns the seconds each took (near zero where JAX's persistent compilation cache had
        it)."""
        for key in self.prefill_specs:
            self._program("prefill", key)
        for key in self.step_keys:
            self._program("step", key)
        self._program("move", None)
        self._program("release", None)
        return dict(self.warmup_s)

    # ---- requests -------------------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: RequestParams) -> tuple[list[int], tuple[int, ...], int]:
        """Validate a request without touching the table: (prompt ids, stop ids, seed). Raises RequestError."""
        cfg, vocab = self.config, self.engine.target.cfg.vocab_size
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise RequestError("prompt", f"must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("prompt", "is empty")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise RequestError("prompt", "must hold integer token ids")
        bad = [int(t) for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError("prompt", f"has token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
        n = params.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise RequestError("max_new_tokens", f"must be an integer >= 1, got {n!r}")
        if len(prompt) + n > cfg.max_context:
            raise PromptTooLongError(
                "prompt" if len(prompt) >= cfg.max_context else "max_new_tokens",
                f"the prompt's {len(prompt)} tokens plus max_new_tokens {n} exceed max_context {cfg.max_context}")
        try:
            sampling.SamplingParams(params.temperature, params.top_k, params.top_p).check_cap(cfg.top_k_cap)
        except sampling.ParamError as e:
            raise RequestError(e.field, e.detail) from None
        extra = tuple(params.stop_token_ids)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in extra):
            raise RequestError("stop_token_ids", f"must be integer token ids, got {extra!r}")
        out = [t for t in extra if not 0 <= t < vocab]
        if out:
            raise RequestError("stop_token_ids", f"ids outside the vocabulary (0..{vocab - 1}): {out[:5]}")
        stop = tuple(dict.fromkeys((() if params.ignore_eos else self.stop_ids) + tuple(int(t) for t in extra)))
        if len(stop) > cfg.max_stop_ids:
            raise RequestError("stop_token_ids", f"{len(stop)} stop ids (the model's included) exceed the table's "
                                                 f"{cfg.max_stop_ids}")
        seed = params.seed
        if seed is None:
            seed = int(self._rng.integers(SEED_LIMIT))
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
            raise RequestError("seed", f"must be an integer in [0, 2**32), got {seed!r}")
        return [int(t) for t in prompt], stop, int(seed)

    def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams(), *,
               request_id: int | None = None) -> int:
        """Queue a request; returns its id. Bad input raises RequestError and changes nothing."""
        if self._closed:
            raise EngineClosedError("the serving engine is shut down; no new requests")
        if len(self._waiting) >= self.config.max_queue:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue {self.config.max_queue})")
        ids, stop, seed = self.check(prompt, params)
        rid = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, rid + 1)
        self._waiting.append(_Request(rid, ids, params, stop, seed, time.perf_counter()))
        return rid

    def cancel(self, request_id: int) -> RequestRecord | None:
        """Drop a waiting or running request; its slot is free for the next step. Returns its record: "cancelled",
        or "error" where the step it was in had failed; None if it is not here."""
        self._faults += self._settle()  # the table is back from the device thread
        for i, rec in enumerate(self._faults):
            if rec.request_id == request_id:
                return self._faults.pop(i)
        for r in self._waiting:
            if r.rid == request_id:
                self._waiting.remove(r)
                return self._record(r, "cancelled")
        for slot, r in enumerate(self._slots):
            if r is not None and r.rid == request_id:
                self._free(slot)
                return self._record(r, "cancelled")
        return None

    def shutdown(self) -> list[RequestRecord]:
        """Refuse new requests and cancel every waiting and running one."""
        self._closed = True
        ids = [r.rid for r in self._waiting] + [r.rid for r in self._slots if r is not None]
        records = [rec for rec in map(self.cancel, ids) if rec is not None]
        self._in_flight = None  # every request it ran has ended
        if self._device is not None:
            self._device.shutdown()  # idle: cancel settled its last step
        return records

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def n_running(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or self.n_running > 0 or self._in_flight is not None

    def running_ids(self) -> list[int]:
        return [r.rid for r in self._slots if r is not None]

    def waiting_ids(self) -> list[int]:
        return [r.rid for r in self._waiting]

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Admit waiting requests into free slots, move the running ones into the lowest slots, run one step (k
        rounds) over the narrowest width that holds them, and hand back what the host learnt: this step's tokens,
        or with `overlap` the previous step's, read while this one runs."""
        events = self._settle()
        free = [i for i, r in enumerate(self._slots) if r is None]
        joining = [(self._waiting.popleft(), slot) for slot in free[: len(self._waiting)]]
        admitted = len(joining)
        by_bucket: dict[int, list] = {}
        for r, slot in joining:
            by_bucket.setdefault(self.bucket_for(len(r.prompt)), []).append((r, slot))
        for bucket, group in by_bucket.items():
            while group:
                n = max(k for k in self.prefill_sizes if k <= len(group))
                events += self._admit(bucket, group[:n])
                group = group[n:]
        self._compact()
        active = self.n_running
        kind = self.plan[active] if active else None
        width = self.width_for(active) if active else 0
        done, self._in_flight = self._in_flight, None
        if active:
            run = functools.partial(self._program("step", (kind, width)), self._weight_leaves, self.table)
            self.table = None  # donated to the step until _settle takes it back
            future = self._device.submit(run) if self._device is not None else _run_now(run)
            self._in_flight = _InFlight(kind, self._slots[:width], future=future)
            if self._device is None:  # no overlap: this step is the one to read, now
                events += self._settle()
                done, self._in_flight = self._in_flight, None  # None where it failed: _settle ended its requests
        if done is not None:
            events += self._read(done)
        return StepReport(events, kind, active, admitted, width)

    def _settle(self) -> list:
        """Wait for the queued step and take its table back (its tokens are read later); returns the records of a
        fault found now or earlier outside step()."""
        step = self._in_flight
        if step is not None and step.future is not None:
            future, step.future = step.future, None
            try:
                self.table, step.packed = future.result()
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
        rounds, n_draft = self.config.rounds_per_step, self.specs[(step.kind, len(step.owners))].n_slots - 1
        events = []
        for row, r in enumerate(step.owners):
            if r is None or r.ended:
                continue
            n_new, finish = int(packed[row, 0]), int(packed[row, 1])
            acc = [int(a) for a in packed[row, 2 : 2 + rounds] if a > 0]
            r.accept_lengths += acc
            r.num_draft_tokens += n_draft * len(acc)
            if n_new:
                new = packed[row, 2 + rounds : 2 + rounds + n_new].tolist()
                r.tokens += new
                events.append(TokenDelta(r.rid, new, now))
            if finish != RUNNING:
                self._slots[self._slots.index(r)] = None  # its row is finished on the device already
                events.append(self._record(r, FINISH_REASONS[finish]))
        return events

    def _compact(self) -> None:
        """Move the highest running requests into the lowest free slots, so that they fill rows [0, n_running)."""
        while True:
            free = [i for i, r in enumerate(self._slots) if r is None]
            used = [i for i, r in enumerate(self._slots) if r is not None]
            if not free or not used or free[0] > used[-1]:
                return
            src, dst = used[-1], free[0]
            self.table = self._program("move", None)(self._weight_leaves, self.table, np.int32(src), np.int32(dst))
            self._slots[dst], self._slots[src] = self._slots[src], None
            self.n_moves += 1

    def _admit(self, bucket: int, group: list[tuple[_Request, int]]) -> list:
        """Prefill a group of requests of one bucket into their slots, in one program of len(group) rows."""
        n = len(group)
        prompts = np.zeros((n, bucket), np.int32)
        for i, (r, _) in enumerate(group):
            prompts[i, : len(r.prompt)] = r.prompt
        rows = _rows([r.params for r, _ in group], [r.stop_ids for r, _ in group], self.config.max_stop_ids)
        self.prefill_calls[n] += 1
        try:
            self.table, out = self._program("prefill", (bucket, n))(
                self._weight_leaves, self.table, prompts, np.array([len(r.prompt) for r, _ in group], np.int32),
                np.array([r.seed for r, _ in group], np.uint32), rows, np.array([s for _, s in group], np.int32))
            out = np.asarray(jax.device_get(out))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            return [*self._fail_all(e), *(self._record(r, "error", error=error) for r, _ in group)]
        now = time.perf_counter()
        events = []
        for (r, slot), (first, finish) in zip(group, out.tolist()):
            r.first_token_time = now
            if finish != FINISH_NONFINITE:
                r.tokens.append(first)
                events.append(TokenDelta(r.rid, [first], now))
            if finish == RUNNING:
                self._slots[slot] = r
            else:
                events.append(self._record(r, FINISH_REASONS[finish]))
        return events

    def _free(self, slot: int) -> None:
        self._slots[slot] = None
        self.table = self._program("release", None)(self._weight_leaves, self.table, np.int32(slot))

    def _fail_all(self, error: Exception) -> list[RequestRecord]:
        """A program raised: its donated table is gone, and so is any step queued after it. Every running request
        ends with "error" and the slots start empty again; waiting requests stay queued."""
        log.error("serving step failed: %s: %s", type(error).__name__, error)
        records = [self._record(r, "error", error=f"{type(error).__name__}: {error}")
                   for r in self._slots if r is not None]
        self._slots = [None] * self.config.max_slots
        self._in_flight = None
        self.table = self._new_table()
        return records

    def _record(self, r: _Request, reason: str, error: str | None = None) -> RequestRecord:
        r.ended = True
        return RequestRecord(request_id=r.rid, token_ids=list(r.tokens), finish_reason=reason,
                             prompt_tokens=len(r.prompt), accept_lengths=list(r.accept_lengths),
                             num_draft_tokens=r.num_draft_tokens, error=error, submit_time=r.submit_time,
                             first_token_time=r.first_token_time, finish_time=time.perf_counter())


def _run_now(fn) -> concurrent.futures.Future:
    """fn() on the calling thread, as a finished future (its result or its exception), like the device thread's."""
    future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as e:  # noqa: BLE001  (handed on: _settle turns it into the requests' error records)
        future.set_exception(e)
    return future


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n."""
    return [*(1 << i for i in range(max(n - 1, 0).bit_length()) if 1 << i < n), n]


def _budget_int(b) -> int:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
        raise ValueError(f"a DDTree budget must be an integer >= 1 or 'ar', got {b!r}")
    return int(b)


def _rows(params: list[RequestParams], stop_ids: list[tuple[int, ...]], n_stop: int) -> RequestRows:
    rules = [sampling.SamplingParams(p.temperature, p.top_k, p.top_p) for p in params]
    return RequestRows.of(rules, [p.max_new_tokens for p in params], stop_ids, n_stop)
