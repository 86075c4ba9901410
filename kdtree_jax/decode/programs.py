"""The device programs of a batch generation: chunked prefill, and `lax.while_loop` over speculative rounds.

Pure functions of the modules and the decode state, apart from the host-side `Engine`, so the engine compiles them
and the benchmarks and tests can trace or lower one alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kdtree_jax.constrain import device as cd
from kdtree_jax.decode import logprobs as lp_mod
from kdtree_jax.decode import sampling
from kdtree_jax.decode.speculative import (
    FINISH_NONFINITE,
    DecodeSpec,
    DecodeState,
    RequestRows,
    choose_tokens,
    drafter_pass,
    first_token_finish,
    speculative_round,
)
from kdtree_jax.model.drafter import DrafterCache
from kdtree_jax.model.target import LatentCache, forward_prefill, forward_verify


def prefill(spec: DecodeSpec, target, drafter, prompts: jax.Array, prompt_len: jax.Array, keys: jax.Array,
            params: RequestRows, tables: cd.AutomatonTables | None = None,
            start_state: jax.Array | None = None) -> DecodeState:
    """Fill the target (and drafter) caches from right-padded prompts and pick the first token.

    prompts: [Bt, prompt_cap] int32, prompt_len: [Bt], keys: [Bt, 2] raw PRNG keys, params: what each request asks
    for; tables + start_state [Bt]: each row's automaton start state (`cd.FREE_STATE`: unconstrained), which
    constrains the first token. Chunks run through the verify path (absorbed MLA, causal mask, the verify_attn kernel) when the spec uses
    Pallas: a chunk at a traced start in plain MLA would expand every cache row through kv_b and materialise
    [Bt, H, chunk, S] scores (~17 GB per layer for K2.6 at batch 8 and 32k); the kernel streams the prefix instead.
    Without Pallas, plain MLA.
    """
    bt, cap = prompts.shape
    chunk = spec.prefill_chunk
    cache = LatentCache.zeros(target.cfg, bt, spec.capacity, target.cache_dtype)
    draft_cache = None if drafter is None else DrafterCache.zeros(drafter.cfg, bt, spec.capacity, drafter.compute_dtype)
    dummy_bonus = jnp.zeros((bt,), jnp.int32)

    causal = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (bt, chunk, chunk))

    def one_chunk(carry, c):
        cache, draft_cache, last = carry
        start = c * chunk
        tokens = jax.lax.dynamic_slice_in_dim(prompts, start, chunk, axis=1)
        valid = start + jnp.arange(chunk)[None, :] < prompt_len[:, None]  # [Bt, chunk]
        if spec.use_pallas:  # a causal "tree" over the cached prefix: flash-style kernel, no [S]-sized temporaries
            positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (bt, chunk))
            out = forward_verify(target, tokens, positions, jnp.full((bt,), start, jnp.int32), causal, cache,
                                 taps=spec.taps, use_pallas=True, valid=valid, attn_backend=spec.attn_backend)
        else:
            out = forward_prefill(target, tokens, start, cache, taps=spec.taps, valid=valid)
        row = prompt_len - 1 - start  # [Bt] the prompt's last row, if it is in this chunk
        here = (row >= 0) & (row < chunk)
        logits = jnp.take_along_axis(out.logits, jnp.clip(row, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(here[:, None], logits, last)
        if draft_cache is not None:  # commit the chunk's features; the block drafted alongside is discarded
            n_ctx = jnp.clip(prompt_len - start, 0, chunk)
            _, _, draft_cache = drafter_pass(spec, drafter, target, draft_cache, out.hidden, n_ctx, dummy_bonus)
        return (out.cache, draft_cache, last), None

    last0 = jnp.zeros((bt, target.cfg.vocab_size), jnp.float32)
    (cache, draft_cache, last), _ = jax.lax.scan(one_chunk, (cache, draft_cache, last0), jnp.arange(cap // chunk))

    first_keys = sampling.position_keys(jax.random.wrap_key_data(keys), (prompt_len - 1)[:, None])
    start = None if tables is None else start_state.astype(jnp.int32)
    first = choose_tokens(last[:, None, :], params.sampling, first_keys, spec.top_k_cap, tables,
                          None if start is None else start[:, None])[:, 0]
    state_after = None if tables is None else cd.next_state(tables, start, first)
    tokens = jnp.zeros((bt, spec.capacity), jnp.int32).at[:, :cap].set(prompts)
    tokens = jax.vmap(lambda t, i, v: t.at[i].set(v))(tokens, prompt_len, first)
    finish = first_token_finish(last, first, params, 0)
    nonfinite = finish == FINISH_NONFINITE

    depth, k = max(spec.depth, 1), spec.top_k
    lp = jnp.zeros((bt, depth, k), jnp.float32)
    ids = jnp.zeros((bt, depth, k), jnp.int32)
    if drafter is not None:
        feat = jnp.zeros((bt, 1, drafter.cfg.feature_dim), cache.dtype)
        first_allowed = None if tables is None else cd.allowed_mask(tables, state_after)
        lp, ids, draft_cache = drafter_pass(spec, drafter, target, draft_cache, feat, jnp.zeros((bt,), jnp.int32), first,
                                            first_allowed)
    return DecodeState(
        tokens=tokens,
        length=prompt_len.astype(jnp.int32),
        prompt_len=prompt_len.astype(jnp.int32),
        n_generated=jnp.where(nonfinite, 0, 1).astype(jnp.int32),
        finish=finish,
        cache=cache,
        draft_cache=draft_cache,
        draft_lp=lp,
        draft_ids=ids,
        keys=keys,
        params=params,
        round=jnp.int32(0),
        accept_len=jnp.zeros((bt, spec.max_rounds), jnp.int32),
        constraint_state=state_after,
        logprobs=None if spec.logprobs is None else first_logprobs(spec, last, first),
    )


def first_logprobs(spec: DecodeSpec, last: jax.Array, first: jax.Array) -> lp_mod.LogprobRows:
    """A batch generation's buffer (one entry per token it can write: its limit and one round past it) holding the
    first token, drawn from the prompt's last logits [Bt, V]."""
    bt = first.shape[0]
    rows = lp_mod.LogprobRows.zeros(bt, spec.max_new_tokens + spec.depth + 1, spec.logprobs)
    zero = jnp.zeros((bt, 1), jnp.int32)
    return lp_mod.write(rows, last[:, None, :], first[:, None], zero, jnp.ones((bt, 1), bool))


def decode_loop(spec: DecodeSpec, target, drafter, state: DecodeState, round_limit: jax.Array,
                tables: cd.AutomatonTables | None = None) -> DecodeState:
    """Rounds on the device until every request is done or `round_limit` rounds have run in total."""

    def cond(s: DecodeState):
        return (s.round < jnp.minimum(round_limit, spec.max_rounds)) & jnp.any(~s.done)

    body = functools.partial(speculative_round, spec, target, drafter, tables=tables)
    return jax.lax.while_loop(cond, body, state)


def generate_device(spec, target, drafter, prompts, prompt_len, keys, params, tables=None,
                    start_state=None) -> DecodeState:
    """Prefill + every round: one compiled computation."""
    state = prefill(spec, target, drafter, prompts, prompt_len, keys, params, tables, start_state)
    return decode_loop(spec, target, drafter, state, jnp.int32(spec.max_rounds), tables)
