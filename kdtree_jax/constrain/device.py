"""Token automata on the device: one table pytree that holds every constrained row's automaton, and the lookups a
round needs (the allowed bits of a node's state, the next state, masked logits).

Layout (`AutomatonTables`; the automaton is data, not a constant). The tables are padded to a bucket: the first
bucket (`STATES_BUCKET` states, `EXCEPTIONS_BUCKET` exceptions) doubled until what the live automata need fits, and at
most the caps (`STATES_CAP`, `EXCEPTIONS_CAP`: the budget; a constraint past it is refused). So a constraint that fits
the current bucket runs in the programs already compiled, and a program compiles once per bucket only:
- global state 0 is `FREE_STATE`: every token allowed, every token leads back to it. A row without a constraint
  sits there, and a round with no row outside it skips the masking (`any_constrained`).
- automaton i occupies the states [base_i, base_i + S_i) (its start state is base_i); states no automaton occupies
  are free states too. `pack_tables` lays automata out back to back; the serving engine's `TableLayout` keeps a
  live automaton where it is while requests come and go, so the states its rows hold stay valid.
- `allowed [S, W] uint32`: bit t % 32 of word t // 32 is set iff token t may follow in that state.
- `forced [S] int32`: the one token a state allows where it allows one alone (no stop token), else -1: the draft
  tree takes it without the drafter (`tree_build_masked`).
- `default_next [S] int32` and the exceptions `exc_keys [E]`, `exc_next [E]`: the next state of (s, t) is
  exc_next[i] where exc_keys[i] == s * V + t, else default_next[s]. The keys ascend (automata are laid out in
  state order, each state's exceptions by token), so the lookup is one binary search of fixed depth log2(E); pads
  hold `KEY_PAD`, above every real key.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.constrain.automaton import WORD_BITS, ConstraintTooLarge, TokenAutomaton

# the budget: global states (all rows' automata + the free state; V / 8 bytes each: 160 MiB at Kimi's V = 163,840,
# the most the int32 exception keys allow there being 13,107) and exception entries (tokens whose next state is not
# their state's default; 8 bytes each: 32 MiB)
STATES_CAP = 8192
EXCEPTIONS_CAP = 1 << 22
STATES_BUCKET = 1024  # the smallest tables: 20 MiB of mask at Kimi's V
EXCEPTIONS_BUCKET = 1 << 18
FREE_STATE = 0
STATES_BUDGET_NAMES = "--constraint-states, ServeConfig.constraint_states"  # where an error says the budget is set
EXCEPTIONS_BUDGET_NAMES = "--constraint-exceptions, ServeConfig.constraint_exceptions"
KEY_PAD = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class TableCaps:
    """The budget of the device tables (`states`, `exceptions`: past them a constraint is refused) and their first
    bucket; a program compiles once per bucket the tables take (`shape`)."""

    states: int = STATES_CAP
    exceptions: int = EXCEPTIONS_CAP
    states_bucket: int = STATES_BUCKET
    exceptions_bucket: int = EXCEPTIONS_BUCKET

    def __post_init__(self):
        if self.states < 2:
            raise ValueError(f"constraint states cap must be >= 2 (the free state and one more), got {self.states}")
        if self.exceptions < 1:
            raise ValueError(f"constraint exceptions cap must be >= 1, got {self.exceptions}")
        if self.states_bucket < 1 or self.exceptions_bucket < 1:
            raise ValueError(f"constraint table buckets must be >= 1, got {self.states_bucket}, "
                             f"{self.exceptions_bucket}")

    def shape(self, states: int, exceptions: int) -> tuple[int, int]:
        """(states, exceptions) of the tables that hold this many: each the first bucket doubled until it fits,
        at most its cap (the caller checks the caps)."""
        return _bucket(states, self.states_bucket, self.states), _bucket(exceptions, self.exceptions_bucket,
                                                                         self.exceptions)


def _bucket(n: int, first: int, cap: int) -> int:
    size = min(first, cap)
    while size < n:
        size *= 2
    return min(size, cap)


@flax.struct.dataclass
class AutomatonTables:
    """Every row's automaton in one global state space (layout in the module docstring)."""

    allowed: jax.Array  # [S, W] uint32 allowed-token bits per state
    default_next: jax.Array  # [S] int32
    exc_keys: jax.Array  # [E] int32 ascending state * V + token; KEY_PAD pads
    exc_next: jax.Array  # [E] int32
    forced: jax.Array  # [S] int32: the one token the state allows (no stop token), else -1 (free states: -1)
    vocab_size: int = flax.struct.field(pytree_node=False, default=0)


def pack_tables(automata: Sequence[TokenAutomaton], vocab_size: int, caps: TableCaps = TableCaps()
                ) -> tuple[AutomatonTables, list[int]]:
    """Lay distinct automata out one after another behind the free state -> (numpy tables, start state of each).
    A ConstraintTooLarge names the cap that is exceeded."""
    bases = list(np.cumsum([1] + [a.num_states for a in automata])[:-1])
    return pack_tables_at(automata, [int(b) for b in bases], vocab_size, caps), [int(b) for b in bases]


def pack_tables_at(automata: Sequence[TokenAutomaton], bases: Sequence[int], vocab_size: int,
                   caps: TableCaps = TableCaps()) -> AutomatonTables:
    """Numpy tables with automaton i at states [bases[i], bases[i] + S_i) (ranges disjoint, past the free state);
    every other state is free. A ConstraintTooLarge names the cap that is exceeded."""
    words = -(-vocab_size // WORD_BITS)
    if caps.states * vocab_size > KEY_PAD:
        raise ValueError(f"constraint states cap {caps.states} x vocab {vocab_size} overflows the int32 exception keys "
                         f"(at most {KEY_PAD // vocab_size} states at this vocabulary)")
    for a in automata:
        if a.vocab_size != vocab_size:
            raise ValueError(f"constraint {a.spec.describe()} is over a vocabulary of {a.vocab_size} tokens; the "
                             f"model has {vocab_size}")
    end = max((b + a.num_states for a, b in zip(automata, bases)), default=1)
    n_exc = sum(a.exc_tokens.size for a in automata)
    if end > caps.states:
        raise ConstraintTooLarge(f"constraint: {end} states in all (free state included) exceed the states cap "
                                 f"of {caps.states} (the constraint table budget: {STATES_BUDGET_NAMES})")
    if n_exc > caps.exceptions:
        raise ConstraintTooLarge(f"constraint: {n_exc} transition exceptions in all exceed the exceptions cap of "
                                 f"{caps.exceptions} (the constraint table budget: {EXCEPTIONS_BUDGET_NAMES})")
    n_states, n_entries = caps.shape(end, n_exc)
    allowed = np.full((n_states, words), np.uint32(0xFFFFFFFF))  # free states: every token (bits past V unread)
    default_next = np.full(n_states, FREE_STATE, np.int32)
    exc_keys = np.full(n_entries, KEY_PAD, np.int32)
    exc_next = np.zeros(n_entries, np.int32)
    forced = np.full(n_states, -1, np.int32)
    at = 0
    for a, base in sorted(zip(automata, bases), key=lambda ab: ab[1]):  # keys ascend with the base
        if base <= FREE_STATE:
            raise ValueError(f"automaton base {base} overlaps the free state")
        s = a.num_states
        allowed[base:base + s] = a.allowed
        forced[base:base + s] = a.forced
        own = np.arange(base, base + s, dtype=np.int32)
        default_next[base:base + s] = np.where(a.default_next >= 0, a.default_next + base, own)  # -1: no edges
        owner = np.repeat(np.arange(s, dtype=np.int64), np.diff(a.exc_offsets))  # state of each exception
        e = a.exc_tokens.size
        exc_keys[at:at + e] = (owner + base) * vocab_size + a.exc_tokens
        exc_next[at:at + e] = a.exc_next + base
        at += e
    return AutomatonTables(allowed, default_next, exc_keys, exc_next, forced, vocab_size)


class TableLayout:
    """The host's view of the device tables while requests come and go: each live automaton keeps its states
    (rows decoding under it hold global states) until no request uses it; a new one takes the first free range
    that fits (first fit). `tables()` packs what is placed."""

    def __init__(self, vocab_size: int, caps: TableCaps = TableCaps()):
        self.vocab_size, self.caps = vocab_size, caps
        self._placed: dict = {}  # key -> [automaton, base, users]
        self.version = 0  # bumped whenever a placement changes what `tables()` returns

    def fits_alone(self, automaton: TokenAutomaton) -> str | None:
        """Why `automaton` can never be placed (over a cap by itself), or None."""
        if 1 + automaton.num_states > self.caps.states:
            return (f"{automaton.spec.describe()}: the automaton has {automaton.num_states} states; the device "
                    f"tables hold {self.caps.states - 1} (constraint states cap: the table budget of "
                    f"{self.caps.states} states, {STATES_BUDGET_NAMES})")
        if automaton.exc_tokens.size > self.caps.exceptions:
            return (f"{automaton.spec.describe()}: the automaton has {automaton.exc_tokens.size} transition "
                    f"exceptions; the device tables hold {self.caps.exceptions} (constraint exceptions cap: the "
                    f"table budget, {EXCEPTIONS_BUDGET_NAMES})")
        return None

    def place(self, key, automaton: TokenAutomaton) -> int:
        """One more user of `automaton` -> its base state. ConstraintTooLarge when the live automata leave no room."""
        if key in self._placed:
            self._placed[key][2] += 1
            return self._placed[key][1]
        exc = sum(p[0].exc_tokens.size for p in self._placed.values()) + automaton.exc_tokens.size
        if exc > self.caps.exceptions:
            raise ConstraintTooLarge(f"constraint: the live constraints need {exc} transition exceptions, over the "
                                     f"cap of {self.caps.exceptions}")
        base, need = 1, automaton.num_states
        for a, b, _ in sorted(self._placed.values(), key=lambda p: p[1]):
            if b - base >= need:
                break
            base = b + a.num_states
        if base + need > self.caps.states:
            raise ConstraintTooLarge(f"constraint: no room for {automaton.spec.describe()} ({need} states) beside "
                                     f"the live constraints' {sum(p[0].num_states for p in self._placed.values())} "
                                     f"in the states cap of {self.caps.states}")
        self._placed[key] = [automaton, base, 1]
        self.version += 1
        return base

    def release(self, key) -> None:
        """One user fewer; an automaton without users frees its states (the tables keep them until reused)."""
        p = self._placed.get(key)
        if p is not None:
            p[2] -= 1
            if p[2] <= 0:
                del self._placed[key]

    @property
    def live(self) -> int:
        return len(self._placed)

    def tables(self) -> AutomatonTables:
        placed = list(self._placed.values())
        return pack_tables_at([p[0] for p in placed], [p[1] for p in placed], self.vocab_size, self.caps)


def table_shape(tables: AutomatonTables) -> tuple[int, int]:
    """(states, exceptions) of the tables: the bucket a program that takes them is compiled for."""
    return tables.allowed.shape[0], tables.exc_keys.shape[0]


def to_device(tables: AutomatonTables) -> AutomatonTables:
    """A plain transfer (`jnp.asarray` would trace and compile a staging program per shape)."""
    return jax.device_put(tables)


# ---- lookups (jnp; any leading shape) -------------------------------------------------------------------------
def allowed_bits(tables: AutomatonTables, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """bool, broadcast of states and tokens: token allowed in state."""
    word = tables.allowed[states, tokens // WORD_BITS]
    return ((word >> (tokens % WORD_BITS).astype(jnp.uint32)) & 1).astype(bool)


def allowed_mask(tables: AutomatonTables, states: jax.Array) -> jax.Array:
    """states [...] -> [..., V] bool."""
    words = tables.allowed[states]  # [..., W]
    bits = (words[..., None] >> jnp.arange(WORD_BITS, dtype=jnp.uint32)) & 1
    return bits.reshape(*states.shape, -1)[..., :tables.vocab_size].astype(bool)


def next_state(tables: AutomatonTables, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32, broadcast of states and tokens: the state after `token` (meaningful where it is allowed)."""
    states, tokens = jnp.broadcast_arrays(states.astype(jnp.int32), tokens.astype(jnp.int32))
    key = states * tables.vocab_size + tokens
    keys = tables.exc_keys
    i = jnp.searchsorted(keys, key, side="left", method="scan_unrolled")
    i = jnp.minimum(i, keys.shape[0] - 1)
    return jnp.where(keys[i] == key, tables.exc_next[i], tables.default_next[states]).astype(jnp.int32)


def forced_token(tables: AutomatonTables, states: jax.Array) -> jax.Array:
    """int32 [...]: the token each state forces (it allows that one alone), else -1."""
    return tables.forced[states]


def any_constrained(states: jax.Array) -> jax.Array:
    """[] bool: some row is outside the free state (the masks then do something)."""
    return jnp.any(states != FREE_STATE)


def mask_logits(logits: jax.Array, tables: AutomatonTables, states: jax.Array) -> jax.Array:
    """logits [..., V], states [...] -> logits with disallowed tokens (and NaN) at -inf."""
    ok = allowed_mask(tables, states) & ~jnp.isnan(logits)
    return jnp.where(ok, logits, -jnp.inf)


def first_allowed_token(tables: AutomatonTables, states: jax.Array) -> jax.Array:
    """[...] int32: the lowest allowed token id (the greedy pick when every allowed logit is -inf)."""
    return jnp.argmax(allowed_mask(tables, states), axis=-1).astype(jnp.int32)
