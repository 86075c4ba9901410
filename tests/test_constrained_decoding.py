"""Constrained speculation on the device: the device tables equal the host automaton, the masked heap equals its
numpy reference (and the kernel where every token is allowed) and lets no disallowed node in, constrained greedy
AR equals the float64 reference step on the reference model's logits, ddtree and chain equal AR token for token,
outputs stay inside the language (and parse and validate where they end), schemas never recompile, and constrained
sampling draws from the masked target distribution."""
from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from engine_utils import (CompileCounter, assert_same_distribution, drafter_config, nucleus_probs, random_drafter,
                          random_pair)

from kdtree_jax.checkpoint.weights import init_random, random_hf_weights
from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import ConstraintSpec, ConstraintTooLarge, ConstraintVocabulary, compile_constraint
from kdtree_jax.decode.engine import Engine
from kdtree_jax.model import config
from kdtree_jax.oracles.constrain_ref import constrained_greedy_step_ref
from kdtree_jax.oracles.reference import reference_forward
from pallas_kernels.tree_build import tree_build
from pallas_kernels.tree_build_masked import tree_build_masked
from pallas_kernels.tree_build_ref import tree_build_masked_ref

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "kdtree-mini")
ALPHABET = list('{}":,abc0123456789 truefals')  # every character the regexes below spell, as one-byte tokens
REGEX_OBJECT = r'\{"[a-c]{1,5}":([0-9]{1,3}|true|false)(,"[a-c]{1,5}":([0-9]{1,3}|true|false)){0,2}\}'
REGEX_LIST = r'(true|false|[0-9]{1,2})( ?, ?(true|false|[0-9]{1,2})){0,4}'
SMALL_CAPS = cd.TableCaps(states=256, exceptions=4096)  # the synthetic automata; one compile for both regexes
BLOCK, BUDGET, NEW_TOKENS = 4, 6, 16
NEAR_TIE = 1e-4  # float32 engine vs float64 reference: a top-2 gap below this may flip the greedy pick


def synthetic_vocab(rng, vocab_size: int) -> tuple[list[bytes], ConstraintVocabulary]:
    """One-byte tokens for the alphabet, random 2-3 byte strings over it up to V - 2; the stop id is V - 2 (V - 1
    stays the drafter's mask token)."""
    toks = [c.encode() for c in ALPHABET]
    while len(toks) < vocab_size - 2:
        toks.append("".join(rng.choice(ALPHABET, size=int(rng.integers(2, 4)))).encode())
    return toks, ConstraintVocabulary.from_token_bytes(toks, vocab_size, (vocab_size - 2,))


def host_next(a, state: int) -> np.ndarray:
    """[V] next state of every token from `state` per the host tables (meaningful where allowed)."""
    out = np.full(a.vocab_size, a.default_next[state], np.int64)
    lo, hi = a.exc_offsets[state], a.exc_offsets[state + 1]
    out[a.exc_tokens[lo:hi]] = a.exc_next[lo:hi]
    return out


@pytest.fixture(scope="module")
def synth():
    """A random tiny pair ("grouped") and two automata over a fresh random synthetic vocabulary."""
    seed = int.from_bytes(os.urandom(4), "little") >> 2
    print(f"synthetic pair seed={seed}")
    rng = np.random.default_rng(seed)
    target, drafter = random_pair("grouped", seed, block_size=BLOCK)
    v = target.cfg.vocab_size
    toks, vocab = synthetic_vocab(rng, v)
    eng = Engine(target, drafter, None, use_pallas=True)
    eng.constraint_caps = SMALL_CAPS
    autos = {name: compile_constraint(ConstraintSpec.regex(p), vocab) for name, p in
             (("object", REGEX_OBJECT), ("list", REGEX_LIST))}
    prompts = [rng.integers(0, v - 2, size=n).tolist() for n in (5, 8, 3)]
    return {"seed": seed, "eng": eng, "toks": toks, "autos": autos, "prompts": prompts}


# ---- device tables -------------------------------------------------------------------------------------------
def test_device_tables_equal_host_automaton(synth, rng):
    """allowed bits, masks and next states of every automaton in the packed tables equal the host tables at fresh
    random (state, token) pairs and at every exception; the free state allows everything and stays free."""
    a, b = synth["autos"]["object"], synth["autos"]["list"]
    v = a.vocab_size
    tables, bases = cd.pack_tables([a, b], v, SMALL_CAPS)
    dev = cd.to_device(tables)
    for auto, base in zip((a, b), bases):
        states = rng.integers(0, auto.num_states, 400)
        tokens = rng.integers(0, v, 400)
        exc_states = np.repeat(np.arange(auto.num_states), np.diff(auto.exc_offsets))
        states = np.concatenate([states, exc_states])
        tokens = np.concatenate([tokens, auto.exc_tokens])
        want_ok = np.array([auto.is_allowed(int(s), int(t)) for s, t in zip(states, tokens)])
        got_ok = np.asarray(cd.allowed_bits(dev, jnp.asarray(states + base), jnp.asarray(tokens)))
        np.testing.assert_array_equal(got_ok, want_ok)
        want_next = np.array([host_next(auto, int(s))[t] for s, t in zip(states, tokens)]) + base
        got_next = np.asarray(cd.next_state(dev, jnp.asarray(states + base), jnp.asarray(tokens)))
        np.testing.assert_array_equal(got_next[want_ok], want_next[want_ok])
        masks = np.asarray(cd.allowed_mask(dev, jnp.asarray(np.arange(auto.num_states) + base)))
        np.testing.assert_array_equal(masks, np.stack([auto.allowed_tokens(s) for s in range(auto.num_states)]))
    free = jnp.full((5,), cd.FREE_STATE)
    assert bool(jnp.all(cd.allowed_mask(dev, free)))
    assert bool(jnp.all(cd.next_state(dev, free, jnp.asarray(rng.integers(0, v, 5))) == cd.FREE_STATE))


def test_tables_over_the_caps_are_refused_naming_the_cap(synth):
    a = synth["autos"]["object"]
    with pytest.raises(ConstraintTooLarge, match="states cap"):
        cd.pack_tables([a], a.vocab_size, cd.TableCaps(states=a.num_states, exceptions=1 << 12))
    with pytest.raises(ConstraintTooLarge, match="exceptions cap"):
        cd.pack_tables([a], a.vocab_size, cd.TableCaps(states=1 << 10, exceptions=a.exc_tokens.size - 1))
    with pytest.raises(ValueError, match="vocabulary of"):
        cd.pack_tables([a], a.vocab_size + 1)
    with pytest.raises(ValueError, match="constraint 1 must be"):
        synth["eng"].constraint_inputs([None, "not a spec"], 2)


# ---- the masked heap -----------------------------------------------------------------------------------------
def _draft_lists(rng, bt, depth, k, vocab, ties: bool):
    logits = rng.standard_normal((bt, depth, vocab)).astype(np.float32)
    if ties:  # equal log-probs exercise the rank-path tie rule
        logits = np.round(logits)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits), k)
    return np.asarray(lp), np.asarray(ids)


def _lookup(table: np.ndarray, state: int, token: int):
    return table[state, token].item()


def _dense_build(allowed: np.ndarray, nxt: np.ndarray, budget: int):
    """The masked heap over a dense automaton: allowed [S, V] bool, nxt [S, V] next states."""
    al, nx = jnp.asarray(allowed), jnp.asarray(nxt, jnp.int32)
    return jax.jit(functools.partial(tree_build_masked, budget=budget, allowed=lambda s, t: al[s, t],
                                     step=lambda s, t: nx[s, t]))


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_masked_tree_equals_heap_reference_and_kernel_when_all_allowed(ties, rng):
    """Random dense automata: the jnp heap equals the numpy heap (tokens, parents, depths, n_nodes, mask, states);
    with every token allowed it equals the Pallas kernel bit for bit."""
    bt, depth, k, vocab, n_states = 3, 4, 6, 24, 7
    for _ in range(3):
        budget = int(rng.integers(1, 24))
        lp, ids = _draft_lists(rng, bt, depth, k, vocab, ties)
        allowed = rng.random((n_states, vocab)) < 0.45
        nxt = rng.integers(0, n_states, (n_states, vocab))
        root, root_state = rng.integers(0, vocab, bt), rng.integers(0, n_states, bt)
        tree, states = _dense_build(allowed, nxt, budget)(lp, ids, root, root_state)
        want, want_states = tree_build_masked_ref(lp, ids, root, root_state, budget=budget,
                                                  is_allowed=functools.partial(_lookup, allowed),
                                                  next_state=functools.partial(_lookup, nxt))
        for name, got, exp in zip(want._fields, (tree.tokens, tree.parents, tree.depths, tree.n_nodes, tree.vis),
                                  want):
            np.testing.assert_array_equal(np.asarray(got), exp, err_msg=f"{name}, budget {budget}")
        np.testing.assert_array_equal(np.asarray(states), want_states)
        free, _ = _dense_build(np.ones_like(allowed), nxt, budget)(lp, ids, root, root_state)
        kernel = tree_build(lp, ids, root, budget=budget, interpret=True)
        for name in ("tokens", "parents", "depths", "n_nodes", "vis"):
            np.testing.assert_array_equal(np.asarray(getattr(free, name)), np.asarray(getattr(kernel, name)),
                                          err_msg=name)


def _invalid_nodes(tree, states, auto, base) -> int:
    """Real nodes whose token their parent's state does not allow, or whose state is not next(parent, token)."""
    tokens, parents, n_nodes = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.n_nodes))
    bad = 0
    for b in range(tokens.shape[0]):
        for i in range(1, int(n_nodes[b]) + 1):
            p_state, t = int(states[b, parents[b, i]]) - base, int(tokens[b, i])
            if not auto.is_allowed(p_state, t) or auto.next_state(p_state, t) != int(states[b, i]) - base:
                bad += 1
    return bad


def test_no_disallowed_node_enters_the_tree(synth, rng):
    """The round's tree under the packed tables (drafter-like lists from fresh random logits, roots in random
    reachable states): every real node is allowed in its parent's state and carries next(parent, token). The
    unconstrained kernel's tree of the same lists breaks that, so the check has something to catch."""
    auto = synth["autos"]["object"]
    v = auto.vocab_size
    tables, (base,) = cd.pack_tables([auto], v, SMALL_CAPS)
    dev = cd.to_device(tables)
    bt, depth, k, budget = 8, BLOCK - 1, 16, 24
    logits = rng.standard_normal((bt, depth, v)).astype(np.float32) * 3
    # bias toward the alphabet's one-byte tokens so that some drafted tokens are allowed
    logits[..., : len(ALPHABET)] += 2.5
    root_state = rng.integers(0, auto.num_states, bt) + base
    for b, state in enumerate(root_state):  # and one allowed token on top at depth 1, so no tree is only its root
        logits[b, 0, rng.choice(np.flatnonzero(auto.allowed_tokens(int(state - base))))] += 20
    lp, ids = (np.asarray(x) for x in jax.lax.top_k(jax.nn.log_softmax(logits), k))
    root = rng.integers(0, v, bt)
    build = jax.jit(functools.partial(tree_build_masked, budget=budget, allowed=functools.partial(cd.allowed_bits, dev),
                                      step=functools.partial(cd.next_state, dev)))
    tree, states = build(lp, ids, root, root_state)
    states = np.asarray(states)
    assert int(np.asarray(tree.n_nodes).sum()) > bt  # the trees are not just roots
    assert _invalid_nodes(tree, states, auto, base) == 0
    plain = tree_build(lp, ids, root, budget=budget, interpret=True)
    plain_states = np.zeros_like(states)
    plain_states[:, 0] = root_state
    for i in range(1, budget + 1):  # parents precede children, so one pass in slot order
        par = np.asarray(plain.parents)[:, i]
        plain_states[:, i] = np.asarray(cd.next_state(dev, jnp.asarray(plain_states[np.arange(bt), par]),
                                                      jnp.asarray(np.asarray(plain.tokens)[:, i])))
    assert _invalid_nodes(plain, plain_states, auto, base) > 0


# ---- the engine: exactness -----------------------------------------------------------------------------------
def _ref_steps(cfg, weights, prompt, auto, n):
    """[(token, top-2 gap among the allowed logits)] for n steps of constrained greedy AR in float64."""
    seq, state, steps = list(prompt), 0, []
    for _ in range(n):
        logits = reference_forward(cfg, weights, seq)[-1]
        ok = np.sort(logits[auto.allowed_tokens(state)])[::-1]
        gap = ok[0] - ok[1] if ok.size > 1 else np.inf
        t, state = constrained_greedy_step_ref(logits, state, auto.allowed, auto.default_next, auto.exc_offsets,
                                               auto.exc_tokens, auto.exc_next)
        seq.append(t)
        steps.append((t, gap))
    return steps


def _ar(synth, constraint):
    return synth["eng"].generate(synth["prompts"], NEW_TOKENS, mode="ar", constraint=constraint)


def test_constrained_greedy_ar_equals_reference_step(synth):
    """Engine mode ar under two automata and a free row in one batch = constrained_greedy_step_ref over float64
    reference logits, token for token (a float32/float64 near-tie may end the comparison of that row)."""
    autos = synth["autos"]
    cfg = synth["eng"].target.cfg
    weights = random_hf_weights(cfg, synth["seed"])
    got = _ar(synth, [autos["object"], autos["list"], None]).token_ids
    free = _ar(synth, None).token_ids
    assert got[2] == free[2]  # the free row decodes as without constraints
    assert got[0] != free[0]  # the constraint changed what the random model says
    compared = 0
    for row, auto in ((0, autos["object"]), (1, autos["list"])):
        for i, (t, gap) in enumerate(_ref_steps(cfg, weights, synth["prompts"][row], auto, NEW_TOKENS)):
            if got[row][i] != t:
                assert gap < NEAR_TIE, f"row {row} token {i}: engine {got[row][i]} != reference {t} (gap {gap:.2e})"
                break
            compared += 1
    assert compared >= NEW_TOKENS


def _in_language(toks, auto, ids, pattern) -> bool:
    """Every token allowed; where the walk ends in a final state, the text (stop tokens dropped) matches."""
    state = 0
    for t in ids:
        if not auto.is_allowed(state, t):
            return False
        state = auto.next_state(state, t)
    if auto.final[state]:
        text = b"".join(toks[t] for t in ids if t < len(toks)).decode()
        return re.fullmatch(pattern, text) is not None
    return True


def test_constrained_ddtree_and_chain_equal_constrained_ar(synth):
    """ddtree and chain under the same constraints give the constrained ar tokens; every row stays in its
    language, and a row that reached a final state spells a whole match."""
    autos = synth["autos"]
    constraint = [autos["object"], autos["list"], None]
    ar = _ar(synth, constraint)
    eng = synth["eng"]
    tree = eng.generate(synth["prompts"], NEW_TOKENS, mode="ddtree", budget=BUDGET, constraint=constraint)
    chain = eng.generate(synth["prompts"], NEW_TOKENS, mode="chain", constraint=constraint)
    assert tree.token_ids == ar.token_ids
    assert chain.token_ids == ar.token_ids
    for row, (auto, pattern) in enumerate(((autos["object"], REGEX_OBJECT), (autos["list"], REGEX_LIST))):
        assert _in_language(synth["toks"], auto, ar.token_ids[row], pattern)


COMPILES = CompileCounter()


REGEX_FORCED = r'\{"(bc|cb)":(true|[0-9]{1,2})\}'  # characters each spelled by one token of the alphabet


def test_forced_tokens_keep_ddtree_and_chain_equal_constrained_ar(synth):
    """Over the alphabet's one-byte tokens alone every literal character is a forced token, which the trees take
    without the drafter: ddtree and chain still give the constrained ar tokens, and the row spells a whole match."""
    eng, toks = synth["eng"], synth["toks"]
    v = eng.target.cfg.vocab_size
    auto = compile_constraint(ConstraintSpec.regex(REGEX_FORCED),
                              ConstraintVocabulary.from_token_bytes(toks[:len(ALPHABET)], v, (v - 2,)))
    assert (auto.forced >= 0).sum() >= 6
    constraint = [auto, synth["autos"]["list"], None]
    ar = _ar(synth, constraint)
    tree = eng.generate(synth["prompts"], NEW_TOKENS, mode="ddtree", budget=BUDGET, constraint=constraint)
    chain = eng.generate(synth["prompts"], NEW_TOKENS, mode="chain", constraint=constraint)
    assert tree.token_ids == ar.token_ids
    assert chain.token_ids == ar.token_ids
    assert _in_language(toks, auto, ar.token_ids[0], REGEX_FORCED)
    assert v - 2 in ar.token_ids[0]  # it reached a final state (whose only token is the stop id): a whole match


def test_schemas_are_data_no_recompile(synth):
    """After one constrained ddtree run, other automata (alone, swapped between rows, mixed with free rows) and a
    different regex compile nothing: no trace, no backend compile."""
    autos, eng = synth["autos"], synth["eng"]
    run = functools.partial(eng.generate, synth["prompts"], NEW_TOKENS, mode="ddtree", budget=BUDGET)
    run(constraint=[autos["object"], autos["list"], None])  # warm-up (the equality test's program)
    other = compile_constraint(ConstraintSpec.regex(r"(ab|ba|c)+[0-9]"), ConstraintVocabulary.from_token_bytes(
        synth["toks"], eng.target.cfg.vocab_size, (eng.target.cfg.vocab_size - 2,)))
    with COMPILES.count() as events:
        outs = [run(constraint=c) for c in ([autos["list"], None, autos["object"]], [None, other, other],
                                             autos["object"])]
    assert events == [], events
    assert outs[0].token_ids[0] != outs[2].token_ids[0]  # the swapped automaton did change row 0


# ---- sampling ------------------------------------------------------------------------------------------------
def _masked_probs(logits, auto, state, temperature, top_p):
    x = np.where(auto.allowed_tokens(state), logits, -np.inf)
    return nucleus_probs(x, temperature, top_p)


def masked_pair_distribution(cfg, seed, prompt, auto, temperature, top_p):
    """P(t2, t3) of constrained sampling from the start state, summed over t1, from the float64 reference."""
    weights = random_hf_weights(cfg, seed)
    v = cfg.vocab_size

    def probs(seq, state):
        return _masked_probs(reference_forward(cfg, weights, seq)[-1], auto, state, temperature, top_p)

    out = np.zeros((v, v))
    p1 = probs(prompt, 0)
    for a in np.flatnonzero(p1):
        s1 = auto.next_state(0, int(a))
        p2 = probs(prompt + [int(a)], s1)
        for b in np.flatnonzero(p2):
            s2 = auto.next_state(s1, int(b))
            out[b] += p1[a] * p2[b] * probs(prompt + [int(a), int(b)], s2)
    return out


def test_constrained_sampling_matches_masked_target_distribution(rng):
    """Chi-square: (t2, t3) of constrained ddtree sampling ~ the target's masked, filtered distribution."""
    v = 6
    cfg = config.tiny(vocab_size=v, eos_token_id=())
    seed = int(rng.integers(1 << 30))
    target = init_random(cfg, seed=seed)
    drafter = random_drafter(drafter_config(cfg, block_size=BLOCK), seed, scale=3.0)
    eng = Engine(target, drafter, None, use_pallas=False)
    eng.constraint_caps = cd.TableCaps(states=16, exceptions=64)
    vocab = ConstraintVocabulary.from_token_bytes([b"a", b"b", b"ab", b"ba"], v, (4,))
    auto = compile_constraint(ConstraintSpec.regex(r"(a|bb?a)+b?"), vocab)
    allowed_sets = {tuple(np.flatnonzero(auto.allowed_tokens(s))) for s in range(auto.num_states)}
    assert len(allowed_sets) > 2  # the states allow different tokens
    prompt = rng.integers(0, v, size=4).tolist()
    temperature, top_p = 1.5, 0.95
    expected = masked_pair_distribution(cfg, seed, prompt, auto, temperature, top_p)
    counts = np.zeros((v, v))
    batch, calls, deep = 512, 4, 0
    for _ in range(calls):
        out = eng.generate([prompt] * batch, 3, mode="ddtree", budget=8, temperature=temperature, top_p=top_p,
                           seed=[int(rng.integers(1 << 30)) for _ in range(batch)], constraint=auto)
        deep += sum(any(a >= 2 for a in o.accept_lengths) for o in out.outputs)
        for o in out.outputs:
            _walk(auto, o.token_ids)  # every token allowed
            counts[o.token_ids[1], o.token_ids[2]] += 1
    assert deep > 0  # some draws went through an accepted draft node
    assert_same_distribution(counts, expected)


def _walk(auto, ids) -> int:
    state = 0
    for t in ids:
        assert auto.is_allowed(state, t), f"token {t} not allowed in state {state}"
        state = auto.next_state(state, t)
    return state


# ---- the shipped trained pair --------------------------------------------------------------------------------
SHIPPED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["def", "class", "import"]},
    "doc": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}}, "required": ["name", "kind", "doc", "ok"]}


@pytest.mark.heavy
def test_shipped_pair_constrained_ddtree_equals_constrained_ar_and_validates():
    """The trained pair under a JSON schema: ddtree = ar token for token, mean acceptance > 1, and every output
    that stopped parses and validates (at least one does)."""
    eng = Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f][:3]
    prompts = [eng.tokenizer.encode(t)[:n] for t, n in zip(texts, (40, 25, 33))]
    constraint = ConstraintSpec.json_schema(SHIPPED_SCHEMA)
    ar = eng.generate(prompts, 72, mode="ar", constraint=constraint)
    tree = eng.generate(prompts, 72, mode="ddtree", budget=16, constraint=constraint)
    free = eng.generate(prompts, 72, mode="ddtree", budget=16)
    print(f"mean acceptance: constrained {tree.stats.mean_acceptance_length:.2f}, "
          f"unconstrained {free.stats.mean_acceptance_length:.2f}")
    assert tree.token_ids == ar.token_ids
    assert tree.stats.mean_acceptance_length > 1.0
    stopped = [o for o in ar.outputs if o.finish_reason == "stop"]
    assert stopped
    for o in stopped:
        text = eng.tokenizer.decode(o.token_ids[:-1])
        jsonschema.validate(json.loads(text), SHIPPED_SCHEMA)
