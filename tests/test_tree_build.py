"""tree_build kernel vs the numpy heap reference, a brute-force prefix enumeration, and Triton lowering."""
import functools
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.tree_build import Tree, topk_logprobs, tree_build
from pallas_kernels.tree_build_ref import topk_logprobs_ref, tree_build_ref

VOCAB = 1000
TRIALS = 6  # fresh inputs per compiled shape


def make_inputs(rng, bt, d, k, *, quant=None, sort=True, vocab=VOCAB):
    """Random per-depth top-k log-probs; `quant` rounds them onto a grid so exact score ties are common."""
    lp = -rng.exponential(1.5, (bt, d, k))
    if quant:
        lp = np.round(lp / quant) * quant
    if sort:
        lp = -np.sort(-lp, axis=-1)
    ids = np.argsort(rng.random((bt, d, vocab)), axis=-1)[..., :k]  # distinct tokens per depth
    root = rng.integers(0, vocab, bt)
    return lp.astype(np.float32), ids.astype(np.int32), root.astype(np.int32)


def assert_tree_equal(tree: Tree, ref, what=""):
    for field in ref._fields:
        got, want = np.asarray(getattr(tree, field)), getattr(ref, field)
        assert got.shape == want.shape, f"{what} {field}: shape {got.shape} != {want.shape}"
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{what} {field}: {len(bad)} mismatches, first at {bad[0]}: {got[tuple(bad[0])]} != " \
                              f"{want[tuple(bad[0])]}"


def run_build(lp, ids, root, budget, interpret):
    return tree_build(jnp.asarray(lp), jnp.asarray(ids), jnp.asarray(root), budget=budget, interpret=interpret)


# (Bt, D, K, B, quant, sorted rows): continuous, tie-heavy, unsorted rows, D=1, K=1, B > sum K^d, batch 64
CASES = [
    (8, 4, 4, 24, None, True),
    (8, 5, 3, 40, 0.5, True),
    (8, 3, 4, 20, 1.0, False),
    (4, 1, 5, 8, None, True),
    (4, 3, 1, 5, 0.5, True),
    (6, 2, 2, 9, 0.5, True),
    (64, 3, 4, 16, 0.25, True),
]


@pytest.mark.parametrize("bt,d,k,budget,quant,sort", CASES)
def test_matches_reference(interpret, rng, bt, d, k, budget, quant, sort):
    for trial in range(TRIALS):
        lp, ids, root = make_inputs(rng, bt, d, k, quant=quant, sort=sort)
        ref = tree_build_ref(lp, ids, root, budget=budget)
        assert_tree_equal(run_build(lp, ids, root, budget, interpret), ref, f"trial {trial}")
    space = sum(k**i for i in range(1, d + 1))
    assert (ref.n_nodes == min(budget, space)).all()


def test_budget_zero_is_root_only(interpret, rng):
    lp, ids, root = make_inputs(rng, 3, 4, 2)
    tree = run_build(lp, ids, root, 0, interpret)
    assert_tree_equal(tree, tree_build_ref(lp, ids, root, budget=0))
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:, 0], root)


def _rank_paths(tree_tokens, tree_parents, n_nodes, ids):
    """Rank path of every real node, in slot order, from tokens (ids rows are distinct per depth)."""
    paths = [()]
    for slot in range(1, n_nodes + 1):
        parent = paths[tree_parents[slot]]
        rank = int(np.flatnonzero(ids[len(parent)] == tree_tokens[slot])[0])
        paths.append(parent + (rank,))
    return paths[1:]


@pytest.mark.parametrize("budget", [13, 50])
def test_brute_force_top_prefixes(interpret, rng, budget):
    """Tiny V = K, D: the slots hold exactly the B most probable prefixes, sorted by (score desc, path asc)."""
    bt, d, k = 4, 3, 3
    for _ in range(TRIALS):
        lp, ids, root = make_inputs(rng, bt, d, k, quant=0.5, vocab=k)
        tree = run_build(lp, ids, root, budget, interpret)
        for b in range(bt):
            ranked = []
            for depth in range(1, d + 1):
                for path in itertools.product(range(k), repeat=depth):
                    score = np.float32(0.0)
                    for i, r in enumerate(path):  # same order of float32 adds as the heap
                        score = np.float32(score + lp[b, i, r])
                    ranked.append((-float(score), path))
            want = [p for _, p in sorted(ranked)[:budget]]
            n = int(tree.n_nodes[b])
            got = _rank_paths(np.asarray(tree.tokens[b]), np.asarray(tree.parents[b]), n, ids[b])
            assert got == want, f"request {b}: slot order {got} != brute force {want}"


def test_vis_is_transitive_closure(interpret, rng):
    bt, d, k, budget = 8, 4, 3, 30
    lp, ids, root = make_inputs(rng, bt, d, k, quant=0.5)
    tree = run_build(lp, ids, root, budget, interpret)
    parents, vis, n_nodes = np.asarray(tree.parents), np.asarray(tree.vis), np.asarray(tree.n_nodes)
    n = budget + 1
    for b in range(bt):
        step = np.zeros((n, n), np.int64)  # step[i, parent(i)] = 1
        real = np.flatnonzero(parents[b] >= 0)
        step[real, parents[b, real]] = 1
        closure = np.eye(n, dtype=np.int64)
        for _ in range(d):
            closure = np.minimum(closure + closure @ step, 1)
        np.testing.assert_array_equal(vis[b], closure.astype(bool), err_msg=f"request {b}")
        assert vis[b, : n_nodes[b] + 1, 0].all(), "every real row sees the root"
        assert (vis[b].sum(-1)[1 : n_nodes[b] + 1] == np.asarray(tree.depths[b])[1 : n_nodes[b] + 1] + 1).all()


def test_topk_logprobs_matches_float64(rng):
    logits = rng.normal(0.0, 3.0, (4, 5, 300)).astype(np.float32)
    lp, ids = jax.jit(topk_logprobs, static_argnames="k")(jnp.asarray(logits), k=16)
    want_lp, want_ids = topk_logprobs_ref(logits, 16)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(-6, 0), min_size=2 * 3 * 4, max_size=2 * 3 * 4), st.integers(0, 2**31 - 1))
def test_property_quantised_ties(interpret, levels, seed):
    """Hypothesis: arbitrary (often tied, unsorted) integer log-probs; the kernel always equals the heap."""
    lp = (np.asarray(levels, np.float32) * 0.5).reshape(2, 3, 4)
    _, ids, root = make_inputs(np.random.default_rng(seed), 2, 3, 4)
    assert_tree_equal(run_build(lp, ids, root, 19, interpret), tree_build_ref(lp, ids, root, budget=19))


@pytest.mark.parametrize("d,budget,k", [(7, 16, 16), (7, 64, 64), (15, 64, 64), (15, 256, 256), (1, 8, 8), (7, 64, 12)])
def test_lowers_for_h200(d, budget, k):
    bt = 8
    specs = (jax.ShapeDtypeStruct((bt, d, k), jnp.float32), jax.ShapeDtypeStruct((bt, d, k), jnp.int32),
             jax.ShapeDtypeStruct((bt,), jnp.int32))
    text = lower_for_h200(functools.partial(tree_build, budget=budget, interpret=False), *specs).as_text()
    assert "triton" in text.lower()


def test_bad_input_names_argument():
    lp = jnp.zeros((2, 3, 4), jnp.float32)
    with pytest.raises(ValueError, match="ids shape"):
        tree_build(lp, jnp.zeros((2, 3, 5), jnp.int32), jnp.zeros((2,), jnp.int32), budget=4)
    with pytest.raises(ValueError, match="root must be"):
        tree_build(lp, jnp.zeros((2, 3, 4), jnp.int32), jnp.zeros((3,), jnp.int32), budget=4)


@pytest.mark.gpu
def test_compiled_matches_reference_engine_size(rng):
    bt, d, budget = 64, 15, 256
    for quant in (None, 0.25):
        lp, ids, root = make_inputs(rng, bt, d, budget, quant=quant, vocab=4096)
        tree = run_build(lp, ids, root, budget, False)
        assert_tree_equal(tree, tree_build_ref(lp, ids, root, budget=budget), f"quant={quant}")
