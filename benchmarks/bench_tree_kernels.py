"""Benchmark the device tree kernels against the host numpy heap / walk that REF runs every round.

Device: the jitted `tree_build` (kernel + ancestor mask) and `tree_accept`, per-call time of SETS distinct inputs
issued back to back inside one jit (`bench_util.per_call_s`: the engine runs them inside its compiled loop, so the
host's per-call dispatch is not theirs), median of several passes. Host: device->host copy of the inputs plus
the numpy reference for the whole batch (what a host-side tree build costs per round), median of a few calls.

    python benchmarks/bench_tree_kernels.py [--out rows.json] [--batches 1 8 64] [--budgets 16 32 64 128 256]

`run(out_rows)` appends one dict per (kernel, batch, budget) for a combined benchmark script.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import per_call_s, write_results  # noqa: E402

from pallas_kernels.tree_accept import tree_accept  # noqa: E402
from pallas_kernels.tree_accept_ref import tree_accept_ref  # noqa: E402
from pallas_kernels.tree_build import tree_build  # noqa: E402
from pallas_kernels.tree_build_ref import tree_build_ref  # noqa: E402

VOCAB = 163840  # Kimi K2 vocab: token ids drawn from it
STOP_PROB = 0.3  # chance the synthetic target disagrees with the best draft child at a slot
SETS = 16  # distinct input sets per timed jit


def _host_median_s(fn, device_inputs, reps: int) -> float:
    """Times fn(host copies) including the device->host copy; fresh device buffers each rep (no cached copy)."""
    times = []
    for _ in range(reps):
        fresh = [x + 0 for x in device_inputs]
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        fn(*(np.asarray(x) for x in fresh))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(rng, bt: int, depth: int, k: int):
    lp = -np.sort(rng.exponential(1.0, (bt, depth, k)), axis=-1)
    lp[..., 0] = -rng.exponential(0.1, (bt, depth))  # confident spine, as a trained drafter gives
    ids = np.stack([rng.choice(VOCAB, (depth, k), replace=False) for _ in range(bt)])
    root = rng.integers(0, VOCAB, bt)
    return (jnp.asarray(lp.astype(np.float32)), jnp.asarray(ids.astype(np.int32)), jnp.asarray(root.astype(np.int32)))


def _choice(rng, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Synthetic target: agrees with the first (best) child of each slot unless a random stop fires."""
    bt, n = tokens.shape
    choice = rng.integers(0, VOCAB, (bt, n))
    for b in range(bt):
        first = {}
        for slot in range(n - 1, 0, -1):
            if parents[b, slot] >= 0:
                first[int(parents[b, slot])] = slot
        for parent, slot in first.items():
            if rng.random() > STOP_PROB:
                choice[b, parent] = tokens[b, slot]
    return choice.astype(np.int32)


def run(out_rows: list, *, batches=(1, 8, 64), budgets=(16, 32, 64, 128, 256), depth: int = 15, reps: int = 10,
        host_reps: int = 5, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    device = jax.devices()[0].device_kind
    for bt in batches:
        for budget in budgets:
            k = budget
            sets = [_inputs(rng, bt, depth, k) for _ in range(SETS)]
            build = functools.partial(tree_build, budget=budget)
            dev_s = per_call_s(build, sets, min_reps=reps, max_reps=reps)
            host_s = _host_median_s(lambda a, b, c: tree_build_ref(a, b, c, budget=budget), sets[0], host_reps)
            trees = [build(*x) for x in sets]
            out_rows.append(dict(kernel="tree_build", device=device, batch=bt, budget=budget, depth=depth, k=k,
                                 device_ms=dev_s * 1e3, host_ms=host_s * 1e3, speedup=host_s / dev_s))

            walk_sets = [(jnp.asarray(_choice(rng, np.asarray(t.tokens), np.asarray(t.parents))), t.tokens, t.parents,
                          t.n_nodes) for t in trees]
            walk = functools.partial(tree_accept, max_depth=depth)
            dev_s = per_call_s(walk, walk_sets, min_reps=reps, max_reps=reps)
            host_s = _host_median_s(lambda c, t, p, n: tree_accept_ref(c, t, p, n, max_depth=depth), walk_sets[0],
                                    host_reps)
            mean_acc = float(np.mean([np.asarray(walk(*x).n_accepted).mean() for x in walk_sets]))
            out_rows.append(dict(kernel="tree_accept", device=device, batch=bt, budget=budget, depth=depth, k=k,
                                 device_ms=dev_s * 1e3, host_ms=host_s * 1e3, speedup=host_s / dev_s,
                                 mean_accepted=mean_acc))
            print(json.dumps(out_rows[-2]), json.dumps(out_rows[-1]), flush=True)
    return out_rows


def markdown(rows: list) -> str:
    lines = ["| kernel | batch | B | D | device ms | host numpy ms | speedup |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['batch']} | {r['budget']} | {r['depth']} | {r['device_ms']:.3f} | "
                     f"{r['host_ms']:.2f} | {r['speedup']:.1f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON to this path")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--host-reps", type=int, default=5)
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"warning: backend is {jax.default_backend()}; kernels run in the Pallas interpreter", file=sys.stderr)
    rows = run([], batches=args.batches, budgets=args.budgets, depth=args.depth, reps=args.reps,
               host_reps=args.host_reps)
    print(markdown(rows))
    if args.out:
        write_results(args.out, rows)


if __name__ == "__main__":
    main()
