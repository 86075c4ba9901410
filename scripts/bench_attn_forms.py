"""Absorbed-MLA verify attention two ways, side by side in one run: the verify_attn Pallas kernel and a chunked
library-matmul form (`chunked_attention` below).

    python scripts/bench_attn_forms.py [--heads 64] [--score-mb 128 512] [--out results.json]

At H = 64 the tree rows (N x H of them) make the attention bound by matmul throughput, where the kernel's
mma.sync tiles reach 13-31% of the bf16 matmul peak (BENCHMARKS.md section 3); the chunked form hands the two
products to cuBLAS and pays for fp32 scores in memory instead. Each shape's cache holds exactly prefix + N rows (the
chunked form reads every row it is given; the kernel stops at the valid length). Times from `per_call_s` (calls back
to back inside one jit, enough distinct caches that a rotation reads >= 256 MB); FLOPs = 2 B N H (prefix + N)
(576 + 512); matmul peak measured in the same run. "max rel diff" = max |chunked - kernel| / max |kernel|.

Measured once on an H200 (BENCHMARKS.md section 3, session 5): the chunked form was 0.2-1.3x the kernel's speed, no
robust win, so the engine keeps the kernel; the form stays here as the measured alternative.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_kimi_layer import ancestor_mask  # noqa: E402
from bench_util import matmul_peak, per_call_s  # noqa: E402
from kdtree_jax.mla import NEG_INF  # noqa: E402
from pallas_kernels.verify_attn import verify_attn  # noqa: E402

R, DR, SCALE = 512, 64, 0.1446796  # K2.6 latent widths and softmax scale
GPU_SHAPES = [(1, 1, 8192), (1, 17, 8192), (1, 17, 32768), (1, 65, 8192), (1, 65, 32768), (1, 257, 8192),
              (8, 1, 32768), (8, 17, 8192), (8, 17, 32768), (8, 65, 8192), (64, 1, 8192), (64, 17, 8192)]
CPU_SHAPES = [(1, 5, 40), (2, 3, 70)]
ROTATION_BYTES = 256 << 20


def chunked_attention(q: jax.Array, cache: jax.Array, prefix_len: jax.Array, tree_kv: jax.Array,
                               tree_mask: jax.Array, *, scale: float, kv_lora_rank: int,
                               score_bytes: int = 256 << 20) -> jax.Array:
    """`kdtree_jax.mla.absorbed_attention_jnp` as library matmuls over cache chunks with an online softmax: a
    candidate form for many query rows (N x H large), where the attention is bound by matmul throughput.

    Per chunk of C cache rows: scores [B, N*H, C] (fp32, at most `score_bytes`) = q . chunk^T in the input dtype
    with fp32 accumulation, then probabilities (input dtype) . chunk[:, :, :R]. The last chunk starts at S - C and
    masks the rows an earlier chunk already counted, so any S works without copying the cache.
    """
    f32 = jnp.float32
    b, n, h, a = q.shape
    s_len = cache.shape[1]
    rows = q.reshape(b, n * h, a)
    c = max(1, min(s_len, score_bytes // (4 * b * n * h)))
    n_chunks = -(-s_len // c)

    def update(carry, keys, valid):  # one online-softmax step over keys [B, K, A] with valid [B, N*H | 1, K]
        m, l, o = carry
        sc = jnp.einsum("bra,bka->brk", rows, keys.astype(q.dtype), preferred_element_type=f32) * scale
        sc = jnp.where(valid, sc, NEG_INF)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.where(valid, jnp.exp(sc - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("brk,bkv->brv", p.astype(q.dtype), keys[..., :kv_lora_rank].astype(q.dtype),
                        preferred_element_type=f32)
        return m_new, l * alpha + p.sum(-1), o * alpha[..., None] + pv

    def chunk(carry, i):
        start = jnp.minimum(i * c, s_len - c)
        idx = start + jnp.arange(c)
        valid = (idx >= i * c)[None, :] & (idx[None, :] < prefix_len[:, None])  # [B, C]
        return update(carry, jax.lax.dynamic_slice_in_dim(cache, start, c, axis=1), valid[:, None, :]), None

    init = (jnp.full((b, n * h), NEG_INF, f32), jnp.zeros((b, n * h), f32),
            jnp.zeros((b, n * h, kv_lora_rank), f32))
    carry, _ = jax.lax.scan(chunk, init, jnp.arange(n_chunks))
    _, l, o = update(carry, tree_kv, jnp.repeat(tree_mask, h, axis=1))  # row n*H + h is node n
    return (o / jnp.where(l > 0, l, 1.0)[..., None]).reshape(b, n, h, kv_lora_rank)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--score-mb", type=int, nargs="+", default=[128, 512],
                        help="fp32 score bytes per chunk of the chunked form, MiB")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shapes, dtype = (GPU_SHAPES, jnp.bfloat16) if on_gpu else (CPU_SHAPES, jnp.float32)
    peak = matmul_peak(8192 if on_gpu else 256)
    h, rng, rows = args.heads, np.random.default_rng(0), []
    print(f"## verify attention forms, H = {h}, {jax.devices()[0].device_kind}, matmul peak {peak / 1e12:.0f} TFLOP/s")
    for bt, n, prefix in shapes:
        s = prefix + n
        n_sets = max(2, min(8, -(-ROTATION_BYTES // (bt * s * (R + DR) * 2))))
        sets = [(jnp.asarray(rng.standard_normal((bt, n, h, R + DR)), dtype),
                 jnp.asarray(rng.standard_normal((bt, s, R + DR)), dtype),
                 jnp.full((bt,), prefix, jnp.int32),
                 jnp.asarray(rng.standard_normal((bt, n, R + DR)), dtype),
                 jnp.asarray(ancestor_mask(rng, bt, n))) for _ in range(n_sets)]
        flops = 2 * bt * n * h * s * (R + DR + R)
        row = dict(batch=bt, nodes=n, prefix=prefix, heads=h)
        try:
            def kernel(q, c, p, t, m):
                return verify_attn(q, c, p, t, m, scale=SCALE, kv_lora_rank=R)

            ref = np.asarray(jax.jit(kernel)(*sets[0]), np.float32)
            row["kernel_ms"] = per_call_s(kernel, sets) * 1e3
            for mb in args.score_mb:
                def chunked(q, c, p, t, m, mb=mb):
                    return chunked_attention(q, c, p, t, m, scale=SCALE, kv_lora_rank=R,
                                                      score_bytes=mb << 20)

                got = np.asarray(jax.jit(chunked)(*sets[0]), np.float32)
                row[f"chunked{mb}_ms"] = per_call_s(chunked, sets) * 1e3
                row[f"chunked{mb}_diff"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        except Exception as e:  # noqa: BLE001  (OOM / compile failure: record and go on)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        row["tflop"] = flops / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| batch | N | prefix | kernel ms | kernel TFLOP/s | "
          + " | ".join(f"chunked {mb} MiB ms (TFLOP/s) | kernel / chunked | max rel diff" for mb in args.score_mb)
          + " |")
    print("|---|---|---|---|---|" + "---|---|---|" * len(args.score_mb))
    for r in rows:
        if "kernel_ms" not in r:
            print(f"| {r['batch']} | {r['nodes']} | {r['prefix']} | {r.get('error', '')} |")
            continue
        cells = []
        for mb in args.score_mb:
            ms = r.get(f"chunked{mb}_ms")
            cells.append("— | — | —" if ms is None else
                         f"{ms:.3f} ({r['tflop'] / ms * 1e3:.0f}) | {r['kernel_ms'] / ms:.2f} | "
                         f"{r[f'chunked{mb}_diff']:.1e}")
        print(f"| {r['batch']} | {r['nodes']} | {r['prefix']} | {r['kernel_ms']:.3f} | "
              f"{r['tflop'] / r['kernel_ms'] * 1e3:.0f} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, matmul_tflops=peak / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
