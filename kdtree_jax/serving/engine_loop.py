"""The loop that owns a `ServingEngine`, the same wherever it runs: take every queued message, apply it, step while
there is work, wait for a message when idle, and hand out what each pass did. `AsyncServingEngine` runs it in a worker
thread (frontend.py), `EngineProcessClient` in the engine process (engine_process.py); each brings its transport.

Messages, in the order they were posted: ("submit", id, prompt ids, params) | ("cancel", id) | ("shutdown",).
"""
from __future__ import annotations

from collections.abc import Callable

from kdtree_jax.serving.core import ServingEngine, StepReport
from kdtree_jax.serving.request import EngineClosedError, QueueFullError, RequestRecord

# receive(wait): the messages queued so far, waiting for the first where `wait`; None once nobody can send any
Receive = Callable[[bool], list | None]
# send(records of the messages applied, the step or None, closed): False once nobody reads what is sent
Send = Callable[[list, StepReport | None, bool], bool]


def run_engine(core: ServingEngine, receive: Receive, send: Send) -> None:
    """Serve `core` until "shutdown", or until the transport ends (the engine is shut down then, so that no request
    holds its slot). One `send` a pass: what the messages did, then the step, skipped when nothing runs or on
    shutdown. An exception from the engine propagates: the caller reports the engine's death."""
    while True:
        msgs = receive(not core.has_work)
        if msgs is None:
            core.shutdown()
            return
        events, closed = _apply(core, msgs)
        report = core.step() if core.has_work and not closed else None
        if not send(events, report, closed):
            core.shutdown()
            return
        if closed:
            return


def _apply(core: ServingEngine, msgs: list) -> tuple[list, bool]:
    """Apply submits, cancels and shutdown in order: (the records they ended with, whether one is "shutdown"). A
    submit the engine refuses ends at once with its record, not with an exception in this loop."""
    events, closed = [], False
    for msg in msgs:
        if msg[0] == "submit":
            _, rid, ids, params = msg
            try:
                core.submit(ids, params, request_id=rid)
            except (QueueFullError, EngineClosedError, ValueError) as e:
                events.append(refused(rid, len(ids), e))
        elif msg[0] == "cancel":
            record = core.cancel(msg[1])
            if record is not None:
                events.append(record)
        else:
            events += core.shutdown()
            closed = True
    return events, closed


def step_events(report: StepReport) -> list:
    """A step's token deltas, then its records (each after its request's last delta): the one place a front reads
    them, so a stream sees its tokens before it ends."""
    return [*report.deltas, *report.records]


def refused(rid: int, prompt_tokens: int, error: Exception) -> RequestRecord:
    """The record of a request the engine refused when it reached it (the queue filled meanwhile, shut down)."""
    return failed(rid, prompt_tokens, f"{type(error).__name__}: {error}")


def failed(rid: int, prompt_tokens: int, error: str) -> RequestRecord:
    """The record of a request that ended with `error` and no tokens."""
    return RequestRecord(request_id=rid, token_ids=[], finish_reason="error", prompt_tokens=prompt_tokens,
                         accept_lengths=[], num_draft_tokens=0, error=error)


__all__ = ["Receive", "Send", "failed", "refused", "run_engine", "step_events"]
