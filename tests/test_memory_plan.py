"""The pool planner's arithmetic, on fake memory figures and fake program analyses."""
from __future__ import annotations

import types

import pytest

from kdtree_jax.serving import memory_plan

GIB = 2**30


def _analysis(temp, argument, output, alias):
    stats = types.SimpleNamespace(temp_size_in_bytes=temp, argument_size_in_bytes=argument,
                                  output_size_in_bytes=output, alias_size_in_bytes=alias)
    return types.SimpleNamespace(memory_analysis=lambda: stats)


@pytest.mark.timeout(30)
def test_the_pool_is_what_the_weights_programs_and_margin_leave():
    prefill = memory_plan.ProgramMemory.of(_analysis(3 * GIB, 10 * GIB, 10 * GIB + 5, 10 * GIB))
    step = memory_plan.ProgramMemory.of(_analysis(2 * GIB, 10 * GIB, 10 * GIB + 7 * 2**20, 10 * GIB))
    assert prefill.peak == 3 * GIB + 5 and step.peak == 2 * GIB + 7 * 2**20  # outputs written in place: not counted
    peak = max(prefill.peak, step.peak)
    plan = memory_plan.plan_pool(bytes_limit=80 * GIB, bytes_in_use=20 * GIB, utilization=0.9, programs_peak=peak,
                                 page_bytes=3 * 2**20, groups=1, pages_per_request=10, margin=GIB)
    free = int(80 * GIB * 0.9) - 20 * GIB - peak - GIB
    assert plan.pages == free // (3 * 2**20)
    assert plan.pool_bytes <= free < plan.pool_bytes + 3 * 2**20
    line = plan.summary(requests=plan.pages // 10, max_context=512)
    assert line.startswith("memory: weights 20.00 GiB / programs' peak 3.00 GiB / pool ")
    assert f"/ {plan.pages // 10} requests of max_context 512" in line


@pytest.mark.timeout(30)
def test_each_data_group_gets_the_pages_of_its_own_device():
    plan = memory_plan.plan_pool(bytes_limit=10 * GIB, bytes_in_use=GIB, utilization=1.0, programs_peak=GIB,
                                 page_bytes=GIB // 4, groups=4, pages_per_request=2, margin=0)
    assert plan.pages == 4 * 32  # (10 - 1 - 1) GiB per device, 4 pages a GiB, on each of 4 devices


@pytest.mark.timeout(30)
def test_a_pool_without_room_for_one_request_names_the_flags():
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--num-pages.*--max-context"):
        memory_plan.plan_pool(bytes_limit=10 * GIB, bytes_in_use=4 * GIB, utilization=0.9, programs_peak=5 * GIB,
                              page_bytes=2**20, groups=1, pages_per_request=1)
