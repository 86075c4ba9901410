"""Device mesh, the one logical->mesh rule table, and the sharded layout of every target parameter and cache.

Mesh axes (always three, in this order):
  data   - batch (data-parallel attention: each data shard owns whole requests and their latent cache rows)
  tensor - attention heads, dense / shared-expert FFN width, vocab, and the width of every routed expert
  expert - routed experts (EP)

The model-parallel group is tensor x expert: heads, dense FFN width and vocab are split over *both* axes (2-D TP,
as in jax-llm-examples), while routed experts split their E dim over `expert` and their width over `tensor`. So on
8 GPUs `1x1x8` gives attention TP=8 and EP=8 at once, `1x8x1` gives TP=8 everywhere (each GPU holds 1/8 of every
expert), and both put ~1/8 of the model on each GPU. A mesh axis cannot be in two places of one spec (P2 check).

Everything else — which parameter has which logical axes — is keyed by the parameter's path in the NNX state
(`layers.3.attn.q_b`), so restores (`checkpoint_io.abstract_sharded_state`) need no live module. A dim that does
not divide its mesh axes falls back to fewer axes, then to replicated, and the fallback is recorded
(`sharding_notes`).

The MoE runs under plain GSPMD propagation: with experts sharded on E, the model's "dense" expert path computes
each device's local experts and all-reduces the combine (no all-gather of expert weights; see docs/sharding.md).
`moe.moe_expert_parallel` is the explicit `shard_map` form of the same dispatch for the "gather"-sized case, and
`verify_attn_on_mesh` below runs the attention kernel per device. This module imports no model code (mla.py
imports it), so the layers use the rules without an import cycle.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.verify_attn import verify_attn

MESH_AXES = ("data", "tensor", "expert")

# P2: logical axis -> mesh axes, the only table that names mesh axes. Tuples shard one dim over several axes.
LOGICAL_TO_MESH: dict[str, tuple[str, ...]] = {
    "batch": ("data",),
    "heads": ("tensor", "expert"),  # attention heads: q_b / q_proj, W_UK, W_UV, o_proj
    "mlp": ("tensor", "expert"),  # dense-layer and shared-expert SwiGLU width
    "vocab": ("tensor", "expert"),  # embedding rows, lm_head columns
    "expert": ("expert",),  # routed experts' E dim (float and INT4 packed words / scales)
    "expert_mlp": ("tensor",),  # routed experts' width (moe_intermediate_size, or its packed /8, /group form)
}

# Parameter path (dots, layer index as a number) -> logical axis per dim; first match wins. ndim disambiguates the
# dense / shared down ([I, D]) from the stacked routed experts' ([E, I, D]). Replicated entries are deliberate: qkv_a
# (q_a | kv_a) and their norms are small and feed RMSNorms that would otherwise need a collective; the router is tiny.
PARAM_RULES: tuple[tuple[str, int, tuple[str | None, ...]], ...] = (
    (r"embed", 2, ("vocab", None)),  # [V, D]
    (r"lm_head", 2, (None, "vocab")),  # [D, V]
    (r"norm", 1, (None,)),  # final norm [D]
    (r"layers\.\d+\.(input_norm|post_norm)", 1, (None,)),
    (r"layers\.\d+\.attn\.qkv_a", 2, (None, None)),  # [D, Rq + R + P]
    (r"layers\.\d+\.attn\.(q_a_norm|kv_a_norm)", 1, (None,)),
    (r"layers\.\d+\.attn\.(q_b|q_proj)", 3, (None, "heads", None)),  # [Rq | D, H, K + P]
    (r"layers\.\d+\.attn\.(w_uk|w_uv|o_proj)", 3, ("heads", None, None)),  # [H, K, R], [H, V, R], [H, V, D]
    (r"layers\.\d+\.mlp\.router", 2, (None, None)),  # [D, E]
    (r"layers\.\d+\.mlp\.bias", 1, (None,)),  # [E] e_score_correction_bias
    (r"layers\.\d+\.mlp\.(gate|up)", 3, ("expert", None, "expert_mlp")),  # routed float [E, D, I]
    (r"layers\.\d+\.mlp\.down", 3, ("expert", "expert_mlp", None)),  # routed float [E, I, D]
    (r"layers\.\d+\.mlp\.(gate|up)_(packed|scale)", 3, ("expert", "expert_mlp", None)),  # [E, I, D/8 | D/g]
    (r"layers\.\d+\.mlp\.down_(packed|scale)", 3, ("expert", None, "expert_mlp")),  # [E, D, I/8 | I/g]
    (r"layers\.\d+\.mlp\.(shared\.)?gate_up", 3, (None, None, "mlp")),  # dense / shared [D, 2, I]
    (r"layers\.\d+\.mlp\.(shared\.)?down", 2, ("mlp", None)),  # dense / shared [I, D]
)

LATENT_CACHE_AXES = ("batch", None, None)  # each layer of LatentCache.latent [B, S, A]: batch-split, never head-split


class ShardingError(ValueError):
    """A mesh string, mesh shape or parameter path that cannot be laid out; the message names it."""


# ---- mesh ------------------------------------------------------------------------------------------------------
def make_mesh(shape: Sequence[int] | str, axes: Sequence[str] = MESH_AXES, *, devices=None) -> Mesh:
    """A mesh over all (or the given) devices with `AxisType.Auto` axes: classic GSPMD propagation.

    `shape` may be a string such as "2x4" (see `parse_mesh_shape`). Auto rather than jax's default Explicit: the
    model's contractions over sharded dims (o_proj over heads, experts' combine over E) then just all-reduce.
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(shape, str):
        shape = parse_mesh_shape(shape, len(devices), n_axes=len(axes))
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axes):
        raise ShardingError(f"mesh shape {shape} has {len(shape)} dims but axes {tuple(axes)} has {len(axes)}")
    if math.prod(shape) != len(devices):
        raise ShardingError(f"mesh shape {shape} needs {math.prod(shape)} devices, {len(devices)} available")
    return jax.make_mesh(shape, tuple(axes), axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def parse_mesh_shape(text: str, n_devices: int | None = None, *, n_axes: int = len(MESH_AXES)) -> tuple[int, ...]:
    """'2x4' -> (2, 4, 1): data x tensor x expert, missing trailing dims = 1; product must equal the device count."""
    n_devices = jax.device_count() if n_devices is None else n_devices
    parts = str(text).strip().lower().split("x")
    if not 1 <= len(parts) <= n_axes or not all(p.strip().isdigit() for p in parts):
        raise ShardingError(f"--mesh {text!r}: expected up to {n_axes} positive integers joined by 'x' "
                            f"({' x '.join(MESH_AXES[:n_axes])}), e.g. 1x8x1 or 2x4")
    shape = tuple(int(p) for p in parts) + (1,) * (n_axes - len(parts))
    if min(shape) < 1:
        raise ShardingError(f"--mesh {text!r}: every dim must be >= 1, got {shape}")
    if math.prod(shape) != n_devices:
        raise ShardingError(f"--mesh {text!r}: {' x '.join(map(str, shape))} = {math.prod(shape)} devices, but "
                            f"{n_devices} are available")
    return shape


def parse_mesh(text: str, devices=None) -> Mesh:
    """The CLI's --mesh: a string such as '1x8x1' or '2x4' -> a data x tensor x expert Mesh over all devices."""
    devices = list(jax.devices() if devices is None else devices)
    return make_mesh(parse_mesh_shape(text, len(devices)), devices=devices)


# ---- rules -----------------------------------------------------------------------------------------------------
def logical_spec(logical: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | None = None,
                 notes: list[str] | None = None, name: str = "") -> P:
    """Logical axes -> PartitionSpec; with a mesh, a dim that does not divide its axes falls back (noted)."""
    out, used = [], []
    for dim, axis in enumerate(logical):
        if axis is None:
            out.append(None)
            continue
        if axis not in LOGICAL_TO_MESH:
            raise ShardingError(f"{name or 'spec'}: unknown logical axis {axis!r} (known: {sorted(LOGICAL_TO_MESH)})")
        mesh_axes = LOGICAL_TO_MESH[axis]
        if mesh is not None:
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
            if shape is not None:
                mesh_axes = _divisible_axes(mesh_axes, shape[dim], mesh, notes, f"{name} dim {dim} ({axis})")
        used.extend(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    if len(used) != len(set(used)):
        raise ShardingError(f"{name or 'spec'}: mesh axis used twice in {tuple(logical)} -> {out}")
    return P(*out)


def _divisible_axes(axes: tuple[str, ...], size: int, mesh: Mesh, notes: list[str] | None, what: str
                    ) -> tuple[str, ...]:
    """The longest prefix of `axes` (else the single axis) whose device count divides `size`; () = replicated."""
    candidates = [axes[:k] for k in range(len(axes), 0, -1)] + [(a,) for a in axes[1:]]
    for cand in candidates:
        if size % math.prod(mesh.shape[a] for a in cand) == 0:
            if cand != axes and notes is not None:
                notes.append(f"{what}: size {size} does not divide {axes}, sharded over {cand} only")
            return cand
    if axes and notes is not None:
        notes.append(f"{what}: size {size} does not divide any of {axes}, replicated")
    return ()


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at `path` (e.g. 'layers.1.mlp.gate_packed') with `ndim` dims."""
    for pattern, rule_ndim, axes in PARAM_RULES:
        if rule_ndim == ndim and re.fullmatch(pattern, path):
            return axes
    raise ShardingError(f"parameter {path!r} ({ndim}-D) has no sharding rule in kdtree_jax/sharding.PARAM_RULES")


def partition_spec(path: str, value, mesh: Mesh | None = None, notes: list[str] | None = None) -> P:
    """PartitionSpec of one parameter (`value`: anything with .shape); without a mesh, the ideal spec."""
    shape = tuple(value.shape)
    return logical_spec(param_logical_axes(path, len(shape)), shape, mesh, notes, name=path)


def path_str(key_path) -> str:
    """jax key path of an nnx.State / pure-dict leaf -> 'layers.0.attn.q_b' (Variable '.value' keys dropped)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            continue  # nnx.Variable's value
        key = getattr(k, "key", getattr(k, "idx", k))
        parts.append(str(key))
    return ".".join(parts)


def state_shardings(state, mesh: Mesh, notes: list[str] | None = None):
    """Same tree as `state` (nnx.State, pure dict, or their abstract forms) with a NamedSharding per leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, partition_spec(path_str(kp), x, mesh, notes)), state)


def sharding_notes(state, mesh: Mesh) -> list[str]:
    """Every fallback the rules took for this state on this mesh (empty when every dim divides its axes)."""
    notes: list[str] = []
    state_shardings(state, mesh, notes)
    return notes


def latent_cache_sharding(mesh: Mesh, cache_shape: Sequence[int] | None = None) -> NamedSharding:
    """One layer of LatentCache.latent, [B, S, A] (a pool: [n_pages, P, A]): split by batch (pages) over data,
    replicated over tensor/expert (docs/sharding.md)."""
    return NamedSharding(mesh, logical_spec(LATENT_CACHE_AXES, cache_shape, mesh, name="LatentCache.latent"))


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Per-request arrays ([B, ...] tokens, positions, masks, logits): batch over data, rest replicated."""
    return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh, name="batch"))


def constrain_cache(cache, mesh: Mesh):
    """`with_sharding_constraint` of a LatentCache to its layout (inside jit, e.g. right after LatentCache.zeros)."""
    return cache.replace(latent=tuple(jax.lax.with_sharding_constraint(x, latent_cache_sharding(mesh, x.shape))
                                      for x in cache.latent))


# ---- placing a model -------------------------------------------------------------------------------------------
def put_global(x, sharding: NamedSharding) -> jax.Array:
    """Host value -> global array in `sharding`; each process builds only its addressable shards (multi-process)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """The same model with every parameter placed in its NamedSharding (values unchanged)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    state = jax.tree.map(put_global, state, shardings)
    return nnx.merge(graphdef, state)


def per_device_bytes(state) -> int:
    """Bytes one device holds for a state whose leaves carry NamedShardings (arrays or ShapeDtypeStructs)."""
    total = 0
    for x in jax.tree.leaves(state):
        total += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def total_bytes(state) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


# ---- attention on a mesh ---------------------------------------------------------------------------------------
def verify_attn_on_mesh(q, cache, prefix_len, tree_kv, tree_mask, *, layer: int | None = None, mesh=None,
                        page_table=None, **kw):
    """`pallas_kernels.verify_attn` run by every device on its own requests and heads (jax.shard_map).

    GSPMD cannot split a custom call, so a Triton kernel fed a batch-split cache would first have it gathered onto
    every device. Here each device passes its batch shard of the layer's cache ([Bt/data, S, A], replicated over
    the head split, as LATENT_CACHE_AXES lays it out; [L, ...] with a static `layer`) and its slice of the heads
    ("heads" axes) straight to the kernel. A page pool ([n_pages, P, A] with page_table [Bt, W]) splits its pages
    the same way: each data group owns the pages of its requests, so the group's table entries (global page ids)
    fall in its own shard.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    q_spec = logical_spec(("batch", None, "heads", None), q.shape, mesh, name="verify_attn q")  # as the weights
    data = q_spec[0]
    cache_spec = P(data) if layer is None else P(None, data)  # LATENT_CACHE_AXES: batch-split, never head-split
    row = P(data)

    if page_table is None:
        def local(q, cache, prefix_len, tree_kv, tree_mask):
            return verify_attn(q, cache, prefix_len, tree_kv, tree_mask, layer=layer, **kw)

        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, cache_spec, row, row, row), out_specs=q_spec,
                             check_vma=False)(q, cache, prefix_len, tree_kv, tree_mask)

    def local_paged(q, cache, prefix_len, tree_kv, tree_mask, page_table):
        pages = cache.shape[0 if layer is None else 1]
        first = _data_index(data) * pages  # the first global page id of this device's shard
        table = jnp.clip(page_table - first, 0, pages - 1)
        return verify_attn(q, cache, prefix_len, tree_kv, tree_mask, layer=layer, page_table=table, **kw)

    return jax.shard_map(local_paged, mesh=mesh, in_specs=(q_spec, cache_spec, row, row, row, row), out_specs=q_spec,
                         check_vma=False)(q, cache, prefix_len, tree_kv, tree_mask, page_table)


def _data_index(data) -> jax.Array:
    """This device's index along the (possibly compound) data axes of a shard_map, 0 where nothing is split."""
    if data is None:
        return jnp.int32(0)
    names = data if isinstance(data, tuple) else (data,)
    index = jnp.int32(0)
    for name in names:
        index = index * jax.lax.axis_size(name) + jax.lax.axis_index(name)
    return index
