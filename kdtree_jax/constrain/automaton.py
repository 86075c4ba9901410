"""Structured output: a regex, a JSON schema, `json_object` or a choice list -> a token-level automaton over the
model's vocabulary, as numpy tables a device step can index (`constrain_ref.py` is their decoding rule).

outlines-core turns the constraint into a regex (JSON schemas through `schema_regex.py`, which enforces every
keyword of the schema or refuses it) and walks every token's bytes through the regex's DFA. The result is
flattened into `TokenAutomaton`:

- `allowed [S, W] uint32`, W = ceil(V / 32): bit `t % 32` of word `t // 32` of row s is set iff token t may follow
  in state s. Stop tokens are allowed exactly in final states (the text so far is a whole match).
- the transition `next(s, t)` of an allowed token is `default_next[s]` unless t is one of state s's exceptions:
  `exc_tokens[exc_offsets[s]:exc_offsets[s + 1]]` (ascending) with states `exc_next[...]`. The default is the most
  common target of the state's tokens (inside a JSON string nearly every token stays in the string), so the
  exceptions are few where a dense `[S, V]` table would be 640 KiB a state at Kimi's V = 163,840.
- `final [S] bool`; state 0 is the start. A stop token leaves the state unchanged.

Special tokens never spell constrained text, except the ones a constraint names as `markers`: marker i is spelled by
the control character chr(MARKER_CHAR_BASE + i) in the regex and in a vocabulary built for those markers, where the
special token is that character and every ordinary token containing one of the marker characters is left out. So a
marker matches only its special token, never ordinary text spelling the same characters, and JSON (whose strings
and structure never hold raw control characters) loses no token to it. Kimi's tool-call section is a regex of this
kind (`<|tool_call_begin|>` and the rest are special tokens around JSON arguments).

States are capped (`MAX_STATES`, per compile: the device tables' default budget) because each costs V / 8 bytes of
mask; past the cap the compile fails with a `ConstraintTooLarge` that names the constraint. Compiled automata are
cached by the constraint's text. The compile reads outlines-core's transitions (a million entries for a schema of
real size) with C iterators and packs them with one sort; outlines-core's index and its transitions dict are most
of the time.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING

from kdtree_jax.constrain.regex_pieces import literal
from kdtree_jax.constrain.schema_regex import schema_to_regex

WORD_BITS = 32
MAX_STATES = 8192  # default cap, the device tables' default budget: 8192 states x 20 KiB of mask at V = 163,840
CACHE_ENTRIES = 64  # compiled automata kept by the compiler (least recently used dropped first)
JSON_WHITESPACE = r"[ ]?"  # between JSON tokens: one optional space keeps automata small and output compact
JSON_OBJECT_DEPTH = 2  # `json_object`: objects / arrays nest this deep in all (a regex has no stack; 3 compiles 40x slower)
DENSE_IDS_MAX = 1 << 26  # outlines-core state ids up to this are renumbered through a lookup table (else sorted)
SPEC_PREVIEW_CHARS = 120  # how much of a constraint's text an error message quotes
KINDS = ("regex", "json_schema", "json_object", "choice")
MARKER_CHAR_BASE = 0x01  # marker i of a constraint is chr(MARKER_CHAR_BASE + i): control characters JSON never holds
MAX_MARKERS = 8  # \x01..\x08
# characters that have a meaning in outlines-core's (Rust) regex syntax, escaped in choice literals


class ConstraintTooLarge(ValueError):
    """The automaton has more states than the cap allows."""


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """What to constrain to; `text` is the cache key (a schema's JSON text as given: property order matters)."""

    kind: str  # one of KINDS
    text: str  # regex pattern, schema JSON, "" for json_object, JSON list of choices
    markers: tuple[str, ...] = ()  # special tokens the regex spells as `marker(i)` (module docstring)

    @classmethod
    def regex(cls, pattern: str, markers: Sequence[str] = ()) -> ConstraintSpec:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex: must be a non-empty string, got {pattern!r}")
        if len(markers) > MAX_MARKERS or len(set(markers)) != len(markers):
            raise ValueError(f"regex: at most {MAX_MARKERS} distinct markers, got {tuple(markers)!r}")
        return cls("regex", pattern, tuple(markers))

    @staticmethod
    def marker(i: int) -> str:
        """The regex that matches marker i (the special token `markers[i]`)."""
        return f"\\x{{{MARKER_CHAR_BASE + i:02X}}}"

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> ConstraintSpec:
        if isinstance(schema, dict):
            return cls("json_schema", json.dumps(schema))
        if not isinstance(schema, str):
            raise ValueError(f"json_schema: must be a JSON object or its text, got {type(schema).__name__}")
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not valid JSON ({e})") from e
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"json_schema: must be a JSON object, got {type(parsed).__name__}")
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        return cls("json_object", "")

    @classmethod
    def choice(cls, choices: Sequence[str]) -> ConstraintSpec:
        if (isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise ValueError(f"choice: must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    def describe(self) -> str:
        text = self.text if len(self.text) <= SPEC_PREVIEW_CHARS else self.text[:SPEC_PREVIEW_CHARS] + "..."
        return f"{self.kind} {text!r}" if text else self.kind

    def to_regex(self) -> str:
        """The regex outlines-core compiles; a ValueError names the constraint when it cannot be translated."""
        if self.kind == "regex":
            return self.text
        if self.kind == "choice":
            return "|".join(literal(c) for c in json.loads(self.text))
        if self.kind == "json_object":
            return _json_object_regex(JSON_OBJECT_DEPTH)
        if self.kind == "json_schema":
            try:
                return schema_to_regex(json.loads(self.text), JSON_WHITESPACE)
            except ValueError as e:
                raise ValueError(f"json_schema: {e}") from e
        raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")


def spec_from_response_format(response_format: Any) -> ConstraintSpec | None:
    """OpenAI's `response_format` ({type: text | json_object | json_schema, json_schema: {name, schema}}) -> a
    spec, or None for plain text; a ValueError names the field that is wrong."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec.json_object()
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema"), (dict, str)):
            raise ValueError("response_format.json_schema.schema: a JSON schema object is required")
        try:
            return ConstraintSpec.json_schema(body["schema"])
        except ValueError as e:
            raise ValueError(f"response_format.{e}") from e
    raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _json_object_regex(depth: int) -> str:
    """A JSON object nesting objects and arrays `depth` levels deep in all (itself the first)."""
    ws = JSON_WHITESPACE

    def obj(value: str) -> str:
        member = f"{STRING}{ws}:{ws}{value}"
        return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"

    def array(value: str) -> str:
        return rf"\[{ws}(?:{value}(?:{ws},{ws}{value})*)?{ws}\]"

    value = f"(?:{STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    for _ in range(depth - 1):
        value = f"(?:{value}|{obj(value)}|{array(value)})"
    return obj(value)


@dataclasses.dataclass(frozen=True, eq=False)
class ConstraintVocabulary:
    """The model's vocabulary as outlines-core sees it: the bytes of every ordinary token (special tokens never
    spell constrained text unless a constraint names them as markers), plus the stop tokens a final state allows."""

    vocab_size: int
    stop_ids: tuple[int, ...]
    index_vocab: Vocabulary
    by_bytes: dict[bytes, list[int]] = dataclasses.field(default_factory=dict, repr=False)
    special_ids: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)  # marker name -> token id
    _with_markers: dict = dataclasses.field(default_factory=dict, repr=False)  # markers -> Vocabulary

    @classmethod
    def from_token_bytes(cls, token_bytes: Sequence[bytes], vocab_size: int, stop_ids: Sequence[int],
                         special_ids: dict[str, int] | None = None) -> ConstraintVocabulary:
        """`token_bytes[i]` spells token i (ids past len(token_bytes) are special); stop ids lie in
        [len(token_bytes), vocab_size); `special_ids`: the special tokens a constraint may name as markers."""
        if not stop_ids or not all(len(token_bytes) <= s < vocab_size for s in stop_ids):
            raise ValueError(f"stop_ids {tuple(stop_ids)} must be special ids in [{len(token_bytes)}, {vocab_size})")
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b:
                by_bytes.setdefault(b, []).append(i)
        specials = {k: v for k, v in (special_ids or {}).items() if v not in stop_ids}
        return cls(vocab_size, tuple(sorted(stop_ids)), Vocabulary(min(stop_ids), by_bytes), by_bytes, specials)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ConstraintVocabulary:
        """From a `KimiTokenizer`: ordinary tokens below its special base, its chat stop ids, its special tokens."""
        return cls.from_token_bytes([tokenizer.token_bytes(i) for i in range(tokenizer.special_base)],
                                    tokenizer.vocab_size, tokenizer.stop_token_ids, dict(tokenizer.special_tokens))

    def for_markers(self, markers: tuple[str, ...]) -> Vocabulary:
        """The index vocabulary in which marker i is the special token markers[i], spelled chr(MARKER_CHAR_BASE + i),
        and no ordinary token holds a marker character."""
        if not markers:
            return self.index_vocab
        if markers not in self._with_markers:
            missing = [m for m in markers if m not in self.special_ids]
            if missing:
                raise ValueError(f"markers {missing} are not special tokens of this vocabulary (stop tokens cannot "
                                 f"be markers)")
            chars = {MARKER_CHAR_BASE + i for i in range(len(markers))}
            by_bytes = {b: ids for b, ids in self.by_bytes.items() if not chars.intersection(b)}
            for i, m in enumerate(markers):
                by_bytes[bytes([MARKER_CHAR_BASE + i])] = [self.special_ids[m]]
            self._with_markers[markers] = Vocabulary(min(self.stop_ids), by_bytes)
        return self._with_markers[markers]


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A compiled constraint (layout in the module docstring). Start state 0."""

    spec: ConstraintSpec
    vocab_size: int
    stop_ids: tuple[int, ...]
    allowed: np.ndarray  # [S, ceil(V/32)] uint32 bitmask of allowed tokens
    default_next: np.ndarray  # [S] int32
    exc_offsets: np.ndarray  # [S + 1] int32
    exc_tokens: np.ndarray  # [E] int32, ascending within a state
    exc_next: np.ndarray  # [E] int32
    final: np.ndarray  # [S] bool

    @property
    def num_states(self) -> int:
        return self.final.shape[0]

    @functools.cached_property
    def forced(self) -> np.ndarray:
        """[S] int32: the one token a state allows where it allows exactly one and that is no stop token (the
        text there is forced: a tree takes it without the drafter), else -1."""
        one = np.bitwise_count(self.allowed).sum(axis=1) == 1
        word = np.argmax(self.allowed != 0, axis=1)
        bits = self.allowed[np.arange(self.num_states), word]
        token = word.astype(np.int64) * WORD_BITS + np.log2(np.maximum(bits, 1)).astype(np.int64)
        forced = one & ~np.isin(token, self.stop_ids)
        return np.where(forced, token, -1).astype(np.int32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.allowed, self.default_next, self.exc_offsets, self.exc_tokens,
                                      self.exc_next, self.final))

    def allowed_tokens(self, state: int) -> np.ndarray:
        """[V] bool."""
        bits = np.unpackbits(self.allowed[state].view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def is_allowed(self, state: int, token: int) -> bool:
        return bool((int(self.allowed[state, token // WORD_BITS]) >> (token % WORD_BITS)) & 1)

    def next_state(self, state: int, token: int) -> int:
        if not self.is_allowed(state, token):
            raise ValueError(f"token {token} is not allowed in state {state} of {self.spec.describe()}")
        lo, hi = int(self.exc_offsets[state]), int(self.exc_offsets[state + 1])
        at = lo + int(np.searchsorted(self.exc_tokens[lo:hi], token))
        return int(self.exc_next[at]) if at < hi and self.exc_tokens[at] == token else int(self.default_next[state])

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether the tokens spell a whole match (a trailing stop token is allowed)."""
        state = 0
        for t in tokens:
            if not self.is_allowed(state, int(t)):
                return False
            state = self.next_state(state, int(t))
        return bool(self.final[state])


def compile_constraint(spec: ConstraintSpec, vocab: ConstraintVocabulary, max_states: int = MAX_STATES
                       ) -> TokenAutomaton:
    """Build the token automaton of `spec` over `vocab`; ValueError (naming the constraint) when the pattern is
    invalid, matches nothing, or needs more than `max_states` states."""
    pattern = spec.to_regex()  # its ValueError names the constraint already
    try:
        index = Index(anchored_regex(pattern), vocab.for_markers(spec.markers))
    except ValueError as e:
        raise ValueError(f"{spec.kind}: cannot be compiled ({e}): {spec.describe()}") from e
    edges = _Edges.of(index.get_transitions(), min(vocab.stop_ids))
    order = edges.reachable(index.get_initial_state())
    if len(order) > max_states:
        raise ConstraintTooLarge(f"{spec.describe()}: the automaton has {len(order)} states, over the cap of "
                                 f"{max_states} (kdtree_jax.constrain.automaton.MAX_STATES)")
    final = np.array([index.is_final_state(int(s)) for s in edges.ids[order]], dtype=bool)
    number = np.full(edges.ids.size, -1, np.int64)
    number[order] = np.arange(len(order))
    src, dst = number[edges.src], number[edges.dst]
    live = src >= 0  # edges out of unreachable states (their targets are reachable where their source is)
    stops = np.array(vocab.stop_ids, np.int32)
    at_final = np.repeat(np.flatnonzero(final), len(stops))  # a stop token ends the text where it is
    automaton = _pack(spec, vocab, final, np.concatenate([src[live], at_final]),
                      np.concatenate([edges.tok[live], np.tile(stops, int(final.sum()))]),
                      np.concatenate([dst[live], at_final]))
    if not automaton.allowed[0].any():
        raise ValueError(f"{spec.kind}: no token sequence of this vocabulary matches {spec.describe()}")
    return automaton


def anchored_regex(pattern: str) -> str:
    """`pattern` anchored at the end of the text. outlines-core's index (0.2.14) leaves out tokens that step from a
    final state into a non-final one unless the pattern is anchored: `a( b)*` would never allow " " after "a"."""
    return f"(?:{pattern})$"


@dataclasses.dataclass(frozen=True)
class _Edges:
    """outlines-core's transitions ({state: {token: state}}, a million entries for a schema of real size) as flat
    arrays, read by C iterators (no Python step per edge); states are indices into `ids`, outlines-core's ids."""

    ids: np.ndarray  # [n] int64 outlines-core state ids, ascending
    src: np.ndarray  # [E] int64
    tok: np.ndarray  # [E] int32
    dst: np.ndarray  # [E] int64

    @classmethod
    def of(cls, transitions: dict[int, dict[int, int]], drop_token: int) -> _Edges:
        n_edges = sum(map(len, transitions.values()))
        raw_src = np.repeat(np.fromiter(transitions.keys(), np.int64, len(transitions)),
                            np.fromiter(map(len, transitions.values()), np.int64, len(transitions)))
        tok = np.fromiter(itertools.chain.from_iterable(transitions.values()), np.int32, n_edges)
        raw_dst = np.fromiter(itertools.chain.from_iterable(map(dict.values, transitions.values())), np.int64,
                              n_edges)
        keep = tok != drop_token
        raw_src, tok, raw_dst = raw_src[keep], tok[keep], raw_dst[keep]
        sources = np.fromiter(transitions.keys(), np.int64, len(transitions))
        top = int(max(sources.max(initial=0), raw_dst.max(initial=0)))
        if top > DENSE_IDS_MAX:  # sparse ids: sort them
            ids = np.unique(np.concatenate([sources, raw_dst]))
            return cls(ids, np.searchsorted(ids, raw_src), tok, np.searchsorted(ids, raw_dst))
        present = np.zeros(top + 1, bool)
        present[sources] = True
        present[raw_dst] = True
        ids = np.flatnonzero(present)
        index = np.zeros(top + 1, np.int64)
        index[ids] = np.arange(ids.size)
        return cls(ids, index[raw_src], tok, index[raw_dst])

    def reachable(self, initial: int) -> np.ndarray:
        """The state indices reachable from `initial`, breadth first (the start first), over the distinct
        (source, target) pairs: a few per state, where the edges are hundreds."""
        n = self.ids.size
        pairs = np.unique(self.src * n + self.dst)
        offsets = np.searchsorted(pairs // n, np.arange(n + 1))
        targets = (pairs % n).tolist()
        start = int(np.searchsorted(self.ids, initial))
        order, seen, queue = [], {start}, collections.deque([start])
        while queue:
            s = queue.popleft()
            order.append(s)
            for t in targets[offsets[s]:offsets[s + 1]]:
                if t not in seen:
                    seen.add(t)
                    queue.append(t)
        return np.array(order, np.int64)


def _pack(spec: ConstraintSpec, vocab: ConstraintVocabulary, final: np.ndarray, src: np.ndarray, tok: np.ndarray,
          dst: np.ndarray) -> TokenAutomaton:
    """Edges (src, tok, dst) -> bitmask + default target + sorted exceptions."""
    n_states, words, v = final.shape[0], -(-vocab.vocab_size // WORD_BITS), vocab.vocab_size
    src, tok, dst = src.astype(np.int64, copy=False), tok.astype(np.int64), dst.astype(np.int64, copy=False)
    # edges by (state, token): one sort of (key << 32 | target), keys < 2**31 (the device tables' int32 keys)
    key = src * v + tok
    if n_states * v < 2**31:
        packed = np.sort(key << 32 | dst)
        key, dst = packed >> 32, packed & 0xFFFFFFFF
    else:
        by_key = np.argsort(key)
        key, dst = key[by_key], dst[by_key]
    src, tok = key // v, key % v
    allowed = np.zeros((n_states, words), np.uint32)
    word = src * words + tok // WORD_BITS  # ascending with the key
    if word.size:
        starts = np.flatnonzero(np.concatenate([[True], word[1:] != word[:-1]]))
        bits = np.left_shift(np.uint32(1), (tok % WORD_BITS).astype(np.uint32))
        allowed.reshape(-1)[word[starts]] = np.bitwise_or.reduceat(bits, starts)
    # default target per state: the most frequent (src, dst) pair's dst (the lowest dst among equals)
    pairs, counts = np.unique(src * n_states + dst, return_counts=True)
    by_count = np.lexsort((-counts, pairs // n_states))  # per state, most frequent first
    first = np.unique(pairs[by_count] // n_states, return_index=True)[1]
    default_next = np.full(n_states, -1, np.int32)
    default_next[(pairs[by_count] // n_states)[first]] = (pairs[by_count] % n_states)[first]
    exc = dst != default_next[src]
    exc_src, exc_tokens, exc_next = src[exc], tok[exc], dst[exc]  # ascending by (state, token) already
    exc_offsets = np.searchsorted(exc_src, np.arange(n_states + 1)).astype(np.int32)
    return TokenAutomaton(spec, vocab.vocab_size, vocab.stop_ids, allowed, default_next, exc_offsets,
                          exc_tokens.astype(np.int32), exc_next.astype(np.int32), final)


class ConstraintCompiler:
    """Compiles constraints over one vocabulary and keeps the last `cache_entries` automata, keyed by the
    constraint's kind and text. Thread-safe (the server compiles off its event loop)."""

    def __init__(self, vocab: ConstraintVocabulary, max_states: int = MAX_STATES,
                 cache_entries: int = CACHE_ENTRIES):
        self.vocab, self.max_states, self.cache_entries = vocab, max_states, cache_entries
        self._cache: collections.OrderedDict[ConstraintSpec, TokenAutomaton] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: ConstraintSpec) -> TokenAutomaton:
        key = spec  # frozen: kind, text and markers are its value
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        automaton = compile_constraint(spec, self.vocab, self.max_states)
        with self._lock:
            self.misses += 1
            self._cache[key] = automaton
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return automaton
