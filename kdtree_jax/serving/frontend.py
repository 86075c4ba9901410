"""The async front of the serving engine: submit a request, iterate its token deltas, read its final record.

`ServingFront` is what the HTTP server uses, wherever the engine runs: `submit` / `cancel`, the engine's `config`,
a `stats()` snapshot for /health and /metrics, and `failure` once the engine has died. Two fronts implement it:
`AsyncServingEngine` here (the engine in a worker thread of this process) and `EngineProcessClient`
(engine_process.py: the engine in its own process). Validation runs in the caller, so a bad request raises at
`submit` and never reaches the engine or another request's slot.

`AsyncServingEngine`: one worker thread owns the `ServingEngine` and steps it while there is work; callers on an
asyncio loop talk to it through a thread-safe inbox (submit, cancel) and per-request queues (deltas, then the record).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Sequence

from kdtree_jax.serving.config import ServeConfig
from kdtree_jax.serving.core import ServingEngine, StepReport
from kdtree_jax.serving.engine_loop import failed, run_engine, step_events
from kdtree_jax.serving.request import EngineClosedError, QueueFullError, RequestParams, RequestRecord, TokenDelta

log = logging.getLogger(__name__)


class EngineDeadError(EngineClosedError):
    """The engine stopped for good (its process exited, its worker thread failed); the message says how."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What /health and /metrics read of the engine; a snapshot, taken after each step where the engine runs apart."""

    running: int  # requests prefilling or decoding
    waiting: int  # requests queued in the engine (not counting those still on their way to it)
    free_pages: int
    num_pages: int
    page_size: int
    kv_cache_usage: float  # share of the page pool held by requests, 0..1
    num_preemptions: int
    taken: int = 0  # submits the engine has taken from its inbox, since it started
    prefix_cache_queries: int = 0  # context tokens of admissions, and those found in the prefix cache
    prefix_cache_hits: int = 0
    pool_bytes: int = 0  # the page pools' bytes on the device (every layer, target and drafter)

    @classmethod
    def of(cls, core: ServingEngine, taken: int = 0) -> EngineStats:
        cache = core.cache
        return cls(core.n_running, core.n_waiting, cache.free_pages, cache.num_pages, cache.page_size, cache.usage,
                   core.n_preemptions, taken, core.prefix_cache_queries, core.prefix_cache_hits, core.pool_bytes)


class RequestStream:
    """Token deltas of one request as they are committed; `record` once the iteration ends."""

    def __init__(self, engine: ServingFront, request_id: int, prompt_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.record: RequestRecord | None = None
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = asyncio.Event()
        self._output = asyncio.Event()  # its first delta (or its record) has come

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.record is not None and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, RequestRecord):
            self.record = item
            self._done.set()
            raise StopAsyncIteration
        return item

    async def result(self) -> RequestRecord:
        """The final record (consumes any deltas not read yet)."""
        async for _ in self:
            pass
        await self._done.wait()
        return self.record

    async def first_output(self) -> None:
        """Wait until the request has produced its first delta (its prompt is prefilled) or ended; consumes
        nothing."""
        await self._output.wait()

    def cancel(self) -> None:
        """Stop the request; its slot is freed before the next step and the stream ends with "cancelled"."""
        if self.record is None:
            self._engine.cancel(self.request_id)

    def _push(self, item) -> None:
        self._queue.put_nowait(item)
        self._output.set()


class ServingFront:
    """Requests in, token deltas and records out, over an engine that runs elsewhere (a thread, a process); use from
    one asyncio event loop. Subclasses say how a request reaches the engine (`_post`), how many wait
    (`_queued`), how a request is checked (`_check`) and what the engine's state is (`stats`)."""

    config: ServeConfig

    def __init__(self):
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.failure: str | None = None  # why the engine died; set once, then every request ends with it
        self.step_listeners: list = []  # callables(StepReport), run after each step

    # ---- what a front implements ----------------------------------------------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def _check(self, prompt: Sequence[int], params: RequestParams) -> tuple[list[int], tuple[int, ...], int]:
        raise NotImplementedError

    def _queued(self) -> int:
        raise NotImplementedError

    def _post(self, msg: tuple) -> None:
        raise NotImplementedError

    # ---- requests ---------------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams()) -> RequestStream:
        """Queue a request; raises RequestError (bad field), QueueFullError, EngineClosedError or EngineDeadError at
        once."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self._closing or self._loop is None:
            raise EngineClosedError("the serving engine is not running; no new requests")
        queued = self._queued()
        if queued >= self.config.max_queue:
            raise QueueFullError(f"{queued} requests are waiting (max_queue {self.config.max_queue})")
        ids, _, seed = self._check(prompt, params)
        if params.seed is None:  # fix the drawn seed now: the record can then reproduce the request
            params = dataclasses.replace(params, seed=seed)
        rid = next(self._ids)
        stream = RequestStream(self, rid, len(ids))
        self._streams[rid] = stream
        self._post(("submit", rid, ids, params))
        return stream

    def cancel(self, request_id: int) -> None:
        if self.failure is None:
            self._post(("cancel", request_id))

    @property
    def n_running(self) -> int:
        return self.stats().running

    @property
    def n_waiting(self) -> int:
        return self._queued()

    # ---- results (on the event loop) --------------------------------------------------------------------------
    def _push_events(self, events: list) -> None:
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if isinstance(ev, RequestRecord):
                self._streams.pop(ev.request_id, None)
            stream._push(ev)

    def _fail(self, message: str) -> None:
        """The engine died: every open request ends with `message` as its error, and so does every later submit."""
        if self.failure is not None:
            return
        log.error("%s; failing %d open requests", message, len(self._streams))
        self.failure = message
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream._push(failed(rid, stream.prompt_tokens, message))

    async def _wait_streams(self, timeout: float | None) -> None:
        """Let the open requests finish for up to `timeout` seconds (None: no limit)."""
        if timeout is None or not self._streams:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(s._done.wait() for s in list(self._streams.values()))), timeout)
        except TimeoutError:
            log.warning("shutdown: cancelling %d requests still running after %.1f s", len(self._streams), timeout)


class AsyncServingEngine(ServingFront):
    """Runs a `ServingEngine` in a worker thread of this process; use from one asyncio event loop."""

    def __init__(self, core: ServingEngine):
        super().__init__()
        self.core = core
        self.config = core.config
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _pending
        self._pending = 0  # submitted, not yet taken by the worker

    async def start(self) -> None:
        """Start the worker (warm up `core` first: a step that compiles would stall every request)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kdtree-serving", daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        return EngineStats.of(self.core)

    def _check(self, prompt, params):
        return self.core.check(prompt, params)

    def _queued(self) -> int:
        return self.core.n_waiting + self._pending

    def _post(self, msg: tuple) -> None:
        if msg[0] == "submit":
            with self._lock:
                self._pending += 1
        self._inbox.put(msg)
        self._wake.set()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, let running and waiting ones finish for up to `timeout` seconds (None: no limit),
        cancel what is left and stop the worker."""
        self._closing = True
        if self._thread is None:
            return
        await self._wait_streams(timeout)
        self._inbox.put(("shutdown",))
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- worker thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            run_engine(self.core, self._receive, self._send)
        except Exception as e:  # a fault step() does not handle: end every request instead of leaving them hanging
            log.exception("the serving engine's worker thread failed")
            self._loop.call_soon_threadsafe(self._fail, f"the serving engine failed: {type(e).__name__}: {e}")

    def _receive(self, wait: bool) -> list:
        """Every message queued in the inbox; waits for a post first where `wait`."""
        if wait:
            self._wake.wait()
            self._wake.clear()
        msgs = []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._pending -= sum(msg[0] == "submit" for msg in msgs)
        return msgs

    def _send(self, events: list, report: StepReport | None, closed: bool) -> bool:
        """Hand the pass's records and deltas to the event loop; the step listeners run here, in the worker."""
        if report is not None:
            events = events + step_events(report)
        if events:
            self._loop.call_soon_threadsafe(self._push_events, events)
        if report is not None:
            for listener in list(self.step_listeners):
                listener(report)
        return True


__all__ = ["AsyncServingEngine", "EngineDeadError", "EngineStats", "RequestStream", "ServingFront", "StepReport"]
