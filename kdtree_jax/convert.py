"""`python -m kdtree_jax.convert SRC DST`: HF safetensors checkpoint -> converted (orbax) checkpoint.

FP8 weights are dequantized once here; INT4 routed experts stay packed. The destination appears only when the
conversion is complete (see `checkpoint_io`), so an interrupted run leaves nothing that loads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kdtree_jax.checkpoint.hf import HFCheckpoint, tokenizer_files
from kdtree_jax.checkpoint.io import DTYPES, _with_progress, save_converted
from kdtree_jax.checkpoint.weights import detect_expert_format, load_model


def convert(src: str, dst: str, *, dtype: str = "bfloat16", overwrite: bool = False, progress: bool = True) -> str:
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: no such checkpoint directory")
    with HFCheckpoint.open(src) as ckpt:
        ckpt.validate()
        expert_format = detect_expert_format(ckpt.config, ckpt.get)
        model = load_model(_with_progress(ckpt, progress), param_dtype=DTYPES[dtype], dtype=DTYPES[dtype])
        with open(os.path.join(src, "config.json")) as f:
            config_json = json.load(f)
        return save_converted(model, dst, config_json=config_json, extra_files=tokenizer_files(src),
                              expert_format=expert_format, overwrite=overwrite, progress=progress)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kdtree_jax.convert", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="destination directory (must not exist unless --force)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="stored dtype of float parameters")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    args = p.parse_args(argv)
    try:
        out = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.force)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(out)


if __name__ == "__main__":
    main()
