"""Kernel benchmark on one GPU: verify_attn at Kimi K2 sizes against ceilings measured in the same run, then the
tree kernels (`benchmarks/bench_tree_kernels.py`, when present).

    python benchmarks/bench_kernels.py [--quick] [--out results.json] [--heads 64 8] [--tune] [--backends ...] [--trace]
        [--paged [P]]

verify_attn: bf16, H heads, A = 512 + 64, N = 1 (AR) and 1 + B tree slots, batch 1/8/64, prefix 1k..32k; the
cache capacity is fixed per (batch, N) and the prefix length is a runtime value, as in the engine, so one compile
serves every prefix. Bytes moved = the cache prefix read once per request + q + out + tree latents/mask;
FLOPs = 2 * N*H * (prefix + N) * (A + R). Ceilings: a 2 GiB elementwise copy (read + write bytes) and an 8192^3
bf16 matmul. "% copy" = achieved bandwidth / copy bandwidth (the target is >= 60% where the call is memory-bound,
i.e. AR); "% roofline" = max(bytes / copy bw, FLOPs / matmul peak) / time, the fair figure for trees, which are
compute-bound (intensity ~ 2*N*H flop per cache byte, far above the ~190 flop/byte machine balance).
With `--trace`, "read" is the GPU time of an XLA sum over the same cache bytes in the same harness, and "% read" =
read time / kernel time: where a call reads only a few MB, a read alone stays far below the copy bandwidth.
`--tune` first times a few (block_q, block_k, warps, stages, splits) choices on representative shapes for
each `--heads` value, the kernel's defaults and its split rule's predecessor (CDIV_RULE) among them.
Timing: `bench_util.per_call_s` (calls back to back inside one jit, host dispatch amortised) over enough
distinct caches that one rotation reads >= 256 MB, so no call is served from the previous call's L2.
`--paged P` (P = 64 when omitted) also times each call over a paged cache, as the serving engine lays it out: the same
rows in a pool [Bt * W, P, A] whose pages are shuffled (`page_pool`), read through a page table [Bt, W]; both layouts
then have W * P cache rows, and each (shape, backend, prefix) times contiguous, paged, contiguous, paged on the same
q / tree / mask (the row keeps the faster of a layout's two); `paged_table` prints paged / contiguous per row.
On a CPU backend it runs a tiny smoke sweep in the Pallas interpreter (numbers meaningless; checks the script).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import _back_to_back, copy_ceiling, matmul_peak, per_call_s, write_results  # noqa: E402

from kdtree_jax.decode.speculative import aligned_rows  # noqa: E402
from pallas_kernels import verify_attn_mgpu  # noqa: E402
from pallas_kernels.verify_attn import BACKENDS, MIN_SPLIT_ROWS, SM_COUNT, _default_splits, _make_plan, verify_attn  # noqa: E402

# --backends choices -> (verify_attn backend, its extra keywords)
BENCH_BACKENDS = {**{b: (b, {}) for b in BACKENDS}, "mosaic-xla-tree": ("mosaic", {"tree_in_kernel": False})}
SCALE = 0.1446796  # K2.6 softmax scale (`kimi_k2_6().softmax_scale`: 192^-0.5 x YaRN mscale^2)
MIN_BENCH_S = 0.3  # keep timing a shape until this much time is spent (after at least MIN_REPS calls)
MIN_REPS, MAX_REPS = 3, 20
ROTATE_BYTES = 256 << 20  # cache bytes read per rotation of input sets: 5x the H200's 50 MB L2
MAX_SETS, MIN_SETS = 64, 8  # input sets (calls) per timed jit: one host dispatch is shared by >= 8 calls
SET_MEMORY = 32 << 30  # device bytes the rotated caches may take (MIN_SETS wins where they would take more)


def median_per_call_s(fn, sets) -> float:
    return per_call_s(fn, sets, min_reps=MIN_REPS, max_reps=MAX_REPS, min_total_s=MIN_BENCH_S)


def kernel_per_call_s(fn, sets) -> tuple[float, float]:
    """(GPU kernel time, kernel span) per call from a jax.profiler trace of the same back-to-back jit: the sum of
    every kernel's duration, and first kernel start to last kernel end (kernels + the gaps between them, without
    the host dispatch before the first). Device timestamps, so what the kernels themselves take."""
    return kernel_time_per_call(traced_kernels(fn, sets), len(sets))


def traced_kernels(fn, sets) -> list[dict]:
    """The GPU kernel events of one run of fn over every set back to back in one jit (a warm run first)."""
    from profile_round import gpu_kernels

    run = _back_to_back(fn)
    jax.block_until_ready(run(list(sets)))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(run(list(sets)))
        return gpu_kernels(trace_dir)


def kernel_time_per_call(events: list[dict], calls: int) -> tuple[float, float]:
    """(summed kernel durations, first start to last end) / calls, in seconds, from trace events (µs ts / dur)."""
    if not events:
        raise RuntimeError("kernel_per_call_s: the trace has no GPU kernel events (is the backend a GPU?)")
    busy = sum(e["dur"] for e in events) * 1e-6
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) * 1e-6
    return busy / calls, span / calls


@dataclasses.dataclass(frozen=True)
class Sweep:
    batches: tuple[int, ...]
    nodes: tuple[int, ...]  # N = 1 (AR) or 1 + B
    prefixes: tuple[int, ...]
    r: int = 512
    dr: int = 64
    dtype: str = "bfloat16"
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192


FULL = Sweep(batches=(1, 8, 64), nodes=(1, 17, 65, 257), prefixes=(1024, 4096, 8192, 32768))
QUICK = Sweep(batches=(1, 8), nodes=(1, 17), prefixes=(1024, 8192))
CPU_SMOKE = Sweep(batches=(1, 2), nodes=(1, 5), prefixes=(40, 100), r=32, dr=8, dtype="float32",
                  copy_bytes=16 << 20, matmul_n=256)
TUNE_SHAPES = {  # heads -> (batch, N, prefix)
    64: ((1, 1, 32768), (8, 1, 32768), (64, 1, 8192), (8, 17, 8192), (1, 257, 8192)),
    8: ((1, 1, 32768), (8, 1, 8192), (8, 1, 32768), (64, 1, 8192), (64, 1, 32768), (8, 17, 8192)),
}
CDIV_RULE = "cdiv"  # num_splits = the first split rule min(cdiv(132, Bt * tiles), S // 256), for a side-by-side
ONE_RESIDENT = "wave1"  # num_splits = the wave rule assuming one resident block per SM whatever the tile
TUNE_CONFIGS = {  # heads -> (block_q, block_k, num_warps, num_stages, num_splits); None = the kernel's default
    64: ((None, None, None, None, None), (None, None, None, None, CDIV_RULE), (16, 64, 4, 3, None),
         (32, 32, 4, 3, None), (32, 64, 4, 2, None), (32, 32, 4, 3, 32)),
    8: ((None, None, None, None, None), (None, None, None, None, CDIV_RULE), (None, None, None, None, ONE_RESIDENT),
        (16, 64, 4, 3, None), (16, 32, 4, 4, None), (16, 64, 4, 2, None), (32, 64, 4, 2, None)),
}


def baseline_splits(rule: str, bt: int, n: int, h: int, s: int, block_q: int | None) -> int:
    """Split counts of earlier rules, the baselines of the wave rule: CDIV_RULE (the first rule: one program per SM,
    rounded up) or ONE_RESIDENT (whole waves of one block per SM)."""
    plan = _make_plan(bt, n, h, s, 512, 64, block_q, None, 1, 2)  # K2 widths, bf16
    if rule == CDIV_RULE:
        return min(-(-SM_COUNT // (bt * plan.n_q)), max(1, s // MIN_SPLIT_ROWS))
    return _default_splits(bt * plan.n_q, s // MIN_SPLIT_ROWS, 1, s)


def ancestor_masks(rng, bt: int, n: int) -> np.ndarray:
    """[bt, n, n] ancestor-or-self masks of random trees (parent slot < child slot)."""
    vis = np.broadcast_to(np.eye(n, dtype=bool), (bt, n, n)).copy()
    for i in range(1, n):
        parents = rng.integers(0, i, bt)
        vis[:, i] |= vis[np.arange(bt), parents]
    return vis


def n_sets(bt: int, prefix: int, capacity: int, a: int, itemsize: int) -> int:
    """Input sets to rotate so one rotation reads >= ROTATE_BYTES of cache (L2 cannot serve the next call)."""
    touched, whole = bt * prefix * a * itemsize, bt * capacity * a * itemsize
    return max(MIN_SETS, min(MAX_SETS, -(-ROTATE_BYTES // touched), SET_MEMORY // whole))


def make_inputs(sweep: Sweep, bt: int, n: int, h: int, capacity: int, seed: int, caches: int = 1):
    """q [Bt, N, H, A], `caches` distinct caches [Bt, S, A], tree_kv [Bt, N, A], ancestor masks [Bt, N, N]."""
    dtype = jnp.dtype(sweep.dtype)
    a = sweep.r + sweep.dr
    kq, kt, *kc = jax.random.split(jax.random.key(seed), 2 + caches)
    q = jax.random.normal(kq, (bt, n, h, a), dtype)
    cache = [jax.random.normal(k, (bt, capacity, a), dtype) for k in kc]
    tree_kv = jax.random.normal(kt, (bt, n, a), dtype)
    mask = jnp.asarray(ancestor_masks(np.random.default_rng(seed), bt, n))
    return q, cache, tree_kv, mask


def reference_row0(q, cache, prefix: int, tree_kv, mask, r: int) -> jax.Array:
    """fp32 jnp attention for request 0 only (cheap enough at every size): -> [N, H, R]."""
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    keys = jnp.concatenate([cache[0, :prefix], tree_kv[0]], axis=0).astype(f32)  # [P + N, A]
    vis = jnp.concatenate([jnp.ones((q.shape[1], prefix), bool), mask[0]], axis=1)  # [N, P + N]
    s = jnp.einsum("nha,ka->nhk", q[0].astype(f32), keys, precision=hi) * SCALE
    p = jax.nn.softmax(jnp.where(vis[:, None, :], s, -jnp.inf), axis=-1)
    return jnp.einsum("nhk,kr->nhr", p, keys[:, :r], precision=hi)


def rel_err_row0(call, q, cache, prefix: int, tree_kv, mask, r: int) -> float:
    got = call(q, cache, jnp.full((q.shape[0],), prefix, jnp.int32), tree_kv, mask)[0].astype(jnp.float32)
    want = reference_row0(q, cache, prefix, tree_kv, mask, r)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def timed_sets(q, caches, prefix: int, tree_kv, mask):
    """One argument set per cache; the prefix differs by one row between sets, so XLA cannot merge two calls."""
    bt = q.shape[0]
    return [(q, c, jnp.full((bt,), prefix - i, jnp.int32), tree_kv, mask) for i, c in enumerate(caches)]


def paged_capacity(capacity: int, page: int) -> int:
    """Cache rows per request when the cache is paged: `capacity` rounded up to whole pages (the table's W * P)."""
    return -(-capacity // page) * page


def page_pool(cache, page: int, key):
    """The rows of `cache` [Bt, S, A] (S a multiple of page) as a shuffled page pool: -> (pool [Bt * W, P, A],
    page_table [Bt, W] int32) with pool[page_table[b, s // P], s % P] == cache[b, s] and every pool page used once,
    in a random order (so neighbouring pages of a request are not neighbours in the pool)."""
    bt, s, a = cache.shape
    if s % page:
        raise ValueError(f"page_pool: {s} cache rows are not whole pages of {page}")
    pages = cache.reshape(bt * (s // page), page, a)  # flat page f = b * W + w
    perm = jax.random.permutation(key, pages.shape[0]).astype(jnp.int32)  # flat page f goes to pool page perm[f]
    return pages[jnp.argsort(perm)], perm.reshape(bt, s // page)


def paged_sets(q, pools, prefix: int, tree_kv, mask):
    """`timed_sets` over (pool, page table) pairs: arguments of verify_attn's paged call, the table last."""
    bt = q.shape[0]
    return [(q, pool, jnp.full((bt,), prefix - i, jnp.int32), tree_kv, mask, table)
            for i, (pool, table) in enumerate(pools)]


def output_diff(a, b) -> float:
    """max |a - b| / max |b| over two outputs of one call (0.0: bit-equal)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def read_same_bytes(caches, prefix: int, trace: bool) -> tuple[float, float]:
    """(wall, GPU kernel) seconds per call of an XLA sum over the cache rows a verify call reads, in the same
    back-to-back harness: the time a call that only reads those bytes takes at this size, launch and tail
    included. For a small read this, not the 2 GiB copy, bounds what any attention kernel can reach."""
    def read(c):
        return c[:, :prefix].astype(jnp.float32).sum(axis=(1, 2))

    sets = [(c,) for c in caches]
    return median_per_call_s(read, sets), (kernel_per_call_s(read, sets)[0] if trace else float("nan"))


def bench_verify_attn(sweep: Sweep, heads: tuple[int, ...], interpret: bool, deadline: float,
                      backends: tuple[str, ...] = ("triton",), trace: bool = False, page: int = 0) -> list[dict]:
    """Every shape with each backend that applies to it, on the same inputs, one after the other; with `trace`,
    also the GPU kernel time per call (kernel_per_call_s), and that of an XLA read of the same cache bytes. With
    `page`, each prefix is also timed over a shuffled page pool of the same rows (rows with layout "paged<P>"),
    the two layouts interleaved twice (each row keeps its faster run); layout "contiguous" otherwise."""
    rows = []
    a, r = sweep.r + sweep.dr, sweep.r
    itemsize = jnp.dtype(sweep.dtype).itemsize
    layouts = ("contiguous",) + ((f"paged{page}",) if page else ())
    for h in heads:
        for n in sweep.nodes:
            for bt in sweep.batches:
                if time.perf_counter() > deadline:
                    print(f"time budget spent: skipping H={h} N={n} batch={bt}", flush=True)
                    continue
                capacity = aligned_rows(max(sweep.prefixes) + n)  # as the engine allocates it
                if page:  # both layouts get the table's rows, so only the addressing differs
                    capacity = paged_capacity(capacity, page)
                sets = n_sets(bt, min(sweep.prefixes), capacity, a, itemsize)
                q, caches, tree_kv, mask = make_inputs(sweep, bt, n, h, capacity, seed=bt * 1000 + n, caches=sets)
                pools = ([page_pool(c, page, jax.random.key(bt * 1000 + n + 7919 * i)) for i, c in enumerate(caches)]
                         if page else [])
                reads = {}  # prefix -> read_same_bytes, measured once for both backends
                for backend in backends:
                    kernel_backend, tree_kw = BENCH_BACKENDS[backend]
                    if kernel_backend == "mosaic" and not verify_attn_mgpu.supports(sweep.dtype, r, sweep.dr,
                                                                                    capacity):
                        continue

                    def call(q, c, p, t, m, backend=kernel_backend, kw=tree_kw):
                        return verify_attn(q, c, p, t, m, scale=SCALE, kv_lora_rank=r, interpret=interpret,
                                           backend=backend, **kw)

                    def call_paged(q, pool, p, t, m, table, backend=kernel_backend, kw=tree_kw):
                        return verify_attn(q, pool, p, t, m, page_table=table, scale=SCALE, kv_lora_rank=r,
                                           interpret=interpret, backend=backend, **kw)

                    t0 = time.perf_counter()
                    jax.block_until_ready(call(*timed_sets(q, caches, sweep.prefixes[0], tree_kv, mask)[0]))
                    compile_s = {"contiguous": time.perf_counter() - t0}
                    err = max(rel_err_row0(call, q, caches[0], p, tree_kv, mask, r)
                              for p in (min(sweep.prefixes), max(sweep.prefixes)))
                    diff = {"contiguous": 0.0}
                    if page:
                        t0 = time.perf_counter()
                        jax.block_until_ready(call_paged(*paged_sets(q, pools, sweep.prefixes[0], tree_kv, mask)[0]))
                        compile_s[layouts[1]] = time.perf_counter() - t0
                        diff[layouts[1]] = max(output_diff(call_paged(*paged_sets(q, pools, p, tree_kv, mask)[0]),
                                                           call(*timed_sets(q, caches, p, tree_kv, mask)[0]))
                                               for p in (min(sweep.prefixes), max(sweep.prefixes)))
                    for prefix in sweep.prefixes:
                        k = n_sets(bt, prefix, capacity, a, itemsize)
                        timed = {"contiguous": (call, timed_sets(q, caches[:k], prefix, tree_kv, mask))}
                        if page:
                            timed[layouts[1]] = (call_paged, paged_sets(q, pools[:k], prefix, tree_kv, mask))
                        runs = {x: [] for x in layouts}
                        for _ in range(2 if page else 1):  # interleaved: drift hits both layouts alike
                            for layout, (fn, args) in timed.items():
                                runs[layout].append(median_per_call_s(fn, args))
                        if prefix not in reads:
                            reads[prefix] = read_same_bytes(caches[:k], prefix, trace)
                        nbytes = (bt * prefix * a * itemsize + q.nbytes + q.nbytes * r // a + tree_kv.nbytes
                                  + mask.nbytes)
                        flops = 2 * bt * n * h * (prefix + n) * (a + r)
                        for layout, (fn, args) in timed.items():
                            sec = min(runs[layout])
                            kernel_s, span_s = kernel_per_call_s(fn, args) if trace else (float("nan"),) * 2
                            rows.append(dict(kernel="verify_attn", backend=backend, layout=layout, batch=bt,
                                             nodes=n, heads=h, prefix=prefix, capacity=capacity, ms=sec * 1e3,
                                             ms_runs=[x * 1e3 for x in runs[layout]], bytes=nbytes, flops=flops,
                                             gbps=nbytes / sec / 1e9, tflops=flops / sec / 1e12, rel_err_row0=err,
                                             diff_vs_contiguous=diff[layout], first_call_s=compile_s[layout],
                                             sets=k, kernel_ms=kernel_s * 1e3, span_ms=span_s * 1e3,
                                             kernel_gbps=nbytes / kernel_s / 1e9, read_ms=reads[prefix][0] * 1e3,
                                             read_kernel_ms=reads[prefix][1] * 1e3))
                            print(json.dumps(rows[-1]), flush=True)
                del q, caches, tree_kv, mask, pools
    return rows


def paged_table(rows: list[dict]) -> str:
    """Paged against contiguous, one line per (backend, batch, N, H, prefix) that has both: wall ms per call and,
    where traced, GPU kernel ms per call, each with paged / contiguous; "diff" = max |paged - contiguous| / max
    |contiguous| of the outputs (0: bit-equal)."""
    key = lambda x: (x.get("backend", "triton"), x["batch"], x["nodes"], x["heads"], x["prefix"])  # noqa: E731
    contiguous = {key(x): x for x in rows if x.get("layout", "contiguous") == "contiguous"}
    lines = ["| backend | batch | N | H | prefix | layout | contiguous ms | paged ms | paged / contiguous | "
             "contiguous kernel ms | paged kernel ms | paged / contiguous (kernels) | diff |", "|---" * 13 + "|"]
    for x in rows:
        c = contiguous.get(key(x))
        if x.get("layout", "contiguous") == "contiguous" or c is None:
            continue
        kc, kp = c.get("kernel_ms", float("nan")), x.get("kernel_ms", float("nan"))
        lines.append(f"| {key(x)[0]} | {x['batch']} | {x['nodes']} | {x['heads']} | {x['prefix']} | {x['layout']} | "
                     f"{c['ms']:.3f} | {x['ms']:.3f} | {x['ms'] / c['ms']:.3f} | {kc:.3f} | {kp:.3f} | "
                     f"{kp / kc:.3f} | {x.get('diff_vs_contiguous', float('nan')):.1e} |")
    return "\n".join(lines)


def paged_summary(rows: list[dict], tolerance: float = 0.05) -> str:
    """The worst paged / contiguous ratio per backend, wall and kernel time, against 1 + tolerance."""
    key = lambda x: (x.get("backend", "triton"), x["batch"], x["nodes"], x["heads"], x["prefix"])  # noqa: E731
    contiguous = {key(x): x for x in rows if x.get("layout", "contiguous") == "contiguous"}
    paged = [(x, contiguous[key(x)]) for x in rows
             if x.get("layout", "contiguous") != "contiguous" and key(x) in contiguous]
    lines = []
    for backend in sorted({key(x)[0] for x, _ in paged}):
        for label, field in (("wall", "ms"), ("kernels", "kernel_ms")):
            ratios = [x[field] / c[field] for x, c in paged if key(x)[0] == backend and c.get(field, 0) > 0
                      and x.get(field) == x.get(field)]  # NaN (untraced) left out
            if ratios:
                worst, verdict = max(ratios), "met" if max(ratios) <= 1 + tolerance else "not met"
                lines.append(f"{backend}, {label}: paged / contiguous {min(ratios):.3f}-{worst:.3f} over "
                             f"{len(ratios)} rows (goal <= {1 + tolerance:.2f}: {verdict})")
    return "\n".join(lines)


def tune(sweep: Sweep, heads: int, interpret: bool, deadline: float) -> list[dict]:
    rows = []
    a, r = sweep.r + sweep.dr, sweep.r
    itemsize = jnp.dtype(sweep.dtype).itemsize
    for bt, n, prefix in TUNE_SHAPES[heads]:
        k = n_sets(bt, prefix, prefix + n, a, itemsize)
        q, caches, tree_kv, mask = make_inputs(sweep, bt, n, heads, prefix + n, seed=7, caches=k)
        nbytes = bt * prefix * a * itemsize
        for bq, bk, warps, stages, splits in TUNE_CONFIGS[heads]:
            if time.perf_counter() > deadline:
                break
            if splits in (CDIV_RULE, ONE_RESIDENT):
                splits = baseline_splits(splits, bt, n, heads, prefix + n, bq)
            row = dict(batch=bt, nodes=n, heads=heads, prefix=prefix, block_q=bq, block_k=bk, num_warps=warps,
                       num_stages=stages, num_splits=splits)

            def call(q, c, p, t, m, bq=bq, bk=bk, w=warps, st=stages, sp=splits):
                return verify_attn(q, c, p, t, m, scale=SCALE, kv_lora_rank=r, block_q=bq, block_k=bk, num_warps=w,
                                   num_stages=st, num_splits=sp, interpret=interpret, backend="triton")

            try:
                row["splits_used"] = _make_plan(bt, n, heads, prefix + n, r, sweep.dr, bq, bk, splits,
                                                itemsize).n_splits
                row["rel_err_row0"] = rel_err_row0(call, q, caches[0], prefix, tree_kv, mask, r)
                row["ms"] = median_per_call_s(call, timed_sets(q, caches, prefix, tree_kv, mask)) * 1e3
                row["cache_gbps"] = nbytes / row["ms"] / 1e6
            except Exception as e:  # a config that does not compile (e.g. shared memory) is a result, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, caches, tree_kv, mask
    return rows


def tune_table(rows: list[dict]) -> str:
    lines = ["| batch | N | H | prefix | block_q | block_k | warps | stages | splits (used) | ms | cache GB/s | "
             "rel err |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        res = (f"{x['ms']:.3f} | {x['cache_gbps']:.0f} | {x['rel_err_row0']:.1e}" if "ms" in x
               else f"{x['error']} | - | -")
        lines.append(f"| {x['batch']} | {x['nodes']} | {x['heads']} | {x['prefix']} | {x['block_q']} | "
                     f"{x['block_k']} | {x['num_warps']} | {x['num_stages']} | "
                     f"{x['num_splits']} ({x.get('splits_used', '-')}) | {res} |")
    return "\n".join(lines)


def verify_table(rows: list[dict], copy_bw: float, peak: float) -> str:
    lines = ["| backend | layout | batch | N | H | prefix | ms | GB/s | % copy | kernel ms | span ms | "
             "% copy (kernels) | read ms (kernels) | % read (kernels) | TFLOP/s | % roofline | bound | rel err |",
             "|---" * 18 + "|"]
    for x in rows:
        t_mem, t_mma = x["bytes"] / copy_bw, x["flops"] / peak
        roof = max(t_mem, t_mma) / (x["ms"] / 1e3)
        kern = x.get("kernel_ms", float("nan"))
        lines.append(f"| {x.get('backend', 'triton')} | {x.get('layout', 'contiguous')} | {x['batch']} | "
                     f"{x['nodes']} | {x['heads']} | {x['prefix']} | "
                     f"{x['ms']:.3f} | {x['gbps']:.1f} | {100 * x['gbps'] * 1e9 / copy_bw:.0f}% | {kern:.3f} | "
                     f"{x.get('span_ms', float('nan')):.3f} | {100 * x['bytes'] / (kern / 1e3) / copy_bw:.0f}% | "
                     f"{x.get('read_kernel_ms', float('nan')):.3f} | "
                     f"{100 * x.get('read_kernel_ms', float('nan')) / kern:.0f}% | {x['tflops']:.1f} | "
                     f"{100 * roof:.0f}% | {'mem' if t_mem >= t_mma else 'mma'} | {x['rel_err_row0']:.1e} |")
    return "\n".join(lines)


def bandwidth_summary(rows: list[dict], copy_bw: float, peak: float, min_prefix: int = 8192) -> str:
    """The >= 60%-of-copy target, checked where it is physically reachable (memory-bound rows, prefix >= 8k)."""
    lines = []
    for backend in sorted({x.get("backend", "triton") for x in rows}):
        mem = [x for x in rows if x.get("backend", "triton") == backend and x["prefix"] >= min_prefix
               and x["bytes"] / copy_bw >= x["flops"] / peak]
        if not mem:
            lines.append(f"{backend}: no memory-bound row with prefix >= {min_prefix}")
            continue
        for label, sec in (("wall", lambda x: x["ms"] / 1e3), ("kernels", lambda x: x.get("kernel_ms", 0) / 1e3)):
            pct = [100 * x["bytes"] / sec(x) / copy_bw for x in mem if sec(x) > 0]
            if pct:
                lines.append(f"{backend}, {label}: memory-bound rows with prefix >= {min_prefix}: {len(pct)}, "
                             f"% of copy bandwidth min {min(pct):.0f}% / median {statistics.median(pct):.0f}% / max "
                             f"{max(pct):.0f}% (target >= 60%)")
    return "\n".join(lines)


def run_tree_bench(out_rows: list, quick: bool) -> str:
    path = os.path.join(ROOT, "benchmarks", "bench_tree_kernels.py")
    if not os.path.exists(path):
        return "note: benchmarks/bench_tree_kernels.py not found; tree kernel benchmark skipped"
    spec = importlib.util.spec_from_file_location("bench_tree_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    params = inspect.signature(mod.run).parameters
    kw = {k: v for k, v in dict(batches=(1, 8), budgets=(16, 64)).items() if k in params} if quick else {}
    mod.run(out_rows, **kw)
    if hasattr(mod, "markdown"):
        return mod.markdown(out_rows)
    return "\n".join(json.dumps(x) for x in out_rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sweep")
    parser.add_argument("--out", help="write all results as JSON to this path")
    parser.add_argument("--heads", type=int, nargs="+", default=None, help="query heads per GPU (default 64)")
    parser.add_argument("--tune", action="store_true", help="first time block / warp / split choices")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no new shape after this many seconds")
    parser.add_argument("--skip-tree", action="store_true", help="do not run the tree kernel benchmark")
    parser.add_argument("--batches", type=int, nargs="+", help="override the sweep's batch sizes")
    parser.add_argument("--nodes", type=int, nargs="+", help="override the sweep's N (1 = AR, 1 + B = a tree)")
    parser.add_argument("--prefixes", type=int, nargs="+", help="override the sweep's prefix lengths")
    parser.add_argument("--trace", action="store_true",
                        help="also the GPU kernel time per call, from a jax.profiler trace of each timed jit")
    parser.add_argument("--paged", type=int, nargs="?", const=64, default=0, metavar="P",
                        help="also time each call over a shuffled pool of P-row pages (default P: 64), interleaved "
                             "with the contiguous cache, and print paged / contiguous")
    parser.add_argument("--backends", nargs="+", choices=tuple(BENCH_BACKENDS), default=None,
                        help="verify_attn backends to time side by side (default: triton and mosaic on a GPU, "
                             "triton on CPU; mosaic-xla-tree: mosaic with the tree block in XLA)")
    args = parser.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    sweep = (QUICK if args.quick else FULL) if on_gpu else CPU_SMOKE
    overrides = dict(batches=args.batches, nodes=args.nodes, prefixes=args.prefixes)
    sweep = dataclasses.replace(sweep, **{k: tuple(v) for k, v in overrides.items() if v})
    heads = tuple(args.heads or ((64,) if on_gpu else (4,)))
    interpret = not on_gpu
    if not on_gpu:
        print(f"warning: backend {jax.default_backend()}: tiny smoke sweep in the Pallas interpreter", file=sys.stderr)
    device = jax.devices()[0].device_kind
    t_start = time.perf_counter()
    copy_bw, peak = copy_ceiling(sweep.copy_bytes), matmul_peak(sweep.matmul_n)
    result = dict(device=device, copy_gbps=copy_bw / 1e9, matmul_tflops=peak / 1e12)
    print(f"## Ceilings on {device}\ncopy (read+write) {copy_bw / 1e9:.0f} GB/s, bf16 matmul {peak / 1e12:.0f} "
          f"TFLOP/s\n", flush=True)

    deadline = t_start + args.budget_s
    if args.tune:
        if not on_gpu:
            parser.error("--tune times compiled kernels at K2 sizes and needs a GPU backend")
        result["tune"] = [row for h in heads for row in tune(sweep, h, interpret, deadline)]
        print(f"## verify_attn tuning\n{tune_table(result['tune'])}\n", flush=True)
    backends = tuple(args.backends or (BACKENDS if on_gpu else ("triton",)))
    if args.paged and (args.paged < 16 or args.paged & (args.paged - 1)):
        parser.error(f"--paged {args.paged}: the page size must be a power of two >= 16")
    rows = bench_verify_attn(sweep, heads, interpret, deadline, backends, trace=args.trace and on_gpu,
                             page=args.paged)
    result["verify_attn"] = rows
    summary = bandwidth_summary([x for x in rows if x.get("layout", "contiguous") == "contiguous"], copy_bw, peak)
    result["verify_attn_summary"] = summary
    print(f"## verify_attn ({sweep.dtype}, A = {sweep.r} + {sweep.dr})\n{verify_table(rows, copy_bw, peak)}\n\n"
          f"{summary}\n", flush=True)
    if args.paged:
        result["paged_summary"] = paged_summary(rows)
        print(f"## verify_attn over {args.paged}-row pages against the contiguous cache\n{paged_table(rows)}\n\n"
              f"{result['paged_summary']}\n", flush=True)
    if not args.skip_tree:
        tree_rows = []
        print(f"## tree kernels\n{run_tree_bench(tree_rows, args.quick)}\n", flush=True)
        result["tree_kernels"] = tree_rows
    result["total_s"] = time.perf_counter() - t_start
    print(f"total {result['total_s']:.0f} s")
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
