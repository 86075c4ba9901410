"""JSON schemas keep every promise: each keyword is enforced by the token automaton or refused with a 400 naming the
keyword and its path, never ignored. Bound regexes equal their bounds exactly; random walks of each keyword's
automaton over the shipped vocabulary, and the shipped pair's greedy and sampled outputs with and without a tree,
validate with `jsonschema` (formats checked); invalid and unsupported schemas are 400s on every field that takes
one; a server that does not speculate reports no speculative figures."""
from __future__ import annotations

import decimal
import json
import os
import re
import time

import jsonschema
import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_agent_api import MODEL, USER, ScriptedFront

from kdtree_jax.checkpoint.tokenizer import KimiTokenizer
from kdtree_jax.constrain import regex_pieces, schema_regex
from kdtree_jax.constrain.automaton import ConstraintCompiler, ConstraintSpec, ConstraintVocabulary
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.server import constraints as agent_constraints
from kdtree_jax.serving import RequestRecord, ServeConfig
from kdtree_jax.serving.request import TokenDelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
KIMI_VOCAB = 163_840
WALKS = 60  # random walks per automaton
JSON_NUMERAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")
SEEDS = 6  # sampled generations per schema, beside the greedy one


def _object(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# one schema per keyword group of OpenAI's strict structured outputs
SCHEMAS = {
    "integer_bounds": _object(n={"type": "integer", "minimum": 0, "maximum": 99},
                              m={"type": "integer", "minimum": -20, "maximum": -3},
                              e={"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 10},
                              k={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    "number_bounds": _object(x={"type": "number", "minimum": -1.5, "maximum": 2.25},
                             y={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    "dates": _object(d={"type": "string", "format": "date"}, t={"type": "string", "format": "time"},
                     dt={"type": "string", "format": "date-time"}, p={"type": "string", "format": "duration"}),
    "addresses": _object(a={"type": "string", "format": "ipv4"}, b={"type": "string", "format": "ipv6"},
                         h={"type": "string", "format": "hostname"}),
    "ids": _object(e={"type": "string", "format": "email"}, u={"type": "string", "format": "uuid"}),
    "shapes": {**_object(code={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                         tags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                         v={"anyOf": [{"const": "none"}, {"$ref": "#/$defs/pt"}]}),
               "$defs": {"pt": _object(q={"type": "integer", "minimum": 1, "maximum": 9})}},
}
VOLUME = _object(level={"type": "integer", "minimum": 1, "maximum": 11}, unit={"enum": ["db", "percent"]})
TOOLS = [{"type": "function", "function": {"name": "set_volume", "parameters": VOLUME}}]


def _validate(value, schema) -> None:
    jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)


@pytest.fixture(scope="module")
def tokenizer() -> KimiTokenizer:
    return KimiTokenizer.from_dir(os.path.join(SHIPPED, "tokenizer"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(ConstraintVocabulary.from_tokenizer(tokenizer))


# ---- bounds: exact ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_integer_ranges_match_exactly_the_integers_between_their_bounds():
    """Every integer in a window, both signs, against random bounds (either side may be open); no leading zero."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    window = [str(x) for x in range(-1300, 1300)] + ["123456789", "-123456789"]
    for _ in range(60):
        lo, hi = (None if rng.random() < 0.25 else int(rng.integers(-1200, 1200)) for _ in range(2))
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        r = re.compile(regex_pieces.integer_range(lo, hi))
        for s in window:
            want = (lo is None or int(s) >= lo) and (hi is None or int(s) <= hi)
            assert bool(r.fullmatch(s)) == want, (lo, hi, s)
        assert not any(r.fullmatch(s) for s in ("01", "00", "-01", "-0", "1e2", "+1"))


@pytest.mark.timeout(60)
def test_number_ranges_match_exactly_the_decimals_between_their_bounds():
    """Decimals around random inclusive / exclusive bounds (their neighbours, trailing zeros, -0) match iff they
    lie between them."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    D = decimal.Decimal

    def draw():
        return D(int(rng.integers(-3000, 3000))) / D(int(rng.choice([1, 10, 100, 1000])))

    for _ in range(150):
        lo, hi = (None if rng.random() < 0.25 else (draw(), bool(rng.random() < 0.5)) for _ in range(2))
        if lo is not None and hi is not None and lo[0] > hi[0]:
            lo, hi = hi, lo
        rx = regex_pieces.number_range(lo, hi)
        values = {draw() for _ in range(80)} | {D(0)}
        for b in (lo, hi):
            if b is not None:
                values |= {b[0] + d for d in (D(0), D("0.001"), D("-0.001"), D("0.00001"), D("-0.00001"))}
        def between(v):
            return ((lo is None or v > lo[0] or (lo[1] and v == lo[0]))
                    and (hi is None or v < hi[0] or (hi[1] and v == hi[0])))

        for v in values:
            if rx is None:
                assert not between(v), (lo, hi, v)
                continue
            for s in {format(v, "f"), format(v, "f") + ("0" if "." in format(v, "f") else ".0"),
                      format(v.normalize(), "f")}:
                want = between(D(s))
                if not JSON_NUMERAL.fullmatch(s):
                    continue
                if s.startswith("-") and D(s) == 0:
                    assert not re.fullmatch(rx, s) or want, (lo, hi, s)
                    continue
                assert bool(re.fullmatch(rx, s)) == want, (lo, hi, s)


# ---- every keyword enforced or refused ----------------------------------------------------------------------------
def _readme_table() -> dict[str, str]:
    """keyword -> enforced | refused | annotation, from the README's keyword table."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    table = text.split("| keyword | treatment |", 1)[1].split("\n\n", 1)[0]
    out = {}
    for row in table.strip().splitlines()[1:]:
        keys, treatment = row.strip("|").split("|", 1)
        for k in re.findall(r"`([^`]+)`", keys):
            out[k] = re.match(r"\w+", treatment.strip()).group(0)
    return out


@pytest.mark.timeout(30)
def test_readme_keyword_table_is_the_code():
    assert _readme_table() == schema_regex.KEYWORDS


REFUSED_EXAMPLES = {  # a schema for each refused keyword (at a nested path)
    "uniqueItems": {"type": "array", "uniqueItems": True}, "not": {"not": {"type": "string"}},
    "if": {"if": {"type": "string"}, "then": {"maxLength": 2}}, "then": {"then": {"maxLength": 2}},
    "else": {"else": {"maxLength": 2}}, "allOf": {"allOf": [{"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "patternProperties": {"type": "object", "patternProperties": {"^a": {"type": "string"}}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 3}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    "dependencies": {"type": "object", "dependencies": {"a": ["b"]}},
    "minProperties": {"type": "object", "minProperties": 1}, "maxProperties": {"type": "object", "maxProperties": 1},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
    "unevaluatedItems": {"type": "array", "unevaluatedItems": False},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}]},
    "additionalItems": {"type": "array", "additionalItems": False}, "contains": {"type": "array", "contains": {}},
    "minContains": {"type": "array", "contains": {}, "minContains": 2},
    "maxContains": {"type": "array", "contains": {}, "maxContains": 2},
    "$dynamicRef": {"$dynamicRef": "#x"}, "$dynamicAnchor": {"$dynamicAnchor": "x"},
    "$recursiveRef": {"$recursiveRef": "#"}, "$recursiveAnchor": {"$recursiveAnchor": "x"},
    "$anchor": {"$anchor": "x"}, "$id": {"$id": "https://example.com/s"}, "$vocabulary": {"$vocabulary": {}},
    "contentSchema": {"type": "string", "contentSchema": {}},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keyword", sorted(k for k, v in schema_regex.KEYWORDS.items() if v == "refused"))
def test_each_refused_keyword_is_refused_naming_it_and_its_path(keyword):
    sub = REFUSED_EXAMPLES[keyword]
    schema = {"type": "object", "properties": {"x": sub}, "required": ["x"]}
    with pytest.raises(ValueError) as e:
        ConstraintSpec.json_schema(schema).to_regex()
    first = next(k for k in sub if schema_regex.KEYWORDS.get(k) == "refused")
    assert f"#/properties/x/{first}: {first}" in str(e.value), str(e.value)


UNSUPPORTED = {  # schema -> (path, words the message must hold)
    "unknown_keyword": ({"type": "object", "properties": {"a": {"type": "string", "nullable": True}}},
                        "#/properties/a/nullable", "nullable"),
    "unbounded_multiple": ({"type": "integer", "multipleOf": 5}, "#/multipleOf", "finite minimum and maximum"),
    "too_many_multiples": ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10 ** 5}, "#/multipleOf",
                           "cap"),
    "fractional_step": ({"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 1}, "#/multipleOf",
                        "integer step"),
    "bound_too_long": ({"type": "number", "minimum": 1e-30}, "#/minimum", "digits"),
    "empty_range": ({"type": "integer", "exclusiveMinimum": 3, "maximum": 3}, "#/minimum", "no integer"),
    "format_unknown": ({"type": "string", "format": "uri"}, "#/format", "uri"),
    "pattern_lookbehind": ({"type": "string", "pattern": "(?<=a)b"}, "#/pattern", "not supported"),
    "pattern_and_length": ({"type": "string", "pattern": "a+", "maxLength": 3}, "#/maxLength", "beside pattern"),
    "recursive_ref": ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
        "c": {"$ref": "#/$defs/n"}}}}}, "#/$defs/n/properties/c/$ref", "recursive"),
    "sibling_of_anyof": ({"type": "string", "anyOf": [{"maxLength": 2}]}, "#/type", "beside anyOf"),
}
INVALID = {  # breaks the metaschema: (schema, path)
    "minimum_not_a_number": ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "zero"}}},
                             "#/properties/n/minimum"),
    "required_not_a_list": ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": "n"},
                            "#/required"),
    "type_unknown": ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "#/properties/a/type"),
    "negative_max_items": ({"type": "array", "maxItems": -1}, "#/maxItems"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(UNSUPPORTED) + sorted(INVALID))
def test_unsupported_or_invalid_schemas_are_refused_naming_the_path(case):
    schema, path, *words = UNSUPPORTED.get(case) or INVALID[case]
    with pytest.raises(ValueError) as e:
        ConstraintSpec.json_schema(schema).to_regex()
    assert f"{path}:" in str(e.value), str(e.value)
    assert all(w in str(e.value) for w in words) and (case in UNSUPPORTED or "invalid schema" in str(e.value))


def _bodies(schema) -> dict[str, tuple[dict, str]]:
    """Every request field that takes a schema -> (extra body, the field a 400 names)."""
    return {"response_format": ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}}}, "response_format"),
            "structured_outputs": ({"structured_outputs": {"json": schema}}, "structured_outputs"),
            "tool_parameters": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                                 "tool_choice": {"type": "function", "function": {"name": "f"}}},
                                "tools[0].function.parameters")}


@pytest.mark.timeout(120)
def test_every_schema_field_answers_400_naming_the_keyword_and_path(tokenizer):
    """Invalid and unsupported schemas (uniqueItems, not, if, patternProperties among them) in response_format,
    structured_outputs and a tool's parameters: each a 400 in OpenAI's shape naming the field, the path and the
    keyword; none reaches the engine."""
    front = ScriptedFront(tokenizer, ServeConfig(num_pages=4))
    app = build_app(front, tokenizer, ServerSettings(model_names=(MODEL,), tool_call_parser="kimi_k2"))
    cases = [(s, p, p.rsplit("/", 1)[-1]) for s, p, *_ in UNSUPPORTED.values()] + [
        (s, p, "invalid schema") for s, p in INVALID.values()] + [
        ({"type": "object", "properties": {"x": REFUSED_EXAMPLES[k]}}, f"#/properties/x/{k}", k)
        for k in ("uniqueItems", "not", "if", "patternProperties")]
    with TestClient(app) as http:
        for schema, path, keyword in cases:
            for extra, field in _bodies(schema).values():
                r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **extra})
                assert r.status_code == 400, (field, schema, r.text)
                error = r.json()["error"]
                assert error["param"] == field and error["message"].startswith(field), error
                assert path in error["message"] and keyword in error["message"], error
    assert front.params == []


# ---- every enforced keyword: automata and outputs validate ---------------------------------------------------------
def _walk(automaton, rng, stop_ids, max_steps: int = 400) -> list[int] | None:
    """Random allowed tokens from the start until a stop token is drawn (None: no stop within max_steps)."""
    state, out = 0, []
    for _ in range(max_steps):
        allowed = np.flatnonzero(automaton.allowed_tokens(state))
        stops = [t for t in allowed if t in stop_ids]
        if stops and (rng.random() < 0.3 or len(stops) == len(allowed)):
            return out
        t = int(rng.choice([t for t in allowed if t not in stop_ids]))
        out.append(t)
        state = automaton.next_state(state, t)
    return None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_of_each_keywords_automaton_validate(name, tokenizer, compiler):
    """Any token path the automaton allows to a stop spells JSON that validates, formats included; and the
    automaton's tables at Kimi's V = 163,840 fit the device's default caps."""
    schema = SCHEMAS[name]
    automaton = compiler.compile(ConstraintSpec.json_schema(schema))
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    stop = set(compiler.vocab.stop_ids)
    done = 0
    for _ in range(WALKS):
        ids = _walk(automaton, rng, stop)
        if ids is None:
            continue
        _validate(json.loads(tokenizer.decode(ids)), schema)
        done += 1
    assert done >= WALKS // 2
    mask_bytes = automaton.num_states * KIMI_VOCAB // 8
    print(f"{name}: {automaton.num_states} states, {automaton.exc_tokens.size} exceptions, "
          f"{mask_bytes / 2 ** 20:.1f} MiB of masks at V = {KIMI_VOCAB}")
    assert automaton.num_states < 512


@pytest.mark.timeout(60)
def test_bounds_cost_few_states(compiler):
    """Integer bounds cost states by the digits of the bound, not its size: [0, 10^15] is a few dozen states
    (about 20 KiB of mask each at V = 163,840), and enumerated multiples stay under the default cap."""
    plain = compiler.compile(ConstraintSpec.json_schema({"type": "integer"})).num_states
    wide = compiler.compile(ConstraintSpec.json_schema({"type": "integer", "minimum": -10 ** 15,
                                                        "maximum": 10 ** 15})).num_states
    steps = compiler.compile(ConstraintSpec.json_schema({"type": "integer", "multipleOf": 7, "minimum": 0,
                                                         "maximum": 7 * (schema_regex.MAX_MULTIPLES - 1)})).num_states
    assert plain < wide < 64 and steps < 256, (plain, wide, steps)


@pytest.mark.timeout(60)
def test_enum_keeps_only_values_the_rest_of_the_schema_allows(compiler, tokenizer):
    automaton = compiler.compile(ConstraintSpec.json_schema({"type": "integer", "enum": [1, 5, "x", 50],
                                                             "maximum": 9}))
    stop = [compiler.vocab.stop_ids[0]]
    assert automaton.accepts(tokenizer.encode("5") + stop)
    assert not automaton.accepts(tokenizer.encode("50") + stop)
    assert not automaton.accepts(tokenizer.encode('"x"') + stop)


@pytest.fixture(scope="module")
def shipped():
    from kdtree_jax.decode.engine import Engine

    eng = Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        text = json.loads(f.readline())["text"]
    return eng, eng.tokenizer.encode(text)[:24]


def _arguments(tokenizer, ids: list[int]) -> list[str]:
    """The argument texts of a tool-call section's calls (between its argument-begin and call-end markers)."""
    begin = tokenizer.special_id(agent_constraints.ARGUMENT_BEGIN)
    end = tokenizer.special_id(agent_constraints.CALL_END)
    out, at = [], None
    for i, t in enumerate(ids):
        if t == begin:
            at = i + 1
        elif t == end and at is not None:
            out.append(tokenizer.decode(ids[at:i]))
            at = None
    return out


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_shipped_pair_outputs_validate_greedy_and_sampled_with_and_without_a_tree(shipped):
    """Each schema, and a named tool's call, greedy and under SEEDS seeds, in ar, chain (greedy) and ddtree: every
    output stops and validates with jsonschema (formats checked); the tree's tokens equal ar's."""
    eng, prompt = shipped
    tool = agent_constraints.tool_call_spec(agent_constraints.declared_tools(TOOLS), "set_volume", parallel=True)
    rows = {**{name: ConstraintSpec.json_schema(s) for name, s in SCHEMAS.items()}, "tool": tool}
    runs = {}
    for temperature, seeds in ((0.0, [0]), (1.0, list(range(1, SEEDS + 1)))):
        batch = [(name, seed) for name in rows for seed in seeds]
        kw = {"temperature": temperature, "seed": [s for _, s in batch], "constraint": [rows[n] for n, _ in batch]}
        modes = [("ar", {}), ("ddtree", {"budget": 8})] + ([("chain", {})] if temperature == 0 else [])
        for mode, extra in modes:
            t0 = time.perf_counter()
            out = eng.generate([prompt] * len(batch), 96, mode=mode, **kw, **extra)
            runs[mode, temperature] = out.token_ids
            print(f"{mode} T={temperature}: {time.perf_counter() - t0:.1f}s")
            for (name, seed), o in zip(batch, out.outputs):
                assert o.finish_reason == "stop", (mode, name, seed, eng.tokenizer.decode(o.token_ids))
                if name == "tool":
                    args = _arguments(eng.tokenizer, o.token_ids)
                    assert len(args) == 1, eng.tokenizer.decode(o.token_ids)
                    _validate(json.loads(args[0]), VOLUME)
                else:
                    _validate(json.loads(eng.tokenizer.decode(o.token_ids[:-1])), SCHEMAS[name])
    assert runs["ddtree", 0.0] == runs["ar", 0.0] == runs["chain", 0.0]
    assert runs["ddtree", 1.0] == runs["ar", 1.0]


# ---- truthful figures ------------------------------------------------------------------------------------------
class CountingFront(ScriptedFront):
    """A scripted front whose records say every token came from its own round (as a mode-ar engine reports)."""

    def _post(self, msg: tuple) -> None:
        if msg[0] != "submit":
            return
        _, rid, ids, params = msg
        self.params.append(params)
        out = self.tokenizer.encode("yes<|im_end|>")
        events = [TokenDelta(rid, out, time.perf_counter()),
                  RequestRecord(rid, out, "stop", len(ids), [1] * len(out), 0)]
        self._loop.call_soon(self._push_events, events)


def _spec_counters(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^kdtree:(spec_decode_\w+)_total\{[^}]*\} (\S+)$",
                                                                text, re.M)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_speculative_figures_only_where_the_server_speculates(mode, tokenizer):
    """Mode ar: no response (whole or streamed) carries spec_decode and /metrics lists no speculative counter;
    ddtree: both report the rounds."""
    front = CountingFront(tokenizer, ServeConfig(num_pages=4, mode=mode))
    app = build_app(front, tokenizer, ServerSettings(model_names=(MODEL,)))
    with TestClient(app) as http:
        whole = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).json()
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "Is it?"}).json()
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        counters = _spec_counters(http.get("/metrics").text)
    carried = ["spec_decode" in whole, "spec_decode" in done, any("spec_decode" in c for c in chunks)]
    if mode == "ar":
        assert carried == [False, False, False], (whole, done, chunks)
        assert counters == {}, counters
    else:
        assert carried == [True, True, True]
        assert whole["spec_decode"]["num_spec_steps"] == len(tokenizer.encode("yes<|im_end|>"))
        assert counters["spec_decode_num_drafts"] == 3 * len(tokenizer.encode("yes<|im_end|>")), counters
