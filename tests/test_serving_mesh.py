"""Serving on a mesh of 8 simulated devices: the shipped pair sharded over tensor x expert serves exactly the tokens
of one device, and the page pools keep their layout (replicated over tensor and expert, as every head reads the
whole latent) through every program."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kdtree_jax import sharding
from kdtree_jax.engine import Engine
from kdtree_jax.serving import RequestParams, RequestRecord, ServeConfig, ServingEngine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
PROMPT_LENS = (6, 45)  # one chunk, and two
MAX_NEW = 20

pytestmark = [pytest.mark.multidevice, pytest.mark.heavy]


def _load(mesh=None) -> Engine:
    return Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"), mesh=mesh)


def _config(**kw) -> ServeConfig:
    return ServeConfig(**{"max_slots": 2, "max_context": 96, "budget": 8, "rounds_per_step": 2, "page_size": 16,
                          "max_num_batched_tokens": 32, "prefill_batch": 1, **kw})


@pytest.fixture(scope="module")
def prompts_and_want():
    one = _load()
    texts = [json.loads(line)["text"] for line in open(os.path.join(SHIPPED, "heldout_prompts.jsonl"))]
    prompts = [one.tokenizer.encode(t)[:n] for t, n in zip(texts[2:], PROMPT_LENS)]
    return prompts, one.generate(prompts, MAX_NEW, mode="ar").token_ids


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", [(1, 2, 4)])
def test_a_mesh_serves_the_tokens_of_one_device_and_keeps_the_pool_layout(prompts_and_want, shape):
    prompts, want = prompts_and_want
    mesh = sharding.make_mesh(shape)
    core = ServingEngine(_load(mesh), _config())
    pool = core.runner.table.cache.latent
    assert pool.sharding.mesh.shape == mesh.shape and pool.sharding.is_fully_replicated  # data 1: every device
    ids = {core.submit(p, RequestParams(max_new_tokens=MAX_NEW, ignore_eos=True)): i for i, p in enumerate(prompts)}
    records = {}
    while core.has_work:
        records.update({e.request_id: e for e in core.step().events if isinstance(e, RequestRecord)})
    for rid, i in ids.items():
        assert records[rid].token_ids == want[i]
    assert np.mean([a for r in records.values() for a in r.accept_lengths]) > 1.5
    table = core.runner.table
    for got, layout in zip([table.cache.latent, table.draft_cache.k, table.tokens],
                           [core.runner.shardings.cache.latent, core.runner.shardings.draft_cache.k,
                            core.runner.shardings.tokens]):
        assert got.sharding.is_equivalent_to(layout, got.ndim)  # the programs kept the layout they were given


@pytest.mark.timeout(300)
def test_a_mesh_that_splits_data_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--mesh"):
        ServingEngine(_load(sharding.make_mesh((2, 2, 2))), _config())
