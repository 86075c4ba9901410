"""The async front of the serving engine: submit a request, iterate its token deltas, read its final record.

One worker thread owns the `ServingEngine` and steps it while there is work; callers on an asyncio loop talk to
it through a thread-safe inbox (submit, cancel) and per-request queues (deltas, then the record). Validation runs
in the caller, so a bad request raises at `submit` and never reaches the worker or another request's slot.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Sequence

from kdtree_jax.serving.core import (
    EngineClosedError,
    QueueFullError,
    RequestParams,
    RequestRecord,
    ServingEngine,
    StepReport,
    TokenDelta,
)

log = logging.getLogger(__name__)


class RequestStream:
    """Token deltas of one request as they are committed; `record` once the iteration ends."""

    def __init__(self, engine: AsyncServingEngine, request_id: int, prompt_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.record: RequestRecord | None = None
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = asyncio.Event()

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

    def cancel(self) -> None:
        """Stop the request; its slot is freed before the next step and the stream ends with "cancelled"."""
        if self.record is None:
            self._engine.cancel(self.request_id)

    def _push(self, item) -> None:
        self._queue.put_nowait(item)


class AsyncServingEngine:
    """Runs a `ServingEngine` in a worker thread; use from one asyncio event loop."""

    def __init__(self, core: ServingEngine):
        self.core = core
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._lock = threading.Lock()  # guards _pending and the step listeners
        self._pending = 0  # submitted, not yet taken by the worker
        self.step_listeners: list = []  # callables(StepReport), run on the worker thread after each step

    async def start(self) -> None:
        """Start the worker (warm up `core` first: a step that compiles would stall every request)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kdtree-serving", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams()) -> RequestStream:
        """Queue a request; raises RequestError (bad field), QueueFullError or EngineClosedError at once."""
        if self._closing or self._loop is None:
            raise EngineClosedError("the serving engine is not running; no new requests")
        with self._lock:
            if self.core.n_waiting + self._pending >= self.core.config.max_queue:
                raise QueueFullError(f"{self.core.n_waiting + self._pending} requests are waiting "
                                     f"(max_queue {self.core.config.max_queue})")
            ids, _, seed = self.core.check(prompt, params)
            if params.seed is None:  # fix the drawn seed now: the record can then reproduce the request
                params = dataclasses.replace(params, seed=seed)
            rid = next(self._ids)
            self._pending += 1
        stream = RequestStream(self, rid, len(ids))
        self._streams[rid] = stream
        self._inbox.put(("submit", rid, ids, params))
        self._wake.set()
        return stream

    def cancel(self, request_id: int) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    @property
    def n_running(self) -> int:
        return self.core.n_running

    @property
    def n_waiting(self) -> int:
        return self.core.n_waiting + self._pending

    async def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, let running and waiting ones finish for up to `timeout` seconds (None: no limit),
        cancel what is left and stop the worker."""
        self._closing = True
        if self._thread is None:
            return
        if timeout is not None:
            try:
                await asyncio.wait_for(asyncio.gather(*(s._done.wait() for s in list(self._streams.values()))),
                                       timeout)
            except TimeoutError:
                log.warning("shutdown: cancelling %d requests still running after %.1f s",
                            len(self._streams), timeout)
        self._inbox.put(("shutdown",))
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- worker thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._drain():
                return
            while self.core.has_work:
                if self._drain():
                    return
                report = self.core.step()
                self._deliver(report.events)
                for listener in list(self.step_listeners):
                    listener(report)

    def _drain(self) -> bool:
        """Apply queued submits and cancels; True once shutdown was asked."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return False
            if msg[0] == "submit":
                _, rid, ids, params = msg
                with self._lock:
                    self._pending -= 1
                try:
                    self.core.submit(ids, params, request_id=rid)
                except (QueueFullError, EngineClosedError, ValueError) as e:
                    self._deliver([_refused(rid, len(ids), e)])
            elif msg[0] == "cancel":
                record = self.core.cancel(msg[1])
                if record is not None:
                    self._deliver([record])
            else:
                self._deliver(self.core.shutdown())
                return True

    def _deliver(self, events: list) -> None:
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if isinstance(ev, RequestRecord):
                self._streams.pop(ev.request_id, None)
            self._loop.call_soon_threadsafe(stream._push, ev)


def _refused(rid: int, prompt_tokens: int, error: Exception) -> RequestRecord:
    return RequestRecord(request_id=rid, token_ids=[], finish_reason="error", prompt_tokens=prompt_tokens,
                         accept_lengths=[], num_draft_tokens=0, error=f"{type(error).__name__}: {error}")


__all__ = ["AsyncServingEngine", "RequestStream", "StepReport"]
