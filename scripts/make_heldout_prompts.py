"""Cut benchmark prompts from the held-out corpus split: the start of each top-level def/class, one per line.

    python scripts/make_heldout_prompts.py data/corpus/heldout.txt checkpoints/kdtree-mini/heldout_prompts.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
import re


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("heldout")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--chars", type=int, default=600, help="prompt length in characters")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    text = open(args.heldout, encoding="utf-8").read()
    starts = [m.start() for m in re.finditer(r"^(def|class) ", text, flags=re.M)]
    random.Random(args.seed).shuffle(starts)
    with open(args.out, "w", encoding="utf-8") as f:
        for s in sorted(starts[: args.n]):
            f.write(json.dumps({"text": text[s : s + args.chars]}) + "\n")


if __name__ == "__main__":
    main()
