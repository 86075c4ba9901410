"""A bytes-and-FLOPs model of one DDTree round of Kimi K2.6 on 8 H200s, and the budget it would pick (no GPU).

    python benchmarks/predict_k26.py [--mesh 1x1x8] [--bandwidth 2683 4300] [--allreduce-us 15] [--drafter-gb 2.0]
                                     [--layer-fit benchmarks/results/bench_kimi_layer/h200_fit.json]

Per GPU and verify step of N = 1 + B tree slots at batch Bt and cache prefix P, with the engine's own sharding
rules (`kdtree_jax/parallel/sharding.py`, applied to an abstract K2.6 INT4 model on a simulated 8-device mesh):
  bytes = every non-routed weight shard this GPU holds (read once per step; embedding rows excluded)
        + per MoE layer: the distinct routed experts the busiest GPU must read (Monte Carlo of uniform top-8
          routing of Bt * N tokens over 384 experts, experts split over the `expert` axis) x one expert's bytes
        + the latent cache prefix this GPU reads (all Bt * P rows: absorbed MLA's one latent head is replicated
          over the head split)
  flops = 2 x (non-routed + 8 routed experts' params) per token / tensor-parallel ways + attention scores/values
  t_step = max(bytes / bandwidth, flops / bf16 peak) + 2 all-reduces per layer x latency + drafter weights / bw
Tokens/s = Bt x tau(B) / t_step, with tau(B) measured on the shipped pair (BENCHMARKS.md section 1, H200): the
shape of the budget choice at K2.6 scale. Everything here is a model: bandwidth and peak are measured
ceilings (BENCHMARKS.md), the all-reduce latency and drafter size are assumptions (flags), uniform
routing overstates the experts a tree touches (sibling tokens route alike). Not a measurement.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kimi_layer import COST_TERMS, attn_flops, attn_roofline_s  # noqa: E402

from kdtree_jax.checkpoint.io import abstract_sharded_state  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6  # noqa: E402
from kdtree_jax.parallel import sharding as sh  # noqa: E402

ROUTED = ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")
# mean accepted tokens per round of the shipped pair on the H200 (BENCHMARKS.md section 1): mode/B -> tau
TAU = {"ar": (0, 1.0), "chain": (15, 2.90), "ddtree16": (16, 3.62), "ddtree32": (32, 3.94), "ddtree64": (64, 4.21),
       "ddtree128": (128, 4.44), "ddtree256": (256, 4.59)}
MATMUL_PEAK = 705e12  # bf16 FLOP/s measured on the H200 (BENCHMARKS.md header)


def weight_classes(mesh) -> dict:
    """Per-device bytes of the abstract K2.6 INT4 model by class, and one routed expert's bytes."""
    cfg = kimi_k2_6()
    _, state = abstract_sharded_state(cfg, mesh, param_dtype=jnp.bfloat16, expert_format="int4")
    out = dict(routed=0, embed=0, other=0)  # bytes on one device
    whole = dict(routed=0, embed=0, other=0)  # bytes of the whole model
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        keys = [str(getattr(p, "key", "")) for p in path]
        kind = "routed" if any(k in ROUTED for k in keys) else "embed" if keys[0] == "embed" else "other"
        out[kind] += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        whole[kind] += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    out["expert_bytes"] = whole["routed"] // (n_moe * cfg.n_routed_experts)
    out["other_params"] = whole["other"] // 2  # bf16
    out["expert_params"] = cfg.hidden_size * cfg.moe_intermediate_size * 3  # one expert's gate, up, down
    return cfg, out


def busiest_gpu_experts(rng, tokens: int, cfg, n_gpus: int, samples: int = 64) -> float:
    """Mean over samples of max over GPUs of distinct experts touched (uniform top-k routing, experts split evenly)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_gpu = e // n_gpus
    worst = []
    for _ in range(samples):
        picks = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]  # k distinct experts per token
        touched = np.zeros(e, bool)
        touched[picks.ravel()] = True
        worst.append(touched.reshape(n_gpus, per_gpu).sum(axis=1).max())
    return float(np.mean(worst))


def experts_per_gpu(rng, tokens: int, cfg, mesh) -> float:
    """Distinct experts per MoE layer the busiest GPU reads: all touched ones without expert parallelism."""
    if mesh.shape["expert"] > 1:
        return busiest_gpu_experts(rng, tokens, cfg, mesh.shape["expert"])
    return min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)


def cache_bytes(cfg, bt: int, prefix: int) -> float:
    """Latent cache bytes one step reads over all layers (bf16), as `bench_kimi_layer` counts them per run."""
    return bt * prefix * cfg.latent_dim * 2 * cfg.num_hidden_layers


def group_batch(bt: int, mesh) -> int:
    """Requests of the busiest data-parallel group: each data shard owns whole requests (`kdtree_jax/parallel/sharding.py`)."""
    return -(-bt // mesh.shape["data"])


def step_model(cfg, w: dict, mesh, *, bt: int, n: int, prefix: int, bandwidth: float, allreduce_s: float,
               drafter_bytes: float, rng) -> dict:
    n_gpus, ways, bt_g = mesh.size, mesh.size // mesh.shape["data"], group_batch(bt, mesh)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = experts_per_gpu(rng, bt_g * n, cfg, mesh)
    # the group's whole cache on every GPU of the group (absorbed MLA's one latent head is not split over heads)
    nbytes = w["other"] + n_moe * experts * w["expert_bytes"] + cache_bytes(cfg, bt_g, prefix)
    active = w["other_params"] + n_moe * cfg.num_experts_per_tok * w["expert_params"]  # params one token uses
    flops = (2 * active * bt_g * n + attn_flops(cfg, bt_g, n, prefix)) / ways
    t_mem, t_mma = nbytes / bandwidth, flops / MATMUL_PEAK
    t = max(t_mem, t_mma) + 2 * cfg.num_hidden_layers * allreduce_s + drafter_bytes / n_gpus / bandwidth
    return dict(bytes=nbytes, experts=experts, t_mem=t_mem, t_mma=t_mma, t=t)


def measured_step(cfg, w: dict, mesh, fit: dict, nonrouted_bytes_fit: float, *, bt: int, n: int, prefix: int,
                  allreduce_s: float, drafter_bytes: float, bandwidth: float, rng) -> dict:
    """t_step on the mesh from the terms measured on one GPU (`bench_kimi_layer.py`'s cost model, 2 layers):
    the fixed cost scales with the non-routed bytes each GPU reads (the fit's effective bandwidth for them); the
    rest follows the busiest data-parallel group's requests (`group_batch`): the per-token term with layers /
    model-parallel ways, the expert term with the busiest GPU's experts for the group's tokens, the attention term
    with its roofline on one GPU at the fit's copy rate and peak: the group's FLOPs of all layers / model-parallel
    ways against the group's whole cache of all layers (absorbed MLA's one latent head: every tensor-parallel GPU
    reads its requests' whole cache)."""
    terms = fit["terms"]
    unknown = set(terms) - set(COST_TERMS)
    if unknown:
        raise ValueError(f"predict_k26: the layer fit has terms {sorted(unknown)} outside {COST_TERMS}: refit the "
                         f"run with bench_kimi_layer.py --refit")
    ways, bt_g = mesh.size // mesh.shape["data"], group_batch(bt, mesh)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    layers = cfg.num_hidden_layers
    experts = experts_per_gpu(rng, bt_g * n, cfg, mesh)
    parts = dict(  # fixed: each GPU's non-routed weights at the rate the fit's fixed cost read the fit's
        fixed=terms.get("intercept", 0.0) * w["other"] / nonrouted_bytes_fit,
        attention=terms.get("attn_roofline", 0.0) * attn_roofline_s(
            cache_bytes(cfg, bt_g, prefix), attn_flops(cfg, bt_g, n, prefix) / ways,
            fit["copy_gbps"] * 1e9, fit["matmul_tflops"] * 1e12),
        experts=terms.get("expert_bytes", 0.0) * experts * w["expert_bytes"] * n_moe,
        tokens=terms.get("tokens", 0.0) * bt_g * n * layers / 2 / ways,  # the fit's 2 layers -> per layer
        collectives=2 * layers * allreduce_s,
        drafter=drafter_bytes / mesh.size / bandwidth,
    )
    return dict(experts=experts, parts=parts, t=sum(parts.values()))


def print_modes(args, step, columns: str, cells) -> None:
    """One table row per (batch, prefix, mode): `step(bt, n, prefix, drafter_bytes)` -> dict with "t" (and what
    `cells(r)` prints between the mode's N and its tau), tokens/s = batch x tau / t, and the ratio to AR's."""
    print(f"| batch | prefix | mode | N | {columns} | tau | tokens/s | vs ar |")
    print("|---|---|---|---|" + "---|" * (columns.count("|") + 1) + "---|---|---|")
    for bt in args.batches:
        for prefix in args.prefixes:
            rows = {}
            for mode, (budget, tau) in TAU.items():
                r = step(bt, 1 + budget, prefix, 0.0 if mode == "ar" else args.drafter_gb * 1e9)
                rows[mode] = (1 + budget, tau, r, bt * tau / r["t"])
            best = max(rows, key=lambda m: rows[m][3])
            for mode, (n, tau, r, tps) in rows.items():
                mark = " **(best)**" if mode == best else ""
                print(f"| {bt} | {prefix} | {mode}{mark} | {n} | {cells(r)} | {tau:.2f} | {tps:.0f} | "
                      f"{tps / rows['ar'][3]:.2f}x |")
    print()


def print_measured(args, cfg, w, mesh, rng):
    import json

    with open(args.layer_fit) as f:
        run = json.load(f)
    fit = run["fit"]
    nonrouted = run["weight_bytes"]["attention"] + run["weight_bytes"]["other"]
    bw = max(args.bandwidth) * 1e9
    print(f"### from the measured layer ({args.layer_fit}: worst fit error {100 * fit['max_abs_rel_err']:.1f}%, "
          f"leave-one-out {100 * fit['loo_max_abs_rel_err']:.1f}%), all-reduce {args.allreduce_us:.0f} µs\n")
    parts = ("fixed", "attention", "experts", "tokens", "collectives", "drafter")

    def step(bt, n, prefix, drafter_bytes):
        return measured_step(cfg, w, mesh, fit, nonrouted, bt=bt, n=n, prefix=prefix, bandwidth=bw, rng=rng,
                             allreduce_s=args.allreduce_us * 1e-6, drafter_bytes=drafter_bytes)

    print_modes(args, step, "busiest-GPU experts/layer | fixed | attention | experts | per-token | "
                "collectives | drafter | t_step ms",
                lambda r: f"{r['experts']:.1f} | " + " | ".join(f"{r['parts'][k] * 1e3:.2f}" for k in parts)
                + f" | {r['t'] * 1e3:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="1x1x8", help="data x tensor x expert")
    p.add_argument("--bandwidth", type=float, nargs="+", default=[2683.0, 4300.0], help="GB/s (read+write copy)")
    p.add_argument("--allreduce-us", type=float, default=15.0, help="latency of one small all-reduce (assumed)")
    p.add_argument("--drafter-gb", type=float, default=2.0, help="drafter weights read per round (assumed)")
    p.add_argument("--prefixes", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64], help="concurrent requests")
    p.add_argument("--layer-fit", metavar="JSON", help="also predict from a bench_kimi_layer.py run's cost model")
    args = p.parse_args(argv)
    mesh = sh.make_mesh(tuple(int(x) for x in args.mesh.split("x")))
    cfg, w = weight_classes(mesh)
    rng = np.random.default_rng(0)
    active = w["other_params"] + 60 * cfg.num_experts_per_tok * w["expert_params"]
    print(f"per GPU ({args.mesh}): non-routed weights {w['other'] / 1e9:.2f} GB, routed {w['routed'] / 1e9:.1f} GB, "
          f"embedding {w['embed'] / 1e9:.2f} GB; one INT4 expert {w['expert_bytes'] / 1e6:.2f} MB; "
          f"active params per token {active / 1e9:.1f} B\n")
    for bw in args.bandwidth:
        print(f"### bandwidth {bw:.0f} GB/s, all-reduce {args.allreduce_us:.0f} µs, drafter {args.drafter_gb} GB\n")

        def step(bt, n, prefix, drafter_bytes, bw=bw):
            return step_model(cfg, w, mesh, bt=bt, n=n, prefix=prefix, bandwidth=bw * 1e9, rng=rng,
                              allreduce_s=args.allreduce_us * 1e-6, drafter_bytes=drafter_bytes)

        print_modes(args, step, "busiest-GPU experts/layer | GB read/GPU | t_mem ms | t_mma ms | t_step ms",
                    lambda r: f"{r['experts']:.1f} | {r['bytes'] / 1e9:.2f} | {r['t_mem'] * 1e3:.2f} | "
                              f"{r['t_mma'] * 1e3:.2f} | {r['t'] * 1e3:.2f}")
    if args.layer_fit:
        print_measured(args, cfg, w, mesh, rng)


if __name__ == "__main__":
    main()
