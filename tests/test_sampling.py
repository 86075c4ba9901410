"""The sampling filters: the same tokens as the plain formulation (argsort, and argsort again to undo it), with each
filter's cost paid only when some row asks for the filter; the checks of a request's sampling fields."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.decode import sampling
from kdtree_jax.decode.params import ParamError, RequestParams
from kdtree_jax.decode.sampling import SamplingRows

CAP = 8


def plain_filtered_logits(logits, rows: SamplingRows, top_k_cap: int):
    """Temperature, top-k, top-p as first written: the reference `filtered_logits` must equal bit for bit."""
    temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
    x = logits.astype(jnp.float32) / sampling._per_row(temp, logits)
    vocab = x.shape[-1]
    cap = min(top_k_cap, vocab)
    top = jax.lax.top_k(x, cap)[0]
    k = sampling._per_row(jnp.clip(rows.top_k, 1, cap) - 1, logits)
    kth = jnp.take_along_axis(top, jnp.broadcast_to(k, top.shape[:-1] + (1,)), axis=-1)
    on = sampling._per_row((rows.top_k > 0) & (rows.top_k < vocab), logits)
    x = jnp.where(on & (x < kth), -jnp.inf, x)
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    top_p = sampling._per_row(rows.top_p, logits)
    keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    return jnp.where(keep, x, -jnp.inf)


def _logits(rng, shape) -> np.ndarray:
    """Random logits with what breaks careless sorting: runs of equal values, -inf, and zeros of both signs."""
    x = rng.normal(size=shape).astype(np.float32)
    x[..., ::5] = np.round(x[..., ::5], 1)  # ties
    x[..., 3] = -np.inf
    x[..., 7], x[..., 11] = 0.0, -0.0
    return x


def test_filters_equal_the_plain_formulation_bit_for_bit(rng):
    params = [RequestParams(), RequestParams(temperature=1.0), RequestParams(temperature=0.7, top_p=0.9),
              RequestParams(temperature=1.3, top_k=5), RequestParams(temperature=0.5, top_k=3, top_p=0.6),
              RequestParams(temperature=2.0, top_p=0.05), RequestParams(temperature=1.0, top_k=CAP)]
    logits = _logits(rng, (len(params), 3, 64))
    for batch in (params, params[:2], params[1:2], params[3:5]):  # every filter, one of them, none
        rows = SamplingRows.of(batch)
        x = logits[: len(batch)]
        got = jax.jit(sampling.filtered_logits, static_argnums=2)(x, rows, CAP)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(plain_filtered_logits(x, rows, CAP)))


def _primitives(jaxpr, inside_cond: bool = False, found=None) -> list[tuple[str, bool]]:
    """(primitive name, whether it sits in a branch of a lax.cond / switch) for every equation, sub-jaxprs included."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        found.append((eqn.primitive.name, inside_cond))
        for sub in _subjaxprs(eqn):
            _primitives(sub, inside_cond or eqn.primitive.name == "cond", found)
    return found


def _subjaxprs(eqn):
    """The jaxprs an equation holds: a cond's branches, a jit's body, ..."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _branches(jaxpr):
    """The branches of every lax.cond / switch in `jaxpr`, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            yield from (branch.jaxpr for branch in eqn.params["branches"])
        for sub in _subjaxprs(eqn):
            yield from _branches(sub)


def test_each_filter_runs_only_when_a_row_asks_for_it():
    """Top-k and top-p's sort sit in branches of a conditional on the rows, so a batch with neither pays for neither
    (on a CPU they cost more than the draw), and no branch sorts the vocabulary twice (once to order it, again to
    undo the order)."""
    rows = SamplingRows.of([RequestParams(temperature=1.0)])
    logits = jnp.zeros((1, 3, 64), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, r: sampling.filtered_logits(x, r, CAP))(logits, rows).jaxpr
    found = _primitives(jaxpr)
    filters = [inside for name, inside in found if name in ("top_k", "sort")]
    assert filters and all(filters), found
    sorts = [sum(name == "sort" for name, _ in _primitives(branch)) for branch in _branches(jaxpr)]
    assert max(sorts) == 1, sorts


@pytest.mark.parametrize("fields,cap,field,match", [
    ({"temperature": float("nan")}, None, "temperature", "must be a finite number >= 0, got nan"),
    ({"temperature": -1.0}, None, "temperature", "must be a finite number >= 0, got -1.0"),
    ({"temperature": float("inf")}, None, "temperature", "must be a finite number >= 0, got inf"),
    ({"temperature": True}, None, "temperature", "must be a finite number >= 0, got True"),
    ({"top_k": -1}, None, "top_k", r"must be an integer >= 0 \(0: off\), got -1"),
    ({"top_k": 2.0}, None, "top_k", "must be an integer >= 0"),
    ({"top_p": 0.0}, None, "top_p", r"must be in \(0, 1\], got 0.0"),
    ({"top_p": float("nan")}, None, "top_p", r"must be in \(0, 1\], got nan"),
    ({"top_k": CAP + 1}, CAP, "top_k", rf"must be <= {CAP} \(the compiled cap\), got {CAP + 1}"),
])
def test_sampling_checks_name_the_field(fields, cap, field, match):
    """Construction checks nothing (each front raises its own error type at submit); `check_sampling` names the
    field."""
    params = RequestParams(**fields)
    with pytest.raises(ParamError, match=match) as info:
        params.check_sampling(cap)
    assert info.value.field == field and str(info.value).startswith(field + " ")


def test_sampling_checks_pass_in_range_values():
    RequestParams(temperature=0.7, top_k=CAP, top_p=0.9).check_sampling(CAP)
    RequestParams(top_k=np.int64(CAP + 1)).check_sampling()  # no cap: the engine sizes its program to top_k
