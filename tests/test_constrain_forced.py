"""Forced tokens in the draft tree: where a node's state allows exactly one token, the tree takes it without the
drafter (at the parent's score) and goes on below it; the jnp heap equals its numpy reference bit for bit, the
automaton's and the device tables' forced tokens equal a direct count of the allowed tokens, and greedy ddtree and
chain under a schema equal constrained ar token for token with the shipped pair."""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_constrained_decoding import _draft_lists, _lookup

from kdtree_jax.checkpoint.tokenizer import KimiTokenizer
from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import ConstraintSpec, ConstraintVocabulary, compile_constraint
from kdtree_jax.decode.engine import Engine
from pallas_kernels.tree_build_masked import tree_build_masked
from pallas_kernels.tree_build_ref import tree_build_masked_ref

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "kdtree-mini")
RECORD = {"type": "object", "properties": {"kind": {"enum": ["def", "class", "import"]},
                                           "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
          "required": ["kind", "name", "ok"], "additionalProperties": False}


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_forced_nodes_equal_the_heap_reference(ties, rng):
    """Random dense automata in which some states allow one token alone (mostly one the drafter did not rank): the
    jnp heap equals the numpy heap (tokens, parents, depths, n_nodes, mask, states); forced tokens outside the
    top-K lists do enter the tree, each as its parent's only child."""
    bt, depth, k, vocab, n_states = 3, 4, 5, 40, 8
    entered = 0
    for _ in range(3):
        budget = int(rng.integers(4, 24))
        lp, ids = _draft_lists(rng, bt, depth, k, vocab, ties)
        allowed = rng.random((n_states, vocab)) < 0.4
        forced = np.where(rng.random(n_states) < 0.4, rng.integers(0, vocab, n_states), -1)
        for s in np.flatnonzero(forced >= 0):
            allowed[s] = np.arange(vocab) == forced[s]
        nxt = rng.integers(0, n_states, (n_states, vocab))
        root, root_state = rng.integers(0, vocab, bt), rng.integers(0, n_states, bt)
        al, nx, fo = jnp.asarray(allowed), jnp.asarray(nxt, jnp.int32), jnp.asarray(forced, jnp.int32)
        build = jax.jit(functools.partial(tree_build_masked, budget=budget, allowed=lambda s, t: al[s, t],
                                          step=lambda s, t: nx[s, t], forced=lambda s: fo[s]))
        tree, states = build(lp, ids, root, root_state)
        want, want_states = tree_build_masked_ref(lp, ids, root, root_state, budget=budget,
                                                  is_allowed=functools.partial(_lookup, allowed),
                                                  next_state=functools.partial(_lookup, nxt),
                                                  forced=lambda s: int(forced[s]))
        for name, got, exp in zip(want._fields, (tree.tokens, tree.parents, tree.depths, tree.n_nodes, tree.vis),
                                  want):
            np.testing.assert_array_equal(np.asarray(got), exp, err_msg=f"{name}, budget {budget}")
        np.testing.assert_array_equal(np.asarray(states), want_states)
        tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
        states = np.asarray(states)
        for b in range(bt):
            for i in range(1, int(np.asarray(tree.n_nodes)[b]) + 1):
                f = forced[states[b, parents[b, i]]]
                if f >= 0:
                    assert tokens[b, i] == f and np.sum(parents[b] == parents[b, i]) == 1
                    entered += int(f not in ids[b, depths[b, i] - 1])
    assert entered > 0  # the drafter's lists did not hold them: only forcing puts them there


@pytest.mark.timeout(60)
def test_forced_tokens_of_a_schema_equal_a_count_of_its_allowed_tokens(rng):
    """Every state of a schema's automaton over the shipped vocabulary: forced = its one allowed token (no stop
    token), else -1; the device tables carry them at the automaton's base and -1 in free states."""
    tokenizer = KimiTokenizer.from_dir(os.path.join(SHIPPED, "tokenizer"))
    vocab = ConstraintVocabulary.from_tokenizer(tokenizer)
    automaton = compile_constraint(ConstraintSpec.json_schema(RECORD), vocab)
    want = np.full(automaton.num_states, -1)
    for s in range(automaton.num_states):
        allowed = np.flatnonzero(automaton.allowed_tokens(s))
        if allowed.size == 1 and allowed[0] not in vocab.stop_ids:
            want[s] = allowed[0]
    np.testing.assert_array_equal(automaton.forced, want)
    assert (want >= 0).sum() > 4  # enum values and keys spell forced text
    tables, (base,) = cd.pack_tables([automaton], vocab.vocab_size)
    got = np.asarray(cd.forced_token(cd.to_device(tables), jnp.arange(cd.table_shape(tables)[0])))
    np.testing.assert_array_equal(got[base:base + automaton.num_states], want)
    assert (got[:base] == -1).all() and (got[base + automaton.num_states:] == -1).all()


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_shipped_pair_greedy_trees_with_forced_tokens_equal_constrained_ar():
    """Greedy ddtree and chain under a schema with forced text equal constrained ar token for token, and the tree
    accepts more than one token a round."""
    eng = Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f][:2]
    prompts = [eng.tokenizer.encode(t)[:n] for t, n in zip(texts, (24, 31))]
    constraint = ConstraintSpec.json_schema(RECORD)
    ar = eng.generate(prompts, 40, mode="ar", constraint=constraint)
    tree = eng.generate(prompts, 40, mode="ddtree", budget=8, constraint=constraint)
    chain = eng.generate(prompts, 40, mode="chain", constraint=constraint)
    print(f"tau: ddtree {tree.stats.mean_acceptance_length:.2f}, chain {chain.stats.mean_acceptance_length:.2f}")
    assert tree.token_ids == ar.token_ids == chain.token_ids
    assert tree.stats.mean_acceptance_length > 1.5
