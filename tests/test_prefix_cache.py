"""The prefix index alone: keys chain every earlier token, matches stop at the first miss, LRU eviction order."""
import numpy as np
import pytest

from kdtree_jax.serving.prefix_cache import PrefixIndex, page_keys

P = 4


def _tokens(rng, n):
    return rng.integers(0, 50_000, size=n).tolist()


def test_keys_chain_every_earlier_token():
    rng = np.random.default_rng(0)
    a = _tokens(rng, 3 * P)
    keys = page_keys(a, P, 3)
    assert len(set(keys)) == 3
    b = list(a)
    b[1] += 1  # a change in page 0 changes every later key, though pages 1 and 2 hold the same tokens
    assert all(x != y for x, y in zip(keys, page_keys(b, P, 3)))
    c = list(a)
    c[-1] += 1  # a change in page 2 leaves pages 0 and 1
    assert page_keys(c, P, 3)[:2] == keys[:2] and page_keys(c, P, 3)[2] != keys[2]
    assert page_keys(a[P:], P, 2, parent=keys[0]) == keys[1:]  # extends from a parent key
    with pytest.raises(ValueError, match="need 16 tokens"):
        page_keys(a, P, 4)


def test_match_is_the_longest_indexed_run():
    rng = np.random.default_rng(1)
    keys = page_keys(_tokens(rng, 4 * P), P, 4)
    index = PrefixIndex(P)
    for key, page in zip(keys[:2], (7, 3)):
        assert index.add(key, page)
    assert index.add(keys[3], 9)  # indexed, but its parent is not: unreachable through a match
    assert index.match(keys) == [7, 3]
    assert index.match(keys[1:]) == [3]
    assert not index.add(keys[0], 11)  # the key has a page already: that copy stays
    assert not index.add(keys[2], 7)  # the page has a key already
    assert index.match(keys[:1]) == [7] and not index.indexed(11)


def test_eviction_is_lru_and_forgets_the_key():
    rng = np.random.default_rng(2)
    keys = page_keys(_tokens(rng, 3 * P), P, 3)
    index = PrefixIndex(P)
    for key, page in zip(keys, (0, 1, 2)):
        index.add(key, page)
    for page in (2, 1, 0):  # a request lets go tail first
        index.park(page)
    index.unpark(1)
    index.park(1)  # used again: most recent
    assert index.evict() == 2 and index.evict() == 0
    assert index.match(keys) == [] and index.indexed(1) and index.n_parked == 1
    assert index.clear() == [1] and len(index) == 0 and index.n_parked == 0
