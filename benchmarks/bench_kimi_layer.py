"""Full-width Kimi K2.6 layers on one GPU: forward_verify / forward_prefill time against the bytes they must move.

    python benchmarks/bench_kimi_layer.py [--layers 2] [--quick] [--out results.json] [--no-pallas-attn]
                                          [--as-is-max-tokens 65] [--budget-s 270]

K2.6 shapes from `kimi_k2_6()` with `--layers` decoder layers (layer 0 dense, the rest MoE with INT4 experts), bf16
weights and cache, random weights made on the GPU leaf by leaf from an abstract model (`nnx.eval_shape`), so nothing
model-sized ever exists on the host.

Measured (median, warm-up, block_until_ready; cache donated and fed back):
  - forward_verify (absorbed MLA, verify_attn Pallas kernel unless --no-pallas-attn): N = 1 (AR) and N = 1 + B for
    B in {16, 64, 256} (random ancestor-mask trees), batch 1 and 8, cache prefix 4k and 32k (the prefix is a
    runtime value: one compile per (batch, N, MoE)); --steps steps per jitted call on distinct token sets, in a
    loop that threads the cache, so the host's per-call dispatch is amortised as in the engine's decode loop; with
    two loop lengths (--steps 8 32) the per-step time is the slope between them, which drops the fixed cost per
    call entirely.
  - prefill of 4k tokens, batch 1 and 8, two ways: "prefill_chunked" is what the engine runs (256-token chunks through
    the verify path: absorbed MLA, causal mask, verify_attn, at a traced start); "prefill" is one plain-MLA
    forward_prefill over all tokens at start 0 (the model's other form, for comparison). Both rows' roofline uses
    the plain-MLA FLOPs and one read of the weights; the chunked path reads the weights once per chunk and does
    ~3.4x the attention FLOPs per score (576 + 512 wide instead of 192 + 128), so its roofline is a lower bound.
  - --expert-layouts: the kernel MoE with its experts row-major (as loaded) and / or tile-major (as the engine stores
    them on one GPU, `kdtree_jax.model.moe.tile_experts`), side by side; the cost model fits the engine's layout.
  - --expert-pools P..: each kernel-MoE point again with the routed experts folded onto the first P experts (expert
    e -> e mod P, after the router: a token may then meet one expert twice), so that the distinct experts a step
    reads vary at a fixed batch and token count: the points that separate the cost model's expert-byte and per-token
    terms, which rise together over batch sizes.
  - MoE two ways: "kernel" = the model's expert path swapped (locally, by patching kdtree_jax.model.moe's expert functions
    while tracing) for `pallas_kernels.int4_moe.int4_moe_ffn`; "as_is" = the model's own path (gather / dense, which
    dequantizes every gathered or every expert), tried only up to --as-is-max-tokens routed tokens.
Bytes that must move = every non-routed weight (attention, dense MLP, shared expert, router, norms, lm_head) + the
distinct experts each MoE layer touched (INT4 words + scales, counted inside the same jitted call) + the latent
cache prefix read. Roofline = bytes / copy bandwidth measured in the same run; part roofline = the sum over the
attention core, the non-routed weights' matmuls and the routed experts of max(bytes / copy bandwidth, FLOPs / bf16
matmul peak measured in the same run), which counts the compute of wide trees (`step_flops`). A cost model
t = a + b * attention roofline + c * distinct-expert bytes + d * tokens, the attention roofline being max(cache bytes
/ copy rate, attention FLOPs / matmul peak) of the row's own run, coefficients >= 0, fitted for the smallest
worst-case relative error over the verify points of the kernel MoE, with the fit error per point
and the leave-one-out worst error; `--refit results.json` refits a saved run without a GPU. Every config is guarded (OOM / compile failure recorded,
sweep continues) and the whole run stops starting new configs after --budget-s seconds. On a CPU backend it runs a
tiny-config smoke sweep (numbers meaningless).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from trace_parts import busy_time, command_buffers_off, gpu_kernels, hlo_scopes, part_times, top_kernels  # no jax

if __name__ == "__main__" and "--trace" in sys.argv[1:]:  # before jax reads XLA_FLAGS: kernels must name their op
    command_buffers_off()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_int4_moe import cycling  # noqa: E402
from bench_util import (  # noqa: E402
    copy_ceiling,
    finish_on_sigterm,
    is_oom,
    matmul_peak,
    median_s,
    short_error,
    write_results,
)
from flax import nnx  # noqa: E402

import kdtree_jax.model.moe as moe_mod  # noqa: E402
from kdtree_jax.decode.speculative import aligned_rows  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.model.layers import rms_norm  # noqa: E402
from kdtree_jax.model.moe import tile_experts  # noqa: E402
from kdtree_jax.model.target import KimiModel, LatentCache, forward_prefill, forward_verify  # noqa: E402
from pallas_kernels.int4_moe import UNPACK_MODES, int4_moe_ffn  # noqa: E402
from pallas_kernels.verify_attn import BACKENDS  # noqa: E402

N_SETS = 2  # prefill: token sets cycled per timing (different routing each call)
VERIFY_CALLS = 8  # verify steps per jitted call, each on its own token set (different routing each step)
PREFILL_CHUNK = 256  # the engine's prefill chunk (Engine.prefill_chunk)
ROUTED = ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")
# the model's named scopes (kdtree_jax/model/target.py, moe.py) -> the parts of a step a --trace profile reports, matched
# in this order against the scope path's segments; kernels under none of them are "other" (small kernels, glue)
LAYER_PARTS = (("head", "head"), ("attn", "attention"), ("experts", "experts"), ("shared", "shared_expert"),
               ("router", "router"), ("ffn", "dense_mlp"))
LAYER_PALLAS_PARTS = {"verify_attn": "attention", "int4": "experts"}  # pallas_call names -> part
TRACE_HLO, TRACE_KERNELS = "step.hlo.txt", "kernels_by_part.json"  # written beside each --trace profile
TOP_KERNELS = 8  # kernels per part in a result row (TRACE_KERNELS holds them all)
# how the routed INT4 experts are stored: as loaded ([E, N, K/8]), or re-laid by `kdtree_jax.model.moe.tile_experts`, which
# the engine applies when it loads a target onto one device
ROW_MAJOR, TILE_MAJOR = "row-major", "tile-major"
EXPERT_LAYOUTS = (ROW_MAJOR, TILE_MAJOR)
ENGINE_LAYOUT = TILE_MAJOR


@dataclasses.dataclass(frozen=True)
class Sweep:
    batches: tuple[int, ...] = (1, 8)
    nodes: tuple[int, ...] = (1, 17, 65, 257)  # N = 1 (AR) or 1 + B
    prefixes: tuple[int, ...] = (4096, 32768)
    prefill_tokens: int = 4096
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192


FULL = Sweep()
QUICK = Sweep(batches=(1, 8), nodes=(1, 65), prefixes=(4096, 32768))
CPU_SMOKE = Sweep(batches=(1, 2), nodes=(1, 5), prefixes=(20, 40), prefill_tokens=16, copy_bytes=16 << 20,
                  matmul_n=256)


# ---- model with random weights made on the device -----------------------------------------------------------------
def _init_leaf(key, shape, dtype, kind: str, group: int):
    if kind == "bits":
        return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)
    if kind == "scale":  # INT4 group scales: magnitude of a 1/sqrt(fan_in) init
        fan_in = shape[-1] * group
        return (jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5) / (4.0 * fan_in**0.5)).astype(dtype)
    if kind == "norm":
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    if kind == "bias":
        return (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    fan_in = int(np.prod(shape[:-1])) if kind == "matrix" else 1
    return (jax.random.normal(key, shape, jnp.float32) / fan_in**0.5).astype(dtype)


def _leaf_kind(name: str, sds) -> str:
    if sds.dtype == jnp.int32:
        return "bits"
    if name.endswith("_scale"):
        return "scale"
    if name == "bias":
        return "bias"
    if len(sds.shape) == 1:
        return "norm"
    return "embed" if name == "embed" else "matrix"


def random_module(build, group: int, seed: int = 0):
    """(graphdef, state) of the module `build()` makes, each leaf filled by its own jitted init on the device (nothing
    model-sized on the host); `group` = the INT4 scale group, for the scales' magnitude."""
    graphdef, state = nnx.split(nnx.eval_shape(build))
    init = jax.jit(_init_leaf, static_argnums=(1, 2, 3, 4))
    counter = iter(range(1 << 30))

    def fill(path, sds):
        name = next((str(getattr(p, "key", "")) for p in reversed(path) if str(getattr(p, "key", "")) != "value"),
                    "")
        key = jax.random.fold_in(jax.random.key(seed), next(counter))
        return init(key, tuple(sds.shape), sds.dtype, _leaf_kind(name, sds), group)

    return graphdef, jax.tree_util.tree_map_with_path(fill, state)


def build_model(cfg, dtype, moe_impl: str = "auto", expert_layout: str = ENGINE_LAYOUT):
    """(graphdef, state) of a KimiModel with INT4 experts and random weights made on the device, the experts stored
    as the engine stores them (`expert_layout` TILE_MAJOR) or as loaded (ROW_MAJOR)."""
    graphdef, state = random_module(lambda: KimiModel(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype,
                                                      cache_dtype=dtype, expert_format="int4", moe_impl=moe_impl),
                                    cfg.quantization.group_size)
    return (graphdef, state) if expert_layout == ROW_MAJOR else tile_major(graphdef, state)[:2]


def tile_major(graphdef, state):
    """(graphdef, state) with the kernel layers' experts re-laid as the engine does (`moe.tile_experts`; the given
    state is left as it is), and how many layers were re-laid."""
    model = nnx.merge(graphdef, state)
    count = tile_experts(model)
    return (*nnx.split(model), count)


def weight_bytes(state) -> dict:
    """nbytes by class: routed experts (all), attention, embed, other non-routed (dense MLP, shared, router, norms,
    lm_head)."""
    out = dict(routed=0, attention=0, embed=0, other=0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        keys = [str(getattr(p, "key", "")) for p in path]
        kind = ("routed" if any(k in ROUTED for k in keys) else "attention" if "attn" in keys
                else "embed" if keys[0] == "embed" else "other")
        out[kind] += leaf.nbytes
    return out


def int4_expert_bytes(cfg) -> int:
    per = cfg.hidden_size * cfg.moe_intermediate_size
    return 3 * (per // 2 + per // cfg.quantization.group_size * 2)


# ---- MoE swap (local wrapper, active only while tracing) ---------------------------------------------------------
@contextlib.contextmanager
def moe_experts(mode: str, record: list, interpret: bool, expert_pool: int | None = None, unpack: str | None = None):
    """Route the model's MoE expert computation through `mode` ("kernel" | "as_is" | "skip"), recording each layer's
    idx. "skip" returns zeros for the routed experts (router, shared expert and the rest still run): the AR breakdown's
    step without the routed experts. expert_pool P ("kernel" only): expert ids folded to id mod P before the kernel;
    unpack: the kernel's INT4 unpack (`int4_moe.UNPACK_MODES`; None: its default).

    The model's own path choice is pinned to the XLA shape rule (gather / dense) while tracing, so that on a GPU,
    where "auto" would pick the kernel itself, both modes pass through the recording wrappers below."""
    orig = moe_mod._experts_gather, moe_mod._experts_dense
    orig_resolve = moe_mod.resolve_impl
    moe_mod.resolve_impl = lambda moe, n: ("gather" if n * moe.cfg.num_experts_per_tok < moe.cfg.n_routed_experts
                                           else "dense")

    def kernel(moe, x, weights, idx):
        idx = idx if expert_pool is None else idx % expert_pool
        record.append(idx)
        ws = [getattr(moe, n)[...] for n in ROUTED]
        return int4_moe_ffn(x, idx, weights, *ws, unpack=unpack, interpret=interpret).astype(x.dtype)

    def wrap(fn):
        def experts(moe, x, weights, idx):
            record.append(idx)
            return fn(moe, x, weights, idx)
        return experts

    def skip(moe, x, weights, idx):
        record.append(idx)
        return jnp.zeros_like(x)

    if mode == "kernel":
        moe_mod._experts_gather = moe_mod._experts_dense = kernel
    elif mode == "skip":
        moe_mod._experts_gather = moe_mod._experts_dense = skip
    else:
        moe_mod._experts_gather, moe_mod._experts_dense = wrap(orig[0]), wrap(orig[1])
    try:
        yield
    finally:
        moe_mod._experts_gather, moe_mod._experts_dense = orig
        moe_mod.resolve_impl = orig_resolve


def _distinct(record: list, n_experts: int) -> jax.Array:
    """[n MoE layers] distinct experts touched per layer."""
    if not record:
        return jnp.zeros((0,), jnp.int32)
    return jnp.stack([jnp.zeros((n_experts,), jnp.int32).at[i.reshape(-1)].set(1).sum() for i in record])


def make_verify(graphdef, cfg, mode: str, use_pallas: bool, interpret: bool, attn_backend: str | None = None,
                expert_pool: int | None = None, unpack: str | None = None):
    """One jit running a verify step once per token set ([calls, Bt, N]) in a loop that threads the cache: the
    host dispatch (tens of µs) is paid once per `calls` steps, as in the engine's compiled decode loop. Returns
    (a logit sum that keeps every step alive, the cache, mean distinct experts per MoE layer)."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))

    def fn(state, token_sets, positions, start, mask, cache):
        model = nnx.merge(graphdef, state)

        def step(i, carry):
            cache, acc, distinct = carry
            record = []
            with moe_experts(mode, record, interpret, expert_pool, unpack):
                out = forward_verify(model, token_sets[i], positions, start, mask, cache, use_pallas=use_pallas,
                                     interpret=interpret, attn_backend=attn_backend)
            return out.cache, acc + out.logits[0, 0, 0], distinct + _distinct(record, cfg.n_routed_experts)

        init = (cache, jnp.float32(0), jnp.zeros((n_moe,), jnp.int32))
        cache, acc, distinct = jax.lax.fori_loop(0, token_sets.shape[0], step, init)
        return acc, cache, distinct / token_sets.shape[0]
    return jax.jit(fn, donate_argnums=(5,))


def make_head(graphdef, cfg):
    """The step's parts outside the decoder layers, alone: embedding lookup, final norm, lm_head (once per token set,
    in one jit, as make_verify)."""
    def fn(state, token_sets):
        model = nnx.merge(graphdef, state)

        def step(i, acc):
            h = model.embed[...][token_sets[i]].astype(model.dtype)
            logits = jnp.einsum("btd,dv->btv", rms_norm(h, model.norm[...], cfg.rms_norm_eps),
                                model.lm_head[...].astype(model.dtype), preferred_element_type=jnp.float32)
            return acc + logits[0, 0, 0]

        return jax.lax.fori_loop(0, token_sets.shape[0], step, jnp.float32(0))
    return jax.jit(fn)


def make_prefill(graphdef, cfg, mode: str, interpret: bool, chunk: int | None, use_pallas: bool):
    """chunk None: one plain-MLA forward_prefill over all T tokens at start 0. chunk C: what the engine runs, T / C
    chunks through the verify path (absorbed MLA, causal mask, verify_attn) in a scan at a traced start."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))

    def fn(state, tokens, cache):
        model = nnx.merge(graphdef, state)
        if chunk is None:
            record = []
            with moe_experts(mode, record, interpret):
                out = forward_prefill(model, tokens, 0, cache)
            return out.logits[:, -1], out.cache, _distinct(record, cfg.n_routed_experts)
        bt, t = tokens.shape
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (bt, chunk, chunk))

        def one(carry, c):
            cache, distinct = carry
            start = c * chunk
            record = []
            with moe_experts(mode, record, interpret):
                out = forward_verify(model, jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1),
                                     jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (bt, chunk)),
                                     jnp.full((bt,), start, jnp.int32), causal, cache, use_pallas=use_pallas,
                                     interpret=interpret)
            return (out.cache, distinct + _distinct(record, cfg.n_routed_experts)), out.logits[:, -1]

        (cache, distinct), last = jax.lax.scan(one, (cache, jnp.zeros((n_moe,), jnp.int32)), jnp.arange(t // chunk))
        return last[-1], cache, distinct / (t // chunk)
    return jax.jit(fn, donate_argnums=(2,))


def ancestor_mask(rng, bt: int, n: int) -> np.ndarray:
    """[bt, n, n] ancestor-or-self masks of random trees (parent slot < child slot) and depths [bt, n]."""
    vis = np.broadcast_to(np.eye(n, dtype=bool), (bt, n, n)).copy()
    for i in range(1, n):
        vis[np.arange(bt), i] |= vis[np.arange(bt), rng.integers(0, i, bt)]
    return vis


def layer_part(op_name: str) -> str | None:
    """The step part an HLO op_name (its named-scope path) belongs to, or None."""
    segments = set(op_name.split("/"))
    return next((part for scope, part in LAYER_PARTS if scope in segments), None)


def per_step_ms(steps: tuple[int, ...], seconds: list[float]) -> dict:
    """Row fields from the seconds of jitted calls running `steps` steps each. One length: ms = time / steps, which
    still carries the call's fixed cost (host launch of the first step: ~0.6 ms at K2.6 width on an H200, against
    ~0.2 ms of host time per later step, hidden behind the GPU). Two lengths: ms = the slope, the cost of one more
    step in a compiled loop (what every step after the first costs in the engine's decode loop), and the fixed
    cost per call apart."""
    if len(steps) == 1:
        return {"ms": seconds[0] * 1e3 / steps[0]}
    (k0, k1), (t0, t1) = steps, seconds
    slope = (t1 - t0) / (k1 - k0)
    return {"ms": slope * 1e3, "ms_fixed_per_call": (t0 - k0 * slope) * 1e3, f"ms_per_step_of_{k0}": t0 * 1e3 / k0}


# ---- sweep ----------------------------------------------------------------------------------------------------------
class Runner:
    def __init__(self, cfg, sweep: Sweep, args, interpret: bool, dtype):
        self.cfg, self.sweep, self.args, self.interpret, self.dtype = cfg, sweep, args, interpret, dtype
        self.attn_backend = None if args.attn_backend == "auto" else args.attn_backend
        self.t0 = time.perf_counter()
        self.layouts = tuple(args.expert_layouts)
        self.graphdef, self.state = build_model(cfg, dtype, expert_layout=ROW_MAJOR)
        self.states = {ROW_MAJOR: self.state}
        self.tiled_layers = 0  # layers re-laid tile-major (the CPU smoke config's widths do not tile: 0 there)
        if TILE_MAJOR in self.layouts:
            _, self.states[TILE_MAJOR], self.tiled_layers = tile_major(self.graphdef, self.state)
        self.wbytes = weight_bytes(self.state)
        self.expert_bytes = int4_expert_bytes(cfg)
        self.rows: list[dict] = []

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def record(self, row: dict):
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def bytes_of(self, row: dict, distinct: np.ndarray, cache_rows: int) -> None:
        cache = cache_rows * self.cfg.latent_dim * jnp.dtype(self.dtype).itemsize * self.cfg.num_hidden_layers
        row["distinct_experts"] = [round(float(d), 1) for d in distinct]
        row["expert_bytes"] = int(np.sum(distinct)) * self.expert_bytes
        row["attn_bytes"] = self.wbytes["attention"] + cache
        row["cache_bytes"] = cache
        row["bytes"] = row["expert_bytes"] + row["attn_bytes"] + self.wbytes["other"]
        if row["kind"] == "verify":
            row["flops_by_part"] = row_flops(self.cfg, self.wbytes, row, jnp.dtype(self.dtype).itemsize)

    def verify_configs(self):
        sw = self.sweep
        capacity = aligned_rows(max(sw.prefixes) + max(sw.nodes))
        modes = [("kernel", layout) for layout in self.layouts] + [("as_is", ROW_MAJOR)]
        for mode, layout in modes:
            for bt in sw.batches:
                for n in sw.nodes:
                    base = dict(kind="verify", moe=mode, batch=bt, nodes=n, pallas_attn=not self.args.no_pallas_attn,
                                expert_layout=layout)
                    if mode == "as_is" and bt * n > self.args.as_is_max_tokens:
                        self.record({**base, "skipped": f"as-is MoE above {self.args.as_is_max_tokens} tokens "
                                                        "(dequantizes every gathered / every expert)"})
                        continue
                    for row_base in self.pooled(base):
                        if self.out_of_time():
                            self.record({**row_base, "skipped": "time budget"})
                            continue
                        self.verify_one(row_base, bt, n, capacity, mode, layout)

    def pooled(self, base: dict) -> list[dict]:
        """A point's rows: the router's own experts, then (kernel MoE) each --expert-pools P (`expert_pool`)."""
        pools = (self.args.expert_pools or []) if base["moe"] == "kernel" else []
        return [base] + [{**base, "expert_pool": pool} for pool in pools]

    def verify_one(self, base, bt, n, capacity, mode, layout: str = ROW_MAJOR):
        cfg, rng, state = self.cfg, np.random.default_rng(bt * 1000 + n), self.states[layout]
        try:
            t_c = time.perf_counter()
            jitted = make_verify(self.graphdef, cfg, mode, not self.args.no_pallas_attn, self.interpret,
                                 self.attn_backend, base.get("expert_pool"), self.args.int4_unpack)
            cache = LatentCache.from_stacked(jax.random.normal(jax.random.key(3), (cfg.num_hidden_layers, bt, capacity,
                                                                             cfg.latent_dim), self.dtype))
            mask = ancestor_mask(rng, bt, n)
            depth = mask.sum(-1) - 1  # [bt, n]
            sets = {k: jnp.asarray(rng.integers(0, cfg.vocab_size, (k, bt, n)), jnp.int32) for k in self.args.steps}
            holder = {"cache": cache}
            compiled = {}  # one program per loop length (the prefix is runtime data); its HLO names the parts
            first = True
            for prefix in self.sweep.prefixes:
                row = dict(base, prefix=prefix, calls_per_jit=list(self.args.steps))
                start = jnp.full((bt,), prefix, jnp.int32)
                pos = jnp.asarray(prefix + depth, jnp.int32)
                m = jnp.asarray(mask)
                distinct = []

                def steps_of(k):
                    def call():
                        acc, holder["cache"], d = compiled[k](state, sets[k], pos, start, m, holder["cache"])
                        distinct.append(d)
                        return acc
                    return call

                if first:
                    for k in self.args.steps:
                        compiled[k] = jitted.lower(state, sets[k], pos, start, m, holder["cache"]).compile()
                        jax.block_until_ready(steps_of(k)())
                    row["first_call_s"] = time.perf_counter() - t_c
                    first = False
                row.update(per_step_ms(self.args.steps, [median_s(steps_of(k), min_reps=3, max_reps=10,
                                                                  min_total_s=0.1) for k in self.args.steps]))
                if self.args.trace:
                    row["parts_us_per_step"], row["top_kernels_us_per_step"], row["gpu_time_per_step"] = \
                        self.trace_parts(f"{mode}_{layout}_b{bt}_n{n}_p{prefix}", compiled, steps_of)
                self.bytes_of(row, np.mean(np.stack([np.asarray(d) for d in distinct]), axis=0), bt * prefix)
                if mode == "skip":  # routed experts not read
                    row["bytes"] -= row["expert_bytes"]
                    row["expert_bytes"] = 0
                self.record(row)
        except Exception as e:  # noqa: BLE001  (OOM / compile failure: record and go on)
            self.record({**base, "error": short_error(e), "oom": is_oom(e)})

    def trace_parts(self, tag: str, compiled: dict, steps_of) -> tuple[dict[str, float], dict[str, dict], dict]:
        """µs of GPU kernel time per step by part (attention, experts, shared expert, router, dense MLP, head, other),
        each part's largest kernels, and the kernels' launches, busy and span µs per step (`trace_parts.busy_time`),
        from a profiler trace of one call of the longest loop."""
        k = max(compiled)
        scopes = hlo_scopes(compiled[k].as_text(), layer_part)
        trace_dir = os.path.join(self.args.trace, tag)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(steps_of(k)())
        kernels = gpu_kernels(trace_dir)
        args = (kernels, scopes, layer_part, LAYER_PALLAS_PARTS, "other", k)
        every = top_kernels(*args, n=None)  # largest first in each part
        with open(os.path.join(trace_dir, TRACE_HLO), "w") as f:  # the fusions the kernel names refer to
            f.write(compiled[k].as_text())
        with open(os.path.join(trace_dir, TRACE_KERNELS), "w") as f:
            json.dump(every, f, indent=1)
        top = {part: dict(list(names.items())[:TOP_KERNELS]) for part, names in every.items()}
        return part_times(*args), top, busy_time(kernels, k)

    def ar_breakdown(self):
        """The AR step (N = 1) side by side with the same step without the routed experts and with the head alone:
        experts = full - skip, decoder layers without experts = skip - head."""
        capacity = aligned_rows(max(self.sweep.prefixes) + 1)
        for bt in self.sweep.batches:
            for mode, layout in [("kernel", layout) for layout in self.layouts] + [("skip", ROW_MAJOR)]:
                base = dict(kind="verify", moe=mode, batch=bt, nodes=1, pallas_attn=not self.args.no_pallas_attn,
                            expert_layout=layout)
                for row_base in self.pooled(base):
                    self.verify_one(row_base, bt, 1, capacity, mode, layout)
            fn = make_head(self.graphdef, self.cfg)
            rng = np.random.default_rng(bt)
            secs = [median_s(lambda: fn(self.state, tokens), min_reps=3, max_reps=10, min_total_s=0.1)
                    for tokens in (jnp.asarray(rng.integers(0, self.cfg.vocab_size, (k, bt, 1)), jnp.int32)
                                   for k in self.args.steps)]
            head_bytes = (self.cfg.vocab_size + bt + 1) * self.cfg.hidden_size * jnp.dtype(self.dtype).itemsize
            self.record(dict(kind="head", moe="-", batch=bt, nodes=1, calls_per_jit=list(self.args.steps),
                             **per_step_ms(self.args.steps, secs), distinct_experts=[],
                             bytes=head_bytes))  # lm_head + embedding rows + norm

    def prefill_configs(self):
        cfg, t = self.cfg, self.sweep.prefill_tokens
        chunk = min(PREFILL_CHUNK, t)
        for mode, kind, chunked in (("kernel", "prefill_chunked", chunk), ("kernel", "prefill", None),
                                    ("as_is", "prefill", None)):
            for bt in self.sweep.batches:
                layout = self.layouts[-1] if mode == "kernel" else ROW_MAJOR
                base = dict(kind=kind, moe=mode, batch=bt, tokens=t, chunk=chunked, expert_layout=layout)
                if mode == "as_is" and bt * t > self.args.as_is_max_tokens:
                    self.record({**base, "skipped": f"as-is MoE above {self.args.as_is_max_tokens} tokens"})
                    continue
                if self.out_of_time():
                    self.record({**base, "skipped": "time budget"})
                    continue
                try:
                    t_c = time.perf_counter()
                    fn = make_prefill(self.graphdef, cfg, mode, self.interpret, chunked,
                                      not self.args.no_pallas_attn)
                    rng = np.random.default_rng(bt)
                    token_sets = [(jnp.asarray(rng.integers(0, cfg.vocab_size, (bt, t)), jnp.int32),)
                                  for _ in range(N_SETS)]
                    holder = {"cache": LatentCache.zeros(cfg, bt, t, self.dtype)}
                    distinct = []

                    def call(tokens):
                        logits, holder["cache"], d = fn(self.states[layout], tokens, holder["cache"])
                        distinct.append(d)
                        return logits

                    jax.block_until_ready(call(token_sets[0][0]))
                    row = dict(base, first_call_s=time.perf_counter() - t_c)
                    row["ms"] = median_s(cycling(call, token_sets), min_reps=3, max_reps=5, min_total_s=0.1) * 1e3
                    self.bytes_of(row, np.mean(np.stack([np.asarray(d) for d in distinct]), axis=0), bt * t)
                    row["flops"] = prefill_flops(cfg, bt, t, self.wbytes)
                    self.record(row)
                except Exception as e:  # noqa: BLE001
                    self.record({**base, "error": short_error(e), "oom": is_oom(e)})


def prefill_flops(cfg, bt: int, t: int, wbytes: dict) -> float:
    """2 * tokens * active params (non-routed weights incl. lm_head + k experts) + plain-MLA attention (full T x T)."""
    active = (wbytes["attention"] + wbytes["other"]) / 2  # bf16 params
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    active += moe_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    attn = 2 * t * t * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * cfg.num_hidden_layers
    return float(bt * (2 * t * active + attn))


# candidate cost-model terms. The attention core is one term at its own roofline: a sum of FLOP and cache-byte terms
# cannot follow it from bandwidth-bound decode to compute-bound trees (leave-one-out 24% against 15.4% with the
# roofline on the 14 points of results/bench_kimi_layer/h200_block_grid_{ar,verify,verify_b64}.json)
COST_TERMS = ("intercept", "attn_roofline", "expert_bytes", "tokens")


def attn_flops(cfg, bt: int, n: int, prefix: int) -> float:
    """Absorbed-MLA verify attention FLOPs of all layers: every (node, head) row against prefix + tree keys, scores
    over the latent + rope width and values over the latent width. At 64 heads this, not the cache bytes, sets the
    attention time (~120 FLOP per cache byte even at N = 1)."""
    return 2.0 * bt * n * cfg.num_attention_heads * (prefix + n) * (cfg.latent_dim + cfg.kv_lora_rank) \
        * cfg.num_hidden_layers


def step_flops(cfg, wbytes: dict, bt: int, n: int, prefix: int, itemsize: int) -> dict[str, float]:
    """FLOPs of one verify step in its three sequential parts, each bound by its own bytes or its own FLOPs: the
    attention core (against the cache), the matmuls of the non-routed weights (attention projections, dense MLP,
    shared expert, router, lm_head: 2 FLOPs per weight per token) and the routed experts (k per token)."""
    tokens = bt * n
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return dict(attention=attn_flops(cfg, bt, n, prefix),
                weights=2.0 * tokens * (wbytes["attention"] + wbytes["other"]) / itemsize,
                experts=2.0 * tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
                * moe_layers)


def row_flops(cfg, wbytes: dict, row: dict, itemsize: int) -> dict[str, float]:
    """`step_flops` of a verify row's shape; a row with the routed experts skipped does none of theirs."""
    flops = step_flops(cfg, wbytes, row["batch"], row["nodes"], row["prefix"], itemsize)
    if row["moe"] == "skip":
        flops["experts"] = 0.0
    return flops


def attn_roofline_s(cache_bytes: float, flops: float, bw: float, peak: float) -> float:
    """The attention core's roofline: its cache read at the copy rate or its FLOPs at the matmul peak."""
    return max(cache_bytes / bw, flops / peak)


def part_roofline_s(row: dict, bw: float, peak: float) -> float:
    """Sum over the step's parts (`step_flops`) of max(bytes / copy rate, FLOPs / matmul peak): the roofline of
    parts that run one after another. It departs from bytes / bandwidth where a part is compute-bound (the attention
    core of wide trees at long prefixes)."""
    f = row["flops_by_part"]
    weight_bytes = row["bytes"] - row["cache_bytes"] - row["expert_bytes"]
    return (attn_roofline_s(row["cache_bytes"], f["attention"], bw, peak)
            + max(weight_bytes / bw, f["weights"] / peak) + max(row["expert_bytes"] / bw, f["experts"] / peak))


def _minimax_nonneg(x: np.ndarray, t: np.ndarray, iters: int = 300):
    """Coefficients c >= 0 minimising max_i |x_i . c / t_i - 1| (Lawson's reweighted least squares) over every subset
    of the columns; -> (max relative error, column indices, coefficients). Relative error: times span 1 ms..250 ms."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale / t[:, None]  # rows in units of the measured time
    best = None
    for mask in range(1, 1 << x.shape[1]):
        cols = [j for j in range(x.shape[1]) if mask >> j & 1]
        w = np.full(len(t), 1.0 / len(t))
        for _ in range(iters):
            sw = np.sqrt(w)
            c, *_ = np.linalg.lstsq(xs[:, cols] * sw[:, None], sw, rcond=None)
            res = np.abs(xs[:, cols] @ c - 1.0)
            if res.max() < 1e-12:  # exact: nothing left to reweight
                break
            w = w * res / np.sum(w * res)
        if (c < 0).any():
            continue
        err = float(np.abs(xs[:, cols] @ c - 1.0).max())
        if best is None or err < best[0]:
            best = (err, cols, c / scale[cols])
    return best


def fit_cost_model(rows: list[dict], cfg, copy_bw: float, peak: float) -> dict:
    """Verify time t = sum_k c_k * term_k, c_k >= 0, over the kernel-MoE verify points, terms from COST_TERMS (the
    subset with the smallest worst-case relative error); also the leave-one-out worst error (each point predicted by
    a fit without it), the honest figure for a model with this many terms. Each row's attention roofline uses its
    own run's copy rate and matmul peak where it carries them (a refit of several runs), else copy_bw and peak, which
    the result keeps as the rates its attention coefficient is relative to."""
    kernel = [r for r in rows if r.get("kind") == "verify" and r.get("moe") == "kernel" and "ms" in r]
    layouts = {r.get("expert_layout", ROW_MAJOR) for r in kernel}  # runs before the layout field: row-major
    fit_layout = ENGINE_LAYOUT if ENGINE_LAYOUT in layouts else ROW_MAJOR
    pts = [r for r in kernel if r.get("expert_layout", ROW_MAJOR) == fit_layout]
    if len(pts) < len(COST_TERMS) + 2:
        return dict(error=f"only {len(pts)} points")

    def terms(r):
        bw = row_copy_bw(r, copy_bw)
        pk = r["matmul_tflops"] * 1e12 if "matmul_tflops" in r else peak
        attn = attn_roofline_s(r["cache_bytes"], attn_flops(cfg, r["batch"], r["nodes"], r["prefix"]), bw, pk)
        return [1.0, attn, r["expert_bytes"], r["batch"] * r["nodes"]]

    x, t = np.array([terms(r) for r in pts]), np.array([r["ms"] / 1e3 for r in pts])
    err, cols, coef = _minimax_nonneg(x, t)
    pred = x[:, cols] @ coef
    for r, p in zip(pts, pred):
        r["fit_ms"] = float(p * 1e3)
        r["fit_rel_err"] = float(p / (r["ms"] / 1e3) - 1)
    loo = []
    for i in range(len(pts)):
        keep = np.arange(len(pts)) != i
        _, c_cols, c = _minimax_nonneg(x[keep], t[keep])
        loo.append(float(x[i, c_cols] @ c / t[i] - 1))
    named = {COST_TERMS[j]: float(v) for j, v in zip(cols, coef)}
    return dict(expert_layout=fit_layout, terms=named, a_ms=named.get("intercept", 0.0) * 1e3,
                attn_x_roofline=named.get("attn_roofline", 0.0),
                expert_GBps=1 / named["expert_bytes"] / 1e9 if named.get("expert_bytes") else None,
                us_per_token=named.get("tokens", 0.0) * 1e6, copy_gbps=copy_bw / 1e9, matmul_tflops=peak / 1e12,
                max_abs_rel_err=err, loo_max_abs_rel_err=float(np.abs(loo).max()), points=len(pts))


def row_copy_bw(r: dict, copy_bw: float) -> float:
    """A row's copy rate in bytes/s: its own run's in a refit of several runs, else copy_bw."""
    return r["copy_gbps"] * 1e9 if "copy_gbps" in r else copy_bw


def moe_label(r: dict) -> str:
    """The MoE column: the kernel's rows name their expert layout (and an expert pool, if folded onto one)."""
    if r.get("moe") != "kernel":
        return r["moe"]
    pool = f", {r['expert_pool']} experts" if "expert_pool" in r else ""
    return f"{r['moe']} {r.get('expert_layout', ROW_MAJOR)}{pool}"


def markdown(rows: list[dict], copy_bw: float, peak: float) -> str:
    lines = ["| kind | MoE | batch | N / T | prefix | ms | distinct experts / layer | GB moved | roofline ms | "
             "× roofline | × part roofline | fit ms (err) | note |", "|---" * 13 + "|"]
    for r in rows:
        n = r.get("nodes", r.get("tokens"))
        if "ms" not in r:
            note = r.get("skipped") or ("OOM" if r.get("oom") else r.get("error", ""))
            empty = " — |" * 8
            lines.append(f"| {r['kind']} | {moe_label(r)} | {r['batch']} | {n} |{empty} {note} |")
            continue
        bw = row_copy_bw(r, copy_bw)
        roof = r["bytes"] / bw
        if "flops" in r:
            roof = max(roof, r["flops"] / peak)
        fit = f"{r['fit_ms']:.2f} ({100 * r['fit_rel_err']:+.0f}%)" if "fit_ms" in r else "—"
        dist = "/".join(f"{d}" for d in r["distinct_experts"])
        x_parts = f"{r['ms'] / 1e3 / part_roofline_s(r, bw, peak):.2f}" if "flops_by_part" in r else "—"
        notes = ["compute"] if "flops" in r and r["flops"] / peak > r["bytes"] / bw else []
        if r.get("ms_fixed_per_call", 0.0) < 0:  # a fixed cost cannot be negative: the two timings disagree
            notes.append(f"slope noisy: fixed cost {r['ms_fixed_per_call']:.2f} ms per call")
        lines.append(f"| {r['kind']} | {moe_label(r)} | {r['batch']} | {n} | {r.get('prefix', 0)} | {r['ms']:.2f} | "
                     f"{dist} | {r['bytes'] / 1e9:.2f} | {roof * 1e3:.2f} | {r['ms'] / 1e3 / roof:.2f} | {x_parts} | "
                     f"{fit} | {'; '.join(notes)} |")
    traced = [r for r in rows if "parts_us_per_step" in r]
    if traced:
        parts = sorted({p for r in traced for p in r["parts_us_per_step"]})
        lines += ["", "GPU kernel µs per step by part (--trace); span: first kernel start to last kernel end over the "
                  "steps, so no per-call host time, a check on the slope:", "",
                  "| MoE | batch | N | prefix | " + " | ".join(parts) + " | sum | launches | busy | span | "
                  "span × part roofline |", "|---" * (len(parts) + 9) + "|"]
        for r in traced:
            got, gpu = r["parts_us_per_step"], r.get("gpu_time_per_step", {})
            x_span = (f"{gpu['span_us'] / 1e6 / part_roofline_s(r, row_copy_bw(r, copy_bw), peak):.2f}"
                      if "span_us" in gpu and "flops_by_part" in r else "—")
            lines.append(f"| {moe_label(r)} | {r['batch']} | {r['nodes']} | {r['prefix']} | "
                         + " | ".join(f"{got.get(p, 0.0):.1f}" for p in parts) + f" | {sum(got.values()):.1f} | "
                         + " | ".join(f"{gpu[k]:.1f}" if k in gpu else "—" for k in ("kernels", "busy_us", "span_us"))
                         + f" | {x_span} |")
    return "\n".join(lines)


def refit(paths: list[str], out: str | None) -> dict:
    """The cost model and table of saved K2.6-width runs (always K2.6 shapes: only a GPU run measures them). Several
    runs of the same layer count fit as one (e.g. the AR step at batch 1-64 and the verify step at batch 8), each row
    keeping the copy rate of its own run for its roofline."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    layers = {r["layers"] for r in runs}
    if len(layers) != 1:
        raise SystemExit(f"--refit: runs of different layer counts {sorted(layers)} cannot share one cost model")
    cfg = dataclasses.replace(kimi_k2_6(), num_hidden_layers=layers.pop())
    for run in runs:  # runs saved before the part roofline: the FLOPs from each row's shape
        for row in run["rows"]:
            if row.get("kind") == "verify" and "ms" in row and "flops_by_part" not in row and "weight_bytes" in run:
                row["flops_by_part"] = row_flops(cfg, run["weight_bytes"], row,
                                                 jnp.dtype(jnp.bfloat16).itemsize)  # GPU runs are bf16
    result = dict(runs[0], sources=list(paths), rows=[dict(row, copy_gbps=run["copy_gbps"],
                                                           matmul_tflops=run["matmul_tflops"])
                                                      for run in runs for row in run["rows"]])
    result["copy_gbps"] = min(run["copy_gbps"] for run in runs)
    result["matmul_tflops"] = min(run["matmul_tflops"] for run in runs)
    result["fit"] = fit_cost_model(result["rows"], cfg, result["copy_gbps"] * 1e9, result["matmul_tflops"] * 1e12)
    print(markdown(result["rows"], result["copy_gbps"] * 1e9, result["matmul_tflops"] * 1e12))
    print(f"\ncost model (kernel-MoE verify points): {json.dumps(result['fit'])}")
    if out:
        write_results(out, result)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (layer 0 dense, the rest MoE)")
    parser.add_argument("--quick", action="store_true", help="N 1 and 65 only")
    parser.add_argument("--out", help="write all results as JSON to this path")
    parser.add_argument("--no-pallas-attn", action="store_true", help="verify attention in jnp instead of Pallas")
    parser.add_argument("--attn-backend", choices=("auto", *BACKENDS), default="auto",
                        help="verify_attn backend (auto: mosaic on an H100/H200 where it applies)")
    parser.add_argument("--as-is-max-tokens", type=int, default=65,
                        help="measure the model's own MoE path only up to this many routed tokens")
    parser.add_argument("--budget-s", type=float, default=270.0, help="start no new config after this many seconds")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--ar-breakdown", action="store_true",
                        help="only the AR step, without the routed experts, and the head alone (side by side)")
    parser.add_argument("--steps", type=int, nargs="+", default=[VERIFY_CALLS],
                        help="verify steps per jitted call; two lengths (e.g. 8 32) report the slope per step, apart "
                             "from the fixed cost per call")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8)")
    parser.add_argument("--prefixes", type=int, nargs="+", default=None,
                        help="cache rows before the step (default 4096 32768)")
    parser.add_argument("--nodes", type=int, nargs="+", default=None,
                        help="tokens per request per step N = 1 (AR) or 1 + B (default 1 17 65 257)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="also profile each verify point into DIR and report its kernel time per step by part "
                             f"(XLA command buffers off, so that kernels name their HLO op); each point's profile "
                             f"directory also gets the compiled step ({TRACE_HLO}) and every kernel by part "
                             f"({TRACE_KERNELS})")
    parser.add_argument("--expert-layouts", nargs="+", choices=EXPERT_LAYOUTS, default=[ENGINE_LAYOUT],
                        help="how the kernel MoE's experts are stored, each timed side by side (row-major = as "
                             "loaded; tile-major = as the engine stores them, kdtree_jax.model.moe.tile_experts)")
    parser.add_argument("--expert-pools", type=int, nargs="+", metavar="P",
                        help="also run each kernel-MoE point with the expert ids folded onto the first P experts "
                             "(distinct experts varied at a fixed batch, for the cost model)")
    parser.add_argument("--int4-unpack", choices=UNPACK_MODES, default=None,
                        help="the kernel MoE's INT4 unpack in the verify / AR steps (default: the kernel's own)")
    parser.add_argument("--refit", metavar="JSON", nargs="+",
                        help="refit the cost model of saved --out files, as one (no GPU needed)")
    args = parser.parse_args(argv)
    if len(args.steps) not in (1, 2) or min(args.steps) < 1 or len(set(args.steps)) != len(args.steps):
        parser.error(f"--steps takes one length or two different lengths >= 1, got {args.steps}")
    args.steps = tuple(sorted(args.steps))
    if args.expert_pools and min(args.expert_pools) < 1:
        parser.error(f"--expert-pools takes expert counts >= 1, got {args.expert_pools}")
    if args.refit:
        return refit(args.refit, args.out)

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        cfg, sweep, dtype = dataclasses.replace(kimi_k2_6(), num_hidden_layers=args.layers), (
            QUICK if args.quick else FULL), jnp.bfloat16
    else:
        print(f"warning: backend {jax.default_backend()}: tiny-config smoke sweep", file=sys.stderr)
        cfg, sweep, dtype = dataclasses.replace(tiny(), num_hidden_layers=args.layers), CPU_SMOKE, jnp.float32
    chosen = (("batches", args.batches), ("nodes", args.nodes), ("prefixes", args.prefixes))
    sweep = dataclasses.replace(sweep, **{k: tuple(v) for k, v in chosen if v})
    if args.layers <= cfg.first_k_dense_replace:
        print(f"note: --layers {args.layers} gives no MoE layer (first_k_dense_replace {cfg.first_k_dense_replace})")
    t0 = time.perf_counter()
    device = jax.devices()[0].device_kind
    copy_bw, peak = copy_ceiling(sweep.copy_bytes), matmul_peak(sweep.matmul_n)
    print(f"## Kimi K2.6 layers on {device}: {args.layers} layers, copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul "
          f"{peak / 1e12:.0f} TFLOP/s\n", flush=True)
    finish_on_sigterm()
    runner, result = None, dict(device=device, copy_gbps=copy_bw / 1e9, matmul_tflops=peak / 1e12,
                                layers=args.layers, int4_unpack=args.int4_unpack)
    try:
        runner = Runner(cfg, sweep, args, interpret=not on_gpu, dtype=dtype)
        result["weight_bytes"] = runner.wbytes
        result["int4_bytes_per_expert"] = runner.expert_bytes
        result["tile_major_layers"] = runner.tiled_layers
        print(f"weights on device: {json.dumps(runner.wbytes)} (build {time.perf_counter() - t0:.0f} s); "
              f"{runner.tiled_layers} layers' experts tile-major", flush=True)
        if args.ar_breakdown:
            runner.ar_breakdown()
        else:
            runner.verify_configs()
        if not (args.skip_prefill or args.ar_breakdown):
            runner.prefill_configs()
    finally:  # partial tables on any failure
        rows = runner.rows if runner else []
        result["fit"] = fit_cost_model(rows, cfg, copy_bw, peak)
        result["rows"] = rows
        result["total_s"] = time.perf_counter() - t0
        print("\n" + markdown(rows, copy_bw, peak), flush=True)
        print(f"\ncost model (kernel-MoE verify points): {json.dumps(result['fit'])}")
        print(f"total {result['total_s']:.0f} s")
        if args.out:
            write_results(args.out, result)


if __name__ == "__main__":
    main()
