"""tree_accept kernel vs the numpy walk, forced accept lengths, pad safety, and the jitted build->accept chain."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.tree_accept import tree_accept
from pallas_kernels.tree_accept_ref import tree_accept_ref
from pallas_kernels.tree_build import topk_logprobs, tree_build
from pallas_kernels.tree_build_ref import topk_logprobs_ref, tree_build_ref

VOCAB = 64
NO_MATCH = VOCAB + 7  # a target choice that is no draft token


def ref_tree(rng, bt, d, k, budget, *, spine=True):
    """Reference tree; a near-certain rank-0 spine guarantees nodes at every depth 1..D."""
    lp = -np.sort(rng.exponential(1.0, (bt, d, k)), axis=-1)
    if spine:
        lp[..., 0] = -0.01
    ids = np.argsort(rng.random((bt, d, VOCAB)), axis=-1)[..., :k]
    root = rng.integers(0, VOCAB, bt)
    return tree_build_ref(lp.astype(np.float32), ids.astype(np.int32), root.astype(np.int32), budget=budget)


def run_accept(choice, tokens, parents, n_nodes, d, interpret):
    args = (jnp.asarray(x, jnp.int32) for x in (choice, tokens, parents, n_nodes))
    return tree_accept(*args, max_depth=d, interpret=interpret)


def assert_accept_equal(got, ref, what=""):
    for field in ref._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(ref, field), err_msg=f"{what} {field}")


def ancestors(parents, slot):
    path = [slot]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def test_every_accept_length(interpret, rng):
    """Choices forced along a random root->node path give exactly that path, for lengths 1..D+1."""
    d, k, budget = 4, 3, 24
    bt = 4 * (d + 1)
    for _ in range(3):
        tree = ref_tree(rng, bt, d, k, budget)
        choice = rng.integers(0, VOCAB, (bt, budget + 1))
        want_len = np.arange(bt) % (d + 1) + 1
        want_path = np.full((bt, d + 1), -1)
        for b in range(bt):
            deepest = np.flatnonzero((tree.depths[b] == want_len[b] - 1) & (np.arange(budget + 1) <= tree.n_nodes[b]))
            path = ancestors(tree.parents[b], int(rng.choice(deepest)))
            for cur, nxt in zip(path[:-1], path[1:]):
                choice[b, cur] = tree.tokens[b, nxt]
            choice[b, path[-1]] = NO_MATCH
            want_path[b, : len(path)] = path
        got = run_accept(choice, tree.tokens, tree.parents, tree.n_nodes, d, interpret)
        ref = tree_accept_ref(choice, tree.tokens, tree.parents, tree.n_nodes, max_depth=d)
        assert_accept_equal(got, ref)
        np.testing.assert_array_equal(np.asarray(got.n_accepted), want_len)
        np.testing.assert_array_equal(np.asarray(got.path), want_path)
        np.testing.assert_array_equal(np.asarray(got.bonus), np.full(bt, NO_MATCH))
        src = np.where(want_path >= 0, want_path, np.arange(d + 1))
        np.testing.assert_array_equal(np.asarray(got.src_slot), src)


def test_random_choices_batch64(interpret, rng):
    d, k, budget, bt = 3, 4, 20, 64
    for _ in range(3):
        tree = ref_tree(rng, bt, d, k, budget, spine=False)
        # choices drawn from each depth's draft tokens so that partial walks are common
        choice = rng.integers(0, VOCAB, (bt, budget + 1))
        hit = rng.random((bt, budget + 1)) < 0.7
        choice = np.where(hit, np.roll(tree.tokens, -1, axis=1), choice)
        got = run_accept(choice, tree.tokens, tree.parents, tree.n_nodes, d, interpret)
        assert_accept_equal(got, tree_accept_ref(choice, tree.tokens, tree.parents, tree.n_nodes, max_depth=d))
    assert np.asarray(got.n_accepted).max() > 1


def test_pads_never_accepted(interpret, rng):
    """Slots past n_nodes are ignored even when their parent and token match the walk."""
    d, k, budget, bt = 2, 2, 9, 8  # prefix space 6 < budget: 3 pad slots per request
    tree = ref_tree(rng, bt, d, k, budget)
    assert (tree.n_nodes == 6).all()
    tokens, parents = tree.tokens.copy(), tree.parents.copy()
    choice = np.full((bt, budget + 1), NO_MATCH)
    tokens[:, 7:] = NO_MATCH  # pads carry the root's choice and claim the root as parent
    parents[:, 7:] = 0
    got = run_accept(choice, tokens, parents, tree.n_nodes, d, interpret)
    np.testing.assert_array_equal(np.asarray(got.n_accepted), np.ones(bt))
    np.testing.assert_array_equal(np.asarray(got.bonus), np.full(bt, NO_MATCH))
    # truncated n_nodes: the target follows the best-child chain, but the tail of the tree is declared padding
    tree = ref_tree(rng, bt, d + 1, k, budget)
    n_nodes = rng.integers(0, tree.n_nodes + 1)
    choice = _greedy_choice_np(tree.tokens, tree.parents, np.zeros(tree.tokens.shape, bool), NO_MATCH)
    got = run_accept(choice, tree.tokens, tree.parents, n_nodes, d + 1, interpret)
    assert_accept_equal(got, tree_accept_ref(choice, tree.tokens, tree.parents, n_nodes, max_depth=d + 1))
    for b in range(bt):
        chain = [0]  # best-child chain of the full tree; slots increase along it
        while (choice[b, chain[-1]] != NO_MATCH) and len(chain) <= d + 1:
            chain.append(int(np.flatnonzero(tree.parents[b] == chain[-1])[0]))
        want = [s for s in chain if s <= n_nodes[b]]
        assert list(np.asarray(got.path[b, : len(want) + 1])) == (want + [-1])[: d + 2], f"request {b}"


def _greedy_choice(tokens, parents, stop, sentinel):
    """Target stand-in: at slot i choose the token of i's first child (highest score), unless stop[i]."""
    n = tokens.shape[-1]
    is_child = parents[:, None, :] == jnp.arange(n)[None, :, None]  # [Bt, N parent, N child]
    first = jnp.argmax(is_child, axis=-1)
    tok = jnp.take_along_axis(tokens, first, axis=-1)
    return jnp.where(is_child.any(-1) & ~stop, tok, sentinel).astype(jnp.int32)


def _greedy_choice_np(tokens, parents, stop, sentinel):
    out = np.full(tokens.shape, sentinel, np.int32)
    for b, i in np.ndindex(tokens.shape):
        kids = np.flatnonzero(parents[b] == i)
        if len(kids) and not stop[b, i]:
            out[b, i] = tokens[b, kids[0]]
    return out


def _primitives(jaxpr, seen):
    for eqn in jaxpr.eqns:
        seen.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    _primitives(inner, seen)
    return seen


def test_composition_in_one_jit(interpret, rng):
    """topk_logprobs -> tree_build -> tree_accept in one jit: no host callbacks, equal to the references."""
    bt, d, vocab, budget = 8, 4, 48, 20
    k = min(budget, vocab)

    @jax.jit
    def round_step(logits, root, stop):
        lp, ids = topk_logprobs(logits, k)
        tree = tree_build(lp, ids, root, budget=budget, interpret=interpret)
        choice = _greedy_choice(tree.tokens, tree.parents, stop, vocab)
        acc = tree_accept(choice, tree.tokens, tree.parents, tree.n_nodes, max_depth=d, interpret=interpret)
        return lp, ids, tree, choice, acc

    logits = rng.normal(0.0, 4.0, (bt, d, vocab)).astype(np.float32)
    root = rng.integers(0, vocab, bt).astype(np.int32)
    stop = rng.random((bt, budget + 1)) < 0.3
    args = (jnp.asarray(logits), jnp.asarray(root), jnp.asarray(stop))

    prims = _primitives(jax.make_jaxpr(round_step)(*args).jaxpr, set())
    assert "pallas_call" in prims
    assert not [p for p in prims if "callback" in p], prims
    assert "callback" not in round_step.lower(*args).as_text()

    lp, ids, tree, choice, acc = round_step(*args)
    want_lp, want_ids = topk_logprobs_ref(logits, k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-5)
    ref = tree_build_ref(np.asarray(lp), np.asarray(ids), root, budget=budget)
    for field in ref._fields:
        np.testing.assert_array_equal(np.asarray(getattr(tree, field)), getattr(ref, field), err_msg=field)
    want_choice = _greedy_choice_np(ref.tokens, ref.parents, stop, vocab)
    np.testing.assert_array_equal(np.asarray(choice), want_choice)
    assert_accept_equal(acc, tree_accept_ref(want_choice, ref.tokens, ref.parents, ref.n_nodes, max_depth=d))


@pytest.mark.parametrize("d,budget", [(7, 16), (7, 64), (15, 64), (15, 256), (1, 4), (7, 0)])
def test_lowers_for_h200(d, budget):
    """Engine sizes, plus the AR root-only tree (N = 1)."""
    bt = 8
    specs = [jax.ShapeDtypeStruct((bt, budget + 1), jnp.int32)] * 3 + [jax.ShapeDtypeStruct((bt,), jnp.int32)]
    text = lower_for_h200(functools.partial(tree_accept, max_depth=d, interpret=False), *specs).as_text()
    assert "triton" in text.lower()


def test_bad_input_names_argument():
    x = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="parents shape"):
        tree_accept(x, x, jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32), max_depth=3)
    with pytest.raises(ValueError, match="n_nodes must be"):
        tree_accept(x, x, x, jnp.zeros((3,), jnp.int32), max_depth=3)


@pytest.mark.gpu
def test_compiled_matches_reference_engine_size(rng):
    bt, d, k, budget = 64, 15, 256, 256
    tree = ref_tree(rng, bt, d, k, budget)
    choice = np.where(rng.random((bt, budget + 1)) < 0.8, np.roll(tree.tokens, -1, axis=1),
                      rng.integers(0, VOCAB, (bt, budget + 1)))
    got = run_accept(choice, tree.tokens, tree.parents, tree.n_nodes, d, False)
    assert_accept_equal(got, tree_accept_ref(choice, tree.tokens, tree.parents, tree.n_nodes, max_depth=d))
