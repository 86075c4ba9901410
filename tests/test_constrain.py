"""Constraint compiler over the kdtree-mini vocabulary: token sequences the automaton accepts parse and validate
(jsonschema), valid instances are accepted and invalid ones refused, the tables agree with outlines-core's index and
with an independent regex prefix check on fresh random walks, errors name the field, the state cap, the cache, and
the float64 greedy step against a plain loop."""
from __future__ import annotations

import json
import os

import jsonschema
import numpy as np
import pytest
import regex
from outlines_core import Index

from kdtree_jax.checkpoint.tokenizer import KimiTokenizer
from kdtree_jax.constrain.automaton import (
    ConstraintCompiler,
    ConstraintSpec,
    ConstraintTooLarge,
    ConstraintVocabulary,
    anchored_regex,
    compile_constraint,
    spec_from_response_format,
)
from kdtree_jax.oracles.constrain_ref import allowed_mask_ref, constrained_greedy_step_ref

MINI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints", "kdtree-mini", "tokenizer")
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
               "required": ["city"]}
RICH_SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
    "required": ["n", "ok", "where"]}
MAX_WALK_TOKENS = 300  # past this a walk heads for the nearest final state


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer.from_dir(MINI)


@pytest.fixture(scope="module")
def vocab(tok) -> ConstraintVocabulary:
    return ConstraintVocabulary.from_tokenizer(tok)


@pytest.fixture(scope="module")
def compiler(vocab) -> ConstraintCompiler:
    return ConstraintCompiler(vocab)


def next_states(a, state: int) -> np.ndarray:
    """[V] next state of every token from `state` (meaningful where allowed)."""
    out = np.full(a.vocab_size, a.default_next[state], np.int64)
    lo, hi = a.exc_offsets[state], a.exc_offsets[state + 1]
    out[a.exc_tokens[lo:hi]] = a.exc_next[lo:hi]
    return out


def distance_to_final(a) -> np.ndarray:
    dist = np.where(a.final, 0, np.iinfo(np.int64).max)
    for _ in range(a.num_states):
        changed = False
        for s in range(a.num_states):
            ok = a.allowed_tokens(s)
            if ok.any():
                d = dist[next_states(a, s)[ok]].min()
                if d < np.iinfo(np.int64).max and d + 1 < dist[s]:
                    dist[s], changed = d + 1, True
        if not changed:
            return dist
    return dist


def random_walk(a, rng, dist, explore: float = 0.6) -> tuple[list[int], list[int]]:
    """(tokens, states visited before each token): random allowed tokens, heading for a final state with
    probability 1 - explore (always after MAX_WALK_TOKENS); ends with a stop token."""
    state, tokens, states = 0, [], []
    stops = set(a.stop_ids)
    while True:
        ok = np.array([t for t in np.flatnonzero(a.allowed_tokens(state)) if t not in stops], np.int64)
        if a.final[state] and (not ok.size or rng.random() < 0.25 or len(tokens) > MAX_WALK_TOKENS):
            states.append(state)
            tokens.append(a.stop_ids[int(rng.integers(len(a.stop_ids)))])
            return tokens, states
        nxt = next_states(a, state)[ok]
        if rng.random() < explore and len(tokens) <= MAX_WALK_TOKENS:
            pick = int(rng.integers(len(ok)))
        else:
            best = np.flatnonzero(dist[nxt] == dist[nxt].min())
            pick = int(best[rng.integers(len(best))])
        states.append(state)
        tokens.append(int(ok[pick]))
        state = int(nxt[pick])


@pytest.mark.parametrize("schema", [TOOL_SCHEMA, RICH_SCHEMA], ids=["tool", "rich"])
def test_accepted_token_sequences_parse_and_validate(schema, compiler, tok, rng):
    a = compiler.compile(ConstraintSpec.json_schema(schema))
    dist = distance_to_final(a)
    for _ in range(40):
        tokens, _ = random_walk(a, rng, dist)
        assert a.accepts(tokens) and tokens[-1] in tok.stop_token_ids
        text = tok.decode(tokens[:-1])
        jsonschema.validate(json.loads(text), schema)


def random_city(rng) -> str:
    """outlines-core's JSON string has no `\\uXXXX` escape: other control characters than \\n, \\t, ... and ASCII-only
    spellings of other characters are outside it, so the instances use raw UTF-8."""
    alphabet = ['a', 'Z', ' ', '"', '\\', '/', '\n', '\t', '\r', 'é', '你', '🙂', "'", '{', '}']
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=int(rng.integers(0, 12))))


def test_valid_instances_accepted_invalid_refused(compiler, tok, rng):
    a = compiler.compile(ConstraintSpec.json_schema(TOOL_SCHEMA))
    stop = tok.stop_token_ids[0]
    for _ in range(60):
        inst = {"city": random_city(rng)}
        if rng.integers(2):
            inst["unit"] = ["c", "f"][rng.integers(2)]
        seps = [(",", ":"), (", ", ": ")][rng.integers(2)]
        text = json.dumps(inst, separators=seps, ensure_ascii=False)
        jsonschema.validate(json.loads(text), TOOL_SCHEMA)
        ids = tok.encode(text, allow_special=False)
        assert a.accepts(ids) and a.accepts([*ids, stop]), text
        assert not a.accepts(ids[:-1]), text  # a proper prefix is not a whole match
    for bad in ['{"unit":"c"}', '{"city":"x","unit":"k"}', '{"city":"x","other":1}', '{"city":"x"} ',
                '{"city":3}', '{"city":"x"}{', '["x"]']:
        assert not a.accepts(tok.encode(bad, allow_special=False)), bad


@pytest.mark.parametrize("spec", [ConstraintSpec.json_schema(TOOL_SCHEMA), ConstraintSpec.json_object(),
                                  ConstraintSpec.regex(r"(ab|a\.c)[0-9]{2,4}( [a-z]+)*")],
                         ids=["schema", "json_object", "regex"])
def test_tables_agree_with_outlines_index(spec, compiler, vocab, rng):
    """Walk random token sequences through our tables and through outlines-core's index side by side: the allowed
    set (whole vocabulary) and the next state agree at every step."""
    a = compiler.compile(spec)
    index = Index(anchored_regex(spec.to_regex()), vocab.index_vocab)
    eos = min(a.stop_ids)
    dist = distance_to_final(a)
    for _ in range(8):
        tokens, _ = random_walk(a, rng, dist)
        ours, theirs = 0, index.get_initial_state()
        for t in tokens[:-1]:
            expect = np.zeros(a.vocab_size, bool)
            expect[[x for x in index.get_allowed_tokens(theirs) if x != eos]] = True
            if index.is_final_state(theirs):
                expect[list(a.stop_ids)] = True
            np.testing.assert_array_equal(a.allowed_tokens(ours), expect)
            ours, theirs = a.next_state(ours, t), index.get_next_state(theirs, t)
            assert bool(a.final[ours]) == index.is_final_state(theirs)


@pytest.mark.parametrize("spec", [ConstraintSpec.json_schema(TOOL_SCHEMA), ConstraintSpec.json_object()],
                         ids=["schema", "json_object"])
def test_default_target_is_the_most_common(spec, compiler):
    """The exceptions list only the tokens that leave the state's most common target (the compact layout)."""
    a = compiler.compile(spec)
    for s in range(a.num_states):
        ok = a.allowed_tokens(s)
        _, counts = np.unique(next_states(a, s)[ok], return_counts=True)
        assert a.exc_offsets[s + 1] - a.exc_offsets[s] == ok.sum() - counts.max()


def test_final_state_can_continue_through_a_non_final_one(compiler, tok):
    """After "12" (a whole match) the token " " (not yet a match) must stay allowed: outlines-core's index drops
    such steps unless the pattern is anchored."""
    a = compiler.compile(ConstraintSpec.regex(r"[0-9]+( [a-z]+)*"))
    ids = tok.encode("12", allow_special=False)
    space, letters = tok.encode(" ", allow_special=False), tok.encode("ab", allow_special=False)
    assert a.accepts(ids) and a.accepts(ids + space + letters) and not a.accepts(ids + space)


@pytest.mark.parametrize("spec", [ConstraintSpec.json_schema(TOOL_SCHEMA), ConstraintSpec.json_object(),
                                  ConstraintSpec.regex(r"(ab|a\.c)[0-9]{2,4}( [a-z]+)*"),
                                  ConstraintSpec.choice(["yes", "no", "a.b (c)?", "1+1"])],
                         ids=["schema", "json_object", "regex", "choice"])
def test_allowed_tokens_match_regex_prefix_check(spec, compiler, tok, rng):
    """Independent check with the `regex` module's partial matching: token t is allowed after the text so far iff
    text + t can still grow into a whole match (fresh random walks; tokens drawn half allowed, half from all)."""
    a = compiler.compile(spec)
    rx = regex.compile(spec.to_regex())
    dist = distance_to_final(a)
    checked = 0
    for _ in range(12):
        tokens, states = random_walk(a, rng, dist)
        prefix = b""
        for t, s in zip(tokens[:-1], states[:-1]):
            ok = np.flatnonzero(a.allowed_tokens(s))
            ok = ok[ok < tok.special_base]
            for cand in [*rng.choice(ok, size=min(8, len(ok)), replace=False),
                         *rng.integers(0, tok.special_base, size=8)]:
                try:
                    text = (prefix + tok.token_bytes(int(cand))).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                viable = rx.fullmatch(text, partial=True) is not None
                assert a.is_allowed(s, int(cand)) == viable, (text, int(cand))
                checked += 1
            prefix += tok.token_bytes(t)
        text = prefix.decode("utf-8")
        assert rx.fullmatch(text), text
    assert checked > 60


def test_choice_accepts_exactly_the_choices(compiler, tok):
    choices = ["yes", "no", "a.b (c)?", "1+1", "maybe\n"]
    a = compiler.compile(ConstraintSpec.choice(choices))
    for c in choices:
        assert a.accepts(tok.encode(c, allow_special=False)), c
    for c in ["ye", "yes ", "nono", "a.b (c)", "2"]:
        assert not a.accepts(tok.encode(c, allow_special=False)), c


# ---- errors, cap, cache ----

@pytest.mark.parametrize("make, field", [
    (lambda: ConstraintSpec.regex("a(b"), "regex"),
    (lambda: ConstraintSpec.regex(""), "regex"),
    (lambda: ConstraintSpec.json_schema("{not json"), "json_schema"),
    (lambda: ConstraintSpec.json_schema('{"type": "frob"}'), "json_schema"),
    (lambda: ConstraintSpec.json_schema({"$ref": "#/nowhere"}), "json_schema"),
    (lambda: ConstraintSpec.json_schema("[1]"), "json_schema"),
    (lambda: ConstraintSpec.choice([]), "choice"),
    (lambda: ConstraintSpec.choice("yes"), "choice"),
    (lambda: spec_from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}),
     r"response_format\.json_schema\.schema"),
    (lambda: spec_from_response_format({"type": "json_schema", "json_schema": {"schema": "{bad"}}),
     r"response_format\.json_schema"),
    (lambda: spec_from_response_format({"type": "yaml"}), r"response_format\.type"),
])
def test_invalid_constraints_name_the_field(make, field, vocab):
    with pytest.raises(ValueError, match=field):
        compile_constraint(make(), vocab)


def test_response_format_mapping():
    assert spec_from_response_format(None) is None
    assert spec_from_response_format({"type": "text"}) is None
    assert spec_from_response_format({"type": "json_object"}) == ConstraintSpec.json_object()
    assert spec_from_response_format({"type": "json_schema", "json_schema": {"name": "w", "schema": TOOL_SCHEMA}}) \
        == ConstraintSpec.json_schema(TOOL_SCHEMA)


def test_state_cap_names_the_schema(vocab):
    spec = ConstraintSpec.json_schema(TOOL_SCHEMA)
    n = compile_constraint(spec, vocab).num_states
    assert compile_constraint(spec, vocab, max_states=n).num_states == n
    with pytest.raises(ConstraintTooLarge, match=rf'json_schema .*"city".*{n} states, over the cap of {n - 1}'):
        compile_constraint(spec, vocab, max_states=n - 1)


def test_cache_by_text(vocab):
    compiler = ConstraintCompiler(vocab, cache_entries=2)
    a = compiler.compile(ConstraintSpec.json_schema(TOOL_SCHEMA))
    assert compiler.compile(ConstraintSpec.json_schema(json.dumps(TOOL_SCHEMA))) is a
    assert (compiler.hits, compiler.misses) == (1, 1)
    spaced = compiler.compile(ConstraintSpec.json_schema(json.dumps(TOOL_SCHEMA, indent=1)))
    assert spaced is not a and (compiler.hits, compiler.misses) == (1, 2)  # keyed by the text as given
    compiler.compile(ConstraintSpec.choice(["x"]))  # evicts the least recently used (the first schema)
    assert compiler.compile(ConstraintSpec.json_schema(TOOL_SCHEMA)) is not a


# ---- greedy step reference ----

def greedy_loop(logits, state, a):
    best, best_t = None, None
    for t in range(a.vocab_size):
        if a.is_allowed(state, t):
            v = -np.inf if np.isnan(logits[t]) else logits[t]
            if best is None or v > best:
                best, best_t = v, t
    return best_t, a.next_state(state, best_t)


def tables(a):
    return a.allowed, a.default_next, a.exc_offsets, a.exc_tokens, a.exc_next


def test_greedy_step_matches_loop(compiler, rng):
    a = compiler.compile(ConstraintSpec.json_schema(TOOL_SCHEMA))
    batch = 6
    logits = rng.standard_normal((batch, a.vocab_size)) * 4
    logits[0, :] = np.round(logits[0, :])  # many ties
    logits[1, rng.integers(0, a.vocab_size, 500)] = np.nan
    logits[2, :] = -np.inf
    states = rng.integers(0, a.num_states, batch)
    tokens, nxt = constrained_greedy_step_ref(logits.astype(np.float32), states, *tables(a))
    for b in range(batch):
        assert (tokens[b], nxt[b]) == greedy_loop(logits[b].astype(np.float32).astype(np.float64), states[b], a)
        assert a.is_allowed(states[b], tokens[b])
    t0, n0 = constrained_greedy_step_ref(logits[3], int(states[3]), *tables(a))
    assert (t0, n0) == (tokens[3], nxt[3])


def test_greedy_step_masks_the_unconstrained_argmax(compiler, tok):
    a = compiler.compile(ConstraintSpec.choice(["yes", "no"]))
    logits = np.zeros(a.vocab_size)
    logits[tok.encode("maybe", False)[0]] = 100.0
    yes = tok.encode("yes", False)[0]
    logits[yes] = 1.0
    token, state = constrained_greedy_step_ref(logits, 0, *tables(a))
    assert token == yes and state == a.next_state(0, yes)


def test_greedy_step_refuses_a_state_without_tokens():
    allowed = np.zeros((2, 2), np.uint32)
    allowed[0, 1] = 1 << 3  # token 35
    args = (allowed, np.array([1, -1], np.int32), np.zeros(3, np.int32), np.zeros(0, np.int32),
            np.zeros(0, np.int32))
    assert constrained_greedy_step_ref(np.zeros(64), 0, *args) == (35, 1)
    with pytest.raises(ValueError, match=r"states \[1\] allow no token"):
        constrained_greedy_step_ref(np.zeros((1, 64)), np.array([1]), *args)


def test_mask_unpacking_bit_order(rng):
    words = rng.integers(0, 2**32, size=(3, 5), dtype=np.uint64).astype(np.uint32)
    mask = allowed_mask_ref(words, 150)
    for s in range(3):
        for t in range(150):
            assert mask[s, t] == bool((int(words[s, t // 32]) >> (t % 32)) & 1)
