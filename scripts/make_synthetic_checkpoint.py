"""Write a random HF-format Kimi/DeepSeek-V3 checkpoint (bf16 / fp8 / int4; flat K2 or K2.6 wrapper).

    python scripts/make_synthetic_checkpoint.py OUT_DIR --fmt int4 --wrapped --seed 0 --shards 2
    python scripts/make_synthetic_checkpoint.py OUT_DIR --config some/config.json --fmt bf16
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from kdtree_jax.checkpoint.hf import tokenizer_files  # noqa: E402
from kdtree_jax.checkpoint.synthetic import FORMATS, write_synthetic_checkpoint  # noqa: E402
from kdtree_jax.model.config import tiny  # noqa: E402
from kdtree_jax.model.hf_config import config_from_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("--fmt", choices=FORMATS, default="bf16")
    ap.add_argument("--wrapped", action="store_true", help="K2.5/K2.6 layout: text_config + language_model.*")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--config", help="HF config.json whose architecture to use (default: config.tiny())")
    ap.add_argument("--layers", type=int, help="override num_hidden_layers")
    ap.add_argument("--fp8-block", type=int, nargs=2, metavar=("ROWS", "COLS"), help="fp8 block (default 16 16)")
    ap.add_argument("--tokenizer-from", help="directory whose tokenizer files are copied along")
    args = ap.parse_args(argv)

    cfg = config_from_json(args.config) if args.config else tiny()
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    extra = {}
    if args.tokenizer_from:
        for f in tokenizer_files(args.tokenizer_from):
            with open(f, "rb") as fh:
                extra[os.path.basename(f)] = fh.read()
    weights = write_synthetic_checkpoint(args.out, cfg, fmt=args.fmt, wrapped=args.wrapped, seed=args.seed,
                                         n_shards=args.shards, fp8_block=tuple(args.fp8_block) if args.fp8_block
                                         else None, extra_files=extra)
    n_params = sum(w.size for w in weights.values())
    print(f"wrote {args.out}: {len(weights)} tensors, {n_params} parameters, fmt={args.fmt}, wrapped={args.wrapped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
