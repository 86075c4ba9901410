"""The serving engine in its own process, as vLLM's EngineCoreProc and SGLang's Scheduler run apart from their API
servers: the server process keeps HTTP, tokenizing and detokenizing; the engine process ('spawn': JAX is not
fork-safe) loads the checkpoint, owns the `ServingEngine` and steps it.

Two one-way `multiprocessing` pipes join them, each message one pickled object:
    in  (server -> engine): a list of ("submit", id, prompt ids, params) | ("cancel", id) | ("shutdown",), all that
        queued up since the last send
    out (engine -> server): `Ready` once the engine is warmed up (or `Failed`), then one `StepMessage` per pass of
        its loop: the records of the cancels and refusals it applied, the step's `StepReport` (every token delta
        and record of the step) and an `EngineStats` snapshot; the last one has `closed`.
The engine process ignores SIGINT and SIGTERM (a terminal's Ctrl-C and systemd reach the whole process group): the
server drains it and sends "shutdown". If the server goes away, the engine sees its inbox end and stops. If the
engine process ends otherwise (killed, crashed, a device error it did not survive), the server's reader sees its
pipe end at once: every open request ends with "engine process exited with code N", and so does every later submit.
An engine process that lives but stops answering (a device hang, a deadlock) is found by time, as vLLM's
VLLM_ENGINE_ITERATION_TIMEOUT_S finds it: while requests are open, no message for `step_timeout_s` seconds since the
last message or submit means hung; the server kills it and fails the open requests the same way.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax._src import xla_bridge

from kdtree_jax.serving.config import ServeConfig
from kdtree_jax.serving.core import ServingEngine, StepReport
from kdtree_jax.serving.engine_loop import run_engine, step_events
from kdtree_jax.serving.frontend import EngineStats, ServingFront
from kdtree_jax.serving.request import RequestLimits, RequestParams, check_request

log = logging.getLogger(__name__)

# JAX options the engine process takes from the server's: the compilation cache (so a restart loads the programs)
# and what changes the programs it compiles
INHERITED_JAX_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                         "jax_persistent_cache_min_entry_size_bytes", "jax_default_matmul_precision",
                         "jax_enable_x64")
STARTUP_POLL_S = 0.5  # how often the server looks whether a starting engine process is still alive
EXIT_WAIT_S = 5.0  # for the exit code of an engine process whose pipe ended, and for one asked to stop
KILL_WAIT_S = 5.0  # after SIGKILL, for the process to be reaped
# while requests are open, an engine silent this long is hung: a step is milliseconds on a GPU and well under a second
# for the shipped pair on a CPU, and every program is compiled before the port opens; a constraint's automaton, the
# one thing compiled while serving, takes seconds
DEFAULT_STEP_TIMEOUT_S = 120.0
WATCH_POLL_S = 0.5  # how often the reader, with no message, looks whether the engine is hung


@dataclasses.dataclass(frozen=True)
class Ready:
    """The engine is warmed up; what the server needs of it to check requests and answer /health."""

    config: ServeConfig
    limits: RequestLimits
    stats: EngineStats


@dataclasses.dataclass(frozen=True)
class Failed:
    """The engine process could not start; `error` is the exception, raised again in the server."""

    error: BaseException


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """One pass of the engine's loop: what it did, and the state it left."""

    events: list  # records of the cancels and refusals applied before the step
    report: StepReport | None  # the step (None: no request was running)
    stats: EngineStats
    closed: bool = False  # the engine shut down: this is the last message


def exit_message(code: int | None) -> str:
    """How a dead engine process is reported: its exit code, and the signal that ended it where one did."""
    if code is None:
        return "engine process closed its pipe without exiting"
    text = f"engine process exited with code {code}"
    if code < 0:
        try:
            text += f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return text


def inherited_jax_options() -> dict:
    return {name: getattr(jax.config, name) for name in INHERITED_JAX_OPTIONS}


# ---- the engine process ----------------------------------------------------------------------------------------
def engine_main(build: Callable[[], ServingEngine], jax_options: dict, inbox, outbox) -> None:
    """The engine process: build the engine (`build` returns it warmed up), say `Ready`, then step while there is
    work, reading the inbox between steps and waiting on it when idle."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for name, value in jax_options.items():
        jax.config.update(name, value)
    try:
        core = build()
    except BaseException as e:
        if not isinstance(e, (ValueError, FileNotFoundError)):  # bad input is one line, where raised again
            log.exception("the engine process could not start")
        outbox.send(Failed(_picklable(e)))
        raise SystemExit(1) from None
    outbox.send(Ready(core.config, core.limits, EngineStats.of(core)))
    _serve(core, inbox, outbox)


def _serve(core: ServingEngine, inbox, outbox) -> None:
    """The engine loop over the two pipes: one `StepMessage` a pass, with the submits taken so far in its stats."""
    taken = 0

    def receive(wait: bool) -> list | None:
        nonlocal taken
        try:
            msgs = inbox.recv() if wait else []
            while inbox.poll():
                msgs += inbox.recv()
        except (EOFError, OSError):  # the server is gone: nobody reads the results
            return None
        taken += sum(msg[0] == "submit" for msg in msgs)
        return msgs

    def send(events: list, report: StepReport | None, closed: bool) -> bool:
        try:
            outbox.send(StepMessage(events, report, EngineStats.of(core, taken), closed))
        except (BrokenPipeError, OSError):
            return False
        return True

    run_engine(core, receive, send)


def _picklable(e: BaseException) -> BaseException:
    """`e` where it survives pickling (the server raises it again: a UsageError stays one), else its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


# ---- the server's side -----------------------------------------------------------------------------------------
class EngineProcessClient(ServingFront):
    """A `ServingFront` over a `ServingEngine` in its own process. `launch()` starts the process and waits until the
    engine is warmed up (blocking: before the server opens its port); `start()` then connects it to the event
    loop. `build` is a picklable callable (a module-level function, or a functools.partial of one) that the engine
    process calls to load the checkpoint and return a warmed-up `ServingEngine`."""

    def __init__(self, build: Callable[[], ServingEngine], *, jax_options: dict | None = None,
                 name: str = "kdtree-engine", step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S):
        super().__init__()
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s!r}")
        self.step_timeout_s = step_timeout_s  # None: never declared hung
        ctx = multiprocessing.get_context("spawn")
        self._in_recv, self._in_send = ctx.Pipe(duplex=False)
        self._out_recv, self._out_send = ctx.Pipe(duplex=False)
        options = inherited_jax_options() if jax_options is None else jax_options
        self.process = ctx.Process(target=engine_main, args=(build, options, self._in_recv, self._out_send),
                                   name=name, daemon=True)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._stats: EngineStats | None = None
        self._limits: RequestLimits | None = None  # the engine's, from its Ready
        self._rng = np.random.default_rng()  # seeds of requests that give none
        self._sent = 0  # submits posted to the engine
        self._last_heard = time.monotonic()  # the last message from the engine, or submit to it

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def launch(self) -> None:
        """Start the engine process and wait until it is ready; raises what stopped it from starting."""
        if xla_bridge.backends_are_initialized():
            log.warning("JAX's backends are initialised in the server process: on a GPU it holds device memory the "
                        "engine process needs")
        self.process.start()
        # before multiprocessing's own exit handler, which would wait for an engine that ignores its SIGTERM
        atexit.register(self.close)
        self._in_recv.close()  # the engine's ends: its pipes end when it does
        self._out_send.close()
        while not self._out_recv.poll(STARTUP_POLL_S):
            if not self.process.is_alive():
                self.process.join(EXIT_WAIT_S)
                raise RuntimeError(exit_message(self.process.exitcode) + " while starting")
        try:
            msg = self._out_recv.recv()
        except EOFError:
            self.process.join(EXIT_WAIT_S)
            raise RuntimeError(exit_message(self.process.exitcode) + " while starting") from None
        if isinstance(msg, Failed):
            self.process.join(EXIT_WAIT_S)
            raise msg.error
        self.config = msg.config
        self._stats = msg.stats
        self._limits = msg.limits
        log.info("engine process %d ready", self.process.pid)

    async def start(self) -> None:
        """Read the engine's messages from here on (call on the event loop, after `launch`)."""
        if self._limits is None:
            raise RuntimeError("launch() the engine process before start()")
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="kdtree-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="kdtree-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def stats(self) -> EngineStats:
        return self._stats

    def _check(self, prompt: Sequence[int], params: RequestParams):
        return check_request(prompt, params, self._limits, self._rng)

    def _queued(self) -> int:
        return self._stats.waiting + self._sent - self._stats.taken

    def _post(self, msg: tuple) -> None:
        if msg[0] == "submit":
            self._sent += 1
            if len(self._streams) == 1:  # this one (submit registers it first): the silence so far was idleness
                self._last_heard = time.monotonic()
        self._outbox.put(msg)

    async def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, let running and waiting ones finish for up to `timeout` seconds (None: no limit),
        cancel what is left and stop the engine process."""
        self._closing = True
        if self._reader is None:
            await asyncio.get_running_loop().run_in_executor(None, self.close)
            return
        await self._wait_streams(timeout)
        if self.failure is None:
            self._outbox.put(("shutdown",))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._reader.join)
        await loop.run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop the engine process without waiting for its requests (blocking): ask it to shut down, then kill it
        if it has not exited within EXIT_WAIT_S. Safe to call more than once."""
        self._closing = True
        if self.process.pid is None:  # never launched
            return
        atexit.unregister(self.close)
        if self.process.is_alive():
            if self._writer is not None and self._writer.is_alive():
                self._outbox.put(("shutdown",))  # the writer owns the pipe; it stops after sending this
            else:  # not started, or it has sent "shutdown" already
                try:
                    self._in_send.send([("shutdown",)])
                except OSError:
                    pass
        self.process.join(EXIT_WAIT_S)
        if self.process.is_alive():
            log.warning("engine process %d did not exit in %.0f s; killing it", self.process.pid, EXIT_WAIT_S)
            self.process.kill()
            self.process.join(KILL_WAIT_S)

    # ---- threads ------------------------------------------------------------------------------------------------
    def _write(self) -> None:
        """Send what the event loop posted, all that queued up in one message."""
        while True:
            msg = self._outbox.get()
            batch = [msg]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._in_send.send(batch)
            except OSError:  # the engine is gone; the reader reports it
                return
            if any(m[0] == "shutdown" for m in batch):
                return

    def _read(self) -> None:
        """Hand each step's message to the event loop; report the engine's death when its pipe ends, and kill it
        (then report the same) when it is hung."""
        while True:
            try:
                if not self._out_recv.poll(WATCH_POLL_S):
                    if self._hung():
                        log.error("engine process %d sent nothing for %.0f s with %d requests open; killing it",
                                  self.process.pid, self.step_timeout_s, len(self._streams))
                        self.process.kill()
                        self.process.join(KILL_WAIT_S)
                        self._end(f"engine process hung (no step for {self.step_timeout_s:g} s), killed")
                        return
                    continue
                msg = self._out_recv.recv()
            except (EOFError, OSError):
                self.process.join(EXIT_WAIT_S)
                self._end(exit_message(self.process.exitcode))
                return
            self._last_heard = time.monotonic()
            self._loop.call_soon_threadsafe(self._on_step, msg)
            if msg.closed:
                return

    def _hung(self) -> bool:
        """Requests are open and the engine has said nothing for step_timeout_s (read off the event loop's thread:
        a stale view only delays the verdict by a poll)."""
        return (self.step_timeout_s is not None and bool(self._streams)
                and time.monotonic() - self._last_heard > self.step_timeout_s)

    def _end(self, message: str) -> None:
        self._loop.call_soon_threadsafe(self._fail, message)
        self._outbox.put(("shutdown",))  # the writer finds the pipe broken and stops

    def _on_step(self, msg: StepMessage) -> None:
        self._stats = msg.stats
        self._push_events(msg.events)
        if msg.report is not None:
            self._push_events(step_events(msg.report))
            for listener in list(self.step_listeners):
                listener(msg.report)


__all__ = ["EngineProcessClient", "StepMessage", "Ready", "Failed", "engine_main", "exit_message"]
