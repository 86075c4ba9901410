"""What one verify_attn call launches on the GPU: run it back to back under a profiler and list the kernels.

    nsys profile -o trace --stats=true python scripts/trace_verify_attn.py [--batch 1] [--heads 8] [--prefix 1024]
    ncu --metrics gpu__time_duration.sum python scripts/trace_verify_attn.py ...   (the H200 machine has only ncu)

`bench_kernels.py` times calls back to back inside one jit; small decode calls measured ~30 µs whatever the prefix.
This script runs the same call `--calls` times in one jit (cache capacity 32k + 1, as the sweep) so a profiler's
kernel summary shows how that time splits between the Triton kernel, XLA's split-K merge and the small glue ops.
Without a profiler it prints the per-call time only.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_util import per_call_s  # noqa: E402
from pallas_kernels.verify_attn import verify_attn  # noqa: E402

R, DR, SCALE = 512, 64, 0.1446796  # K2.6 latent widths and softmax scale


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=32769)
    parser.add_argument("--calls", type=int, default=16)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    bt, n, h, s = args.batch, args.nodes, args.heads, args.capacity if on_gpu else 300
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(args.calls):
        sets.append((jnp.asarray(rng.standard_normal((bt, n, h, R + DR)), dtype),
                     jnp.asarray(rng.standard_normal((bt, s, R + DR)), dtype),
                     jnp.full((bt,), min(args.prefix, s), jnp.int32),
                     jnp.asarray(rng.standard_normal((bt, n, R + DR)), dtype),
                     jnp.asarray(np.tril(np.ones((n, n), bool))[None].repeat(bt, 0))))

    def call(q, c, p, t, m):
        return verify_attn(q, c, p, t, m, scale=SCALE, kv_lora_rank=R)

    us = per_call_s(call, sets) * 1e6
    print(f"verify_attn batch={bt} N={n} H={h} prefix={args.prefix} capacity={s}: {us:.1f} µs per call "
          f"({jax.devices()[0].device_kind})")


if __name__ == "__main__":
    main()
