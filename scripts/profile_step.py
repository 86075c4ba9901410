"""Where one full-width K2.6 verify step spends its time, kernel by kernel (the AR step by default).

    python scripts/profile_step.py [--batch 1] [--nodes 1] [--prefix 4096] [--layers 2] [--hlo step.hlo.txt]
                                   [--trace DIR]
    ncu --profile-from-start off --print-units base --csv --metrics gpu__time_duration.sum \
        python scripts/profile_step.py ... > kernels.csv
    python scripts/profile_step.py --summarize kernels.csv --wall-us 1250

On the H200 machine (session 5) ncu segfaulted when attached to this process; `--trace DIR` (a jax.profiler
perfetto trace, read with `profile_round.gpu_kernels`) is what gave the per-kernel times there.

The step is `bench_kimi_layer`'s (same random K2.6 weights, INT4 expert kernel, verify_attn), VERIFY_CALLS steps per
jitted call as there (host dispatch amortised, as in the engine's decode loop). After warm-up it prints the wall time
per step, then runs one more call between cuProfilerStart / Stop, so a profiler started with `--profile-from-start
off` sees exactly VERIFY_CALLS steps' kernels. `--summarize` groups a profiler
CSV by kernel and by kind (Triton kernels of ours, cuBLAS, XLA fusions, copies) and sets the kernels' sum against
the wall time per step: the difference is launch gaps and host work between kernels. `--hlo` writes the optimized
HLO, which names the fusions the profiler lists.
"""
from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import dataclasses
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_kimi_layer import VERIFY_CALLS, ancestor_mask, build_model, make_verify  # noqa: E402
from bench_util import median_s  # noqa: E402
from kdtree_jax.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.model import LatentCache  # noqa: E402

KINDS = (  # first match wins: (kind, kernel-name pattern)
    ("verify_attn", r"verify_attn|_attn_"),
    ("int4 experts", r"int4|moe|expert"),
    ("top-k", r"topk"),
    ("cuBLAS / cutlass", r"gemv|gemm|cutlass|xmma|sm90|cublas|ampere|splitKreduce"),
    ("copies / memset", r"memcpy|memset|copy"),
    ("XLA fusions", r"fusion|reduce|loop_|input_|wrapped|transpose|concatenate|convert|dynamic|slice|gather|scatter"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def read_ncu_csv(path: str) -> list[tuple[str, float]]:
    """(kernel name, µs) per launch from `ncu --csv --metrics gpu__time_duration.sum` (any time unit)."""
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu prints its own log lines before the table
    rows = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        if unit not in scale:
            raise ValueError(f"{path}: unknown time unit {unit!r} in column 'Metric Unit'")
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale[unit]))
    if not rows:
        raise ValueError(f"{path}: no gpu__time_duration.sum rows (was ncu run with --csv --metrics "
                         "gpu__time_duration.sum --profile-from-start off?)")
    return rows


def summarize(path: str, wall_us: float | None, steps: int = VERIFY_CALLS, top: int = 25) -> str:
    """Per-step figures: the profile holds `steps` steps."""
    rows = [(name, us / steps) for name, us in read_ncu_csv(path)]
    total = sum(us for _, us in rows)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for name, us in rows:
        by_name[name].append(us)
        by_kind[kind_of(name)].append(us)
    out = [f"{len(rows) / steps:.0f} kernels per step, {total:.1f} µs summed"
           + (f"; wall {wall_us:.1f} µs per step, so {wall_us - total:.1f} µs ({1 - total / wall_us:.0%}) between "
              "kernels" if wall_us else ""), "",
           "| kind | launches per step | µs per step | share of kernel time |", "|---|---:|---:|---:|"]
    for kind, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"| {kind} | {len(v) / steps:g} | {sum(v):.1f} | {sum(v) / total:.0%} |")
    out += ["", "| kernel | kind | launches per step | µs per step | mean µs |", "|---|---|---:|---:|---:|"]
    for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        out.append(f"| `{name[:70]}` | {kind_of(name)} | {len(v) / steps:g} | {sum(v):.1f} | {np.mean(v) * steps:.2f} |")
    return "\n".join(out)


def _cuda_profiler(start: bool) -> None:
    """cuProfilerStart / Stop from the driver API: no CUDA runtime library needs to be importable."""
    lib = ctypes.CDLL("libcuda.so.1")
    rc = (lib.cuProfilerStart if start else lib.cuProfilerStop)()
    if rc:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned CUDA error {rc}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1, help="tokens verified per request (1 = the AR step)")
    parser.add_argument("--prefix", type=int, default=4096, help="cache prefix per request")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (layer 0 dense, the rest MoE)")
    parser.add_argument("--hlo", help="write the step's optimized HLO text here")
    parser.add_argument("--trace", metavar="DIR", help="also record one call with jax.profiler (perfetto JSON) in DIR")
    parser.add_argument("--summarize", metavar="CSV", help="summarize an ncu CSV instead of running")
    parser.add_argument("--wall-us", type=float, help="with --summarize: the wall time per step, µs")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.wall_us))
        return

    on_gpu = jax.default_backend() == "gpu"
    base, dtype = (kimi_k2_6(), jnp.bfloat16) if on_gpu else (tiny(), jnp.float32)
    cfg = dataclasses.replace(base, num_hidden_layers=args.layers)
    prefix = args.prefix if on_gpu else min(args.prefix, 32)
    bt, n = args.batch, args.nodes
    graphdef, state = build_model(cfg, dtype)
    fn = make_verify(graphdef, cfg, "kernel", True, not on_gpu)
    rng = np.random.default_rng(0)
    mask = ancestor_mask(rng, bt, n)
    pos = jnp.asarray(prefix + mask.sum(-1) - 1, jnp.int32)
    start = jnp.full((bt,), prefix, jnp.int32)
    m = jnp.asarray(mask)
    sets = [jnp.asarray(rng.integers(0, cfg.vocab_size, (VERIFY_CALLS, bt, n)), jnp.int32) for _ in range(2)]
    holder = {"cache": LatentCache(latent=jax.random.normal(
        jax.random.key(3), (cfg.num_hidden_layers, bt, prefix + n, cfg.latent_dim), dtype))}
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(fn.lower(state, sets[0], pos, start, m, holder["cache"]).compile().as_text())
    turn = iter(range(1 << 30))

    def call():
        acc, holder["cache"], _ = fn(state, sets[next(turn) % len(sets)], pos, start, m, holder["cache"])
        return acc

    wall = median_s(call, min_reps=10, max_reps=50, min_total_s=0.3) / VERIFY_CALLS
    print(f"step batch={bt} N={n} prefix={prefix} layers={args.layers}: {wall * 1e6:.1f} µs wall per step "
          f"({jax.devices()[0].device_kind})", flush=True)
    if on_gpu:
        _cuda_profiler(True)
        jax.block_until_ready(call())
        _cuda_profiler(False)
    if args.trace:
        with jax.profiler.trace(args.trace, create_perfetto_trace=True):
            jax.block_until_ready(call())


if __name__ == "__main__":
    main()
