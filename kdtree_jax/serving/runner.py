"""The serving runner: the device table and the fixed set of compiled programs that change it.

It holds the table (`programs.empty_table`: slot rows over the page pools) and the constraint tables (every live
automaton, `constrain_device.AutomatonTables`: an argument of every prefill and step program, replaced when the
host lays out a new automaton), compiles each program once per shape
key (prefill chunks per (bucket, rows), steps per (step kind, width), move, release; a prefill or step once more per
larger constraint table bucket the live automata grow the tables to) and runs them. Programs compile against the
table's shapes, not its arrays, so a runner that only compiles (the memory planner's probe) allocates no pool, and the
warm-up compiles its programs on a thread pool (XLA compiles without the GIL). Every program donates the table; a step
can run on a one-thread executor while the host reads the previous step's tokens (`overlap`), and `settle` takes the
table back before anything else touches it. Nothing here decides what runs: the scheduler does
(`kdtree_jax/serving/scheduler.py`).
"""
from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from tqdm.auto import tqdm

from kdtree_jax.constrain import device as cd
from kdtree_jax.decode.speculative import DecodeSpec, RequestRows
from kdtree_jax.parallel import sharding
from kdtree_jax.serving import programs, xla_options
from kdtree_jax.serving.plan import Chunk, Request
from kdtree_jax.serving.request import RequestParams

COMPILE_THREADS_ENV = "KDTREE_COMPILE_THREADS"  # programs the warm-up compiles at once; unset: 1, 0: one per CPU
_TABLE_IDS = itertools.count()  # Engine.compile keys of a table's programs: id() recurs once a table is freed


class ModelRunner:
    """The device half of the serving engine: one table, its programs, and the device thread."""

    def __init__(self, engine, *, uses_drafter: bool, new_table, prefill_specs: dict, step_specs: dict,
                 rounds: int, page_table_width: int, max_slots: int, rows_for, overlap: bool, groups: int = 1,
                 constraint_tables: cd.AutomatonTables, row_slack: int | None = None, allocate: bool = True):
        self.engine = engine
        self.uses_drafter = uses_drafter
        self._new_table = new_table
        self.prefill_specs: dict[tuple[int, int], DecodeSpec] = prefill_specs  # (bucket, rows) -> spec
        self.step_specs: dict = step_specs  # (StepKind, width) -> spec
        self.rounds = rounds
        self.row_slack = row_slack  # scratch rows a round may write past a row's last token (the pages' budget)
        self.width_pages = page_table_width
        self.max_slots = max_slots
        self.groups = groups  # data groups: a step runs over the lowest rows of each (`programs.step`)
        self._rows_for = rows_for  # n -> RequestRows of n default requests (the compile-time example)
        self._programs: dict = {}
        self._uid = next(_TABLE_IDS)
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdtree-step") if overlap else None
        self.mesh = engine.mesh
        self.shardings = None
        # allocate=False: a runner that only compiles (and reads its programs' memory); it never runs
        self.table = self._placed(new_table()) if allocate else None
        self.table_spec = _spec_of(self.table) if allocate else self._abstract(jax.eval_shape(new_table))
        self.tables = self._placed_tables(constraint_tables)
        self._first_tables = cd.table_shape(self.tables)  # the programs warm-up compiles take tables of this bucket
        # the weights as one flat list: a plain list of arrays is the cheapest argument to pass on every call
        t, d = engine.weights
        self._weight_leaves, self._weight_def = jax.tree.flatten((t, d if uses_drafter else None))
        self.warmup_s: dict[str, float] = {}

    # ---- placement ------------------------------------------------------------------------------------------
    def _placed(self, table):
        """The table in its layout on the engine's mesh (`table_shardings`); as it is without one."""
        if self.mesh is None:
            return table
        if self.shardings is None:
            self.shardings = table_shardings(table, self.mesh)
        return jax.device_put(table, self.shardings)

    def _abstract(self, shapes):
        """The table's shapes in the layout `_placed` gives its arrays: what the programs compile against."""
        if self.mesh is None:
            layout = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), shapes)
        else:
            self.shardings = self.shardings or table_shardings(shapes, self.mesh)
            layout = self.shardings
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
                            shapes, layout)

    def _placed_tables(self, tables: cd.AutomatonTables) -> cd.AutomatonTables:
        """Constraint tables on the device, replicated over the mesh (every row may read any automaton)."""
        if self.mesh is None:
            return cd.to_device(tables)
        return jax.device_put(tables, NamedSharding(self.mesh, PartitionSpec()))

    def set_tables(self, tables: cd.AutomatonTables) -> None:
        """Replace the constraint tables (numpy); a step already queued keeps the ones it was given."""
        self.tables = self._placed_tables(tables)

    def _pinned(self, out):
        """A program's (table, ...) result with the table held to its layout, so no program leaves it replicated."""
        if self.shardings is None:
            return out
        if isinstance(out, tuple):
            return (jax.lax.with_sharding_constraint(out[0], self.shardings), *out[1:])
        return jax.lax.with_sharding_constraint(out, self.shardings)

    # ---- programs -------------------------------------------------------------------------------------------
    def _modules(self, w):
        return self.engine.merged(*jax.tree.unflatten(self._weight_def, w), self.uses_drafter)

    def _compile(self, name: str, key, fn, args: tuple, desc: str):
        """`fn(weights, table, *args)` compiled once for (name, key), donating the table; a program that takes the
        constraint tables once more per table bucket past the first (its key then ends with the bucket). JAX names
        the program after `fn` (serve_step, serve_prefill, ...) in its compile logs and events."""
        program_key = (name, key)
        tables = next((a for a in args if isinstance(a, cd.AutomatonTables)), None)
        if tables is not None and cd.table_shape(tables) != self._first_tables:
            program_key = (name, key, cd.table_shape(tables))
            desc = self.desc(program_key)
        if program_key not in self._programs:
            compiled, seconds = self.engine.compile(fn, (self._weight_leaves, self.table_spec, *args),
                                                    ("serve", self._uid, *program_key), desc=desc, donate=(1,),
                                                    progress=False if self._one_bar else None,
                                                    options=xla_options.serving_compile_options())
            self.warmup_s[desc] = seconds
            self._programs[program_key] = compiled
        return self._programs[program_key]

    _one_bar = False  # set while `warm_up` shows one bar for all its programs

    def prefill_program(self, key: tuple[int, int]):
        """The chunk program for (bucket, rows)."""
        spec, (bucket, n) = self.prefill_specs[key], key

        def serve_prefill(w, table, tables, batch):
            return self._pinned(programs.prefill_chunk(spec, *self._modules(w), table, tables, batch))

        example = programs.PrefillBatch.example(n, bucket, self.width_pages, self._rows_for(n))
        return self._compile("prefill", key, serve_prefill, (self.tables, example), prefill_desc(key))

    def step_program(self, key):
        """The step program for (StepKind, width): k rounds over the host's page table."""
        spec, rounds, groups, slack = self.step_specs[key], self.rounds, self.groups, self.row_slack

        def serve_step(w, table, tables, page_table):
            return self._pinned(programs.step(spec, *self._modules(w), table, tables, page_table, rounds, groups,
                                              slack))

        pages = np.zeros((self.max_slots, self.width_pages), np.int32)
        return self._compile("step", key, serve_step, (self.tables, pages), step_desc(key))

    def move_program(self):
        def serve_move(w, table, src, dst):
            return self._pinned(programs.move(table, src, dst))

        return self._compile("move", None, serve_move, (np.int32(0), np.int32(0)), "move")

    def release_program(self):
        def serve_release(w, table, slot):
            return self._pinned(programs.release(table, slot))

        return self._compile("release", None, serve_release, (np.int32(0),), "release")

    def warm_up(self, on_program=None, only: Sequence | None = None) -> dict[str, float]:
        """Compile every program not compiled yet (or those of `only`, keys such as ("step", key)): one prefill per
        (bucket, rows), one step per (kind, width), move and release: one at a time on the calling thread, or
        `compile_threads()` at once on a thread pool (each thread traces under the GIL, then XLA compiles without
        it). `on_program(desc, seconds)` is called after each. Returns the seconds each took (near zero where JAX's
        persistent compilation cache had it)."""
        builders = {**{("prefill", k): functools.partial(self.prefill_program, k) for k in self.prefill_specs},
                    **{("step", k): functools.partial(self.step_program, k) for k in self.step_specs},
                    ("move", None): self.move_program, ("release", None): self.release_program}
        todo = {key: build for key, build in builders.items()
                if key not in self._programs and (only is None or key in only)}
        if not todo:
            return dict(self.warmup_s)
        bar = tqdm(total=len(todo), desc=f"compiling {len(todo)} serving programs", unit="program",
                   leave=False) if self.engine.progress else None
        self._one_bar = bar is not None
        threads = min(len(todo), compile_threads())
        try:
            if threads == 1:
                for key, build in todo.items():
                    build()
                    self._compiled(key, bar, on_program)
            else:
                with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kdtree-compile") as pool:
                    futures = {pool.submit(build): key for key, build in todo.items()}
                    for future in concurrent.futures.as_completed(futures):
                        future.result()
                        self._compiled(futures[future], bar, on_program)
        finally:
            self._one_bar = False
            if bar is not None:
                bar.close()
        return dict(self.warmup_s)

    def _compiled(self, key, bar, on_program) -> None:
        desc = self.desc(key)
        if bar is not None:
            bar.update(1)
        if on_program is not None:
            on_program(desc, self.warmup_s[desc])

    def adopt(self, other: ModelRunner) -> None:
        """Take the programs `other` compiled over a table of this one's shapes and layout (the memory planner's
        probe, when the pool it was compiled for is the one planned), so they are not compiled again."""
        if not self.compiles_like(other):
            raise ValueError("the programs were compiled for another table")
        for key, program in other._programs.items():
            self._programs.setdefault(key, program)
            self.warmup_s.setdefault(self.desc(key), other.warmup_s[self.desc(key)])

    def compiles_like(self, other: ModelRunner) -> bool:
        """Whether `other`'s programs take this runner's table: the same shapes, dtypes and layout."""
        mine, theirs = (jax.tree.flatten(r.table_spec) for r in (self, other))
        return mine[1] == theirs[1] and mine[0] == theirs[0]

    @staticmethod
    def desc(key) -> str:
        """A program's description by its key: "step ddtree-16 x4", "prefill 64 x2", "move", "release"; a key that
        ends with a constraint table bucket adds it ("step ddtree-16 x4 tables 2048x524288")."""
        name, k, *bucket = key
        desc = prefill_desc(k) if name == "prefill" else step_desc(k) if name == "step" else name
        return desc + "".join(f" tables {s[0]}x{s[1]}" for s in bucket)

    def programs_by_desc(self) -> dict:
        """The compiled programs by their descriptions ("step ddtree-16 x4", "prefill 64 x2", "move", ...)."""
        return {self.desc(key): program for key, program in self._programs.items()}

    # ---- running --------------------------------------------------------------------------------------------
    def prefill(self, batch: programs.PrefillBatch) -> list[programs.PrefillRow]:
        """One chunk program over the batch's rows; each row's first token and finish code, from the device."""
        key = (batch.tokens.shape[1], len(batch.slots))
        program = self.prefill_program(key)
        self.table, out = program(self._weight_leaves, self.table, self.tables, batch)
        return programs.unpack_prefill(np.asarray(jax.device_get(out)), batch, self.prefill_specs[key].logprobs)

    def queue_step(self, key, page_table: np.ndarray) -> concurrent.futures.Future:
        """Start a step (k rounds over the first width / groups slots of each data group); the table is the step's
        until `settle`."""
        run = functools.partial(self.step_program(key), self._weight_leaves, self.table, self.tables, page_table)
        self.table = None
        return self._device.submit(run) if self._device is not None else _run_now(run)

    def settle(self, future: concurrent.futures.Future):
        """Wait for a queued step and take the table back; returns its packed output (a device array). Raises what
        the step raised (the table is then lost: `reset`)."""
        self.table, packed = future.result()
        return packed

    def move(self, src: int, dst: int) -> None:
        self.table = self.move_program()(self._weight_leaves, self.table, np.int32(src), np.int32(dst))

    def release(self, slot: int) -> None:
        self.table = self.release_program()(self._weight_leaves, self.table, np.int32(slot))

    def reset(self) -> None:
        """A fresh table, after a program that raised took the donated one with it."""
        self.table = self._placed(self._new_table())

    def shutdown(self) -> None:
        if self._device is not None:
            self._device.shutdown()

    @property
    def overlap(self) -> bool:
        return self._device is not None


def compile_threads() -> int:
    """Programs the warm-up compiles at once: $KDTREE_COMPILE_THREADS (0: one per CPU), else one, on the calling
    thread. A warm start on a thread pool loaded programs from JAX's persistent cache off the main thread, and such a
    load crashed the process (a segmentation fault in `deserialize_executable`) in the CPU suite."""
    given = os.environ.get(COMPILE_THREADS_ENV, "")
    if given and not given.isdigit():
        raise ValueError(f"${COMPILE_THREADS_ENV} must be an integer >= 0, got {given!r}")
    if not given:
        return 1
    return int(given) or os.cpu_count() or 1


def prefill_desc(key: tuple[int, int]) -> str:
    return f"prefill {key[0]} x{key[1]}"


def step_desc(key) -> str:
    return f"step {key[0].name} x{key[1]}"


def _spec_of(tree):
    """Each array's shape, dtype and layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type),
                        tree)


def prefill_batch(rows: Sequence[Chunk | None], bucket: int, page_rows: np.ndarray, max_slots: int, n_stop: int,
                  start_state: np.ndarray) -> programs.PrefillBatch:
    """The chunk program's inputs for the scheduler's rows, one each. A chunk that does not end its request's context
    gets slot `max_slots`, out of range, so its writes to the table's rows drop; so does a padding row (None: a data
    group with fewer chunks than the others), which has no pages either, so nothing it computes is kept."""
    pad = Chunk(Request(None, [0], RequestParams(), (), 0, 0.0, context=[0]), 0, 1, None)
    chunks = [pad if ch is None else ch for ch in rows]
    reqs = [ch.request for ch in chunks]
    return programs.PrefillBatch(
        page_rows, np.stack([ch.tokens(bucket) for ch in chunks]),
        np.array([max_slots if ch.slot is None else ch.slot for ch in chunks], np.int32),
        np.array([ch.start for ch in chunks], np.int32), np.array([ch.n_valid for ch in chunks], np.int32),
        np.array([len(r.prompt) for r in reqs], np.int32), np.array([len(r.tokens) for r in reqs], np.int32),
        np.array([r.seed for r in reqs], np.uint32),
        RequestRows.of([r.params for r in reqs], [r.stop_ids for r in reqs], n_stop),
        np.asarray(start_state, np.int32),
        np.array([-1 if ch.last or ch.start + ch.n_valid >= len(ch.request.context)
                  else ch.request.context[ch.start + ch.n_valid] for ch in chunks], np.int32))


def table_shardings(table, mesh):
    """The table's layout on a mesh: slot rows split over the data axis, and each page pool split by its pages the
    same way (data group g's slots and pages on data shard g: its requests own its pages); replicated over tensor
    and expert, since every head reads the whole latent (docs/sharding.md). The serving engine makes the slot and
    page counts multiples of the data size, so no dim falls back to replicated."""
    axes = programs.slot_axes(table)

    def one(axis, x):
        dim = axis if axis >= 0 else (0 if axis == programs.POOL else None)  # a pool's pages: [n_pages, ...]
        logical = tuple("batch" if d == dim else None for d in range(x.ndim))
        return NamedSharding(mesh, sharding.logical_spec(logical, x.shape, mesh, name="serving table"))

    return jax.tree.map(one, axes, table)


def _run_now(fn) -> concurrent.futures.Future:
    """fn() on the calling thread, as a finished future (its result or its exception), like the device thread's."""
    future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as e:  # noqa: BLE001  (handed on: the engine turns it into the requests' error records)
        future.set_exception(e)
    return future
