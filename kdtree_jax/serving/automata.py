"""The constrained requests' token automata, from the request's constraint to the device's constraint tables.

A constraint is compiled on a worker thread (the engine's `ConstraintCompiler`, cached by the constraint's text)
while its request waits outside the scheduler, so a new schema never stalls the running streams. At the request's
last prefill chunk its automaton is placed in the tables (`constrain_device.TableLayout`: a live automaton keeps its
states, a new one takes a free range and the tables are uploaded again), and its row starts at the automaton's start
state, advanced over any tokens it had generated before a preemption. Its record frees the placement.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import TokenAutomaton
from kdtree_jax.serving.plan import Chunk, Request


class Automata:
    """Compiling, ready and placed automata, by request id; single-threaded apart from the compiler thread."""

    def __init__(self, vocab_size: int, caps: cd.TableCaps, compiler: Callable[[], object]):
        self.layout = cd.TableLayout(vocab_size, caps)
        self._compiler = compiler  # -> an object whose compile(spec) gives a TokenAutomaton
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdtree-constraint")
        self._compiling: list[tuple[Request, concurrent.futures.Future]] = []
        self._ready: dict[Hashable, TokenAutomaton] = {}  # of requests in the scheduler
        self._placed: set = set()  # rids whose automaton is placed in the tables
        self._version = self.layout.version

    @property
    def compiling(self) -> list[Request]:
        return [r for r, _ in self._compiling]

    def submit(self, request: Request) -> None:
        """Start compiling the request's constraint; `take` hands the request on once it is ready."""
        self._compiling.append((request, self._thread.submit(self._compiler().compile, request.params.constraint)))

    def take(self, wait: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests whose automaton is ready (waiting for the first one when `wait`), and those whose
        constraint does not compile or can never fit the tables, with why."""
        if wait and self._compiling:
            concurrent.futures.wait([f for _, f in self._compiling], return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, pending = [], [], []
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
                failed.append((r, problem))
            else:
                self._ready[r.rid] = automaton
                ready.append(r)
        self._compiling = pending
        return ready, failed

    def start_states(self, rows: Sequence[Chunk | None]) -> tuple[np.ndarray, dict, cd.AutomatonTables | None]:
        """Each prefill row's automaton state after its context (`cd.FREE_STATE` where unconstrained, padding or
        not a last chunk), placing the automata of requests that start decoding. Returns (states, {rid: why} of
        requests whose automaton found no room, the tables to upload where a placement changed them, else None)."""
        states = np.full(len(rows), cd.FREE_STATE, np.int32)
        refused = {}
        for i, chunk in enumerate(rows):
            automaton = None if chunk is None or not chunk.last else self._ready.get(chunk.request.rid)
            if automaton is None:
                continue
            r = chunk.request
            try:
                base = self.layout.place(automaton.spec, automaton)
            except cd.ConstraintTooLarge as e:
                refused[r.rid] = str(e)
                continue
            if r.rid in self._placed:  # placed at an earlier admission (then preempted)
                self.layout.release(automaton.spec)
            self._placed.add(r.rid)
            states[i] = base + _walk(automaton, r.tokens)
        changed = self.layout.version != self._version
        self._version = self.layout.version
        return states, refused, self.layout.tables() if changed else None

    def cancel(self, rid: Hashable) -> Request | None:
        """Drop a request whose constraint is still compiling; None if it is not compiling."""
        for i, (r, future) in enumerate(self._compiling):
            if r.rid == rid:
                del self._compiling[i]
                future.cancel()
                return r
        return None

    def release(self, rid: Hashable) -> None:
        """The request ended: its automaton leaves, and its placement is freed."""
        automaton = self._ready.pop(rid, None)
        if rid in self._placed:
            self._placed.discard(rid)
            self.layout.release(automaton.spec)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)


def _walk(automaton: TokenAutomaton, tokens: Sequence[int]) -> int:
    """The automaton's local state after `tokens` (a resumed request's generated tokens) from its start."""
    state = 0
    for t in tokens:
        state = automaton.next_state(state, int(t))
    return state
