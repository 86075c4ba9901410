"""Constraint tables of real size: the device tables grow by bucket (the first bucket doubled, at most the budget)
with lookups equal to the host automaton, a program compiles once per bucket, a constraint past the budget is
refused naming it (a 400 on the server); an 8-item array and agent tool schemas (nested objects, bounded arrays,
enums, 22 properties) compile, fit the default budget, and their automata's walks and the shipped pair's outputs
validate with `jsonschema`."""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_agent_api import MODEL, USER, ScriptedFront
from test_constrain_schema import _walk, compiler, tokenizer  # noqa: F401  (module fixtures)
from test_constrained_decoding import host_next

from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import ConstraintSpec, ConstraintTooLarge, ConstraintVocabulary, compile_constraint
from kdtree_jax.decode.engine import Engine
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.server import constraints as agent_constraints
from kdtree_jax.serving import ServeConfig

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "kdtree-mini")
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
COMPILE_CPU_S = 1.5  # per schema, CPU seconds of this process (outlines-core's index is most of it: see the README)
WALKS = 8


def _object(required=None, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def _text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


DATE = {"type": "string", "format": "date"}
ARRAY_OF_8 = {"type": "array", "minItems": 8, "maxItems": 8, "items": _object(n=_int(0, 99), s=_text(12))}
TOOL_SCHEMAS = {
    "create_event": _object(
        title=_text(40), date=DATE, start={"type": "string", "format": "time"}, duration_minutes=_int(5, 480),
        attendees={"type": "array", "maxItems": 4, "items": _object(
            name=_text(24), email={"type": "string", "format": "email"}, optional={"type": "boolean"})},
        location=_object(["name"], name=_text(32), room={"anyOf": [_text(8), {"type": "null"}]}),
        reminder={"enum": ["none", "5m", "15m", "1h", "1d"]}, visibility={"enum": ["public", "private"]},
        recurrence={"anyOf": [{"type": "null"}, _object(freq={"enum": ["daily", "weekly", "monthly"]},
                                                          count=_int(1, 30))]}),
    "search_flights": _object(
        origin={"type": "string", "pattern": "^[A-Z]{3}$"}, destination={"type": "string", "pattern": "^[A-Z]{3}$"},
        depart=DATE, ret={"anyOf": [DATE, {"type": "null"}]},
        passengers=_object(adults=_int(1, 9), children=_int(0, 8), infants=_int(0, 4)),
        cabin={"enum": ["economy", "premium_economy", "business", "first"]}, max_stops=_int(0, 3),
        max_price={"type": "number", "minimum": 0, "maximum": 20000}, flexible_days=_int(0, 7),
        airlines={"type": "array", "maxItems": 3, "items": {"type": "string", "pattern": "^[A-Z0-9]{2}$"}},
        sort={"enum": ["price", "duration", "departure"]}),
    "update_contact": _object(  # 22 properties
        ["id"], id=_int(1, 999999), first_name=_text(20), last_name=_text(20),
        email={"type": "string", "format": "email"}, phone={"type": "string", "pattern": "^\\+?[0-9]{7,15}$"},
        company=_text(30), title=_text(30),
        department={"enum": ["sales", "engineering", "support", "marketing", "finance", "hr"]},
        status={"enum": ["lead", "prospect", "customer", "churned"]}, score=_int(0, 100),
        newsletter={"type": "boolean"}, country={"type": "string", "pattern": "^[A-Z]{2}$"}, city=_text(24),
        street=_text(40), postal_code={"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
        birthday={"anyOf": [DATE, {"type": "null"}]},
        tags={"type": "array", "maxItems": 5, "items": {"enum": ["vip", "partner", "trial", "enterprise", "smb"]}},
        owner_id=_int(1, 9999), language={"enum": ["en", "fr", "de", "es", "ja", "zh"]},
        timezone={"type": "string", "pattern": "^[A-Za-z]+/[A-Za-z_]+$"}, notes=_text(60),
        do_not_call={"type": "boolean"}),
    "edit_files": _object(
        edits={"type": "array", "minItems": 1, "maxItems": 3, "items": _object(
            path={"type": "string", "pattern": "^[a-z0-9_/]{1,40}\\.py$"}, old=_text(40), new=_text(40))},
        message=_text(50), dry_run={"type": "boolean"}),
    "query_db": _object(
        table={"enum": ["users", "orders", "items", "events"]},
        filters={"type": "array", "maxItems": 3, "items": _object(
            column=_text(16), op={"enum": ["=", "!=", "<", ">", "<=", ">=", "like"]},
            value={"anyOf": [_text(20), _int(-10 ** 6, 10 ** 6), {"type": "boolean"}, {"type": "null"}]})},
        order_by={"anyOf": [{"type": "null"}, _object(column=_text(16), descending={"type": "boolean"})]},
        limit=_int(1, 1000)),
}
REAL_SIZE = {"array_of_8": ARRAY_OF_8, **TOOL_SCHEMAS}


# ---- buckets and the budget ------------------------------------------------------------------------------------
def _counting_vocab(rng) -> ConstraintVocabulary:
    """Tokens of one to three letters of "ab" in a fresh order, "c", and a stop id: `[ab]{0,n}c` has n + 2 states
    whose tokens lead to different states by their length (exceptions in every state)."""
    words = ["".join("ab"[i] for i in p) for n in (1, 2, 3) for p in np.ndindex(*(2,) * n)]
    toks = [w.encode() for w in rng.permutation(words)] + [b"c"]
    return ConstraintVocabulary.from_token_bytes(toks, len(toks) + 2, (len(toks),))


@jax.jit
def _lookups(tables: cd.AutomatonTables, states: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[S, V] allowed tokens and next states of `states`."""
    return cd.allowed_mask(tables, states), cd.next_state(tables, states[:, None],
                                                          jnp.arange(tables.vocab_size)[None, :])


@pytest.mark.timeout(60)
def test_tables_grow_by_bucket_to_the_budget_and_equal_the_host_automata():
    """Buckets 4, 8, 16, 32, then the budget of 40 states (not a power of two); exceptions likewise; every state's
    allowed tokens and next states on the device equal the host automaton's, and past the budget the refusal names
    it."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    vocab = _counting_vocab(rng)
    v = vocab.vocab_size
    caps = cd.TableCaps(states=40, exceptions=2000, states_bucket=4, exceptions_bucket=8)
    seen = set()
    for lengths in ([0], [1, 2], [10], [3, 9], [20], [14, 18]):
        automata = [compile_constraint(ConstraintSpec.regex(f"[ab]{{0,{n}}}c"), vocab) for n in lengths]
        tables, bases = cd.pack_tables(automata, v, caps)
        need_states = 1 + sum(a.num_states for a in automata)
        need_exc = sum(a.exc_tokens.size for a in automata)
        n_states, n_exc = cd.table_shape(tables)
        assert n_states == min(40, 4 * 2 ** int(np.ceil(np.log2(max(need_states / 4, 1))))), (lengths, n_states)
        assert n_exc == min(2000, 8 * 2 ** int(np.ceil(np.log2(max(need_exc / 8, 1))))), (lengths, n_exc)
        seen.add(n_states)
        # every state of the tables at once (one compile per bucket): the automata's, then the padding's
        masks, got = (np.asarray(x) for x in _lookups(cd.to_device(tables), jnp.arange(caps.states) % n_states))
        for a, base in zip(automata, bases):
            at = slice(base, base + a.num_states)
            np.testing.assert_array_equal(masks[at], np.stack([a.allowed_tokens(s) for s in range(a.num_states)]))
            want = np.stack([host_next(a, s) for s in range(a.num_states)]) + base
            np.testing.assert_array_equal(np.where(masks[at], got[at], -1), np.where(masks[at], want, -1))
        assert masks[need_states:n_states].all() and (got[need_states:n_states] == cd.FREE_STATE).all()
    assert seen == {4, 8, 16, 32, 40}, seen
    too_big = compile_constraint(ConstraintSpec.regex("[ab]{0,39}c"), vocab)  # 41 states
    with pytest.raises(ConstraintTooLarge, match=r"states cap of 40 \(the constraint table budget: "
                                                 r"--constraint-states, ServeConfig.constraint_states"):
        cd.pack_tables([too_big], v, caps)
    problem = cd.TableLayout(v, caps).fits_alone(too_big)
    assert "table budget of 40 states" in problem and "ServeConfig.constraint_states" in problem, problem
    with pytest.raises(ConstraintTooLarge, match="exceptions cap of 50 .*constraint_exceptions"):
        cd.pack_tables([compile_constraint(ConstraintSpec.regex("[ab]{0,20}c"), vocab)], v,
                       cd.TableCaps(states=40, exceptions=50, states_bucket=4, exceptions_bucket=8))


@pytest.mark.timeout(60)
def test_a_schema_past_the_budget_is_a_400_naming_it(tokenizer):
    """The server's tables budget (--constraint-states) refuses the 8-item array with a 400 on the field
    that carries it, its message naming the budget; the default budget takes it."""
    for states, status in ((512, 400), (cd.STATES_CAP, 200)):
        front = ScriptedFront(tokenizer, ServeConfig(num_pages=4, constraint_states=states))
        app = build_app(front, tokenizer, ServerSettings(model_names=(MODEL,)))
        body = {"model": MODEL, "messages": USER, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "rows", "schema": ARRAY_OF_8}}}
        with TestClient(app) as http:
            r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == status, r.text
        if status == 400:
            error = r.json()["error"]
            assert error["param"] == "response_format" and error["type"] == "invalid_request_error", error
            assert f"table budget of {states} states" in error["message"], error
            assert "--constraint-states" in error["message"], error
            assert front.params == []
        else:
            assert front.params[-1].constraint == ConstraintSpec.json_schema(ARRAY_OF_8)


# ---- schemas of real size ------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(REAL_SIZE))
def test_real_size_schemas_compile_fit_the_default_budget_and_walk_valid(name, tokenizer):
    """Each compiles within COMPILE_CPU_S, into more states than the first bucket holds (so the tables must grow)
    or fewer, within the default budget; its random walks validate (formats checked)."""
    vocab = ConstraintVocabulary.from_tokenizer(tokenizer)
    schema = REAL_SIZE[name]
    t0 = time.process_time()
    automaton = compile_constraint(ConstraintSpec.json_schema(schema), vocab)
    seconds = time.process_time() - t0
    tables, _ = cd.pack_tables([automaton], vocab.vocab_size)
    print(f"{name}: {automaton.num_states} states, {automaton.exc_tokens.size} exceptions, compiled in "
          f"{seconds * 1e3:.0f} ms of CPU; tables {cd.table_shape(tables)}")
    assert seconds < COMPILE_CPU_S, seconds
    assert cd.table_shape(tables)[0] >= 1 + automaton.num_states
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    done = 0
    for _ in range(WALKS):
        ids = _walk(automaton, rng, set(vocab.stop_ids), max_steps=3000)
        if ids is not None:
            jsonschema.validate(json.loads(tokenizer.decode(ids)), schema, format_checker=FORMAT_CHECKER)
            done += 1
    assert done >= WALKS // 2


@pytest.mark.timeout(60)
def test_the_8_item_array_needs_a_grown_table_and_agent_tools_compile_as_one_section(compiler):
    """The 8-item array is past the first bucket (it was refused by the fixed 1024-state tables); a required tool
    call over three of the tool schemas compiles and fits the default budget."""
    array = compiler.compile(ConstraintSpec.json_schema(ARRAY_OF_8))
    assert 1 + array.num_states > cd.STATES_BUCKET
    tools = {k: TOOL_SCHEMAS[k] for k in ("search_flights", "query_db", "create_event")}
    section = compiler.compile(agent_constraints.tool_call_spec(tools, None, parallel=False))
    tables, _ = cd.pack_tables([array, section], section.vocab_size)
    assert cd.table_shape(tables)[0] <= cd.STATES_CAP


@pytest.mark.timeout(300)
def test_shipped_pair_outputs_under_real_size_schemas_validate():
    """Greedy ddtree under the 8-item array and a nested tool schema in one batch: both stop, validate, and the
    tree accepts more than one token a round."""
    eng = Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        prompt = eng.tokenizer.encode(json.loads(f.readline())["text"])[:24]
    names = ["array_of_8", "query_db"]
    out = eng.generate([prompt] * len(names), 160, mode="ddtree", budget=8,
                       constraint=[ConstraintSpec.json_schema(REAL_SIZE[n]) for n in names])
    for name, o in zip(names, out.outputs):
        text = eng.tokenizer.decode(o.token_ids[:-1])
        assert o.finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), REAL_SIZE[name], format_checker=FORMAT_CHECKER)
    assert out.stats.mean_acceptance_length > 1.5, out.stats.mean_acceptance_length


class _RecordingEngine:
    """The runner's view of an engine: no mesh, no weights, and a compile that records its keys."""

    mesh = None
    weights = ({}, None)

    def __init__(self):
        self.keys: list = []

    def compile(self, fn, args, key, *, desc, donate=(), progress=None, options=None):
        self.keys.append((key, desc, cd.table_shape(args[2])))
        return (lambda *a: a), 0.0


@pytest.mark.timeout(60)
def test_serving_programs_compile_once_per_table_bucket():
    """The serving runner's step program: compiled for the first bucket at warm-up, once more for a larger bucket
    (its description names the tables), and not again when the tables come back to a bucket already compiled."""
    from kdtree_jax.decode.budget import StepKind
    from kdtree_jax.serving.runner import ModelRunner

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    vocab = _counting_vocab(rng)
    caps = cd.TableCaps(states=64, exceptions=4096, states_bucket=8, exceptions_bucket=4096)
    layout = cd.TableLayout(vocab.vocab_size, caps)
    engine = _RecordingEngine()
    runner = ModelRunner(engine, uses_drafter=False, new_table=lambda: jnp.zeros(1), prefill_specs={},
                         step_specs={(StepKind("ar"), 1): None}, rounds=1, page_table_width=1, max_slots=1,
                         rows_for=None, overlap=False, constraint_tables=layout.tables())
    runner.step_program((StepKind("ar"), 1))
    small = compile_constraint(ConstraintSpec.regex("[ab]{0,2}c"), vocab)
    large = compile_constraint(ConstraintSpec.regex("[ab]{0,20}c"), vocab)
    for spec_, automaton in ((small.spec, small), (large.spec, large)):
        layout.place(spec_, automaton)
        runner.set_tables(layout.tables())
        runner.step_program((StepKind("ar"), 1))
    layout.release(large.spec)
    layout.place(small.spec, small)  # a new placement: the tables come back to the first bucket
    runner.set_tables(layout.tables())
    runner.step_program((StepKind("ar"), 1))
    shapes = [shape for _, _, shape in engine.keys]
    assert shapes == [(8, 4096), (32, 4096)], engine.keys
    assert engine.keys[1][1].endswith("tables 32x4096") and engine.keys[1][0][-1] == (32, 4096), engine.keys
    assert cd.table_shape(runner.tables) == (8, 4096)
