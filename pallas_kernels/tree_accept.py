"""Verified-tree walk on device (DDTree §4) as a Pallas Triton kernel, one grid program per request.

From the root, step to the real child of the current slot whose token equals the target's choice at that slot
(siblings carry distinct tokens, so at most one matches); stop when none does or after `max_depth` steps.
The deepest accepted slot's choice is the bonus token. Pad slots (index > n_nodes) are never children, whatever
their token or parent say. Also emits the KV compaction plan `src_slot`: cache row start+j takes row
start+src_slot[j] (the accepted path, then identity), which the engine applies as one gather before one write.
Each step is one masked compare over the N slots and one argmax, in loop carries (Triton: no scratch, no
value gathers; the choice at the current slot is a dynamic scalar ref read).
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._pallas import next_pow2, pallas_call, resolve_interpret


@flax.struct.dataclass
class Accepted:
    """Result of the walk for each request."""

    path: jax.Array  # [Bt, D+1] int32; accepted slots in order, path[0] = 0 (root), pads -1
    n_accepted: jax.Array  # [Bt] int32; len(path) in 1..D+1 (accepted drafts + 1)
    bonus: jax.Array  # [Bt] int32; target choice at the deepest accepted slot (the next root)
    src_slot: jax.Array  # [Bt, D+1] int32; compaction: cache row start+j <- start+src_slot[j]


def _tree_accept_kernel(choice_ref, tok_ref, par_ref, nn_ref, path_ref, src_ref, stat_ref, *, max_depth: int):
    """choice/tok/par_ref: [Np]; nn_ref: [1]; path/src_ref: [P] with P = next_pow2(D+1); stat_ref: [2]."""
    i32 = jnp.int32
    size, plen = tok_ref.shape[0], path_ref.shape[0]
    slots = lax.iota(i32, size)
    steps = lax.iota(i32, plen)
    tokens, parents = tok_ref[...], par_ref[...]
    n_nodes = jnp.sum(nn_ref[...])
    real = (slots >= 1) & (slots <= n_nodes)

    def cond(c):
        n_acc, done = c[0], c[2]
        return (n_acc <= max_depth) & (done == 0)

    def body(c):
        n_acc, cur, _, path = c
        match = (real & (parents == cur) & (tokens == choice_ref[cur])).astype(i32)  # [Np]
        hit = jnp.max(match) > 0
        nxt = jnp.argmax(match).astype(i32)
        path = jnp.where(hit & (steps == n_acc), nxt, path)
        step = hit.astype(i32)  # int arithmetic: a bool->int select in a loop carry miscompiles on Triton
        return n_acc + step, jnp.where(hit, nxt, cur), 1 - step, path

    init = (i32(1), i32(0), i32(0), jnp.where(steps == 0, 0, -1).astype(i32))
    n_acc, cur, _, path = lax.while_loop(cond, body, init)
    path_ref[...] = path
    src_ref[...] = jnp.where(steps < n_acc, path, steps)
    stat_ref[...] = jnp.where(lax.iota(i32, 2) == 0, n_acc, choice_ref[cur])


def _check_inputs(choice, tokens, parents, n_nodes, max_depth: int):
    if choice.ndim != 2:
        raise ValueError(f"tree_accept: choice must be [Bt, N], got shape {choice.shape}")
    for name, x in (("tokens", tokens), ("parents", parents)):
        if x.shape != choice.shape:
            raise ValueError(f"tree_accept: {name} shape {x.shape} must equal choice shape {choice.shape}")
    if n_nodes.shape != choice.shape[:1]:
        raise ValueError(f"tree_accept: n_nodes must be [Bt]={choice.shape[:1]}, got shape {n_nodes.shape}")
    if max_depth < 0:
        raise ValueError(f"tree_accept: max_depth={max_depth} must be >= 0")


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret", "num_warps"))
def tree_accept(choice, tokens, parents, n_nodes, *, max_depth: int, interpret: bool | None = None,
                num_warps: int = 1) -> Accepted:
    """choice [Bt, N] target token per slot, tokens/parents [Bt, N] from `Tree`, n_nodes [Bt] -> `Accepted`."""
    _check_inputs(choice, tokens, parents, n_nodes, max_depth)
    interpret = resolve_interpret(interpret)
    bt, n = choice.shape
    size, plen = next_pow2(n), next_pow2(max_depth + 1)

    def pad(x, value):  # [Bt, N] -> [Bt, Np]; pad slots are never real, and their parent -1 matches no slot
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, size - n)), constant_values=value)

    row = pl.BlockSpec((None, size), lambda b: (b, 0))
    kernel = functools.partial(_tree_accept_kernel, max_depth=max_depth)
    path, src, stat = pallas_call(
        kernel, interpret=interpret, num_warps=num_warps, num_stages=1, grid=(bt,), name="tree_accept",
        in_specs=[row, row, row, pl.BlockSpec((None, 1), lambda b: (b, 0))],
        out_specs=[pl.BlockSpec((None, plen), lambda b: (b, 0))] * 2 + [pl.BlockSpec((None, 2), lambda b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct((bt, plen), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((bt, 2), jnp.int32)],
    )(pad(choice, 0), pad(tokens, 0), pad(parents, -1), n_nodes.astype(jnp.int32).reshape(bt, 1))
    d1 = max_depth + 1
    return Accepted(path[:, :d1], stat[:, 0], stat[:, 1], src[:, :d1])
