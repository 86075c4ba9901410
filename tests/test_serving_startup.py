"""What the serving engine compiles before it serves: one program per (bucket, rows) a step's prefill can fill, per
step kind and width, move and release, each compiled once. On a device that reports its memory, the planner's probe
compiles the widest step and the largest prefill over the pool a reserve for the programs leaves; where their peak
fits it, those are the engine's programs and the warm-up compiles only the others.

Compiles are counted from JAX's backend-compile events (one per program, persistent-cache hits included), by the
program's name (serve_step, serve_prefill, serve_move, serve_release)."""
from __future__ import annotations

import collections
import os
import re

import jax
import numpy as np
import pytest
from jax._src import dispatch

from kdtree_jax.decode.engine import Engine
from kdtree_jax.serving import RequestParams, ServeConfig, ServingEngine, memory_plan, runner, xla_options

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "kdtree-mini")
CHUNK = 32  # buckets 16 and 32: two rows of 16 fit a step's chunk, two rows of 32 do not
CONFIG = ServeConfig(mode="ar", max_slots=2, max_context=64, step_widths=(1, 2), rounds_per_step=2, page_size=16,
                     max_num_batched_tokens=CHUNK, prefill_batch=2, overlap=False, gpu_memory_utilization=0.5)
PROGRAMS = {"serve_prefill": 3, "serve_step": 2, "serve_move": 1, "serve_release": 1}
IN_USE = 3 * 2**20  # the fake device's bytes in use


class Compiles:
    """The serving programs JAX compiles while counting, by name."""

    def __init__(self):
        self.names: list[str] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, _seconds, **kw):
        name = re.search(r"serve_\w+", str(kw.get("fun_name", "")))
        if event == dispatch.BACKEND_COMPILE_EVENT and name:
            self.names.append(name.group())

    def take(self) -> collections.Counter:
        names, self.names = self.names, []
        return collections.Counter(names)

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


@pytest.fixture(scope="module")
def target():
    return Engine.load(os.path.join(SHIPPED, "target"), None)


@pytest.fixture
def compiles():
    counter = Compiles()
    yield counter
    counter.close()


def _device(monkeypatch, engine: ServingEngine, pages: int) -> int:
    """Fake device figures whose 0.5 share leaves `pages` pages past the margin and the programs' reserve; returns
    the limit."""
    limit = 2 * (IN_USE + memory_plan.PROGRAMS_RESERVE + memory_plan.MARGIN_BYTES + pages * engine.page_bytes)
    monkeypatch.setattr(memory_plan, "memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": IN_USE})
    return limit


def _greedy_tokens(core: ServingEngine, prompt: list[int], n: int) -> list[int]:
    rid = core.submit(prompt, RequestParams(max_new_tokens=n))
    tokens, records = [], []
    while core.has_work:
        report = core.step()
        tokens += [t for d in report.deltas if d.request_id == rid for t in d.token_ids]
        records += report.records
    assert [r.finish_reason in ("length", "stop") for r in records] == [True]
    return tokens


@pytest.mark.timeout(600)
def test_each_program_compiles_once_and_the_probe_s_are_the_engine_s(target, compiles, monkeypatch):
    options = []
    compile_ = target.compile

    def recording(fn, args, key, **kw):
        if key[0] == "serve":  # not the reference's own programs
            options.append(kw.get("options"))
        return compile_(fn, args, key, **kw)

    monkeypatch.setattr(target, "compile", recording)
    cpu = ServingEngine(target, CONFIG)  # no memory figures: no probe
    assert compiles.take() == {} and cpu.pool_plan is None
    assert sorted(cpu.prefill_specs) == [(16, 1), (16, 2), (32, 1)]  # 2 x 32 rows exceed a step's 32 tokens

    _device(monkeypatch, cpu, pages=5 * cpu.pages_per_request)
    core = ServingEngine(target, CONFIG)
    probed = compiles.take()
    assert probed == {"serve_step": 1, "serve_prefill": 1}  # the widest step and the largest prefill
    plan = core.pool_plan
    assert plan.programs_peak <= plan.reserve == memory_plan.PROGRAMS_RESERVE
    assert core.num_pages == 5 * core.pages_per_request  # planned after the reserve, not the peak
    assert {"step ar x2", "prefill 32 x1"} == set(core.runner.programs_by_desc())  # the probe's, taken over

    seconds = core.warm_up()
    assert compiles.take() + probed == PROGRAMS  # each program once, the probe's not again
    assert len(seconds) == sum(PROGRAMS.values())
    assert f"({memory_plan.PROGRAMS_RESERVE / 2**30:.2f} GiB reserved)" in core.memory_summary()

    prompt = np.random.default_rng().integers(0, target.target.cfg.vocab_size, 20).tolist()  # prefill 32 x1
    expected = target.generate([prompt], 6, mode="ar").token_ids[0]
    assert _greedy_tokens(core, prompt, 6) == expected  # the probe's programs serve like any other
    assert compiles.take() == {}
    assert options == [{"xla_disable_hlo_passes": "rematerialization"}] * sum(PROGRAMS.values())


@pytest.mark.timeout(10)
def test_serving_programs_keep_the_passes_xla_flags_disable(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer= --xla_disable_hlo_passes=algsimp,cse")
    assert xla_options.serving_compile_options() == {"xla_disable_hlo_passes": "algsimp,cse,rematerialization"}
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=rematerialization")
    assert xla_options.serving_compile_options() == {"xla_disable_hlo_passes": "rematerialization"}


@pytest.mark.timeout(600)
def test_a_peak_over_the_reserve_plans_the_pool_after_it(target, compiles, monkeypatch):
    monkeypatch.setattr(memory_plan, "PROGRAMS_RESERVE", 1024)  # below any program's peak
    cpu = ServingEngine(target, CONFIG)
    probe_pool = 100 * cpu.pages_per_request
    limit = _device(monkeypatch, cpu, pages=probe_pool)
    core = ServingEngine(target, CONFIG)
    assert compiles.take() == {"serve_step": 1, "serve_prefill": 1}
    peak = core.pool_plan.programs_peak
    assert peak > memory_plan.PROGRAMS_RESERVE and core.pool_plan.reserve == 0
    want = (limit // 2 - IN_USE - peak - memory_plan.MARGIN_BYTES) // core.page_bytes
    assert core.pages_per_request <= core.num_pages == want < probe_pool  # the peak's pages less than the guess
    assert core.runner.programs_by_desc() == {}  # compiled for another pool: not kept
    core.warm_up()
    assert compiles.take() == PROGRAMS


@pytest.mark.timeout(10)
def test_compile_threads_follow_the_environment(monkeypatch):
    monkeypatch.delenv(runner.COMPILE_THREADS_ENV, raising=False)
    assert runner.compile_threads() == 1
    for given, want in (("1", 1), ("3", 3), ("0", os.cpu_count())):
        monkeypatch.setenv(runner.COMPILE_THREADS_ENV, given)
        assert runner.compile_threads() == want
    monkeypatch.setenv(runner.COMPILE_THREADS_ENV, "-2")
    with pytest.raises(ValueError, match=runner.COMPILE_THREADS_ENV):
        runner.compile_threads()
