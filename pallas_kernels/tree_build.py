"""Best-first draft tree on device (DDTree Alg. 1) as a Pallas Triton kernel, one grid program per request.

Selects the B most probable prefixes of the factorised draft distribution Q(y_1..y_D) = prod_d q_d(y_d) from the
per-depth top-K log-probs, exactly like the paper's heap, without a device->host sync.

Tie rule and float arithmetic (shared bit for bit with `tree_build_ref.py`):
  - A frontier entry is a prefix named by its 0-based rank path (r_1..r_d). Entries pop in order of
    (score descending, rank path ascending lexicographically); a prefix sorts before its extensions.
    Rank order inside a depth is the top-K order (`jax.lax.top_k`: lower vocab index first on equal logits).
  - score(entry) = parent_score + lp[depth-1][rank], one float32 add; the root's score is 0. The next
    sibling therefore reuses the stored parent score (never `score - lp[r] + lp[r+1]`, which is not exact).

Kernel layout (Triton: power-of-two shapes, no scratch, no value gathers): the frontier lives in loop carries
of size F = next_pow2(B+1): score, parent score, packed (parent, rank, depth) and an order key. Each pop is
max(score) -> min(order key among the max) -> one-hot -> elementwise updates, so 3 reductions per pop.
The popped entry is overwritten in place by its next sibling and its first child goes to index `slot`, which
is always unused (entries sit at indices 0..pops). The order key is each entry's position in the lexicographic
order of the frontier: popping entry e (key k) inserts its child right after e and its sibling right after
that (no frontier entry lies between them, since descendants of e only appear after e pops), so keys > k
shift by 2, the child takes k+1 and the sibling k+2. Ties then reduce to one integer min. The ancestor mask is
built with XLA in the same jit (D+1 rounds of pointer chasing over `parents`).
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._pallas import next_pow2, pallas_call, resolve_interpret
from pallas_kernels.topk import check_topk_args, topk_logprobs_pallas
from pallas_kernels.topk import preferred as topk_kernel_preferred

_INT32_LIMIT = 2**31 - 1


@flax.struct.dataclass
class Tree:
    """One draft tree per request; slots in pop order (scores non-increasing), slot 0 = root."""

    tokens: jax.Array  # [Bt, N] int32; slot 0 = root (bonus) token, pads 0
    parents: jax.Array  # [Bt, N] int32; root and pads -1; parent slot < child slot
    depths: jax.Array  # [Bt, N] int32; root 0, nodes 1..D, pads 0
    n_nodes: jax.Array  # [Bt] int32; non-root real nodes (= B unless the prefix space is smaller)
    vis: jax.Array  # [Bt, N, N] bool; vis[i, j] = j is i or an ancestor of i; pad rows see only themselves


def topk_logprobs(logits: jax.Array, k: int, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-depth top-k true log-probs: full-vocab logsumexp in f32 (no renormalisation over the top-k).

    logits [Bt, D, V] -> lp [Bt, D, k] f32, ids [Bt, D, k] int32; ties -> lower index first (as lax.top_k).
    The Pallas kernel (`topk.py`) where the H200 measured it faster than XLA's top_k (the largest bookkeeping cost
    of a round: `topk.preferred`), compiled; XLA elsewhere, and always in the interpreter, where the kernel's k
    dependent steps only slow the CPU down (its values are tested there through `topk_logprobs_pallas`).
    """
    check_topk_args(logits, k)
    if resolve_interpret(interpret) or not topk_kernel_preferred(logits.shape[-1], k):
        return topk_logprobs_xla(logits, k)
    return topk_logprobs_pallas(logits, k, interpret=False)


def topk_logprobs_xla(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`topk_logprobs` with XLA's logsumexp and lax.top_k: used above FASTER_MAX_K and the benchmark baseline."""
    check_topk_args(logits, k)
    x = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)  # [Bt, D, 1]
    top, ids = lax.top_k(x, k)  # [Bt, D, k]
    return top - logz, ids.astype(jnp.int32)


def _tree_build_kernel(lp_ref, ids_ref, tok_ref, par_ref, dep_ref, *, depth_cap: int, k: int, budget: int):
    """lp_ref, ids_ref: [Dp, Kp]; tok/par/dep_ref: [F] with F = next_pow2(budget + 1)."""
    size = tok_ref.shape[0]
    f32, i32 = jnp.float32, jnp.int32
    iota = lax.iota(i32, size)
    neg_inf = jnp.full((size,), -jnp.inf, f32)
    no_key = jnp.full((size,), _INT32_LIMIT, i32)
    stride_rank = depth_cap + 1  # meta = (parent * k + rank) * (D + 1) + depth
    stride_parent = stride_rank * k

    first = iota == 0
    zero_f = jnp.zeros((size,), f32)
    carry = (
        jnp.int32(0),  # pops so far
        jnp.int32(1),  # live frontier entries
        jnp.where(first, jnp.float32(0.0) + lp_ref[0, 0], neg_inf),  # score  [F] f32
        zero_f,  # parent score  [F] f32
        jnp.where(first, 1, 0).astype(i32),  # meta: depth 1, rank 0, parent 0  [F]
        jnp.zeros((size,), i32),  # lexicographic order key  [F]
        first.astype(i32),  # live flag  [F]
        jnp.zeros((size,), i32),  # node tokens  [F]
        jnp.full((size,), -1, i32),  # node parents  [F]
        jnp.zeros((size,), i32),  # node depths  [F]
    )

    def cond(c):
        pops, n_live = c[0], c[1]
        return (pops < budget) & (n_live > 0)

    def body(c):
        pops, n_live, score, pscore, meta, key, live, tokens, parents, depths = c
        is_live = live != 0
        best = jnp.max(jnp.where(is_live, score, neg_inf))
        lead = jnp.min(jnp.where(is_live & (score == best), key, no_key))
        pick = is_live & (key == lead)  # exactly one entry: order keys are distinct
        e_meta = jnp.sum(jnp.where(pick, meta, 0))
        depth = lax.rem(e_meta, stride_rank)  # 1-based
        rank = lax.rem(lax.div(e_meta, stride_rank), k)
        parent = lax.div(e_meta, stride_parent)

        slot = pops + 1
        at = iota == slot
        tokens = jnp.where(at, ids_ref[depth - 1, rank], tokens)
        parents = jnp.where(at, parent, parents)
        depths = jnp.where(at, depth, depths)

        key = jnp.where(key > lead, key + 2, key)
        # next sibling replaces the popped entry in place (same parent, parent score and depth)
        has_sib = rank + 1 < k
        sib_lp = lp_ref[depth - 1, jnp.minimum(rank + 1, k - 1)]
        score = jnp.where(pick, pscore + sib_lp, score)
        meta = jnp.where(pick, meta + stride_rank, meta)
        key = jnp.where(pick, lead + 2, key)
        live = jnp.where(pick & jnp.logical_not(has_sib), 0, live)
        # first child of the node just emitted, at the never-used index `slot`
        has_child = depth < depth_cap
        child_lp = lp_ref[jnp.minimum(depth, depth_cap - 1), 0]
        new = at & has_child
        score = jnp.where(new, best + child_lp, score)
        pscore = jnp.where(new, best, pscore)
        meta = jnp.where(new, slot * stride_parent + depth + 1, meta)
        key = jnp.where(new, lead + 1, key)
        live = jnp.where(new, 1, live)

        n_live = n_live - 1 + has_sib.astype(i32) + has_child.astype(i32)
        return pops + 1, n_live, score, pscore, meta, key, live, tokens, parents, depths

    out = lax.while_loop(cond, body, carry)
    tok_ref[...] = out[7]
    par_ref[...] = out[8]
    dep_ref[...] = out[9]


def _visibility(parents: jax.Array, max_depth: int) -> jax.Array:
    """parents [Bt, N] -> vis [Bt, N, N]: row i marks i and every ancestor (pointer chase, max_depth+1 rounds)."""
    n = parents.shape[-1]
    cols = lax.iota(jnp.int32, n)
    anc = jnp.broadcast_to(cols, parents.shape)  # [Bt, N] current ancestor of each row (-1 = past the root)
    vis = jnp.zeros(parents.shape + (n,), bool)
    for _ in range(max_depth + 1):
        vis = vis | (anc[..., None] == cols)
        up = jnp.take_along_axis(parents, jnp.maximum(anc, 0), axis=-1)
        anc = jnp.where(anc >= 0, up, -1)
    return vis


def _check_inputs(lp, ids, root, budget: int):
    if lp.ndim != 3:
        raise ValueError(f"tree_build: lp must be [Bt, D, K], got shape {lp.shape}")
    if ids.shape != lp.shape:
        raise ValueError(f"tree_build: ids shape {ids.shape} must equal lp shape {lp.shape}")
    if root.shape != lp.shape[:1]:
        raise ValueError(f"tree_build: root must be [Bt]={lp.shape[:1]}, got shape {root.shape}")
    if not jnp.issubdtype(lp.dtype, jnp.floating):
        raise ValueError(f"tree_build: lp must be floating point log-probs, got dtype {lp.dtype}")
    if budget < 0:
        raise ValueError(f"tree_build: budget={budget} must be >= 0")
    _, depth_cap, k = lp.shape
    if (budget + 1) * k * (depth_cap + 1) > _INT32_LIMIT:
        raise ValueError(f"tree_build: budget={budget}, K={k}, D={depth_cap} overflow the packed int32 frontier")


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "num_warps"))
def tree_build(lp, ids, root, *, budget: int, interpret: bool | None = None, num_warps: int = 1) -> Tree:
    """lp [Bt, D, K] log-probs (full-vocab normalised), ids [Bt, D, K] token ids, root [Bt] bonus tokens.

    Returns the best-first `Tree` with N = 1 + budget slots. `num_warps` defaults to 1: the loop is a serial
    chain of small reductions, and a single warp reduces with shuffles only (no shared memory, no barriers).
    """
    _check_inputs(lp, ids, root, budget)
    interpret = resolve_interpret(interpret)
    bt, depth_cap, k = lp.shape
    n = budget + 1
    root = root.astype(jnp.int32)
    if budget == 0 or depth_cap == 0 or k == 0:  # root only
        parents = jnp.full((bt, n), -1, jnp.int32)
        tokens = jnp.zeros((bt, n), jnp.int32).at[:, 0].set(root)
        return Tree(tokens, parents, jnp.zeros((bt, n), jnp.int32), jnp.zeros((bt,), jnp.int32),
                    _visibility(parents, 0))

    dp, kp, size = next_pow2(depth_cap), next_pow2(k), next_pow2(n)
    pad = ((0, 0), (0, dp - depth_cap), (0, kp - k))
    lp_p = jnp.pad(lp.astype(jnp.float32), pad, constant_values=-jnp.inf)  # [Bt, Dp, Kp]
    ids_p = jnp.pad(ids.astype(jnp.int32), pad)  # [Bt, Dp, Kp]
    in_spec = pl.BlockSpec((None, dp, kp), lambda b: (b, 0, 0))
    out_spec = pl.BlockSpec((None, size), lambda b: (b, 0))
    out_shape = [jax.ShapeDtypeStruct((bt, size), jnp.int32)] * 3
    kernel = functools.partial(_tree_build_kernel, depth_cap=depth_cap, k=k, budget=budget)
    tokens, parents, depths = pallas_call(
        kernel, interpret=interpret, num_warps=num_warps, num_stages=1, grid=(bt,), name="tree_build",
        in_specs=[in_spec, in_spec], out_specs=[out_spec] * 3, out_shape=out_shape,
    )(lp_p, ids_p)
    tokens, parents, depths = tokens[:, :n].at[:, 0].set(root), parents[:, :n], depths[:, :n]
    n_nodes = jnp.sum(parents >= 0, axis=-1, dtype=jnp.int32)
    return Tree(tokens, parents, depths, n_nodes, _visibility(parents, depth_cap))
