"""Numpy reference for `tree_accept`: the verified-tree walk of DDTree (REF `follow_verified_tree`), per request."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class AcceptNp(NamedTuple):
    """Host-side walk result, same fields and padding as `tree_accept.Accepted`."""

    path: np.ndarray  # [Bt, D+1] int32; accepted slots, path[0] = 0, pads -1
    n_accepted: np.ndarray  # [Bt] int32; len(path) in 1..D+1
    bonus: np.ndarray  # [Bt] int32; choice at the deepest accepted slot
    src_slot: np.ndarray  # [Bt, D+1] int32; cache row start+j <- start+src_slot[j]; identity for pads


def accept_one(choice, tokens, parents, n_nodes: int, max_depth: int):
    """One request: follow children whose token equals the target's choice, starting at the root."""
    children: dict[int, dict[int, int]] = {}
    for slot in range(1, n_nodes + 1):  # real nodes only; pad slots are never children
        children.setdefault(int(parents[slot]), {})[int(tokens[slot])] = slot
    path, cur = [0], 0
    while len(path) <= max_depth and int(choice[cur]) in children.get(cur, {}):
        cur = children[cur][int(choice[cur])]
        path.append(cur)
    padded = np.full(max_depth + 1, -1, np.int32)
    padded[: len(path)] = path
    src = np.arange(max_depth + 1, dtype=np.int32)
    src[: len(path)] = path
    return padded, len(path), int(choice[cur]), src


def tree_accept_ref(choice, tokens, parents, n_nodes, *, max_depth: int) -> AcceptNp:
    """Batched reference. choice, tokens, parents: [Bt, N]; n_nodes: [Bt]."""
    choice, tokens, parents, n_nodes = (np.asarray(x) for x in (choice, tokens, parents, n_nodes))
    outs = [accept_one(choice[b], tokens[b], parents[b], int(n_nodes[b]), max_depth) for b in range(len(choice))]
    path, n_acc, bonus, src = zip(*outs)
    return AcceptNp(np.stack(path), np.asarray(n_acc, np.int32), np.asarray(bonus, np.int32), np.stack(src))
