"""Numpy reference for `tree_build`: the paper's best-first heap (DDTree Alg. 1) with Python `heapq`, per request.

Written independently of the kernel (a real heap keyed on `(-score, rank path)` instead of the kernel's
argmax-over-frontier with order keys) so agreement is evidence, not a tautology. The tie rule and the float32
score arithmetic are the ones documented in `pallas_kernels/tree_build.py`:
  - equal score -> lexicographically smaller 0-based rank path first; a prefix before its extensions;
  - score(entry) = parent_score + lp[depth-1][rank], one float32 add, root score 0.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np


class TreeNp(NamedTuple):
    """Host-side tree, same fields and padding as `tree_build.Tree`."""

    tokens: np.ndarray  # [Bt, N] int32; slot 0 = root token, pads 0
    parents: np.ndarray  # [Bt, N] int32; root and pads -1
    depths: np.ndarray  # [Bt, N] int32; root and pads 0
    n_nodes: np.ndarray  # [Bt] int32; non-root real nodes
    vis: np.ndarray  # [Bt, N, N] bool; ancestor-or-self, pad rows see only themselves


def build_one(lp: np.ndarray, ids: np.ndarray, root: int, budget: int):
    """One request. lp, ids: [D, K]. Returns (tokens [N], parents [N], depths [N], n_nodes, vis [N, N])."""
    lp = np.asarray(lp, np.float32)
    depth_cap, k = lp.shape
    n = 1 + budget
    tokens = np.zeros(n, np.int32)
    parents = np.full(n, -1, np.int32)
    depths = np.zeros(n, np.int32)
    tokens[0] = root
    heap = []
    if budget > 0 and depth_cap > 0 and k > 0:
        s0 = np.float32(0.0) + lp[0, 0]
        # (-score, rank path, depth, rank, parent slot, parent score); rank paths are unique, so the compare
        # never looks past the path.
        heap.append((-float(s0), (0,), 1, 0, 0, np.float32(0.0)))
    count = 0
    while heap and count < budget:
        neg, path, depth, rank, parent, pscore = heapq.heappop(heap)
        score = np.float32(-neg)
        count += 1
        tokens[count] = ids[depth - 1, rank]
        parents[count] = parent
        depths[count] = depth
        if rank + 1 < k:
            s = np.float32(pscore + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-float(s), path[:-1] + (rank + 1,), depth, rank + 1, parent, pscore))
        if depth < depth_cap:
            s = np.float32(score + lp[depth, 0])
            heapq.heappush(heap, (-float(s), path + (0,), depth + 1, 0, count, score))
    vis = np.eye(n, dtype=bool)
    for i in range(1, count + 1):  # parent < child, so one pass in slot order closes it
        vis[i] |= vis[parents[i]]
    return tokens, parents, depths, count, vis


def tree_build_ref(lp, ids, root, *, budget: int) -> TreeNp:
    """Batched reference. lp [Bt, D, K] f32, ids [Bt, D, K] int, root [Bt] int."""
    lp, ids, root = np.asarray(lp, np.float32), np.asarray(ids), np.asarray(root)
    outs = [build_one(lp[b], ids[b], int(root[b]), budget) for b in range(lp.shape[0])]
    tokens, parents, depths, n_nodes, vis = (np.stack(x) for x in zip(*outs))
    return TreeNp(tokens, parents, depths, n_nodes.astype(np.int32), vis)


def topk_logprobs_ref(logits, k: int):
    """float64 log-softmax over the full vocab, top-k with lower index first on ties (as `jax.lax.top_k`)."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    logz = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, order, -1) - logz, order.astype(np.int32)


def build_one_masked(lp: np.ndarray, ids: np.ndarray, root: int, root_state: int, budget: int, is_allowed,
                     next_state, forced=None):
    """`build_one` under a token automaton: a candidate enters the heap only if its parent's state allows its
    token, and each node's state is next_state(parent state, token). `forced(state)` -> the one token the state
    allows, or -1: that token is the node's one child, rank K at log-prob 0. Returns build_one's tuple + states [N]."""
    lp = np.asarray(lp, np.float32)
    depth_cap, k = lp.shape
    n = 1 + budget
    tokens = np.zeros(n, np.int32)
    parents = np.full(n, -1, np.int32)
    depths = np.zeros(n, np.int32)
    states = np.full(n, root_state, np.int64)
    tokens[0] = root

    def candidates(state, depth):  # depth is 1-based -> [(rank, token, log-prob)]
        f = -1 if forced is None else forced(state)
        if f >= 0:
            return [(k, f, np.float32(0.0))]
        return [(r, int(ids[depth - 1, r]), lp[depth - 1, r]) for r in range(k)
                if is_allowed(state, int(ids[depth - 1, r]))]

    heap = []

    def push_first(parent, pscore, depth, after, path):
        """The first allowed rank after `after` at `depth` for a child of slot `parent`."""
        later = [c for c in candidates(int(states[parent]), depth) if c[0] > after]
        if later:
            r, token, score = later[0]
            s = np.float32(pscore + score)
            heapq.heappush(heap, (-float(s), path + (r,), depth, r, parent, pscore, token))

    if budget > 0 and depth_cap > 0 and k > 0:
        push_first(0, np.float32(0.0), 1, -1, ())
    count = 0
    while heap and count < budget:
        neg, path, depth, rank, parent, pscore, token = heapq.heappop(heap)
        score = np.float32(-neg)
        count += 1
        tokens[count] = token
        parents[count] = parent
        depths[count] = depth
        states[count] = next_state(int(states[parent]), int(tokens[count]))
        push_first(parent, pscore, depth, rank, path[:-1])
        if depth < depth_cap:
            push_first(count, score, depth + 1, -1, path)
    vis = np.eye(n, dtype=bool)
    for i in range(1, count + 1):
        vis[i] |= vis[parents[i]]
    return tokens, parents, depths, count, vis, states


def tree_build_masked_ref(lp, ids, root, root_state, *, budget: int, is_allowed, next_state, forced=None):
    """Batched `build_one_masked` -> (TreeNp, states [Bt, N]). is_allowed(state, token) -> bool,
    next_state(state, token) -> int and forced(state) -> int (optional) are the automaton's host lookups."""
    lp, ids, root, root_state = (np.asarray(x) for x in (lp, ids, root, root_state))
    outs = [build_one_masked(lp[b], ids[b], int(root[b]), int(root_state[b]), budget, is_allowed, next_state,
                             forced)
            for b in range(lp.shape[0])]
    tokens, parents, depths, n_nodes, vis, states = (np.stack(x) for x in zip(*outs))
    return TreeNp(tokens, parents, depths, n_nodes.astype(np.int32), vis), states
