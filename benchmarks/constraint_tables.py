"""Size and compile time of constraint automata at Kimi's vocabulary size (V = 163,840), on a synthetic vocabulary:
the kdtree-mini tokens plus random BPE-like byte strings (space-led words, capitalised words, digit runs,
punctuation runs, CJK characters) up to Kimi's 163,584 ordinary tokens, and Kimi's 256 special slots. The numeric
schemas show what bounds and multipleOf cost over an unbounded integer.

    python benchmarks/constraint_tables.py [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from kdtree_jax.checkpoint.tokenizer import KIMI_SPECIAL_OFFSETS, NUM_SPECIAL_SLOTS, KimiTokenizer
from kdtree_jax.constrain.automaton import ConstraintSpec, ConstraintVocabulary, compile_constraint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIMI_ORDINARY_TOKENS = 163_584
KIMI_VOCAB = KIMI_ORDINARY_TOKENS + NUM_SPECIAL_SLOTS
TOOL_SCHEMA = ('{"type":"object","properties":{"city":{"type":"string"},"unit":{"enum":["c","f"]}},'
               '"required":["city"]}')
NUMERIC = {  # what numeric bounds cost: each is a schema of one value, bounded by an exact regex
    "integer": {"type": "integer"},
    "integer [0, 99]": {"type": "integer", "minimum": 0, "maximum": 99},
    "integer [0, 1e9]": {"type": "integer", "minimum": 0, "maximum": 10 ** 9},
    "integer [-1e15, 1e15]": {"type": "integer", "minimum": -10 ** 15, "maximum": 10 ** 15},
    "integer, 256 multiples of 7": {"type": "integer", "minimum": 0, "maximum": 7 * 255, "multipleOf": 7},
    "number [-1.5, 2.25]": {"type": "number", "minimum": -1.5, "maximum": 2.25},
}
SPECS = {
    "tool schema": ConstraintSpec.json_schema(TOOL_SCHEMA),
    "json_object": ConstraintSpec.json_object(),
    "choice (3)": ConstraintSpec.choice(["yes", "no", "maybe"]),
    **{name: ConstraintSpec.json_schema(json.dumps(schema)) for name, schema in NUMERIC.items()},
}
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
PUNCT = np.array(list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"))


def synthetic_tokens(rng, base: list[bytes], n: int) -> list[bytes]:
    seen, out = set(base), list(base)
    while len(out) < n:
        kind = rng.integers(6)
        if kind < 3:
            word = "".join(rng.choice(LETTERS, size=rng.integers(1, 11)))
            text = (" " if kind < 2 else "") + (word.capitalize() if kind == 1 else word)
        elif kind == 3:
            text = "".join(str(d) for d in rng.integers(0, 10, size=rng.integers(1, 4)))
        elif kind == 4:
            text = (" " if rng.integers(2) else "") + "".join(rng.choice(PUNCT, size=rng.integers(1, 4)))
        else:
            text = "".join(chr(c) for c in rng.integers(0x4E00, 0x9FFF, size=rng.integers(1, 3)))
        b = text.encode("utf-8")
        if b not in seen:
            seen.add(b)
            out.append(b)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mini = KimiTokenizer.from_dir(os.path.join(REPO, "checkpoints", "kdtree-mini", "tokenizer"))
    base = [mini.token_bytes(i) for i in range(mini.special_base)]
    tokens = synthetic_tokens(np.random.default_rng(args.seed), base, KIMI_ORDINARY_TOKENS)
    stops = [KIMI_ORDINARY_TOKENS + KIMI_SPECIAL_OFFSETS[t] for t in ("[EOS]", "<|im_end|>")]
    t0 = time.perf_counter()
    vocab = ConstraintVocabulary.from_token_bytes(tokens, KIMI_VOCAB, stops)
    print(f"vocabulary: V={KIMI_VOCAB}, {len(tokens)} ordinary tokens, built in {time.perf_counter() - t0:.1f} s")
    print("| constraint | states | exceptions | mask bytes | transition bytes | total bytes | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, spec in SPECS.items():
        t0 = time.perf_counter()
        a = compile_constraint(spec, vocab)
        dt = time.perf_counter() - t0
        trans = a.default_next.nbytes + a.exc_offsets.nbytes + a.exc_tokens.nbytes + a.exc_next.nbytes
        print(f"| {name} | {a.num_states} | {a.exc_tokens.size} | {a.allowed.nbytes} | {trans} | {a.nbytes} "
              f"| {dt:.2f} |")


if __name__ == "__main__":
    main()
