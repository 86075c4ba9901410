"""`engine_loop.run_engine` over a scripted transport and a stand-in engine: what one pass applies, when it steps and
waits, what it sends, and how it ends. Both fronts run this loop (test_engine_process.py and test_server.py serve
through them end to end)."""
from __future__ import annotations

import pytest

from kdtree_jax.serving.core import StepReport
from kdtree_jax.serving.engine_loop import failed, run_engine, step_events
from kdtree_jax.serving.request import EngineClosedError, QueueFullError, RequestRecord, TokenDelta


def _record(rid: int, reason: str) -> RequestRecord:
    return RequestRecord(request_id=rid, token_ids=[], finish_reason=reason, prompt_tokens=1, accept_lengths=[],
                         num_draft_tokens=0)


class _Core:
    """Queues request ids; a step ends the oldest with one token. Params "full" and "bad" make submit refuse."""

    def __init__(self):
        self.queue: list[int] = []
        self.closed = False
        self.shutdowns = 0

    @property
    def has_work(self) -> bool:
        return bool(self.queue)

    def submit(self, ids, params, request_id):
        if self.closed:
            raise EngineClosedError("shut down")
        if params == "full":
            raise QueueFullError("full")
        if params == "bad":
            raise ValueError("bad prompt")
        self.queue.append(request_id)

    def cancel(self, rid):
        if rid not in self.queue:
            return None
        self.queue.remove(rid)
        return _record(rid, "cancelled")

    def shutdown(self):
        self.closed = True
        self.shutdowns += 1
        records, self.queue = [_record(rid, "cancelled") for rid in self.queue], []
        return records

    def step(self):
        rid = self.queue.pop(0)
        return StepReport([TokenDelta(rid, [7], 0.0)], [_record(rid, "length")], None, 1, 0)


class _Transport:
    """Hands out the scripted batches in turn (None: the sender is gone) and keeps what it is sent."""

    def __init__(self, batches, reader_alive: bool = True):
        self.batches = list(batches)
        self.waits: list[bool] = []
        self.sent: list[tuple] = []
        self.reader_alive = reader_alive

    def receive(self, wait: bool):
        self.waits.append(wait)
        return self.batches.pop(0)

    def send(self, events, report, closed) -> bool:
        self.sent.append(([(type(e).__name__, e.request_id) for e in events],
                          None if report is None else [(type(e).__name__, e.request_id) for e in step_events(report)],
                          closed))
        return self.reader_alive


def test_a_pass_applies_every_message_in_order_then_steps_once_and_sends_once():
    core = _Core()
    t = _Transport([
        [("submit", 0, [1], None), ("submit", 1, [1], "full"), ("submit", 2, [1, 2], "bad"), ("submit", 3, [1], None),
         ("cancel", 3), ("cancel", 9), ("submit", 4, [1], None)],
        [],
        [("shutdown",)],
    ])
    run_engine(core, t.receive, t.send)
    assert t.waits == [True, False, True]  # idle: wait; with a request left to run: no wait
    assert t.sent == [
        ([("RequestRecord", 1), ("RequestRecord", 2), ("RequestRecord", 3)], [("TokenDelta", 0), ("RequestRecord", 0)],
         False),
        ([], [("TokenDelta", 4), ("RequestRecord", 4)], False),
        ([], None, True),
    ]
    assert core.closed and core.shutdowns == 1


def test_refused_submits_end_with_the_error_named():
    core = _Core()
    records = []

    def send(events, report, closed):
        records.extend(events)
        return True

    batches = [[("submit", 0, [1, 2, 3], "full"), ("shutdown",), ("submit", 1, [1], None)]]
    run_engine(core, lambda wait: batches.pop(0), send)
    assert [(r.request_id, r.finish_reason, r.error, r.prompt_tokens) for r in records] == [
        (0, "error", "QueueFullError: full", 3), (1, "error", "EngineClosedError: shut down", 1)]
    assert failed(4, 2, "gone") == RequestRecord(request_id=4, token_ids=[], finish_reason="error", prompt_tokens=2,
                                                 accept_lengths=[], num_draft_tokens=0, error="gone")


def test_shutdown_cancels_what_runs_and_skips_the_step():
    core = _Core()
    t = _Transport([[("submit", 0, [1], None), ("submit", 1, [1], None), ("shutdown",)]])
    run_engine(core, t.receive, t.send)
    assert t.sent == [([("RequestRecord", 0), ("RequestRecord", 1)], None, True)]


@pytest.mark.parametrize("end", ["inbox", "reader"])
def test_the_engine_is_shut_down_when_its_transport_ends(end):
    core = _Core()
    if end == "inbox":
        t = _Transport([[("submit", 0, [1], None), ("submit", 1, [1], None)], None])
    else:
        t = _Transport([[("submit", 0, [1], None), ("submit", 1, [1], None)]], reader_alive=False)
    run_engine(core, t.receive, t.send)
    assert core.closed and core.queue == []
    assert len(t.sent) == 1


class _FailingCore(_Core):
    def step(self):
        raise RuntimeError("device lost")


def test_an_engine_fault_propagates_to_the_caller():
    core = _FailingCore()
    t = _Transport([[("submit", 0, [1], None)]])
    with pytest.raises(RuntimeError, match="device lost"):
        run_engine(core, t.receive, t.send)
    assert t.sent == []
