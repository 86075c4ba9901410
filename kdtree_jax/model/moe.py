"""DeepSeek-V3 / Kimi mixture of experts: fp32 router (sigmoid + correction bias, group-limited top-k), SwiGLU
experts kept stacked ([E, in, out] float, or INT4 pack-quantized [E, out, in/8] dequantized inside the jitted
expert matmul so device memory holds them packed), plus the always-on shared expert.

Two exact XLA expert paths: "dense" runs every expert on every token and combines with the (mostly zero) routing
weights — cheap for tiny E; "gather" fetches each token's k selected experts (`w[idx]`) — cheaper when M*k < E.
They are the correctness baseline. "kernel" (INT4 experts only) runs the grouped Pallas kernel
`pallas_kernels.int4_moe.int4_moe_ffn`: the model's packed layout is the kernel's own ([E, out, in/8] words, nibble k
of word j = column 8j+k, bf16 group scales; `tile_experts` re-lays them tile by tile for the kernel's reads), so it
reads the stored arrays as they are, unpacks in registers and skips idle experts. "auto" picks "kernel" for INT4
experts on a GPU backend outside a multi-device mesh (there a custom call would make GSPMD gather the sharded
experts; "ep" is the mesh path), else gather/dense by the shape rule.

Axes: M tokens, D hidden, E experts, k experts per token, I expert width, G groups.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kdtree_jax.model.config import ModelConfig
from kdtree_jax.model.layers import init_normal, swiglu
from kdtree_jax.model.quant import NIBBLES_PER_WORD, dequant_int4_jnp
from pallas_kernels.int4_moe import ffn_tiles, int4_moe_ffn, tile_ffn_int4, tile_int4, untile_int4

MOE_IMPLS = ("auto", "dense", "gather", "kernel", "ep")  # ep: expert-parallel over the mesh set by jax.set_mesh
INT4_ARRAYS = ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")  # kernel arg order
NORM_EPS = 1e-20  # HF MoEGate: denominator = sum(top-k weights) + 1e-20
# HF DeepseekV3 MoEGate masks experts of dropped groups to 0.0 (masked_fill), not -inf as DeepSeek's own
# inference code does; they differ only if a kept expert's biased score is negative. We follow HF (the golden).
GROUP_MASK_VALUE = 0.0


class Int4Weight(nnx.Variable):
    """Packed INT4 words or their group scales; not a trainable Param."""


class MLP(nnx.Module):
    """SwiGLU feed-forward (dense layers and the shared expert); weights [in, out].

    gate_up [D, 2, I] stacks gate and up so that they run as one matmul over one contiguous weight, the width I
    sharded as either was. (Apart, XLA's dot merger joins the shared expert's two and concatenates their weights on
    every call: at a batch-8 B = 16 verify at K2.6 width that merged GEMM took 51 µs for 59 MB, BENCHMARKS.md §4b.)"""

    def __init__(self, d: int, inter: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        gate, up = (init_normal(rngs, (d, inter), d, param_dtype) for _ in range(2))
        self.gate_up = nnx.Param(jnp.stack([gate, up], axis=1), axes=("embed", None, "mlp"))
        self.down = nnx.Param(init_normal(rngs, (inter, d), inter, param_dtype), axes=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.gate_up[...], self.down[...])


class MoE(nnx.Module):
    """Router + stacked routed experts (+ shared expert). `expert_format` is "float" or "int4"."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, expert_format: str = "float",
                 group_size: int | None = None, impl: str = "auto"):
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe impl {impl!r} is not one of {MOE_IMPLS}")
        if expert_format not in ("float", "int4"):
            raise ValueError(f"expert_format {expert_format!r} must be 'float' or 'int4'")
        if impl == "kernel" and expert_format != "int4":
            raise ValueError(f"moe impl 'kernel' runs INT4 experts only, expert_format is {expert_format!r}")
        d, e, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg, self.impl, self.expert_format = cfg, impl, expert_format
        self.group_size = group_size or cfg.quantization.group_size
        self.router = nnx.Param(init_normal(rngs, (d, e), d, param_dtype), axes=("embed", None))
        if cfg.topk_method == "noaux_tc":
            bias = 0.1 * jax.random.normal(rngs.params(), (e,), jnp.float32)
            self.bias = nnx.Param(bias, axes=(None,))  # e_score_correction_bias, kept f32
        if expert_format == "float":
            self.gate = nnx.Param(init_normal(rngs, (e, d, inter), d, param_dtype), axes=("expert", "embed", None))
            self.up = nnx.Param(init_normal(rngs, (e, d, inter), d, param_dtype), axes=("expert", "embed", None))
            self.down = nnx.Param(init_normal(rngs, (e, inter, d), inter, param_dtype), axes=("expert", None, "embed"))
        else:
            for name, (n_out, n_in) in (("gate", (inter, d)), ("up", (inter, d)), ("down", (d, inter))):
                packed, scale = _random_int4(rngs, (e, n_out, n_in), self.group_size)
                setattr(self, name + "_packed", Int4Weight(packed, axes=("expert", None, None)))
                setattr(self, name + "_scale", Int4Weight(scale, axes=("expert", None, None)))
        if cfg.n_shared_experts:
            self.shared = MLP(d, inter * cfg.n_shared_experts, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D]."""
        if self.impl == "ep":  # each device runs its own experts, one psum (`moe_expert_parallel` below)
            with jax.named_scope("experts"):
                return moe_expert_parallel(self, x)
        flat = x.reshape(-1, x.shape[-1])  # [M, D]
        with jax.named_scope("router"):
            logits = flat.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [M, E]
            bias = self.bias[...] if self.cfg.topk_method == "noaux_tc" else None
            weights, idx = route(logits, bias, self.cfg)  # [M, k]
        impl = resolve_impl(self, flat.shape[0])
        with jax.named_scope("experts"):
            if impl == "kernel":
                y = experts_int4_kernel(flat, weights, idx, {n: getattr(self, n)[...] for n in INT4_ARRAYS})
            elif impl == "gather":
                y = _experts_gather(self, flat, weights, idx)
            else:
                y = _experts_dense(self, flat, weights, idx)
        if self.cfg.n_shared_experts:
            with jax.named_scope("shared"):
                y = y + self.shared(flat)
        return y.reshape(x.shape)


def kernel_eligible(moe: MoE) -> bool:
    """The grouped INT4 kernel can run this layer's experts: INT4 with a group size the kernel tiles (8 x a power
    of two), on a GPU backend (on CPU the XLA paths are faster than the Pallas interpreter)."""
    group_words = moe.group_size // NIBBLES_PER_WORD
    tiles = moe.group_size % NIBBLES_PER_WORD == 0 and group_words > 0 and group_words & (group_words - 1) == 0
    return moe.expert_format == "int4" and tiles and jax.default_backend() == "gpu"


def resolve_impl(moe: MoE, n_tokens: int) -> str:
    """The expert path `moe` runs for n_tokens routed tokens (static: decided at trace time).

    "auto" -> "kernel" when `kernel_eligible` and no multi-device mesh is set; otherwise "gather" when M*k < E,
    else "dense". Explicit impls are returned as given.
    """
    if moe.impl != "auto":
        return moe.impl
    mesh = jax.sharding.get_abstract_mesh()
    if kernel_eligible(moe) and (mesh.empty or mesh.size == 1):
        return "kernel"
    return "gather" if n_tokens * moe.cfg.num_experts_per_tok < moe.cfg.n_routed_experts else "dense"


def tile_experts(model: nnx.Module) -> int:
    """Store the routed INT4 experts of every layer that runs the grouped kernel tile-major, in place; returns how
    many layers were re-laid.

    Why: the kernel reads, per K step, a [block_n, block_w] tile of words and its scales; row-major that is block_n
    runs of 128 B strided by a whole weight row (and 16 B runs of scales), tile-major one contiguous block each
    (`pallas_kernels.int4_moe.tile_ffn_int4`, in each kernel's tuned tiles; same values, so the same output bits).
    Layers whose impl resolves to "kernel" only: under a mesh ("ep", or "auto" choosing XLA) the shardings split the
    row-major axes, so they stay. The XLA paths read either layout. A one-time device transpose of each expert
    stack (a copy of one array at a time).
    """
    count = 0
    for _, module in nnx.iter_modules(model):
        if not (isinstance(module, MoE) and module.expert_format == "int4" and resolve_impl(module, 1) == "kernel"):
            continue
        pairs = [(getattr(module, n + "_packed"), getattr(module, n + "_scale")) for n in ("gate", "up", "down")]
        if any(p.ndim == 5 for p, _ in pairs) or not _tiles_evenly(pairs):
            continue  # already tile-major, or widths the kernel's tiles do not divide (tiny test models)
        for (packed, scale), tiles in zip(pairs, ffn_tiles(*(p.shape[1] for p, _ in pairs))):
            tiled = _tile_int4_jit(packed[...], scale[...], **tiles)
            packed.set_value(tiled[0])
            scale.set_value(tiled[1])
        count += 1
    return count


# one program per expert-stack shape and tiles, shared by every layer
_tile_int4_jit = jax.jit(tile_int4, static_argnames=("block_n", "block_w"))


def _tiles_evenly(pairs) -> bool:
    try:
        jax.eval_shape(tile_ffn_int4, *(a[...] for pair in pairs for a in pair))
    except ValueError:
        return False
    return True


def experts_int4_kernel(x: jax.Array, weights: jax.Array, idx: jax.Array, experts: dict, out_dtype=None) -> jax.Array:
    """Routed INT4 SwiGLU experts through the grouped Pallas kernel: x [M, D], weights / idx [M, k] -> [M, D].

    `experts` maps the INT4_ARRAYS names to stacked arrays ([E, out, in/8] int32, [E, out, in/group] scales, or
    their tile-major form from `tile_experts`), which the kernel reads as stored; any E works (e.g. one device's
    local experts: ids outside 0..E-1 are absent pairs that cost nothing). Interpret mode follows the backend
    (`resolve_interpret`).
    """
    return int4_moe_ffn(x, idx, weights, *(experts[n] for n in INT4_ARRAYS), out_dtype=out_dtype)


def _random_int4(rngs: nnx.Rngs, shape: tuple[int, int, int], group_size: int) -> tuple[jax.Array, jax.Array]:
    """Random packed words and bf16 scales with the magnitude of a 1/sqrt(fan_in) init."""
    e, n_out, n_in = shape
    bits = jax.random.bits(rngs.params(), (e, n_out, n_in // NIBBLES_PER_WORD), jnp.uint32)
    scale = jax.random.uniform(rngs.params(), (e, n_out, n_in // group_size), jnp.float32, 0.5, 1.5)
    return jax.lax.bitcast_convert_type(bits, jnp.int32), (scale / (4.0 * n_in**0.5)).astype(jnp.bfloat16)


def route(logits: jax.Array, bias: jax.Array | None, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """HF MoEGate on fp32 logits [M, E] -> (weights [M, k] f32, expert ids [M, k] int32).

    The correction bias only steers selection; the weights come from the unbiased scores, are normalised
    (norm_topk_prob, +1e-20) and then scaled by routed_scaling_factor (DeepSeek-V3 order, for every topk_method).
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    select = scores if bias is None else scores + bias.astype(jnp.float32)
    if cfg.n_group > 1 and cfg.topk_method != "greedy":
        m, e = select.shape
        grouped = select.reshape(m, cfg.n_group, e // cfg.n_group)  # [M, G, E/G]
        if cfg.topk_method == "noaux_tc":
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [M, G]
        else:  # group_limited_greedy
            group_score = grouped.max(-1)
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)  # [M, topk_group]
        kept = jnp.zeros(group_score.shape, bool).at[jnp.arange(m)[:, None], keep].set(True)  # [M, G]
        select = jnp.where(kept[:, :, None], grouped, GROUP_MASK_VALUE).reshape(m, e)
    _, idx = jax.lax.top_k(select, cfg.num_experts_per_tok)  # [M, k]
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:  # transformers' DeepseekV3 (the golden model) normalises for every k, k = 1 included
        weights = weights / (weights.sum(-1, keepdims=True) + NORM_EPS)
    return weights * cfg.routed_scaling_factor, idx


def _expert_weights(moe: MoE, idx: jax.Array | None, dt) -> tuple[jax.Array, jax.Array, jax.Array]:
    """gate, up [..., D, I] and down [..., I, D] in dtype dt: all experts (idx None) or w[idx]."""
    if moe.expert_format == "float":
        ws = (moe.gate[...], moe.up[...], moe.down[...])
        return tuple((w if idx is None else w[idx]).astype(dt) for w in ws)
    out = []
    for name in ("gate", "up", "down"):
        packed, scale = untile_int4(getattr(moe, name + "_packed")[...], getattr(moe, name + "_scale")[...])
        if idx is not None:
            packed, scale = packed[idx], scale[idx]
        out.append(jnp.swapaxes(dequant_int4_jnp(packed, scale, moe.group_size, dt), -1, -2))  # [in, out]
    return tuple(out)


def _experts_dense(moe: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
    """Every expert on every token; combine [M, E] is zero outside each token's top-k."""
    wg, wu, wd = _expert_weights(moe, None, x.dtype)  # [E, D, I], [E, D, I], [E, I, D]
    h = jax.nn.silu(jnp.einsum("md,edi->emi", x, wg)) * jnp.einsum("md,edi->emi", x, wu)
    y = jnp.einsum("emi,eid->emd", h, wd)  # [E, M, D]
    combine = jnp.zeros((x.shape[0], wg.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], idx].add(weights)  # [M, E]
    return jnp.einsum("me,emd->md", combine, y.astype(jnp.float32)).astype(x.dtype)


def _experts_gather(moe: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
    """Only each token's k selected experts, with their weights gathered per token."""
    wg, wu, wd = _expert_weights(moe, idx, x.dtype)  # [M, k, D, I], [M, k, D, I], [M, k, I, D]
    h = jax.nn.silu(jnp.einsum("md,mkdi->mki", x, wg)) * jnp.einsum("md,mkdi->mki", x, wu)
    y = jnp.einsum("mki,mkid->mkd", h, wd)  # [M, k, D]
    return jnp.einsum("mk,mkd->md", weights, y.astype(jnp.float32)).astype(x.dtype)


# ---- expert parallelism over a mesh ----------------------------------------------------------------------------
EXPERT_ARRAYS = {"float": ("gate", "up", "down"),
                 "int4": ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")}


def moe_expert_parallel(moe, x: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """Same result as `MoE.__call__(x)`, with routed experts run by their owners (jax-llm-examples dispatch).

    Activations stay replicated over tensor/expert (split by batch over data): the router runs everywhere, each
    device maps the global top-k ids to its local experts (foreign pairs get weight 0), runs only those on its own
    weight shard (E over `expert`, width over `tensor`), and one psum over (expert, tensor) combines. No expert
    weight ever crosses devices and no all-to-all is needed. `mesh` defaults to the one set by `jax.set_mesh`.
    `MoE(impl="ep")` calls it (see docs/sharding.md).
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    cfg = moe.cfg
    flat = x.reshape(-1, x.shape[-1])  # [M, D]
    logits = flat.astype(jnp.float32) @ moe.router[...].astype(jnp.float32)  # [M, E]
    weights, idx = route(logits, moe.bias[...] if cfg.topk_method == "noaux_tc" else None, cfg)  # [M, k]
    names = EXPERT_ARRAYS[moe.expert_format]
    arrays = [getattr(moe, n)[...] for n in names]
    n_exp = mesh.shape["expert"] if cfg.n_routed_experts % mesh.shape["expert"] == 0 else 1
    width_tp = mesh.shape["tensor"] > 1 and all(
        a.shape[_width_dim(n)] % mesh.shape["tensor"] == 0 for n, a in zip(names, arrays))
    ep_axis = "expert" if n_exp > 1 else None
    specs = [P(ep_axis, *[("tensor" if width_tp and d == _width_dim(n) else None) for d in (1, 2)]) for n in names]
    data = "data" if mesh.shape["data"] > 1 and flat.shape[0] % mesh.shape["data"] == 0 else None
    reduce_axes = tuple(a for a, on in (("expert", ep_axis), ("tensor", width_tp)) if on)
    e_local = cfg.n_routed_experts // n_exp
    use_kernel = kernel_eligible(moe)  # INT4 on GPU: the grouped kernel runs only the local pairs

    def local(xs, w, ids, *experts):
        first = jax.lax.axis_index("expert") * e_local if ep_axis else 0
        lid = ids - first  # [m, k] local expert id, valid in [0, e_local)
        mine = (lid >= 0) & (lid < e_local)
        w = jnp.where(mine, w, 0.0)
        if use_kernel:  # foreign pairs keep an out-of-range id: absent for the kernel, no rows, no work
            y = experts_int4_kernel(xs, w, lid, dict(zip(names, experts)), out_dtype=jnp.float32)
        else:
            wg, wu, wd = _local_expert_weights(moe, dict(zip(names, experts)), jnp.where(mine, lid, 0), xs.dtype)
            h = jax.nn.silu(jnp.einsum("md,mkdi->mki", xs, wg)) * jnp.einsum("md,mkdi->mki", xs, wu)
            y = jnp.einsum("mki,mkid->mkd", h, wd)  # [m, k, D] partial over the local width
            y = jnp.einsum("mk,mkd->md", w, y.astype(jnp.float32))
        return jax.lax.psum(y, reduce_axes) if reduce_axes else y

    tok = P(data, None)
    y = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, *specs), out_specs=tok, check_vma=False)(
        flat, weights, idx, *arrays)
    y = y.astype(x.dtype)
    if cfg.n_shared_experts:
        y = y + moe.shared(flat)
    return y.reshape(x.shape)


def _width_dim(name: str) -> int:
    """Dim of a stacked routed-expert array that holds the expert width (moe_intermediate_size or its packing)."""
    return 2 if name in ("gate", "up") or name.startswith("down_") else 1


def _local_expert_weights(moe, experts: dict, lid: jax.Array, dt) -> tuple[jax.Array, jax.Array, jax.Array]:
    """gate, up [m, k, D, I'] and down [m, k, I', D] of the local experts `lid` [m, k] (INT4 dequantized here)."""
    if moe.expert_format == "float":
        return tuple(experts[n][lid].astype(dt) for n in ("gate", "up", "down"))
    out = []
    for n in ("gate", "up", "down"):
        w = dequant_int4_jnp(experts[n + "_packed"][lid], experts[n + "_scale"][lid], moe.group_size, dt)
        out.append(jnp.swapaxes(w, -1, -2))  # [m, k, out, in] -> [m, k, in, out]
    return tuple(out)
