"""Greedy tokens in bfloat16 against float32: where speculation is exact, and where rounding decides.

    python benchmarks/dtype_agreement.py [--n-prompts 16] [--max-new-tokens 64] [--budget 16] [--out agreement.json]

The engine's guarantee is that ddtree gives the target's greedy tokens. In float32 the verify pass over 1+B tree
tokens and the one-token AR step agree to ~1e-7 and the tokens are identical (tests and BENCHMARKS). In bfloat16 the
two computations round differently (other matmul shapes, other attention splits), and so does bfloat16 AR against
float32 AR. This script measures all of it on one set of held-out prompts: each pair of (dtype, mode) runs, per
prompt, identical or not and the first differing token; then at each first difference between bf16 ddtree and
bf16 ar, the float32 model's top-2 logit margin there and which of the two tokens float32 picks. Small margins
there, against the typical margin over the float32 AR positions, say the flips are near-ties that rounding decides.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # bench_engine: the pair, prompts and agreement

import jax.numpy as jnp  # noqa: E402
from bench_engine import add_pair_args, agreement, load_prompts  # noqa: E402

from benchmarks.bench_util import write_results  # noqa: E402
from kdtree_jax import train as T  # noqa: E402
from kdtree_jax.decode.engine import Engine  # noqa: E402


def next_token_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The float model's logits [len(tokens) + 1, V] for the positions after the prompt's last token."""
    out = T.target_forward(model, jnp.asarray([prompt + tokens], jnp.int32))
    return np.asarray(out.logits[0, len(prompt) - 1:], np.float64)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--out", help="write the result as JSON")
    args = p.parse_args(argv)

    engines = {dt: Engine.load(args.checkpoint, args.drafter, dtype=dt) for dt in ("float32", "bfloat16")}
    prompts = load_prompts(args.prompts, engines["float32"].tokenizer, args.n_prompts, args.prompt_tokens)
    ids = {(dt, mode): e.generate(prompts, args.max_new_tokens, mode=mode, budget=args.budget).token_ids
           for dt, e in engines.items() for mode in ("ar", "ddtree")}
    pairs = {"float32 ddtree vs float32 ar": (("float32", "ddtree"), ("float32", "ar")),
             "bfloat16 ar vs float32 ar": (("bfloat16", "ar"), ("float32", "ar")),
             "bfloat16 ddtree vs bfloat16 ar": (("bfloat16", "ddtree"), ("bfloat16", "ar")),
             "bfloat16 ddtree vs float32 ar": (("bfloat16", "ddtree"), ("float32", "ar"))}
    result = {"args": vars(args), "pairs": {name: agreement(ids[a], ids[b]) for name, (a, b) in pairs.items()}}

    model = engines["float32"].target
    flips = []
    for prompt, ar, dd in zip(prompts, ids["bfloat16", "ar"], ids["bfloat16", "ddtree"]):
        at = next((i for i, (x, y) in enumerate(zip(ar, dd)) if x != y), None)
        if at is None:
            continue
        logits = next_token_logits(model, prompt, ar[:at])[-1]
        pick = int(np.argmax(logits))
        flips.append({"position": at, "float32_margin": float(top2_margin(logits)),
                      "float32_picks": "ar" if pick == ar[at] else "ddtree" if pick == dd[at] else "neither"})
    typical = np.concatenate([top2_margin(next_token_logits(model, prompt, ar)[:-1])
                              for prompt, ar in zip(prompts, ids["float32", "ar"])])
    result["flips"] = flips
    result["float32_margin_percentiles"] = {q: float(np.percentile(typical, q)) for q in (10, 50)}

    n = len(prompts)
    print(f"{n} prompts x {args.max_new_tokens} new tokens, ddtree B = {args.budget}, greedy\n")
    print("| pair | prompts identical | first differing token of the others |\n|---|---|---|")
    for name, a in result["pairs"].items():
        print(f"| {name} | {a['prompts_identical']}/{n} | {a['first_difference_at'] or '-'} |")
    print("\nAt each first difference of bfloat16 ddtree and bfloat16 ar: position, float32 top-2 margin, float32 "
          "picks\n")
    for f in flips:
        print(f"- token {f['position']}: margin {f['float32_margin']:.4f}, float32 picks {f['float32_picks']}")
    pct = result["float32_margin_percentiles"]
    print(f"\nfloat32 top-2 margin over all float32 ar positions: median {pct[50]:.3f}, 10th percentile {pct[10]:.3f}")
    if args.out:
        write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
