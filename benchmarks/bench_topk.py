"""Per-depth top-K draft log-probs (the input of tree_build) at the shipped pair's and K2.6's vocabularies.

    python benchmarks/bench_topk.py [--out topk.json]

The largest bookkeeping piece of a round on the shipped pair (BENCHMARKS.md 4c) is `topk_logprobs`: a full-vocab
logsumexp and `lax.top_k` over [Bt, D, V]. Variants, timed side by side on the same logits (calls back to back inside
one jit, `bench_util.per_call_s`), each checked against xla (ids exactly; the largest log-prob difference is shown):
    xla       logsumexp + lax.top_k over V (tree_build.topk_logprobs_xla)
    current   tree_build.topk_logprobs, what the engine calls (the Pallas kernel for k <= topk.MAX_K)
    pallas    pallas_kernels/topk.py at its default chunk; pallas_c<L> at chunk L
    top_k     lax.top_k alone (what the logsumexp costs)
    lse       logsumexp alone
    chunked   top-k per chunk of V, then top-k over the chunks' candidates (ties: lower index first, as lax.top_k)
    sort      one lax.sort over V carrying the indices
On a CPU backend it runs tiny shapes (numbers meaningless; checks the script).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import per_call_s, write_results  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels.topk import topk_logprobs_pallas  # noqa: E402
from pallas_kernels.tree_build import topk_logprobs, topk_logprobs_xla  # noqa: E402

SETS = 8  # distinct logits per timed jit
DEPTH = 15  # D = block - 1 of the shipped drafter and of DFlash on K2.6
GPU_SHAPES = [(bt, v, k) for v in (4096, 163840) for bt in (1, 8) for k in (16, 32, 64, 256)]
CPU_SHAPES = [(2, 512, 16), (2, 1024, 64)]
CHUNKS = (16, 64)
PALLAS_CHUNKS = (1024, 16384)  # besides topk.CHUNK, for vocabularies larger than the chunk


def chunked(logits, k: int, chunks: int):
    """Top-k of each of `chunks` equal parts of V, then of their chunks * k candidates: exact, and ties keep the lower
    index (candidates are laid out in chunk order, each chunk's in lax.top_k's order)."""
    x = logits.astype(jnp.float32)
    *lead, v = x.shape
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    part = x.reshape(*lead, chunks, v // chunks)
    top, idx = lax.top_k(part, k)  # [..., C, k]
    idx = idx + (jnp.arange(chunks, dtype=idx.dtype) * (v // chunks))[:, None]
    top2, pos = lax.top_k(top.reshape(*lead, chunks * k), k)
    ids = jnp.take_along_axis(idx.reshape(*lead, chunks * k), pos, axis=-1)
    return top2 - logz, ids.astype(jnp.int32)


def by_sort(logits, k: int):
    x = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    iota = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    neg, ids = lax.sort((-x, iota), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    return -neg[..., :k] - logz, ids[..., :k]


def variants(v: int, k: int) -> dict:
    out = {"xla": lambda x: topk_logprobs_xla(x, k), "current": lambda x: topk_logprobs(x, k),
           "pallas": lambda x: topk_logprobs_pallas(x, k), "top_k": lambda x: lax.top_k(x.astype(jnp.float32), k),
           "lse": lambda x: jax.nn.logsumexp(x.astype(jnp.float32), axis=-1), "sort": lambda x: by_sort(x, k)}
    for c in CHUNKS:
        if v % c == 0 and v // c >= k:
            out[f"chunked{c}"] = lambda x, c=c: chunked(x, k, c)
    for c in PALLAS_CHUNKS:
        if c < v:
            out[f"pallas_c{c}"] = lambda x, c=c: topk_logprobs_pallas(x, k, chunk=c)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    rows = []
    for bt, v, k in GPU_SHAPES if on_gpu else CPU_SHAPES:
        rng = np.random.default_rng(bt * v + k)
        sets = [(jnp.asarray(rng.standard_normal((bt, DEPTH, v)) * 3, jnp.float32).round(1),) for _ in range(SETS)]
        ref_lp, ref_ids = topk_logprobs_xla(sets[0][0], k)  # rounded logits: exact ties in every row
        for name, fn in variants(v, k).items():
            fn = jax.jit(fn)
            row = dict(batch=bt, vocab=v, k=k, variant=name)
            got = fn(sets[0][0])
            if isinstance(got, tuple) and len(got) == 2:
                lp, ids = got
                row["ids_equal"] = bool((np.asarray(ids) == np.asarray(ref_ids)).all())
                row["lp_max_diff"] = float(np.abs(np.asarray(lp) - np.asarray(ref_lp)).max())
            row["us"] = per_call_s(fn, sets) * 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| batch | V | K | variant | µs | ids equal | lp max diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['vocab']} | {r['k']} | {r['variant']} | {r['us']:.1f} | "
                     f"{r.get('ids_equal', '-')} | {r.get('lp_max_diff', '-')} |")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, dict(device=jax.devices()[0].device_kind, rows=rows))


if __name__ == "__main__":
    main()
