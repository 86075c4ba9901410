"""bench_engine's per-prompt agreement with ar: counts and first-difference positions on fresh random token lists."""

import numpy as np
from script_loader import load_script


def _module():
    return load_script("scripts/bench_engine.py")


def test_agreement_counts_prompts_and_finds_first_difference():
    agreement = _module().agreement
    rng = np.random.default_rng()
    ar = [rng.integers(0, 1000, int(rng.integers(5, 40))).tolist() for _ in range(12)]
    other = [list(t) for t in ar]
    order = rng.permutation(len(ar)).tolist()
    flipped, short = sorted(order[:5]), order[5]
    expect = {}
    for p in flipped:
        at = int(rng.integers(0, len(ar[p])))
        other[p][at] = ar[p][at] + 1  # a different token from here on
        other[p][at + 1:] = rng.integers(0, 1000, len(ar[p]) - at - 1).tolist()
        expect[p] = at
    other[short] = ar[short][:3]  # a prompt that stopped early differs where its tokens end
    expect[short] = 3
    got = agreement(other, ar)
    assert got["prompts_identical"] == len(ar) - 6
    assert got["first_difference_at"] == [expect[p] for p in sorted(expect)]
    assert agreement(ar, ar) == {"prompts_identical": len(ar), "first_difference_at": []}
