"""verify_attn kernel by kernel: GPU time per call of every kernel one call launches (jax.profiler trace).

    python scripts/trace_verify_attn.py [--backends triton mosaic] [--shapes 8x1x32768 1x17x4096 ...] [--heads 64]
                                        [--out f.json]

Each shape is BATCHxNxPREFIX at H heads, A = 512 + 64, bf16, the cache capacity rounded as the engine does. The calls
run back to back inside one jit over distinct caches (as `bench_kernels.py` times them), under `jax.profiler`;
kernel events are summed by name and divided by the number of calls. Shows what a call's wall time is made of:
the attention kernel, XLA's merge of split-K partials, the tree block (mosaic path). (Nsight Systems is not on
the H200 machine and Nsight Compute crashes on JAX processes there: jax.profiler is the working path.)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_kernels import SCALE, Sweep, make_inputs, timed_sets, traced_kernels  # noqa: E402
from kdtree_jax.speculative import aligned_rows  # noqa: E402
from pallas_kernels import verify_attn_mgpu  # noqa: E402
from pallas_kernels.verify_attn import BACKENDS, verify_attn  # noqa: E402

CALLS = 8  # distinct caches, one call each (identical calls would be merged by XLA)


def kernels_per_call(backend: str, bt: int, n: int, h: int, prefix: int) -> dict[str, float]:
    sweep = Sweep(batches=(bt,), nodes=(n,), prefixes=(prefix,))
    q, caches, tree_kv, mask = make_inputs(sweep, bt, n, h, aligned_rows(prefix + n), seed=bt + n, caches=CALLS)

    def call(q, c, p, t, m):
        return verify_attn(q, c, p, t, m, scale=SCALE, kv_lora_rank=sweep.r, backend=backend)

    sets = timed_sets(q, caches, prefix, tree_kv, mask)
    events = traced_kernels(call, sets)
    per_name: dict[str, float] = collections.defaultdict(float)
    for e in events:
        per_name[e["name"]] += e["dur"] / len(sets)
    return dict(sorted(per_name.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--shapes", nargs="+", default=["1x1x32768", "8x1x32768", "64x1x8192", "8x17x32768"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("traces compiled kernels: needs a GPU backend")
    results = []
    for shape in args.shapes:
        bt, n, prefix = (int(x) for x in shape.split("x"))
        for backend in args.backends:
            if backend == "mosaic" and not verify_attn_mgpu.supports(jnp.bfloat16, 512, 64, 8):
                continue
            per = kernels_per_call(backend, bt, n, args.heads, prefix)
            results.append(dict(backend=backend, batch=bt, nodes=n, heads=args.heads, prefix=prefix, kernels_us=per,
                                total_us=sum(per.values())))
            print(f"## {backend} batch {bt} N {n} H {args.heads} prefix {prefix}: {sum(per.values()):.1f} µs of "
                  "kernels per call")
            for name, us in per.items():
                print(f"  {us:9.1f} µs  {name[:110]}")
            sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
