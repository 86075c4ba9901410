"""The serving engine over a paged latent cache: requests joining and leaving between steps, prompts prefilled in
chunks, the newest request preempted and recomputed when pages run out, nothing compiled after warm-up, every
request's tokens exactly what `Engine.generate` gives it alone, and every page accounted for.

The shipped pair (trained, float32) serves here, so DDTree rounds really accept several tokens: the tests assert it,
so they cannot pass on rounds that accept one token each."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from engine_utils import (CompileCounter, assert_same_distribution, drafter_config, exact_pair_distribution,
                          random_drafter)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdtree_jax.checkpoint.weights import init_random
from kdtree_jax.constrain.automaton import ConstraintSpec
from kdtree_jax.decode.engine import Engine
from kdtree_jax.decode.speculative import RUNNING
from kdtree_jax.model import config
from kdtree_jax.serving import (
    AsyncServingEngine,
    EngineClosedError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
    RequestParams,
    RequestRecord,
    ServeConfig,
    ServingEngine,
    programs,
)
from kdtree_jax.decode.budget import StepKind

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
BLOCK = 4  # the random pair of the sampling test
MAX_CONTEXT = 96
PROMPT_LENS = (5, 20, 40, 70)  # one chunk, one, two and three chunks of CHUNK
CHUNK = 32  # max_num_batched_tokens: prompt tokens prefilled per step
PAGE = 16
SWITCHING = {1: 8, 2: "ar", 3: 4}  # a budget per count of active slots: trees of two sizes and plain AR
MIN_ACCEPTANCE = 1.5  # mean tokens per DDTree round the shipped pair must reach here (it reaches 2.5-5)


COMPILES = CompileCounter()


@pytest.fixture(scope="module")
def pair():
    """The shipped trained pair in float32 (token identity with Engine.generate is exact there)."""
    return Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))


def _config(**kw) -> ServeConfig:
    return ServeConfig(**{"max_slots": 3, "max_context": MAX_CONTEXT, "budget": SWITCHING, "rounds_per_step": 2,
                          "max_stop_ids": 5, "top_k_cap": 8, "max_queue": 64, "page_size": PAGE,
                          "max_num_batched_tokens": CHUNK, "prefill_batch": 2, **kw})


@pytest.fixture(scope="module")
def served(pair):
    """Three slots over the default pool (three max_context requests): nothing is preempted. Steps compile for
    widths 1 and 3 only, so two requests run in a width with an empty row."""
    core = ServingEngine(pair, _config(step_widths=(1, 3)))
    core.warm_up()
    return core


@pytest.fixture(scope="module")
def expected(pair):
    """Greedy continuations of held-out prompts, each alone through Engine.generate (no stop ids)."""
    texts = [json.loads(line)["text"] for line in open(os.path.join(SHIPPED, "heldout_prompts.jsonl"))]
    prompts = [pair.tokenizer.encode(t)[:n] for t, n in zip(texts, PROMPT_LENS)]
    full = pair.generate(prompts, MAX_CONTEXT - max(PROMPT_LENS), mode="ar").token_ids
    return prompts, full


def _greedy(n: int, **kw) -> RequestParams:
    return RequestParams(max_new_tokens=n, ignore_eos=True, **kw)


def _ddtree_acceptance(records) -> float:
    """Mean tokens per round over requests that ran tree rounds only."""
    lengths = [a for rec in records for a in rec.accept_lengths]
    return float(np.mean(lengths)) if lengths else 0.0


def _want(full: list[int], max_new: int, stop: tuple[int, ...]) -> list[int]:
    """What a greedy request gives: its continuation cut at max_new, or just after its first stop token."""
    out = full[:max_new]
    for i, t in enumerate(out):
        if t in stop:
            return out[: i + 1]
    return out


MAX_STEPS = 2000  # far more than any schedule here needs: a request that never ends fails, it does not hang


def _run(core: ServingEngine, schedule: dict[int, list[tuple[list[int], RequestParams]]],
         held: frozenset = frozenset()):
    """Step until idle, submitting schedule[i] before step i; returns ({rid: record}, step kinds in order). Every
    step runs over the narrowest width that holds its running requests, and after every step each page is free or
    held by a live request (or by an owner in `held`, outside the scheduler)."""
    records, kinds, ids, i = {}, [], {}, 0
    while core.has_work or any(k >= i for k in schedule):
        assert i < MAX_STEPS, f"not idle after {MAX_STEPS} steps: {core.running_ids()} still running"
        for prompt, params in schedule.get(i, []):
            ids[core.submit(prompt, params)] = (prompt, params)
        report = core.step()
        assert report.width == (core.scheduler.width_for(report.active) if report.active else 0)
        kinds.append(report.kind)
        records.update({e.request_id: e for e in report.records})
        _accounted(core, set(ids) - set(records) | held, set(records))
        i += 1
    held_pages = sum(len(core.cache.pages(rid)) for rid in held)
    assert core.n_running == 0 and core.n_waiting == 0 and core.cache.free_pages + held_pages == core.num_pages
    return {rid: (records[rid], *ids[rid]) for rid in ids}, kinds


def _accounted(core: ServingEngine, live: set, ended: set) -> None:
    """Every page free (or cached) or held by live requests that have been admitted (a prefix hit shares a page);
    nothing held by a request whose record is out; decoding requests one slot each. `live` and `ended` are the caller's own model."""
    owners = core.cache.owners()
    core.cache.check()
    assert core.cache.free_pages + len({p for pages in owners.values() for p in pages}) == core.num_pages
    assert not set(owners) & ended, f"ended requests hold pages: {set(owners) & ended}"
    assert set(owners) <= live
    assert not set(owners) & set(core.waiting_ids())  # a waiting request holds nothing, preempted ones included
    decoding = [r.rid for r in core.scheduler.slots if r is not None]
    assert len(decoding) == len(set(decoding)) and set(decoding) <= set(owners)


def _free_rows_are_finished(core: ServingEngine) -> None:
    """On the device (the table is home: no step in flight), every row no request decodes in is finished, so
    rounds carry it unchanged instead of decoding a request that has left."""
    finish = np.asarray(core.runner.table.finish)
    free = [i for i, r in enumerate(core.scheduler.slots) if r is None]
    assert (finish[free] != RUNNING).all(), f"rows {[i for i in free if finish[i] == RUNNING]} still decode"


# ---- exactness ---------------------------------------------------------------------------------------------------
@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_greedy_requests_equal_generate_alone_while_others_join_leave_and_the_budget_changes(served, expected):
    """Prompts over one to three chunks join at different steps and requests leave, the budget follows the load,
    rows move down: every request's tokens are Engine.generate's alone, and its statistics count what it emitted."""
    prompts, full = expected
    schedule = {0: [(prompts[3], _greedy(26))],
                1: [(prompts[1], _greedy(7)), (prompts[0], _greedy(16))],
                2: [(prompts[2], _greedy(25))],
                4: [(prompts[1], _greedy(13)), (prompts[0], _greedy(3))],
                9: [(prompts[2], _greedy(9))],
                # alone again, a short request below a long one: the short one ends in its first step, the long one
                # cannot, so the long one must move down
                40: [(prompts[0], _greedy(2)), (prompts[1], _greedy(26))]}
    moves, batched = served.n_moves, sum(c for n, c in served.prefill_calls.items() if n > 1)
    results, kinds = _run(served, schedule)
    assert served.n_moves > moves  # a request ended below another: its row moved down, and its tokens stayed exact
    assert sum(c for n, c in served.prefill_calls.items() if n > 1) > batched  # two joined in one chunk program
    for rec, prompt, params in results.values():
        assert rec.finish_reason == "length"
        assert rec.token_ids == full[prompts.index(prompt)][: params.max_new_tokens]
        # the prefill's token, then the rounds' (each cut where the request ended): what was emitted, no more
        assert sum(rec.accept_lengths) == len(rec.token_ids) - 1
    assert _ddtree_acceptance(rec for rec, *_ in results.values()) > MIN_ACCEPTANCE
    ran = {k for k in kinds if k is not None}
    assert {StepKind("ar"), StepKind("ddtree", 4), StepKind("ddtree", 8)} <= ran  # the budget followed the load


@pytest.fixture(scope="module")
def tight(pair):
    """Two slots over a pool of one max_context request and a page: two long requests cannot both fit."""
    probe = ServingEngine(pair, _config(max_slots=2, budget=8, prefill_batch=1, num_pages=1 << 10))
    core = ServingEngine(pair, _config(max_slots=2, budget=8, prefill_batch=1, num_pages=probe.pages_per_request + 1))
    core.warm_up()
    return core


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_preempted_requests_resume_with_exactly_their_tokens(tight, served, expected):
    """When pages run out the newest request gives its pages back, waits, and is recomputed from its prompt and
    the tokens it had: greedy and seeded-sampling requests end with exactly the tokens they give uninterrupted."""
    prompts, full = expected
    sampled = RequestParams(max_new_tokens=60, temperature=1.1, top_p=0.9, seed=77, ignore_eos=True)
    long = _greedy(70)
    alone, _ = _run(served, {0: [(prompts[0], long), (prompts[1], sampled)]})
    uninterrupted = {id(params): rec.token_ids for rec, _, params in alone.values()}
    assert uninterrupted[id(long)][:len(full[0])] == full[0]
    # the first two fit at admission (3 + 4 of the 9 pages) and outgrow the pool together (6 + 7)
    schedule = {0: [(prompts[0], long)], 1: [(prompts[1], sampled)], 2: [(prompts[2], _greedy(25))],
                3: [(prompts[0], _greedy(20))]}
    before, queries, hits = tight.n_preemptions, tight.prefix_cache_queries, tight.prefix_cache_hits
    live, ended = set(), set()
    results, ids, i = {}, {}, 0
    counts, last_preempted = {}, set()
    while tight.has_work or i in schedule:
        for prompt, params in schedule.get(i, []):
            ids[tight.submit(prompt, params)] = (prompt, params)
            live.add(max(ids))
        for e in tight.step().records:
            results[e.request_id] = e
            live.discard(e.request_id)
            ended.add(e.request_id)
        _accounted(tight, live, ended)
        sched = tight.scheduler
        now = {r.rid: r.num_preemptions for r in [*sched.waiting, *sched.prefilling, *sched.running]}
        preempted = {rid for rid, n in now.items() if n > counts.get(rid, 0)}
        assert not preempted & last_preempted, f"step {i}: {preempted & last_preempted} preempted again at once"
        counts, last_preempted = {**counts, **now}, preempted
        i += 1
    assert tight.n_preemptions > before
    assert any(rec.num_preemptions for rec in results.values())
    for rid, rec in results.items():
        prompt, params = ids[rid]
        assert rec.finish_reason == "length"
        if id(params) in uninterrupted:
            assert rec.token_ids == uninterrupted[id(params)]
        else:
            assert rec.token_ids == full[prompts.index(prompt)][: params.max_new_tokens]
        assert len(rec.token_ids) - 1 - rec.num_preemptions <= sum(rec.accept_lengths) <= len(rec.token_ids) - 1
    assert _ddtree_acceptance(results.values()) > MIN_ACCEPTANCE
    assert tight.cache.free_pages == tight.num_pages
    # a recompute is no new query: the prefix counts add up against the prompts admitted, each once
    assert tight.prefix_cache_queries - queries == sum(len(ids[rid][0]) for rid in results)
    assert tight.prefix_cache_hits - hits == sum(rec.cached_tokens for rec in results.values())


def _cached_pages(core: ServingEngine) -> dict:
    """(page, key) -> sha256 of the page's rows in both pools, for every page in the prefix cache. Takes the table
    back from the device thread first (the next step finds nothing to settle)."""
    core._faults += core._settle()
    table = core.runner.table
    pools = [np.asarray(p) for p in programs.pools(table)]  # each layer's [pages, P, A] and [pages, Hk, P, Dh]
    return {(page, key): hashlib.sha256(b"".join(p[page].tobytes() for p in pools)).hexdigest()
            for page, key in core.cache.indexed_pages().items()}


def _serve(core: ServingEngine, requests, check_cached=False) -> list[RequestRecord]:
    """Submit `requests` at once and step until they end; with check_cached, every page that stays in the prefix
    cache under the same key keeps its rows from step to step (a shared page is never written)."""
    rids = [core.submit(prompt, params) for prompt, params in requests]
    records, before = {}, _cached_pages(core) if check_cached else None
    for _ in range(MAX_STEPS):
        if not core.has_work:
            break
        records.update({e.request_id: e for e in core.step().records})
        if check_cached:
            after = _cached_pages(core)
            changed = [k for k in before.keys() & after.keys() if before[k] != after[k]]
            assert not changed, f"cached pages written: {changed}"
            before = after
    return [records[rid] for rid in rids]


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_prefix_hits_reuse_prompts_and_replies_with_unchanged_tokens(served, expected):
    """A second turn (first prompt + the reply + a new message) hits the cache past its first prompt, into the pages
    of the reply the engine generated; a request sharing only the first prompt's start hits those pages. Greedy and
    seeded sampling give exactly the tokens of the same requests prefilled cold, and no cached page is written."""
    prompts, _ = expected
    sampled = RequestParams(max_new_tokens=14, temperature=1.1, top_p=0.9, seed=99, ignore_eos=True)
    (first,) = _serve(served, [(prompts[2], _greedy(24))])
    turn2 = prompts[2] + first.token_ids + prompts[0]
    sibling = prompts[2][:2 * PAGE + 3] + prompts[1][:9]
    asks = [(turn2, _greedy(14)), (turn2, sampled), (sibling, _greedy(10))]

    served.cache.prefix_caching = False
    try:
        cold = _serve(served, asks)
    finally:
        served.cache.prefix_caching = True
    assert [r.cached_tokens for r in cold] == [0, 0, 0]
    (again,) = _serve(served, [(prompts[2], _greedy(24))])  # the cold runs may have evicted its pages: cache them
    assert again.token_ids == first.token_ids
    queries, hits = served.prefix_cache_queries, served.prefix_cache_hits
    warm = _serve(served, asks, check_cached=True)
    # the first turn's rows: all but its last token, whose row no round wrote (64 tokens: a page boundary)
    committed = len(prompts[2]) + len(first.token_ids) - 1
    assert warm[0].cached_tokens == committed // PAGE * PAGE > len(prompts[2])  # into the reply's pages
    assert warm[2].cached_tokens == 2 * PAGE
    assert served.prefix_cache_queries - queries == 2 * len(turn2) + len(sibling)
    assert served.prefix_cache_hits - hits == sum(r.cached_tokens for r in warm)
    for w, c in zip(warm, cold):
        assert w.token_ids == c.token_ids and w.finish_reason == c.finish_reason == "length"
    assert _ddtree_acceptance(warm) > MIN_ACCEPTANCE


def _preempt_newest(core: ServingEngine) -> None:
    """Preempt the newest running request between steps, as `reserve` does when pages run out."""
    core._faults += core._settle()
    s = core.scheduler
    victim = s._newest(s.running[0].group)
    slot = s.slots.index(victim)
    s._preempt(victim)
    core.runner.release(slot)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_a_preempted_request_resumes_from_its_own_cached_pages(served, expected):
    """A request preempted mid-generation finds its prompt's and its own reply's full pages still cached when it is
    readmitted: it prefills only past them, and ends with exactly the tokens of an uninterrupted run, greedy and
    seeded sampling alike."""
    prompts, full = expected
    sampled = RequestParams(max_new_tokens=24, temperature=1.1, top_p=0.9, seed=7, ignore_eos=True)
    asks = [(prompts[3], _greedy(24)), (prompts[2], sampled)]
    served.cache.prefix_caching = False
    try:
        uninterrupted = _serve(served, asks)
    finally:
        served.cache.prefix_caching = True
    rids = [served.submit(prompt, params) for prompt, params in asks]
    records, hits, step, preempted = {}, served.resumed_prefix_hits, 0, 0
    while served.has_work:
        assert step < MAX_STEPS
        if step in (3, 5):  # after a few decode steps each: their reply's pages are cached by then
            _preempt_newest(served)
            preempted += 1
        records.update({e.request_id: e for e in served.step().records})
        step += 1
    assert sum(records[rid].num_preemptions for rid in rids) == preempted == 2
    resumed_hits = served.resumed_prefix_hits - hits
    assert resumed_hits >= 2 * PAGE * preempted  # each resume skipped at least two pages
    for rid, want in zip(rids, uninterrupted):
        assert records[rid].token_ids == want.token_ids
    assert records[rids[0]].token_ids == full[3][:24]


def test_a_pool_too_small_for_one_request_is_refused_naming_the_flags(pair):
    probe = ServingEngine(pair, _config(num_pages=1 << 10))
    with pytest.raises(ValueError, match="--num-pages or --gpu-memory-utilization.*--max-context"):
        ServingEngine(pair, _config(num_pages=probe.pages_per_request - 1))


@pytest.mark.heavy
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,overlap", [("ar", True), ("chain", False)])
def test_ar_and_chain_tables_equal_generate_alone(pair, expected, mode, overlap):
    """Also without overlap: each step's tokens are read before the next step is queued."""
    prompts, full = expected
    core = ServingEngine(pair if mode == "chain" else Engine(pair.target, None, pair.tokenizer),
                         _config(max_slots=2, mode=mode, rounds_per_step=3, overlap=overlap))
    schedule = {0: [(prompts[i], _greedy(4 + 3 * i)) for i in range(4)],
                3: [(prompts[2], _greedy(10, stop_token_ids=(full[2][5],)))]}
    results, kinds = _run(core, schedule)
    assert {k for k in kinds if k is not None} == {StepKind(mode)}
    for rec, prompt, params in results.values():
        want = _want(full[prompts.index(prompt)], params.max_new_tokens, params.stop_token_ids)
        assert rec.token_ids == want
        assert rec.finish_reason == ("stop" if params.stop_token_ids and want[-1] in params.stop_token_ids
                                     else "length")
    if mode == "chain":
        assert _ddtree_acceptance(rec for rec, *_ in results.values()) > MIN_ACCEPTANCE
    assert any(rec.cached_tokens for rec, *_ in results.values())  # the second prompts[2] started from the first's


def _pool_page(core: ServingEngine, page: int) -> list[np.ndarray]:
    core._faults += core._settle()
    return [np.asarray(p[page]) for p in programs.pools(core.runner.table)]


def _poison_page(core: ServingEngine, page: int) -> None:
    """Page `page` of every pool := a value no model writes (the table is home: no step in flight)."""
    core._faults += core._settle()
    leaves, axes = jax.tree.leaves(core.runner.table), jax.tree.leaves(programs.slot_axes(core.runner.table))
    poisoned = [x.at[page].set(7e4) if axis == programs.POOL else x for axis, x in zip(axes, leaves)]
    core.runner.table = jax.tree.unflatten(jax.tree.structure(core.runner.table), poisoned)


@pytest.fixture(scope="module")
def chain_core(pair):
    """A chain table without overlap (as the ar/chain identity test's: the compilation cache serves both)."""
    return ServingEngine(pair, _config(max_slots=2, mode="chain", rounds_per_step=3, overlap=False))


@pytest.fixture(scope="module")
def ar_core(pair):
    return ServingEngine(Engine(pair.target, None, pair.tokenizer),
                         _config(max_slots=2, mode="ar", rounds_per_step=3, overlap=True))


@pytest.mark.heavy
@pytest.mark.timeout(900)
@pytest.mark.parametrize("table", ["served", "chain_core", "ar_core"])
def test_rows_out_of_pages_idle_and_resume_with_exactly_their_tokens(table, expected, request, monkeypatch):
    """Every request but one reserves only the rows of one more round, so its row runs out of pages inside most
    steps, idles, and is grown before the next step: greedy requests still give Engine.generate's tokens, a seeded
    sampled one the tokens it gives over ample pages, and the one with ample pages its own (a row at its budget
    costs the others nothing). A page held outside the scheduler, poisoned, is never written."""
    core = request.getfixturevalue(table)
    prompts, full = expected
    ample = RequestParams(max_new_tokens=20, temperature=1.1, top_p=0.9, seed=91, ignore_eos=True)
    starved = RequestParams(max_new_tokens=18, temperature=0.8, seed=92, ignore_eos=True)
    alone, _ = _run(core, {0: [(prompts[1], ample)], 1: [(prompts[2], starved)]})
    want = {params.seed: rec.token_ids for rec, _, params in alone.values()}
    s = core.scheduler
    least = s._decode_rows

    def one_round(r, steps, known=None):  # the least that lets a round run: known tokens and one round's scratch
        if r.params is ample:
            return least(r, steps, known)
        return min((r.known_len if known is None else known) + s.row_slack, s._final_rows(r), s.max_rows)

    monkeypatch.setattr(s, "_decode_rows", one_round)
    (poison,) = core.cache.grow("poison", 1)
    _poison_page(core, poison)
    before, paused = _pool_page(core, poison), core.n_paused
    schedule = {0: [(prompts[0], _greedy(26)), (prompts[1], ample)], 1: [(prompts[2], starved)],
                2: [(prompts[3], _greedy(22))]}
    try:
        results, _ = _run(core, schedule, held=frozenset({"poison"}))
        after = _pool_page(core, poison)
    finally:
        core.cache.free("poison")
    assert core.n_paused > paused  # rows did run out of pages
    for rec, prompt, params in results.values():
        assert rec.finish_reason == "length"
        if params.temperature:
            assert rec.token_ids == want[params.seed], params.seed
        else:
            assert rec.token_ids == full[prompts.index(prompt)][: params.max_new_tokens]
    assert all((a == b).all() for a, b in zip(before, after))  # no write outside the rows' own pages


def test_stop_ids_end_a_request_at_the_first_one(served, expected):
    prompts, full = expected
    stop = (full[1][4], full[1][9])
    schedule = {0: [(prompts[1], _greedy(14, stop_token_ids=stop)),
                    (prompts[0], _greedy(1, stop_token_ids=(full[0][0],)))]}
    results, _ = _run(served, schedule)
    for rec, prompt, params in results.values():
        want = _want(full[prompts.index(prompt)], params.max_new_tokens, params.stop_token_ids)
        assert rec.token_ids == want and rec.finish_reason == "stop"


def test_a_seed_reproduces_its_request_whoever_shares_the_steps(served, expected, pair):
    prompts, _ = expected
    mine = (prompts[2], RequestParams(max_new_tokens=12, temperature=1.3, top_p=0.9, top_k=6, seed=1234))
    alone, _ = _run(served, {0: [mine]})
    crowd = {0: [(prompts[0], RequestParams(max_new_tokens=9, temperature=0.7, seed=5)), mine],
             2: [(prompts[3], RequestParams(max_new_tokens=6, temperature=2.0, seed=6))]}
    together, kinds = _run(served, crowd)
    (a,) = [r for r, p, _ in alone.values()]
    (b,) = [r for r, p, params in together.values() if params is mine[1]]
    assert a.token_ids == b.token_ids
    assert len({k for k in kinds if k is not None}) >= 2  # the crowd changed the budget under it
    # the draw for the token after position p uses key fold_in(seed, p): any mode gives the same tokens
    gen = pair.generate([mine[0]], 12, mode="ar", temperature=1.3, top_p=0.9, top_k=6, seed=[1234])
    assert gen.token_ids[0] == a.token_ids
    other = dict(mine[1].__dict__, seed=1235)
    c, _ = _run(served, {0: [(mine[0], RequestParams(**other))]})
    assert [r for r, *_ in c.values()][0].token_ids != a.token_ids  # the seed matters


@pytest.mark.heavy
def test_sampling_keeps_the_targets_distribution(rng):
    """Chi-square: (t2, t3) of served requests, many seeds, against the float64 reference's distribution."""
    cfg = config.tiny(vocab_size=6, eos_token_id=())
    seed = int(rng.integers(1 << 30))
    target = init_random(cfg, seed=seed)
    drafter = random_drafter(drafter_config(cfg, block_size=BLOCK), seed, scale=3.0)
    core = ServingEngine(Engine(target, drafter, None, use_pallas=False),
                         ServeConfig(max_slots=64, max_context=16, budget=8, rounds_per_step=2, max_queue=4096))
    prompt = rng.integers(0, 6, size=4).tolist()
    temperature, top_p = 1.5, 0.95
    params = [RequestParams(max_new_tokens=3, temperature=temperature, top_p=top_p, seed=int(s))
              for s in rng.integers(0, 1 << 32, size=1536)]
    results, _ = _run(core, {0: [(prompt, p) for p in params]})
    counts = np.zeros((6, 6))
    deep = 0
    for rec, *_ in results.values():
        counts[rec.token_ids[1], rec.token_ids[2]] += 1
        deep += any(a >= 2 for a in rec.accept_lengths)
    assert deep > 0  # some tokens came through accepted draft nodes
    assert_same_distribution(counts, exact_pair_distribution(cfg, seed, prompt, temperature, top_p))


# ---- compiled once -----------------------------------------------------------------------------------------------
CONSTRAINTS = (  # schemas and patterns are data of the programs: none of them compiles anything
    ConstraintSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    ConstraintSpec.json_schema({"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}),
    ConstraintSpec.regex(r"[a-z]+( [a-z]+)*\."),
    ConstraintSpec.choice(["yes", "no", "maybe"]),
)


def test_nothing_compiles_after_warm_up(served, expected):
    """Every step program, cancels, then 24 requests with mixed decoding rules, seeds, stop ids, token limits,
    prompt lengths (every bucket) and constraints (four schemas and patterns, laid out in the tables as they come and
    go) joining at different steps: no trace and no compile after warm-up, and every constrained token allowed."""
    prompts, full = expected
    rng = np.random.default_rng(3)
    vocab = served.engine.target.cfg.vocab_size
    schedule = {}
    for i in range(24):
        n = int(rng.integers(1, MAX_CONTEXT - 8)) if i else MAX_CONTEXT - 9  # several chunks included
        prompt = rng.integers(0, vocab - 1, size=n).tolist()
        params = RequestParams(max_new_tokens=int(rng.integers(1, min(12, MAX_CONTEXT - n + 1))),
                               temperature=float(rng.choice([0, 0.5, 1.7])),
                               top_k=int(rng.integers(0, 9)), top_p=float(rng.choice([1.0, 0.8, 0.3])),
                               seed=int(rng.integers(1 << 32)),
                               stop_token_ids=tuple(int(t) for t in rng.integers(0, vocab, size=rng.integers(0, 4))),
                               constraint=CONSTRAINTS[i % len(CONSTRAINTS)] if i % 3 == 0 else None)
        schedule.setdefault(int(rng.integers(0, 10)), []).append((prompt, params))
    with COMPILES.count() as events:
        ramp = []  # 1, 2, then 3 active slots: every step program runs, then every slot is cancelled
        for i in (0, 1, 0):  # one-chunk prompts: each joins in its own step
            served.submit(prompts[i], _greedy(MAX_CONTEXT - 30))  # outlives the ramp
            ramp.append(served.step().kind)
        for rid in served.running_ids():
            assert served.cancel(rid).finish_reason == "cancelled"
        results, _ = _run(served, schedule)
    assert events == []
    assert ramp == [served.scheduler.kinds[a] for a in range(1, served.config.max_slots + 1)]
    assert set(ramp) == {kind for kind, _ in served.step_keys}  # every step program's kind ran
    assert len(results) == 24 and {r.finish_reason for r, *_ in results.values()} <= {"stop", "length"}
    assert {served.bucket_for(len(p)) for _, p, _ in results.values()} == set(served.buckets)
    constrained = [(r, p.constraint) for r, _, p in results.values() if p.constraint is not None]
    assert {c for _, c in constrained} == set(CONSTRAINTS)
    compiler = served.engine.constraint_compiler()
    for rec, spec in constrained:  # every token was allowed where it was drawn
        automaton, state = compiler.compile(spec), 0
        for t in rec.token_ids:
            assert automaton.is_allowed(state, t), (spec, rec.token_ids)
            state = automaton.next_state(state, t)
    assert served.automata.layout.live == 0


# ---- pages and slots ---------------------------------------------------------------------------------------------
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 14), st.sampled_from([(), (0,), (5, 9)])),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("step")),
    st.tuples(st.just("fail")),
), min_size=600, max_size=600)


@pytest.mark.timeout(900)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(events=EVENTS)
def test_random_submit_cancel_step_events_leak_no_page(served, expected, events):
    """600 random submits, cancels (mid-chunk included), steps and failed steps: every finished request has its
    exact tokens, a cancelled one a prefix of them, a failed step ends its running requests with "error" (with
    overlap, found when the step is settled: by the next step or a cancel), and after every event each page is
    free or held by one live request, against the test's own record of which requests are live."""
    prompts, full = expected
    requests, finished = {}, {}
    fail_next = False

    def done(records):
        for rec in records:
            assert rec.request_id not in finished
            finished[rec.request_id] = rec

    for ev in events:
        if ev[0] == "submit":
            params = RequestParams(max_new_tokens=ev[2], stop_token_ids=ev[3])
            if served.n_waiting == served.config.max_queue:
                with pytest.raises(QueueFullError):
                    served.submit(prompts[ev[1]], params)
                continue
            requests[served.submit(prompts[ev[1]], params)] = (ev[1], params)
        elif ev[0] == "cancel":
            live = [*served.running_ids(), *served.waiting_ids()]
            if live:
                rec = served.cancel(live[ev[1] % len(live)])
                assert rec is not None and rec.finish_reason in ("cancelled", "error")
                done([rec])
                _free_rows_are_finished(served)
        elif ev[0] == "fail":
            fail_next = True
        else:
            if fail_next:
                with _failing_steps(served):
                    report = served.step()
                fail_next = False
                if served.config.overlap and report.kind is not None:
                    done(report.records)
                    failed = set(served.running_ids())
                    report = served.step()  # settles the failed step first
                    ended = {e.request_id: e.finish_reason for e in report.records}
                    assert all(ended[rid] == "error" for rid in failed)
                else:
                    errors = [e for e in report.records if e.finish_reason == "error"]
                    assert report.kind is None or (served.n_running == 0 and errors)  # no step: nothing to fail
            else:
                report = served.step()
            done(report.records)
        _accounted(served, set(requests) - set(finished), set(finished))
    while served.has_work:  # what is left runs to its end
        done(served.step().records)
    assert served.n_running == 0 and served.n_waiting == 0
    assert served.cache.free_pages == served.num_pages
    assert set(finished) == set(requests)
    print("finish reasons:", {r: sum(f.finish_reason == r for f in finished.values())
                              for r in ("length", "stop", "cancelled", "error")})
    for rid, rec in finished.items():
        i, params = requests[rid]
        want = _want(full[i], params.max_new_tokens, params.stop_token_ids)
        if rec.finish_reason in ("stop", "length"):
            assert rec.token_ids == want, (rid, rec)
        else:
            assert rec.finish_reason in ("cancelled", "error") and rec.token_ids == want[: len(rec.token_ids)]


@contextlib.contextmanager
def _failing_steps(core: ServingEngine):
    """Every step program raises, as a device fault would, for the duration."""
    saved = dict(core.runner._programs)

    def boom(*_args):
        raise RuntimeError("injected device fault")

    for key in saved:
        if key[0] == "step":
            core.runner._programs[key] = boom
    try:
        yield
    finally:
        core.runner._programs.update(saved)


# ---- bad input ---------------------------------------------------------------------------------------------------
def _params(**kw) -> RequestParams:
    return RequestParams(**{"max_new_tokens": 4, **kw})


@pytest.mark.parametrize("prompt,params,field", [
    ([1] * MAX_CONTEXT, _params(max_new_tokens=1), "prompt"),
    ([1, 2], _params(max_new_tokens=MAX_CONTEXT), "max_new_tokens"),
    ([1, 2], _params(max_new_tokens=0), "max_new_tokens"),
    ([1, 2], _params(temperature=-0.1), "temperature"),
    ([1, 2], _params(temperature=float("nan")), "temperature"),
    ([1, 2], _params(temperature=float("inf")), "temperature"),
    ([1, 2], _params(top_p=0.0), "top_p"),
    ([1, 2], _params(top_p=1.5), "top_p"),
    ([1, 2], _params(top_k=9), "top_k"),
    ([1, 2], _params(top_k=-1), "top_k"),
    ([1, 2], _params(stop_token_ids=(10**6,)), "stop_token_ids"),
    ([1, 2], _params(stop_token_ids=(1, 2, 3, 4, 5)), "stop_token_ids"),
    ([1, 2], _params(seed=-1), "seed"),
    ([1, 2], _params(seed=1 << 32), "seed"),
    ([], _params(), "prompt"),
    ([1, 10**6], _params(), "prompt"),
    ("text", _params(), "prompt"),
    ([1.5, 2], _params(), "prompt"),
])
def test_bad_requests_name_their_field_and_leave_the_others_alone(served, expected, prompt, params, field):
    prompts, full = expected
    rid = served.submit(prompts[1], _greedy(6))
    records = served.step().records
    with pytest.raises(RequestError) as info:
        served.submit(prompt, params)
    assert info.value.field == field and str(info.value).startswith(field)
    if isinstance(prompt, list) and prompt and len(prompt) + params.max_new_tokens > MAX_CONTEXT:
        assert isinstance(info.value, PromptTooLongError) and f"max_context {MAX_CONTEXT}" in str(info.value)
    assert served.n_waiting == 0
    while served.has_work:
        records += served.step().records
    (rec,) = [r for r in records if r.request_id == rid]
    assert rec.token_ids == full[1][:6]


def test_queue_limit_and_shutdown_refuse_new_requests(pair):
    core = ServingEngine(Engine(pair.target, None, None), _config(max_slots=1, mode="ar", max_queue=2))
    core.submit([1, 2, 3], RequestParams(max_new_tokens=2))
    core.submit([1, 2, 3], RequestParams(max_new_tokens=2))
    with pytest.raises(QueueFullError, match="max_queue 2"):
        core.submit([1, 2, 3])
    cancelled = core.shutdown()
    assert [r.finish_reason for r in cancelled] == ["cancelled", "cancelled"]
    with pytest.raises(EngineClosedError):
        core.submit([1, 2, 3])


# ---- the async front ---------------------------------------------------------------------------------------------
@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_async_front_streams_deltas_then_the_record(pair, expected):
    prompts, full = expected
    core = ServingEngine(Engine(pair.target, None, None), _config(max_slots=2, mode="ar"))
    core.warm_up()

    async def main():
        front = AsyncServingEngine(core)
        await front.start()
        with pytest.raises(RequestError, match="top_p"):
            front.submit(prompts[0], RequestParams(max_new_tokens=4, top_p=2.0))

        async def one(i, n, cancel_after=None):
            stream = front.submit(prompts[i], _greedy(n))
            got, deltas = [], 0
            async for delta in stream:
                got += delta.token_ids
                deltas += 1
                if cancel_after is not None and len(got) >= cancel_after:
                    stream.cancel()
            return got, deltas, stream.record

        runs = await asyncio.gather(one(0, 14), one(1, 9), one(2, 16, cancel_after=2), one(3, 12))
        await front.shutdown(timeout=30)
        with pytest.raises(EngineClosedError):
            front.submit(prompts[0], RequestParams(max_new_tokens=4))
        return runs

    runs = asyncio.run(main())
    assert core.closed and core.n_running == 0
    for i, (got, deltas, rec) in enumerate(runs):
        assert got == rec.token_ids
        if i == 2:
            assert rec.finish_reason == "cancelled" and got == full[2][: len(got)] and len(got) < 16
        else:
            assert rec.finish_reason == "length" and got == full[i][: len(got)] and deltas >= 2
            assert rec.first_token_time <= rec.finish_time and rec.rounds == len(rec.accept_lengths) > 0


# ---- row programs ------------------------------------------------------------------------------------------------
def test_move_copies_a_whole_row_and_put_rows_writes_back_only_its_rows(pair, rng):
    """A row is the request's small state and its page-table row; the page pools are nobody's row."""
    from kdtree_jax.decode.speculative import FINISH_LENGTH
    from kdtree_jax.serving import programs

    empty = programs.empty_table(pair.target, pair.drafter, slots=5, capacity=32, n_pages=6, page_size=16, n_stop=3,
                                 depth=3, draft_k=4, rounds=2)
    leaves, tree = jax.tree.flatten(empty)
    table = jax.tree.unflatten(tree, [np.asarray(rng.integers(1, 1000, size=x.shape)).astype(x.dtype)
                                      for x in leaves])
    axes = jax.tree.leaves(programs.slot_axes(table))
    moved = programs.move(table, np.int32(3), np.int32(1))
    for axis, before, after, name in zip(axes, jax.tree.leaves(table), jax.tree.leaves(moved),
                                         [jax.tree_util.keystr(k) for k, _ in jax.tree.leaves_with_path(table)]):
        before, after = np.asarray(before), np.asarray(after)
        if axis < 0:
            np.testing.assert_array_equal(after, before, err_msg=name)
            continue
        np.testing.assert_array_equal(np.take(after, 1, axis), np.take(before, 3, axis), err_msg=name)
        np.testing.assert_array_equal(np.take(after, [0, 2, 4], axis), np.take(before, [0, 2, 4], axis), err_msg=name)
    assert int(moved.finish[3]) == FINISH_LENGTH  # the source is free
    part = jax.tree.map(lambda x: x + 1, programs.slice_rows(table, 0, 2))
    back = programs.put_rows(table, part, 0)
    for axis, before, after in zip(axes, jax.tree.leaves(table), jax.tree.leaves(back)):
        before, after = np.asarray(before), np.asarray(after)
        if axis < 0:
            np.testing.assert_array_equal(after, before + 1)
            continue
        np.testing.assert_array_equal(np.take(after, [0, 1], axis=axis), np.take(before, [0, 1], axis=axis) + 1)
        np.testing.assert_array_equal(np.take(after, [2, 3, 4], axis=axis), np.take(before, [2, 3, 4], axis=axis))


_LOOP_GRAPHS_PROBE = """
import json, os, sys
import jax
from kdtree_jax.serving import enable_loop_graphs
first = enable_loop_graphs()
flags = os.environ.get("XLA_FLAGS", "")
x = float(jax.numpy.arange(3.0).sum())  # XLA parses the flags here: a bad one aborts the process
os.environ["XLA_FLAGS"] = ""
late = enable_loop_graphs()  # the backend is up: the flag would do nothing now, so it is not set
print(json.dumps({"first": first, "flags": flags, "x": x, "late": late, "late_flags": os.environ["XLA_FLAGS"]}))
"""


@pytest.mark.parametrize("given_flags, expect_set", [
    ("", True),
    ("--xla_force_host_platform_device_count=2", True),
    ("--xla_gpu_enable_command_buffer=", False),  # the user's choice stays
])
def test_loop_graphs_flag_is_added_before_the_backend_starts_and_never_overrides(given_flags, expect_set):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if given_flags:
        env["XLA_FLAGS"] = given_flags
    out = subprocess.run([sys.executable, "-c", _LOOP_GRAPHS_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["x"] == 3.0
    assert got["first"] is expect_set
    assert got["late"] is False and got["late_flags"] == ""
    if expect_set:
        assert got["flags"].split() == [*given_flags.split(), "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"]
    else:
        assert got["flags"] == given_flags
