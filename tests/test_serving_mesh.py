"""Serving on a mesh of 8 simulated devices: the shipped pair sharded over data x tensor x expert serves exactly the
tokens of one device while requests join, leave and prefill in chunks, and the page pools keep their layout through
every program: split by pages over data (each data group's pages on its own shard), replicated over tensor and
expert (every head reads the whole latent)."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from kdtree_jax.decode.engine import Engine
from kdtree_jax.parallel import sharding
from kdtree_jax.serving import RequestParams, ServeConfig, ServingEngine, programs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
PROMPT_LENS = (6, 45, 20, 33, 12)  # 45 and 33: two chunks of max_num_batched_tokens
MAX_NEW = 20
LIMITS = (20, 20, 4, 14, 6)  # each request's max_new_tokens: they leave at different steps
SCHEDULE = {0: (0, 1, 2), 4: (3,), 5: (4,)}  # step -> the requests submitted before it
MAX_STEPS = 500  # far more than the schedule needs: a request that never ends fails, it does not hang
MIN_ACCEPTANCE = 1.5  # mean tokens per DDTree round the shipped pair must reach (it reaches 2.5-5)
SLOTS = {(1, 2, 4): 2, (2, 2, 2): 4}  # 2x2x2: two slots in each data group, so groups fill and empty

pytestmark = [pytest.mark.multidevice, pytest.mark.heavy]


def _load(mesh=None) -> Engine:
    return Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"), mesh=mesh)


def _config(**kw) -> ServeConfig:
    return ServeConfig(**{"max_slots": 2, "max_context": 96, "budget": 8, "rounds_per_step": 2, "page_size": 16,
                          "max_num_batched_tokens": 32, "prefill_batch": 1, **kw})


@pytest.fixture(scope="module")
def prompts_and_want():
    one = _load()
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    prompts = [one.tokenizer.encode(t)[:n] for t, n in zip(texts[2:], PROMPT_LENS)]
    assert len(prompts) == len(PROMPT_LENS) and [len(p) for p in prompts] == list(PROMPT_LENS)
    return prompts, one.generate(prompts, MAX_NEW, mode="ar").token_ids


def _serve(core: ServingEngine, prompts, want) -> tuple[dict, set, int]:
    """Run SCHEDULE to the end, checking after every step that each request's tokens so far are one device's and
    that each page is free or held by a request of its own data group; returns ({prompt index: record}, the groups
    requests were admitted to, the steps narrower than the table that ran requests of several groups)."""
    ids, records, groups, got, i, narrow = {}, {}, set(), {}, 0, 0
    while core.has_work or any(k >= i for k in SCHEDULE):
        assert i < MAX_STEPS, f"not idle after {MAX_STEPS} steps: {core.running_ids()} still running"
        for k in SCHEDULE.get(i, ()):
            ids[core.submit(prompts[k], RequestParams(max_new_tokens=LIMITS[k], ignore_eos=True))] = k
        report = core.step()
        for e in report.deltas:
            k = ids[e.request_id]
            got[k] = got.get(k, []) + list(e.token_ids)
            assert got[k] == want[k][: len(got[k])], (k, i)  # fails at the first wrong token
        records.update({ids[e.request_id]: e for e in report.records})
        core.scheduler.check()
        groups |= {r.group for r in core.scheduler.prefilling + core.scheduler.running}
        narrow += report.width < core.config.max_slots and report.active > report.width // core.groups
        i += 1
    assert core.cache.free_pages == core.num_pages
    return records, groups, narrow


def _assert_split_by_pages(pool: jax.Array, n_pages: int, data: int) -> None:
    """One layer's pool [n_pages, ...]: its page axis split over 'data' into equal contiguous ranges, nothing else
    split."""
    spec = tuple(pool.sharding.spec) + (None,) * (pool.ndim - len(pool.sharding.spec))
    assert spec[0] == "data" and all(s is None for i, s in enumerate(spec) if i != 0), spec
    assert not pool.sharding.is_fully_replicated
    assert pool.sharding.shard_shape(pool.shape)[0] == n_pages // data
    starts = {shard.index[0].start for shard in pool.addressable_shards}
    assert starts == {g * n_pages // data for g in range(data)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_a_mesh_serves_the_tokens_of_one_device_and_keeps_the_pool_layout(prompts_and_want, shape):
    prompts, want = prompts_and_want
    mesh = sharding.make_mesh(shape)
    data = shape[0]
    core = ServingEngine(_load(mesh), _config(max_slots=SLOTS[shape]))
    assert core.groups == data and core.num_pages % data == 0
    table = core.runner.table
    for pool in programs.pools(table):
        assert pool.sharding.mesh.shape == mesh.shape
        if data == 1:
            assert pool.sharding.is_fully_replicated  # data 1: every device holds the whole pool
        else:
            _assert_split_by_pages(pool, core.num_pages, data)
    records, groups, narrow = _serve(core, prompts, want)
    assert groups == set(range(data))  # every data group served requests
    if data > 1:  # steps over the lowest rows of each group, and a row moved down within its group
        assert narrow > 0 and core.n_moves > 0
    for k, rec in records.items():
        assert rec.token_ids == want[k][: LIMITS[k]], k
    assert np.mean([a for r in records.values() for a in r.accept_lengths]) > MIN_ACCEPTANCE
    table = core.runner.table
    for got, layout in zip([*table.cache.latent, *table.draft_cache.k, table.tokens],
                           [*core.runner.shardings.cache.latent, *core.runner.shardings.draft_cache.k,
                            core.runner.shardings.tokens]):
        assert got.sharding.is_equivalent_to(layout, got.ndim)  # the programs kept the layout they were given
    if data > 1:
        for pool in programs.pools(table):
            _assert_split_by_pages(pool, core.num_pages, data)


@pytest.mark.timeout(300)
def test_a_data_split_refuses_slot_page_and_width_counts_it_cannot_divide():
    engine = _load(sharding.make_mesh((2, 2, 2)))
    with pytest.raises(ValueError, match="--max-slots"):
        ServingEngine(engine, _config(max_slots=3))
    with pytest.raises(ValueError, match="--step-widths"):
        ServingEngine(engine, _config(max_slots=4, step_widths=(3, 4)))
    with pytest.raises(ValueError, match="--num-pages"):
        ServingEngine(engine, _config(max_slots=4, num_pages=33))


@pytest.mark.timeout(120)
def test_grouped_rows_slice_and_put_back_the_lowest_rows_of_each_group(rng):
    """A step of width w over G data groups runs on the first w / G rows of each group, in group order."""
    empty = programs.empty_table(_load().target, None, slots=6, capacity=32, n_pages=6, page_size=16, n_stop=2,
                                 depth=2, draft_k=2, rounds=2)
    leaves, tree = jax.tree.flatten(empty)
    table = jax.tree.unflatten(tree, [np.asarray(rng.integers(1, 1000, size=x.shape)).astype(x.dtype)
                                      for x in leaves])
    axes = jax.tree.leaves(programs.slot_axes(table))
    part = programs.slice_rows(table, 0, 4, groups=2)  # rows 0, 1 of group 0 (rows 0-2), then 3, 4 of group 1
    for axis, before, got in zip(axes, jax.tree.leaves(table), jax.tree.leaves(part)):
        if axis >= 0:
            np.testing.assert_array_equal(got, np.take(before, [0, 1, 3, 4], axis))
    back = programs.put_rows(table, jax.tree.map(lambda x: x + 1, part), 0, groups=2)
    for axis, before, after in zip(axes, jax.tree.leaves(table), jax.tree.leaves(back)):
        before, after = np.asarray(before), np.asarray(after)
        if axis < 0:
            np.testing.assert_array_equal(after, before + 1)  # the pools and the round are the part's
            continue
        np.testing.assert_array_equal(np.take(after, [0, 1, 3, 4], axis), np.take(before, [0, 1, 3, 4], axis) + 1)
        np.testing.assert_array_equal(np.take(after, [2, 5], axis), np.take(before, [2, 5], axis))
