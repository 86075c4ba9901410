"""The serving programs' memory does not grow with the page pool beyond the pool itself.

Every program updates the donated pools in place, so its temporaries are the same at any pool size. A copy of a
pool-sized buffer (one layer's pool, the interpreter's copy of a kernel operand, a stacked pool around a write)
shows here as temp bytes that scale with num_pages (`compiled.memory_analysis()`, which a GPU compile follows)."""
from __future__ import annotations

import os

import pytest

from kdtree_jax.decode.engine import Engine
from kdtree_jax.serving import ServeConfig, ServingEngine, memory_plan, programs

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "kdtree-mini")
POOLS = (64, 512)  # pages of 64 rows: one layer of the target's latent is 8.8 MiB apart at these sizes
SLACK = 1 << 20  # what temp bytes may differ by


@pytest.fixture(scope="module")
def pair():
    return Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))


# (mode, budget, step widths): every step kind at the narrowest width and the widest, whose gathers and scatters of
# one row per request (width 1) lower differently from several rows' (a dynamic slice and update of the pool)
CONFIGS = {
    "ar": ("ar", 8, (1, 4)),  # plain AR, no drafter
    "chain": ("chain", 8, (4,)),
    "ddtree": ("ddtree", 8, (1, 4)),
    "ar-keeping-the-draft": ("ddtree", {1: "ar", 2: 8}, (1, 4)),  # an AR step of a table with a drafter
}


def _analyses(engine, mode: str, budget, widths: tuple[int, ...], n_pages: int) -> tuple[dict, int]:
    core = ServingEngine(engine, ServeConfig(max_slots=4, max_context=256, step_widths=widths, mode=mode,
                                             budget=budget, rounds_per_step=2, num_pages=n_pages, page_size=64,
                                             max_num_batched_tokens=64, prefill_batch=2, overlap=False))
    core.warm_up()
    pool_bytes = sum(x.nbytes for x in programs.pools(core.runner.table))
    return {key: program.memory_analysis() for key, program in core.runner._programs.items()}, pool_bytes


@pytest.mark.heavy
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_programs_keep_no_pool_sized_copy(pair, config):
    mode, budget, widths = CONFIGS[config]
    engine = pair if mode != "ar" else Engine(pair.target, None, pair.tokenizer)
    (small, small_pools), (large, large_pools) = (_analyses(engine, mode, budget, widths, n) for n in POOLS)
    assert large_pools - small_pools > 8 * SLACK  # the pools do grow
    assert small.keys() == large.keys() and len(small) >= 4
    assert {key[1][1] for key in small if key[0] == "step"} == set(widths)
    for key in small:
        grew = large[key].temp_size_in_bytes - small[key].temp_size_in_bytes
        assert abs(grew) < SLACK, (key, grew)
        for m, pools in ((small[key], small_pools), (large[key], large_pools)):
            assert m.alias_size_in_bytes >= pools, (key, m.alias_size_in_bytes, pools)  # every pool updated in place


HLO_SMALL = """
  %copy.1 = f32[4,17,80]{2,1,0} copy(%a)
  %copy.2 = f32[256,16,80]{2,1,0} copy(%pool.1)
  %x = f32[256,16,80]{2,1,0} fusion(%copy.2)
"""


@pytest.mark.timeout(60)
def test_scaling_copies_counts_the_copies_that_follow_the_pool():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "hlo_cache_copies.py")
    spec = importlib.util.spec_from_file_location("hlo_cache_copies", path)
    hlo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hlo)
    large = HLO_SMALL.replace("256,", "2048,") + "  %copy.3 = bf16[4,17,80]{2,1,0} copy(%b)\n"
    found = hlo.scaling_copies(HLO_SMALL, large)
    assert [n for n, _ in found] == [2048 * 16 * 80 * 4, 4 * 17 * 80 * 2]  # the pool's copy, and a new one
    assert hlo.scaling_copies(HLO_SMALL, HLO_SMALL) == []
    assert [n for n, _ in hlo.copies(HLO_SMALL)] == [4 * 17 * 80 * 4, 256 * 16 * 80 * 4]


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_the_planner_sizes_the_pool_after_the_probed_programs(pair, monkeypatch):
    config = ServeConfig(max_slots=2, max_context=128, step_widths=(2,), budget=4, rounds_per_step=2, page_size=16,
                         max_num_batched_tokens=32, prefill_batch=2, gpu_memory_utilization=0.5)
    cpu = ServingEngine(pair, config)  # no memory figures: max_slots requests of max_context, as before
    assert cpu.pool_plan is None and cpu.num_pages == 2 * cpu.pages_per_request
    cpu.warm_up()
    report = cpu.memory_report()
    assert report["pool_bytes"] == cpu.num_pages * cpu.page_bytes and report["weight_bytes"] > 0
    assert {"move", "release", "step ddtree-4 x2"} <= report["programs"].keys()
    peak = max(p["temp"] + p["output"] - p["alias"] for p in report["programs"].values())
    assert f"programs' peak {peak / 2**30:.2f} GiB" in cpu.memory_summary()

    limit, in_use = 64 * 2**20 + memory_plan.MARGIN_BYTES, 3 * 2**20  # fake device figures
    monkeypatch.setattr(memory_plan, "memory_stats", lambda: {"bytes_limit": limit * 2, "bytes_in_use": in_use})
    planned = ServingEngine(pair, config)
    probed = planned.probe_programs()
    assert len(probed) == 2 and all(m.temp > 0 for m in probed.values())
    peak = max(m.peak for m in probed.values())
    assert planned.pool_plan.programs_peak == peak
    assert planned.num_pages == (limit - in_use - peak - memory_plan.MARGIN_BYTES) // planned.page_bytes
    assert planned.memory_summary().startswith(f"memory: weights {in_use / 2**30:.2f} GiB")
