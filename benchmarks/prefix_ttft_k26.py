"""Time to first token with and without a prefix-cache hit, at Kimi K2.6 width on one GPU.

    python benchmarks/prefix_ttft_k26.py [--layers 3] [--prefix-tokens 32768] [--suffix-tokens 64] [--repeats 3]
                                         [--max-num-batched-tokens 8192] [--out prefix_ttft_k26.json] [--tiny]

The target is `kimi_k2_6()` cut to --layers decoder layers (layer 0 dense, the rest MoE with 384 INT4 experts, stored
tile-major as the engine stores them), bf16 weights and cache, random weights made on the device leaf by leaf
(`bench_kimi_layer.build_model`). It runs in an `Engine` (no drafter, no tokenizer) under a `ServingEngine` (mode ar,
--max-slots 2, pages of --page-size rows, chunked prefill of --max-num-batched-tokens tokens per step, prefix caching
on), stepped directly: no HTTP, no front. Each repeat draws a fresh random prefix P and two suffixes A and B (random
ids, B's first token unlike A's, so no page past P can match) and runs, greedy, --max-new-tokens each:
  cold  P + A with nothing cached: the whole context is prefilled, chunk by chunk;
  hit   P + B right after: P's full pages come from the cache (cached_tokens = P rounded down to the page), the rest
        is prefilled in one chunk;
  off   P + B again with the cache cleared and prefix caching off: the cold time of the hit's own request, whose
        first tokens must equal the hit's.
TTFT = RequestRecord.first_token_time - submit_time. A first repeat on its own prefix compiles the programs these
requests run (a prefill chunk per bucket they reach, the ar step) and is not in the statistics; its
wall time and each program's compile seconds are. Reported: each request's TTFT, cached tokens, prefill tokens/s
(tokens computed / TTFT) and first tokens; min and median TTFT per case; TTFT off / hit; whether every hit found
P's pages and drew the off request's tokens (the exit status is 1 where not).

Memory at the default 3 layers: 25.3 GB of weights, 19.0 GB of them the two MoE layers' routed experts (384 x 3 x
7168 x 2048 / 2 bytes of INT4 words + bf16 scales per group of 32, ~9.5 GB a layer); a pool of 2 requests of
max_context (576 bf16 latents x 3 layers a row: ~0.23 GB); an 8192-token chunk's activations, its largest the
chunk's f32 logits (8192 x 163840 x 4 bytes, 5.4 GB). An out-of-memory failure stops the run with a message naming
the flags that shrink it, and the JSON records it.

--tiny: `config.tiny()` shapes (prefix 256, suffix 16, pages of 16, 64-token chunks, f32) on any backend: on a CPU
it checks the script, not the speed. Without --tiny a CPU backend is refused (the weights alone need 25 GB).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kimi_layer import ENGINE_LAYOUT, build_model, weight_bytes  # noqa: E402
from bench_util import finish_on_sigterm, recorded_run  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax.decode.engine import Engine  # noqa: E402
from kdtree_jax.decode.speculative import aligned_rows  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.serving import RequestParams, ServeConfig, ServingEngine  # noqa: E402
from kdtree_jax.serving.xla_options import CACHE_ENV, enable_compilation_cache  # noqa: E402
from pallas_kernels.verify_attn import PAGE_SIZES  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
CASES = ("cold", "hit", "off")
MAX_SLOTS = 2  # a request at a time is timed; a second slot keeps the pool and the programs a serving engine's
# rows of the pool beyond max_context per request: one ar round's scratch (2 rows) and the rows reserved ahead of
# a step (rounds x 1), with room to spare
POOL_SCRATCH_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Shape:
    """Defaults of one model width: K2.6 on a GPU, or the tiny config anywhere."""

    prefix_tokens: int
    suffix_tokens: int
    page_size: int
    chunk_tokens: int  # max_num_batched_tokens
    context_margin: int  # max_context = prefix + this
    dtype: str


K26 = Shape(prefix_tokens=32768, suffix_tokens=64, page_size=64, chunk_tokens=8192, context_margin=512,
            dtype="bfloat16")
TINY = Shape(prefix_tokens=256, suffix_tokens=16, page_size=16, chunk_tokens=64, context_margin=64, dtype="float32")


class RequestFailed(RuntimeError):
    """A request ended with "error": a program raised (its message says what, e.g. out of memory)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=3, help="decoder layers (layer 0 dense, the rest MoE)")
    p.add_argument("--prefix-tokens", type=int, help="shared prefix length (default 32768; --tiny 256)")
    p.add_argument("--suffix-tokens", type=int, help="new message after the prefix (default 64; --tiny 16)")
    p.add_argument("--repeats", type=int, default=3, help="fresh random prefixes timed (after one warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--page-size", type=int, help="cache rows per page (default 64; --tiny 16)")
    p.add_argument("--max-num-batched-tokens", type=int, help="prefill tokens per step (default 8192; --tiny 64)")
    p.add_argument("--max-context", type=int, help="serving max_context (default prefix + 512; --tiny prefix + 64)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="weights and cache (default bfloat16; --tiny float32)")
    p.add_argument("--seed", type=int, default=0, help="token ids and weights")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no repeat after the first once this many seconds have passed")
    p.add_argument("--tiny", action="store_true", help="config.tiny() shapes: a check of the script, on any backend")
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    shape = TINY if args.tiny else K26
    for name in ("prefix_tokens", "suffix_tokens", "page_size", "dtype"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(shape, name))
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = shape.chunk_tokens
    if args.max_context is None:
        args.max_context = args.prefix_tokens + shape.context_margin
    for flag in ("layers", "prefix_tokens", "suffix_tokens", "repeats", "max_new_tokens", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.page_size not in PAGE_SIZES:
        p.error(f"--page-size must be one of {PAGE_SIZES}, got {args.page_size}")
    need = args.prefix_tokens + args.suffix_tokens + args.max_new_tokens
    if need > args.max_context:
        p.error(f"--max-context {args.max_context} is below --prefix-tokens + --suffix-tokens + --max-new-tokens "
                f"({need})")
    return args


def model_config(args):
    base = tiny() if args.tiny else kimi_k2_6()
    return dataclasses.replace(base, num_hidden_layers=args.layers)


def serve_config(args) -> ServeConfig:
    """Ar serving over a pool of MAX_SLOTS requests of max_context (and their scratch); nothing else in it."""
    pages = -(-aligned_rows(args.max_context + POOL_SCRATCH_ROWS) // args.page_size)
    return ServeConfig(max_slots=MAX_SLOTS, max_context=args.max_context, mode="ar", page_size=args.page_size,
                       max_num_batched_tokens=args.max_num_batched_tokens, num_pages=MAX_SLOTS * pages,
                       prefill_batch=1, overlap=False, enable_prefix_caching=True)


def run_request(core: ServingEngine, prompt: list[int], params: RequestParams) -> dict:
    """Submit one request, step until the engine is idle; its TTFT, cached tokens and first tokens."""
    rid = core.submit(prompt, params)
    record, steps = None, 0
    while core.has_work:
        report = core.step()
        steps += 1
        record = next((e for e in report.records if e.request_id == rid), record)
    if record is None or record.finish_reason == "error":
        raise RequestFailed(record.error if record is not None else f"request {rid} never finished")
    ttft = record.first_token_time - record.submit_time
    computed = len(prompt) - record.cached_tokens
    return dict(prompt_tokens=len(prompt), cached_tokens=record.cached_tokens, computed_tokens=computed,
                ttft_s=ttft, prefill_tokens_per_s=computed / ttft, first_tokens=list(record.token_ids),
                finish_reason=record.finish_reason, steps=steps)


def one_repeat(core: ServingEngine, rng: np.random.Generator, args, vocab: int) -> dict[str, dict]:
    """cold (P + A), hit (P + B), off (P + B, caching off) on a fresh random prefix P."""
    prefix = rng.integers(0, vocab, args.prefix_tokens).tolist()
    a, b = (rng.integers(0, vocab, args.suffix_tokens).tolist() for _ in range(2))
    if b[0] == a[0]:  # the page holding P's end must differ, or the hit would reach past P
        b[0] = (a[0] + 1) % vocab
    params = RequestParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True, seed=args.seed)
    cache = core.cache
    cache.clear_cache()
    out = {"cold": run_request(core, prefix + a, params), "hit": run_request(core, prefix + b, params)}
    cache.prefix_caching = False
    cache.clear_cache()
    try:
        out["off"] = run_request(core, prefix + b, params)
    finally:
        cache.prefix_caching = True
    return out


def summarize(rows: list[dict], expected_cached: int) -> dict:
    """Per case: min / median TTFT, cached tokens, prefill tokens/s; the off / hit ratio; the checks."""
    by = {c: [r for r in rows if r["case"] == c] for c in CASES}
    cases = {c: dict(ttft_min_s=min(r["ttft_s"] for r in rs), ttft_median_s=statistics.median(r["ttft_s"] for r in rs),
                     cached_tokens=[r["cached_tokens"] for r in rs],
                     prefill_tokens_per_s_median=statistics.median(r["prefill_tokens_per_s"] for r in rs))
             for c, rs in by.items() if rs}
    out = dict(cases=cases, expected_hit_cached_tokens=expected_cached)
    if by["hit"] and by["off"]:
        ratios = [o["ttft_s"] / h["ttft_s"] for o, h in zip(by["off"], by["hit"])]
        out["ttft_ratio_off_over_hit"] = dict(per_repeat=ratios, median=statistics.median(ratios),
                                              of_medians=cases["off"]["ttft_median_s"] / cases["hit"]["ttft_median_s"])
        out["hits_found_prefix"] = all(r["cached_tokens"] == expected_cached for r in by["hit"])
        out["cold_and_off_found_nothing"] = all(r["cached_tokens"] == 0 for r in by["cold"] + by["off"])
        out["hit_tokens_equal_off"] = all(h["first_tokens"] == o["first_tokens"] for h, o in zip(by["hit"], by["off"]))
    return out


def markdown(result: dict) -> str:
    s, serve = result["summary"], result["serve"]
    title = (f"prefix TTFT, {result['model']} x {result['layers']} layers, {result['dtype']}, {result['device']}: "
             f"prefix {result['prefix_tokens']} + suffix {result['suffix_tokens']} tokens, page {serve['page_size']}, "
             f"chunk {serve['max_num_batched_tokens']}")
    lines = [title, "", "| case | TTFT min ms | TTFT median ms | cached tokens | prefill tokens/s (median) |",
             "|---|---|---|---|---|"]
    for c, v in s["cases"].items():
        lines.append(f"| {c} | {1e3 * v['ttft_min_s']:.1f} | {1e3 * v['ttft_median_s']:.1f} | "
                     f"{v['cached_tokens']} | {v['prefill_tokens_per_s_median']:.0f} |")
    if "ttft_ratio_off_over_hit" in s:
        lines += ["", (f"TTFT off / hit: median {s['ttft_ratio_off_over_hit']['median']:.1f}x; hits found the "
                       f"prefix: {s['hits_found_prefix']}; hit tokens = off tokens: {s['hit_tokens_equal_off']}")]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and not args.tiny:
        print("prefix_ttft_k26: K2.6 width needs a GPU (25 GB of weights at 3 layers); pass --tiny on a CPU",
              file=sys.stderr)
        return 2
    if os.environ.get(CACHE_ENV):
        enable_compilation_cache()
    finish_on_sigterm()
    cfg, dtype = model_config(args), DTYPES[args.dtype]
    device = jax.devices()[0].device_kind
    result = dict(benchmark="prefix_ttft_k26", model="tiny" if args.tiny else "kimi_k2_6", device=device,
                  backend=jax.default_backend(), layers=args.layers, dense_layers=min(cfg.first_k_dense_replace,
                                                                                      args.layers),
                  dtype=args.dtype, expert_format="int4", expert_layout=ENGINE_LAYOUT,
                  shapes=dict(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                              n_routed_experts=cfg.n_routed_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                              intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                              kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim),
                  prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, repeats=args.repeats,
                  max_new_tokens=args.max_new_tokens, rows=[])
    shrink = (f"--layers ({args.layers}), --max-num-batched-tokens ({args.max_num_batched_tokens}) or "
              f"--prefix-tokens ({args.prefix_tokens})")
    with recorded_run("prefix_ttft_k26", result, args.out, shrink) as run:
        run.stage = "building the model"
        graphdef, state = build_model(cfg, dtype)
        result["weight_bytes"] = weight_bytes(state)
        engine = Engine(nnx.merge(graphdef, state), None, None, use_pallas=not on_cpu)
        run.stage = "building the serving engine"
        core = ServingEngine(engine, serve_config(args))
        result["serve"] = dict(dataclasses.asdict(core.config), page_bytes=core.page_bytes,
                               pool_bytes=core.num_pages * core.page_bytes)
        result["build_s"] = time.perf_counter() - run.t0
        print(f"{device}: {core.capacity_summary()}; weights {sum(result['weight_bytes'].values()) / 1e9:.1f} GB, "
              f"built in {result['build_s']:.0f} s", flush=True)
        rng = np.random.default_rng(args.seed)
        run.stage = "the warm-up repeat (compiles)"
        t1 = time.perf_counter()
        warm = one_repeat(core, rng, args, cfg.vocab_size)
        result["warmup"] = dict(wall_s=time.perf_counter() - t1, compile_s=dict(core.warmup_s),
                                ttft_s={c: r["ttft_s"] for c, r in warm.items()})
        print(f"warm-up {result['warmup']['wall_s']:.0f} s; compiled {result['warmup']['compile_s']}", flush=True)
        for i in range(args.repeats):
            if i and time.perf_counter() - run.t0 > args.budget_s:
                result["stopped_early"] = f"--budget-s {args.budget_s} reached after {i} repeats"
                print(result["stopped_early"], flush=True)
                break
            run.stage = f"repeat {i}"
            for case, row in one_repeat(core, rng, args, cfg.vocab_size).items():
                result["rows"].append(dict(repeat=i, case=case, **row))
                print(f"repeat {i} {case}: TTFT {1e3 * row['ttft_s']:.1f} ms, cached {row['cached_tokens']}, "
                      f"{row['prefill_tokens_per_s']:.0f} prefill tokens/s", flush=True)
        result["prefix_cache"] = dict(hits=core.prefix_cache_hits, queries=core.prefix_cache_queries)
        expected = args.prefix_tokens // args.page_size * args.page_size
        result["summary"] = summarize(result["rows"], expected)
        print(markdown(result), flush=True)
        s = result["summary"]
        if not (s.get("hits_found_prefix") and s.get("cold_and_off_found_nothing") and s.get("hit_tokens_equal_off")):
            print("prefix_ttft_k26: a check failed (see summary)", file=sys.stderr)
            run.status = 1
    return run.status


if __name__ == "__main__":
    sys.exit(main())
