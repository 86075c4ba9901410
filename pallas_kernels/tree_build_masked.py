"""Best-first draft tree under a token automaton (structured output), in jnp: `tree_build`'s heap where a node may
only take a token its parent's state allows.

Every node carries an automaton state: the root's is given (the request's state after its bonus token), a child's
is next(parent state, token). The top-K lists are per depth, not per parent, so the filter runs where the heap
expands: a popped entry's next sibling is its parent's next *allowed* rank at that depth, and a node's first child
its own first allowed rank one depth down. No disallowed node enters the tree, and the tree is the best-first tree
over the valid prefixes of the factorised draft distribution (the scores are the drafter's log-probs, not
renormalised over the allowed tokens).

Forced tokens (`forced`, optional): where a node's state allows exactly one token, its one child is that token
whether or not the drafter ranked it, at the parent's score (probability 1: it pops before anything else), and the
tree goes on below it with the drafter's next depth. The target's masked choice at the parent is that token, so
verification accepts it: the text a schema spells out costs the drafter nothing. In the frontier the forced child
is rank K (one past the drafter's K), with log-prob 0.

Tie rule and float arithmetic are `tree_build.py`'s, so where every token is allowed the tree equals the kernel's
bit for bit. The lexicographic order keys stay exact with skipped ranks: the ranks between a popped entry and its
next allowed sibling are never in the frontier. This form is plain XLA (a `while_loop` over pops, every request at
once); the automaton lookups are callbacks, so this package keeps no table layout.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.tree_build import Tree, _check_inputs, _visibility

_NO_KEY = jnp.iinfo(jnp.int32).max

# allowed(states [...], tokens [...]) -> bool [...];  step(states [...], tokens [...]) -> int32 states [...]
AllowedFn = Callable[[jax.Array, jax.Array], jax.Array]
StepFn = Callable[[jax.Array, jax.Array], jax.Array]
# forced(states [...]) -> int32 [...]: the one token the state allows where it allows one alone, else -1
ForcedFn = Callable[[jax.Array], jax.Array]


def tree_build_masked(lp, ids, root, root_state, *, budget: int, allowed: AllowedFn, step: StepFn,
                      forced: ForcedFn | None = None) -> tuple[Tree, jax.Array]:
    """lp [Bt, D, K] log-probs, ids [Bt, D, K] token ids, root [Bt] bonus tokens, root_state [Bt] int32.

    Returns (the `Tree` with N = 1 + budget slots, states [Bt, N] int32: each node's state after its token; the
    root's is root_state, and so is every pad's)."""
    _check_inputs(lp, ids, root, budget)
    bt, depth_cap, k = lp.shape
    n = budget + 1
    i32 = jnp.int32
    root = root.astype(i32)
    root_state = root_state.astype(i32)
    states0 = jnp.broadcast_to(root_state[:, None], (bt, n))
    if budget == 0 or depth_cap == 0 or k == 0:
        parents = jnp.full((bt, n), -1, i32)
        tokens = jnp.zeros((bt, n), i32).at[:, 0].set(root)
        return Tree(tokens, parents, jnp.zeros((bt, n), i32), jnp.zeros((bt,), i32), _visibility(parents, 0)), states0

    lp = lp.astype(jnp.float32)
    ids = ids.astype(i32)
    if forced is not None:  # rank K: the forced token, log-prob 0
        lp = jnp.concatenate([lp, jnp.zeros((bt, depth_cap, 1), jnp.float32)], axis=-1)
        ids = jnp.concatenate([ids, jnp.zeros((bt, depth_cap, 1), i32)], axis=-1)
    rows = jnp.arange(bt)
    ranks = jnp.arange(k, dtype=i32)
    slots = jnp.arange(n, dtype=i32)

    def first_allowed(state, d, after):
        """First rank > after at depth index d whose token `state` allows -> (rank, any) per request."""
        cand = ids[rows, d, :k]  # [Bt, K]
        ok = allowed(state[:, None], cand) & (ranks[None, :] > after[:, None])
        rank, has = jnp.argmax(ok, axis=-1).astype(i32), jnp.any(ok, axis=-1)
        if forced is None:
            return rank, has
        f = forced(state) >= 0  # the forced child alone: rank K, once
        return jnp.where(f, k, rank), jnp.where(f, after < k, has)

    r0, has0 = first_allowed(root_state, jnp.zeros((bt,), i32), jnp.full((bt,), -1, i32))
    first = slots[None, :] == 0
    carry = {
        "pops": jnp.zeros((bt,), i32),
        "n_live": has0.astype(i32),
        "score": jnp.where(first & has0[:, None], (jnp.float32(0.0) + lp[rows, 0, r0])[:, None], -jnp.inf),
        "pscore": jnp.zeros((bt, n), jnp.float32),
        "parent": jnp.zeros((bt, n), i32),
        "rank": jnp.where(first, r0[:, None], 0),
        "depth": jnp.ones((bt, n), i32),
        "key": jnp.zeros((bt, n), i32),
        "live": first & has0[:, None],
        "tokens": jnp.zeros((bt, n), i32).at[:, 0].set(root),
        "parents": jnp.full((bt, n), -1, i32),
        "depths": jnp.zeros((bt, n), i32),
        "states": states0,
    }

    def running(c):
        return (c["pops"] < budget) & (c["n_live"] > 0)

    def body(c):
        go = running(c)
        live = c["live"]
        best = jnp.max(jnp.where(live, c["score"], -jnp.inf), axis=-1)
        lead = jnp.min(jnp.where(live & (c["score"] == best[:, None]), c["key"], _NO_KEY), axis=-1)
        pick = live & (c["key"] == lead[:, None])  # one entry per request: order keys are distinct

        def picked(x):
            return jnp.sum(jnp.where(pick, x, 0), axis=-1)

        parent, rank, depth = picked(c["parent"]), picked(c["rank"]), picked(c["depth"])  # depth is 1-based
        pscore = jnp.sum(jnp.where(pick, c["pscore"], 0.0), axis=-1)
        p_state = jnp.take_along_axis(c["states"], parent[:, None], axis=1)[:, 0]
        token = ids[rows, depth - 1, rank]
        if forced is not None:
            token = jnp.where(rank == k, forced(p_state), token)
        state = step(p_state, token)
        slot = c["pops"] + 1
        at = slots[None, :] == slot[:, None]
        new = dict(c)
        new["tokens"] = jnp.where(at, token[:, None], c["tokens"])
        new["parents"] = jnp.where(at, parent[:, None], c["parents"])
        new["depths"] = jnp.where(at, depth[:, None], c["depths"])
        new["states"] = jnp.where(at, state[:, None], c["states"])

        key = jnp.where(c["key"] > lead[:, None], c["key"] + 2, c["key"])
        # the next allowed sibling replaces the popped entry in place (same parent, parent score and depth)
        sib, has_sib = first_allowed(p_state, depth - 1, rank)
        score = jnp.where(pick, (pscore + lp[rows, depth - 1, sib])[:, None], c["score"])
        rank_a = jnp.where(pick, sib[:, None], c["rank"])
        key = jnp.where(pick, (lead + 2)[:, None], key)
        live = jnp.where(pick & ~has_sib[:, None], False, live)
        # the first allowed child of the node just emitted, at the never-used frontier index `slot`
        below = jnp.minimum(depth, depth_cap - 1)
        child, has_child = first_allowed(state, below, jnp.full((bt,), -1, i32))
        has_child = has_child & (depth < depth_cap)
        fresh = at & has_child[:, None]
        score = jnp.where(fresh, (best + lp[rows, below, child])[:, None], score)
        new["pscore"] = jnp.where(fresh, best[:, None], c["pscore"])
        new["parent"] = jnp.where(fresh, slot[:, None], c["parent"])
        new["rank"] = jnp.where(fresh, child[:, None], rank_a)
        new["depth"] = jnp.where(fresh, (depth + 1)[:, None], c["depth"])
        new["key"] = jnp.where(fresh, (lead + 1)[:, None], key)
        new["live"] = jnp.where(fresh, True, live)
        new["score"] = score
        new["n_live"] = c["n_live"] - 1 + has_sib.astype(i32) + has_child.astype(i32)
        new["pops"] = slot
        return jax.tree.map(lambda a, b: jnp.where(go.reshape((bt,) + (1,) * (a.ndim - 1)), a, b), new, c)

    out = lax.while_loop(lambda c: jnp.any(running(c)), body, carry)
    parents = out["parents"]
    n_nodes = jnp.sum(parents >= 0, axis=-1, dtype=i32)
    tree = Tree(out["tokens"], parents, out["depths"], n_nodes, _visibility(parents, depth_cap))
    return tree, out["states"]
