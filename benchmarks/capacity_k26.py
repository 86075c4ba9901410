"""How many Kimi K2.6 requests fit at once on 8 H200s: the old slot table against the paged cache (no GPU).

    python benchmarks/capacity_k26.py [--meshes 1x1x8 2x1x4] [--contexts 8192 32768 131072] [--fill 0.25 0.5]
                                      [--hbm-gb 149.2] [--utilization 0.9] [--page-size 64] [--budget 32]
                                      [--rounds-per-step 8] [--json benchmarks/results/capacity_k26.json]

Every byte count is measured from the code's own shapes with `jax.eval_shape` (nothing allocated):
  - the caches: `LatentCache.pool` (kdtree_jax/model/target.py, bf16 latent, L arrays of [n_pages, P, 576]) and `DrafterCache.pool`
    (kdtree_jax/model/drafter.py, k and v [Ld, n_pages, Hk, P, Dh] in the drafter's compute dtype) of the K2.6-DFlash
    drafter (6 Qwen3 layers, 8 KV heads of 128, 5 sliding + 1 full; every layer's rows are kept in the pool), per
    page and per token; a page holds both caches' rows for its P positions (kdtree_jax/model/paged.py);
  - per GPU, the pool's layout from `sharding.latent_cache_sharding` (pages split over `data`, replicated over
    tensor / expert: absorbed MLA's one latent head has no head axis); the drafter's pool follows the same pages;
  - per GPU, the target's weights: `checkpoint_io.abstract_sharded_state` (the rules of kdtree_jax/parallel/sharding.py) of
    `kimi_k2_6()` with INT4 routed experts on an 8-device mesh (simulated CPU devices); the drafter's bf16 weights
    whole on every GPU (`Engine.load` loads the drafter without a mesh).

The pool per GPU is what the serving engine gives it (`ServingEngine._num_pages`, kdtree_jax/serving/core.py):
device memory x utilisation - bytes in use (here: the weights). A data group (the tensor x expert GPUs of one
`data` index) owns its pages and its requests; requests at once = data groups x requests per group.

Rows one request holds (kdtree_jax/serving/core.py, kdtree_jax/decode/speculative.py):
  - slot table (the old engine): every slot reserves `aligned_rows(max_context + slack)` rows, slack = one round's
    scratch = max(1 + B, depth + 2); requests = floor(pool bytes / (rows x bytes per token));
  - paged: a request holds pages for its used rows + the rows the next step may commit (`rounds_per_step x
    (depth + 1) x 2`, the x 2 for the overlapped step in flight) + slack, in whole pages; for a mix whose requests
    each use `fill x max_context` tokens, requests = floor(pages in the pool / pages per request).
The mix is a stated assumption (every request at the mean), not a measured trace; the int32 token rows of the
slot state (4 B a token) and activations (within 1 - utilisation) are left out.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.bench_util import write_results  # noqa: E402
from kdtree_jax.decode.speculative import aligned_rows  # noqa: E402
from kdtree_jax.model.config import ModelConfig, kimi_k2_6  # noqa: E402
from kdtree_jax.model.drafter import DFlashDrafter, DrafterCache  # noqa: E402
from kdtree_jax.model.drafter_config import DrafterConfig  # noqa: E402
from kdtree_jax.model.target import LatentCache  # noqa: E402
from kdtree_jax.parallel import sharding as sh  # noqa: E402

GB = 1e9
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "capacity_k26.json")

# z-lab's Kimi-K2.5-DFlash config.json (tests/test_drafter.py: KIMI_K25_DRAFTER) with K2.6's layer layout: every
# layer but the last slides with a 2048 window (benchmarks/profile_round.py --sliding-window 2048).
K26_DRAFTER_HF = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "intermediate_size": 18432,
    "num_hidden_layers": 6, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 163840, "num_target_layers": 61, "block_size": 8,
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
    "max_position_embeddings": 262144, "rope_theta": 50000,
    "rope_scaling": {"rope_type": "yarn", "factor": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1,
                     "mscale_all_dim": 1, "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 2048,
}


def k26_drafter_config() -> DrafterConfig:
    return DrafterConfig.from_hf_dict(K26_DRAFTER_HF, source="capacity_k26 K2.6-DFlash drafter")


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---- caches ------------------------------------------------------------------------------------------------------
def abstract_pools(cfg: ModelConfig, dcfg: DrafterConfig | None, n_pages: int, page_size: int,
                   cache_dtype=jnp.bfloat16, draft_dtype=jnp.bfloat16):
    """(LatentCache, DrafterCache | None) pools of n_pages as ShapeDtypeStructs: the engine's own constructors under
    jax.eval_shape, nothing allocated."""

    def build():
        table = jnp.zeros((1, 1), jnp.int32)
        lat = LatentCache.pool(cfg, n_pages, page_size, table, cache_dtype)
        dc = None if dcfg is None else DrafterCache.pool(dcfg, n_pages, page_size, table, draft_dtype)
        return lat, dc

    return jax.eval_shape(build)


def cache_bytes(cfg: ModelConfig, dcfg: DrafterConfig | None, page_size: int, cache_dtype=jnp.bfloat16,
                draft_dtype=jnp.bfloat16) -> dict:
    """Bytes of one page and one token of each cache (the page table and lengths are not cache rows)."""
    lat, dc = abstract_pools(cfg, dcfg, 1, page_size, cache_dtype, draft_dtype)
    latent = _nbytes(lat.latent)
    drafter = 0 if dc is None else _nbytes(dc.k) + _nbytes(dc.v)
    out = dict(page_size=page_size, latent_page=latent, drafter_page=drafter, page=latent + drafter)
    for k in ("latent", "drafter", ""):
        key = f"{k}_page" if k else "page"
        assert out[key] % page_size == 0, (key, out[key], page_size)
        out[f"{k}_token" if k else "token"] = out[key] // page_size
    return out


def page_bytes_per_gpu(cfg: ModelConfig, dcfg: DrafterConfig | None, page_size: int, mesh,
                       cache_dtype=jnp.bfloat16, draft_dtype=jnp.bfloat16) -> int:
    """Bytes one GPU holds per page of its data group: a pool of `data` pages laid out as the rules say (pages over
    data, replicated over tensor x expert), one device's shard. The drafter's k / v follow the latent's pages."""
    d = mesh.shape["data"]
    lat, dc = abstract_pools(cfg, dcfg, d, page_size, cache_dtype, draft_dtype)
    total = sum(math.prod(sh.latent_cache_sharding(mesh, x.shape).shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                for x in lat.latent)
    if dc is not None:
        for x in (*dc.k, *dc.v):
            spec = sh.logical_spec(("batch", None, None, None), x.shape, mesh, name="DrafterCache.k")
            total += math.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


# ---- weights -----------------------------------------------------------------------------------------------------
def target_weight_bytes(mesh, cfg: ModelConfig | None = None) -> dict:
    """Per-GPU and whole bytes of the target with INT4 routed experts (bf16 elsewhere), by the repo's rules."""
    from kdtree_jax.checkpoint.io import abstract_sharded_state

    cfg = cfg or kimi_k2_6()
    _, state = abstract_sharded_state(cfg, mesh, param_dtype=jnp.bfloat16, expert_format="int4")
    return dict(per_gpu=sh.per_device_bytes(state), total=sh.total_bytes(state),
                notes=sh.sharding_notes(state, mesh))


def drafter_weight_bytes(dcfg: DrafterConfig, dtype=jnp.bfloat16) -> int:
    """The drafter's own weights (fc, norms, layers; it shares the target's embedding and lm_head)."""
    state = nnx.state(nnx.eval_shape(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0), param_dtype=dtype,
                                                           compute_dtype=dtype)))
    return sum(_nbytes(x) for x in jax.tree.leaves(state))


# ---- capacity arithmetic -----------------------------------------------------------------------------------------
def request_rows(max_context: int, fill: float | None, page_size: int, slack: int, ahead: int) -> int:
    """Cache rows one request holds. fill None: a slot table's slot (contiguous, `aligned_rows`); else a paged
    request using round(fill x max_context) tokens, with the next step's rows and one round's scratch, whole pages
    (capped at a full-length request's pages)."""
    full = aligned_rows(max_context + slack)
    if fill is None:
        return full
    used = int(round(fill * max_context))
    cap_pages = -(-full // page_size)
    return min(-(-(used + ahead + slack) // page_size), cap_pages) * page_size


def capacity_rows(pool_bytes_per_gpu: int, token_bytes: int, page_bytes_gpu: int, page_size: int, data: int,
                  contexts, fills, slack: int, ahead: int) -> list[dict]:
    """One row per max_context: slot-table and paged requests at once over all data groups, the pool's pages and
    tokens. token_bytes: one token of every cache; page_bytes_gpu: what one GPU holds per page (= page_size x
    token_bytes when pages are replicated over the group)."""
    pool = max(pool_bytes_per_gpu, 0)
    n_pages = pool // page_bytes_gpu  # per data group
    rows = []
    for ctx in contexts:
        slot_rows = request_rows(ctx, None, page_size, slack, ahead)
        r = dict(max_context=ctx, slot_rows=slot_rows,
                 slot_table=data * (pool // (slot_rows * token_bytes)),
                 pages_per_group=n_pages, pages=data * n_pages, tokens=data * n_pages * page_size,
                 paged_full=data * (n_pages // (-(-slot_rows // page_size))), paged={})
        for f in fills:
            rows_f = request_rows(ctx, f, page_size, slack, ahead)
            r["paged"][f"{f:g}"] = dict(fill=f, rows=rows_f, requests=data * (n_pages // (rows_f // page_size)))
        rows.append(r)
    return rows


def markdown(mesh_name: str, rows: list[dict], fills) -> str:
    head = ("| mesh | max_context | slot table: rows / request | slot table: requests | pool pages (tokens) | "
            "paged at full length | " + " | ".join(f"paged, {100 * f:g}% used: rows / requests" for f in fills)
            + " |")
    out = [head, "|" + "---|" * (6 + len(fills))]
    for r in rows:
        paged = " | ".join(f"{r['paged'][f'{f:g}']['rows']} / **{r['paged'][f'{f:g}']['requests']}**"
                           for f in fills)
        out.append(f"| {mesh_name} | {r['max_context'] // 1024}k | {r['slot_rows']} | **{r['slot_table']}** | "
                   f"{r['pages']} ({r['tokens'] / 1e3:.0f}k) | {r['paged_full']} | {paged} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", nargs="+", default=["1x1x8", "2x1x4"], help="data x tensor x expert over 8 GPUs")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072], help="max_context")
    p.add_argument("--fill", type=float, nargs="+", default=[0.25, 0.5],
                   help="the mix: tokens each request uses, as a share of max_context")
    p.add_argument("--hbm-gb", type=float, default=139 * 2**30 / GB,
                   help="device memory the allocator reports (GB; default 139 GiB, docs/sharding.md)")
    p.add_argument("--utilization", type=float, default=0.9, help="ServeConfig.gpu_memory_utilization")
    p.add_argument("--page-size", type=int, default=64, help="ServeConfig.page_size")
    p.add_argument("--budget", type=int, default=32, help="the largest ddtree budget B (slack = 1 + B)")
    p.add_argument("--rounds-per-step", type=int, default=8, help="ServeConfig.rounds_per_step")
    p.add_argument("--no-drafter", action="store_true", help="AR serving: the latent only, no drafter weights")
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)

    cfg = kimi_k2_6()
    dcfg = None if args.no_drafter else k26_drafter_config()
    depth = 0 if dcfg is None else dcfg.block_size - 1
    slack = max(1 + args.budget if dcfg is not None else 1, depth + 2)  # DecodeSpec.slack: ddtree, or ar
    ahead = args.rounds_per_step * (depth + 1) * 2
    per = cache_bytes(cfg, dcfg, args.page_size)
    d_weights = 0 if dcfg is None else drafter_weight_bytes(dcfg)
    usable = int(args.hbm_gb * GB * args.utilization)
    print(f"K2.6 caches (bf16), page of {args.page_size}: latent {per['latent_token']:,} B/token "
          f"({per['latent_page']:,} B/page), drafter {per['drafter_token']:,} B/token ({per['drafter_page']:,} "
          f"B/page), together {per['token']:,} B/token, {per['page'] / 2**20:.2f} MiB/page")
    print(f"drafter weights {d_weights / GB:.2f} GB on every GPU; usable per GPU {args.hbm_gb:.1f} GB x "
          f"{args.utilization} = {usable / GB:.1f} GB; slack {slack} rows, next step {ahead} rows\n")
    result = dict(
        assumptions=dict(hbm_gb=args.hbm_gb, utilization=args.utilization, usable_bytes=usable,
                         page_size=args.page_size, budget=args.budget, slack_rows=slack,
                         rounds_per_step=args.rounds_per_step, ahead_rows=ahead, fills=args.fill,
                         drafter=None if dcfg is None else K26_DRAFTER_HF,
                         cache_dtype="bfloat16", expert_format="int4",
                         mix="every request uses fill x max_context tokens"),
        bytes=dict(**per, drafter_weights=d_weights), meshes={})
    tables = []
    for name in args.meshes:
        mesh = sh.make_mesh(sh.parse_mesh_shape(name, 8), devices=jax.devices()[:8])
        w = target_weight_bytes(mesh, cfg)
        page_gpu = page_bytes_per_gpu(cfg, dcfg, args.page_size, mesh)
        pool = usable - w["per_gpu"] - d_weights
        data = mesh.shape["data"]
        rows = capacity_rows(pool, per["token"], page_gpu, args.page_size, data, args.contexts, args.fill,
                             slack, ahead)
        fits = pool >= page_gpu
        print(f"mesh {name}: target weights {w['per_gpu'] / GB:.2f} GB per GPU (whole {w['total'] / GB:.1f} GB), "
              f"pool {pool / GB:.1f} GB per GPU{'' if fits else ' -- does not fit'}; {data} data group(s), a page "
              f"{page_gpu:,} B on each GPU of its group; {rows[0]['pages_per_group']} pages per group"
              + (f"; rule fallbacks: {w['notes']}" if w["notes"] else ""))
        result["meshes"][name] = dict(data=data, target_weights_per_gpu=w["per_gpu"], target_weights_total=w["total"],
                                      pool_bytes_per_gpu=pool, page_bytes_per_gpu=page_gpu, fits=fits, rows=rows)
        tables.append(markdown(name, rows, args.fill))
    print()
    print("\n".join([tables[0]] + [t.split("\n", 2)[2] for t in tables[1:]]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_results(args.json, result)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
