"""Property tests (hypothesis): every kernel in pallas_kernels/ (tree_build, tree_accept, verify_attn on both
backends, top-k, the INT4 MoE matmul and FFN) against its numpy reference on random shape combinations, dtypes and
ties the fixed-case tests do not use, and greedy ddtree generation against autoregressive greedy decoding of the
float64 golden model on random small target configs. References, input makers and tolerances come from each kernel's
own test file.

Compiles dominate on CPU (every drawn shape is a new program), so each property draws few examples.
"""
from __future__ import annotations

import math

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import drafter_config, random_drafter
from hypothesis import HealthCheck, Phase, example, given, note, settings
from test_int4_moe import TOL as INT4_TOL
from test_int4_moe import as_input, present_only, random_routing, routing_with_absent
from test_int4_moe import assert_close as assert_int4_close
from test_topk import check as check_topk
from test_topk import tied_logits

from kdtree_jax.checkpoint.weights import init_random, random_hf_weights
from kdtree_jax.decode.engine import Engine
from kdtree_jax.model import config
from kdtree_jax.model.quant import quant_int4
from kdtree_jax.oracles.reference import reference_forward
from pallas_kernels import int4_moe
from pallas_kernels.int4_moe import int4_expert_matmul, int4_moe_ffn
from pallas_kernels.int4_moe_ref import int4_expert_matmul_ref, int4_moe_ffn_ref
from pallas_kernels.topk import topk_logprobs_pallas
from pallas_kernels.tree_accept import tree_accept
from pallas_kernels.tree_accept_ref import tree_accept_ref
from pallas_kernels.tree_build import tree_build
from pallas_kernels.tree_build_ref import tree_build_ref
from pallas_kernels.verify_attn import verify_attn
from pallas_kernels.verify_attn_mgpu import SEQ_ALIGN
from pallas_kernels.verify_attn_ref import verify_attn_ref

SEEDS = st.integers(0, 2**31 - 1)
KERNEL_SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MOSAIC_SETTINGS = settings(KERNEL_SETTINGS, max_examples=3)  # the Mosaic GPU interpreter: seconds per example
INT4_SETTINGS = settings(KERNEL_SETTINGS, max_examples=4)  # two kernels and their glue: ~3 s of compiles per example
# verify_attn relative error vs float64 (as tests/test_verify_attn.py); float16 (measured ~3e-4) gets what bfloat16
# gets, ~5 units of its rounding
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2.5e-3}
GARBAGE = 1e4  # cache rows past each prefix hold large finite junk: any leak dominates the output
NEAR_TIE = 1e-4  # float64 top-2 logit gap below which fp32 greedy may legitimately pick the other token


def _assert_fields_equal(got, want, what: str) -> None:
    for field in want._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), getattr(want, field), err_msg=f"{what} {field}")


# ---- tree_build ------------------------------------------------------------------------------------------------
def _draft_logprobs(rng, bt, d, k, kind):
    """[Bt, D, K] per-depth log-probs: continuous, on a coarse grid (frequent ties), or all equal (every score tied)."""
    if kind == "equal":
        return np.full((bt, d, k), -float(rng.exponential(1.0)) - 0.1, np.float32)
    lp = -rng.exponential(1.5, (bt, d, k))
    if kind == "grid":
        lp = np.round(lp * 2.0) / 2.0
    return lp.astype(np.float32)


@KERNEL_SETTINGS
@given(bt=st.integers(1, 5), d=st.integers(1, 5), k=st.integers(1, 6), budget=st.integers(1, 40),
       kind=st.sampled_from(["continuous", "grid", "equal"]), sort=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), seed=SEEDS)
def test_tree_build_matches_heap(interpret, bt, d, k, budget, kind, sort, dtype, seed):
    """Any (batch, depth, K, budget, lp dtype), sorted or unsorted rows, exact ties and budgets past the prefix space.
    Half-precision log-probs tie more often; the kernel widens them to float32, exactly what the reference sees."""
    rng = np.random.default_rng(seed)
    lp = _draft_logprobs(rng, bt, d, k, kind)
    if sort:
        lp = -np.sort(-lp, axis=-1)
    lp = np.asarray(jnp.asarray(lp, dtype).astype(jnp.float32))  # the values the kernel sees
    ids = np.argsort(rng.random((bt, d, 3 * k)), axis=-1)[..., :k].astype(np.int32)  # distinct per depth
    root = rng.integers(0, 3 * k, bt).astype(np.int32)
    tree = tree_build(jnp.asarray(lp, dtype), jnp.asarray(ids), jnp.asarray(root), budget=budget, interpret=interpret)
    want = tree_build_ref(lp, ids, root, budget=budget)
    _assert_fields_equal(tree, want, f"bt={bt} d={d} k={k} B={budget} {kind} {dtype}")
    space = sum(k**i for i in range(1, d + 1))
    np.testing.assert_array_equal(np.asarray(tree.n_nodes), min(budget, space))
    parents, slots = np.asarray(tree.parents), np.arange(budget + 1)
    for b in range(bt):  # real nodes hang below an earlier slot; pads are detached
        m = int(tree.n_nodes[b])
        assert ((0 <= parents[b, 1 : m + 1]) & (parents[b, 1 : m + 1] < slots[1 : m + 1])).all()
        assert (parents[b, m + 1 :] == -1).all() and (np.asarray(tree.depths)[b] <= d).all()


# ---- tree_accept -----------------------------------------------------------------------------------------------
@KERNEL_SETTINGS
@given(bt=st.integers(1, 6), d=st.integers(1, 5), k=st.integers(1, 4), budget=st.integers(0, 30),
       hit=st.floats(0.0, 1.0), truncate=st.booleans(), seed=SEEDS)
def test_tree_accept_matches_walk(interpret, bt, d, k, budget, hit, truncate, seed):
    """Random trees (incl. root-only and truncated n_nodes) and target choices that follow the tree with prob `hit`."""
    rng = np.random.default_rng(seed)
    vocab = 4 * k + 4
    lp = -np.sort(rng.exponential(1.0, (bt, d, k)), axis=-1).astype(np.float32)
    ids = np.argsort(rng.random((bt, d, vocab)), axis=-1)[..., :k].astype(np.int32)
    tree = tree_build_ref(lp, ids, rng.integers(0, vocab, bt), budget=budget)
    n_nodes = rng.integers(0, tree.n_nodes + 1) if truncate else tree.n_nodes
    n = budget + 1
    choice = rng.integers(0, vocab, (bt, n))
    for b, i in np.ndindex(bt, n):  # with prob `hit`, the token of a random child of slot i
        kids = np.flatnonzero(tree.parents[b] == i)
        if len(kids) and rng.random() < hit:
            choice[b, i] = tree.tokens[b, rng.choice(kids)]
    args = [jnp.asarray(x, jnp.int32) for x in (choice, tree.tokens, tree.parents, n_nodes)]
    got = tree_accept(*args, max_depth=d, interpret=interpret)
    want = tree_accept_ref(choice, tree.tokens, tree.parents, n_nodes, max_depth=d)
    _assert_fields_equal(got, want, f"bt={bt} d={d} k={k} B={budget}")
    path, n_acc = np.asarray(got.path), np.asarray(got.n_accepted)
    for b in range(bt):  # the accepted path is a root-first chain of real nodes whose tokens the target chose
        p = path[b, : n_acc[b]]
        assert p[0] == 0 and (p[1:] <= n_nodes[b]).all()
        assert (tree.parents[b, p[1:]] == p[:-1]).all()
        assert (choice[b, p[:-1]] == tree.tokens[b, p[1:]]).all()
        assert int(got.bonus[b]) == choice[b, p[-1]]


# ---- verify_attn -----------------------------------------------------------------------------------------------
def _tree_mask(rng, bt, n, kind):
    if kind == "causal":
        return np.broadcast_to(np.tril(np.ones((n, n), bool)), (bt, n, n)).copy()
    masks = np.zeros((bt, n, n), bool)
    for b in range(bt):
        n_real = n if kind == "ancestor" else int(rng.integers(1, n + 1))  # "padded": rows past n_real see nothing
        masks[b, :n_real, :n_real] = np.eye(n_real, dtype=bool)
        for i in range(1, n_real):
            masks[b, i] |= masks[b, rng.integers(0, i)]
    return masks


def _check_verify_attn(interpret, backend, bt, n, h, r, dr, s, splits, dtype, mask, seed):
    """One random verify_attn case on `backend` against float64: shape, dtype, finite, blind rows 0, TOL."""
    rng = np.random.default_rng(seed)
    a = r + dr
    prefix = rng.integers(0, s + 1, bt)
    prefix[0] = max(prefix[0], 1)  # some key is visible to every row of request 0 (non-zero reference norm)
    q = rng.standard_normal((bt, n, h, a))
    cache = rng.standard_normal((bt, s, a))
    for b, p in enumerate(prefix):
        cache[b, p:] = GARBAGE * rng.standard_normal((s - p, a))
    tree_kv = rng.standard_normal((bt, n, a))
    tree_mask = _tree_mask(rng, bt, n, mask)
    cast = lambda x: np.array(jnp.asarray(x, dtype))  # noqa: E731  (inputs exactly as the kernel sees them)
    q, cache, tree_kv = cast(q), cast(cache), cast(tree_kv)
    scale = 1.5 / math.sqrt(a)
    out = verify_attn(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(prefix, jnp.int32), jnp.asarray(tree_kv),
                      jnp.asarray(tree_mask), scale=scale, kv_lora_rank=r, num_splits=splits, interpret=interpret,
                      backend=backend)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (bt, n, h, r)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = verify_attn_ref(q, cache, prefix, tree_kv, tree_mask, scale=scale, kv_lora_rank=r)
    assert np.isfinite(out).all()
    blind = (prefix[:, None] == 0) & ~tree_mask.any(-1)  # [Bt, N] rows that see no key at all
    assert (out[blind] == 0.0).all()
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    worst = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel <= TOL[dtype] and worst <= TOL[dtype], f"rel {rel:.2e}, max-abs {worst:.2e} (prefix {prefix})"


@KERNEL_SETTINGS
@given(bt=st.integers(1, 3), n=st.integers(1, 9), h=st.sampled_from([1, 2, 4]), r=st.sampled_from([16, 24, 32]),
       dr=st.sampled_from([4, 8]), s=st.integers(8, 150), splits=st.sampled_from([None, 1, 2, 3]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       mask=st.sampled_from(["ancestor", "causal", "padded"]), seed=SEEDS)
@pytest.mark.heavy
def test_verify_attn_matches_float64(interpret, bt, n, h, r, dr, s, splits, dtype, mask, seed):
    """Triton kernel: random (batch, nodes, heads, latent widths incl. non-powers of two, cache rows, prefixes, splits,
    dtype)."""
    _check_verify_attn(interpret, "triton", bt, n, h, r, dr, s, splits, dtype, mask, seed)


@MOSAIC_SETTINGS
@given(bt=st.integers(1, 2), n=st.integers(1, 5), h=st.sampled_from([1, 8, 64]), r=st.sampled_from([128, 256]),
       s=st.integers(1, 24).map(lambda rows: rows * SEQ_ALIGN), splits=st.sampled_from([None, 1, 2, 3]),
       dtype=st.sampled_from(["bfloat16", "float16"]), mask=st.sampled_from(["ancestor", "causal", "padded"]),
       seed=SEEDS)
@pytest.mark.heavy
def test_verify_attn_mosaic_matches_float64(interpret, bt, n, h, r, s, splits, dtype, mask, seed):
    """Mosaic GPU (wgmma) kernel, in Mosaic GPU's interpreter on CPU: the widths and cache rows it supports (R a
    multiple of 128, rope 64, S a multiple of 8); query rows from 1 (one padded 64-row tile) to 5 whole tiles; prefixes
    from empty to the whole cache, over more splits than blocks."""
    _check_verify_attn(interpret, "mosaic", bt, n, h, r, 64, s, splits, dtype, mask, seed)


# ---- top-k log-probs --------------------------------------------------------------------------------------------
TOPK_MAX_K = 72  # past FASTER_MAX_K = 64 (the largest k topk_logprobs sends to the kernel at small vocab)


@st.composite
def topk_shapes(draw):
    """(V, k, chunk): any vocab, or one at a chunk edge (whole chunks, one entry short or over); k from 1 to V and
    above a small requested chunk (which then grows to hold k); chunk None = the default, one chunk for these V."""
    chunk = draw(st.sampled_from([16, 64, 128, None]))
    edge = draw(st.integers(1, 4)) * (chunk or 128) + draw(st.sampled_from([-1, 0, 1]))
    v = draw(st.one_of(st.integers(1, 400), st.just(edge)))
    k = draw(st.one_of(st.integers(1, min(v, TOPK_MAX_K)), st.just(min(v, TOPK_MAX_K))))
    return v, k, chunk


def _topk_logits(rng, shape, kind):
    """[Bt, D, V] f32: "normal" continuous; "grid" test_topk's tied logits (0.1 grid, some -inf, one row mostly
    -inf); "levels" three values (ties inside and across every chunk); "equal" one value (the answer is ids 0..k-1)."""
    if kind == "grid":
        return tied_logits(rng, shape)
    if kind == "levels":
        return rng.integers(-1, 2, shape).astype(np.float32) * np.float32(rng.exponential(2.0))
    if kind == "equal":
        return np.full(shape, 3 * rng.standard_normal(), np.float32)
    return (3 * rng.standard_normal(shape)).astype(np.float32)


@settings(KERNEL_SETTINGS, max_examples=5)
@given(shape=topk_shapes(), bt=st.integers(1, 3), d=st.integers(1, 3),
       kind=st.sampled_from(["normal", "grid", "levels", "equal"]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), seed=SEEDS)
@pytest.mark.heavy
@example(shape=(129, 72, 16), bt=2, d=1, kind="equal", dtype="bfloat16", seed=0)  # all tied; k > chunk: 2 chunks
def test_topk_matches_reference(interpret, shape, bt, d, kind, dtype, seed):
    """Ids exactly (equal values: lower vocab index first, the reference's and lax.top_k's rule) and lp to
    test_topk.TOL, against the float64 reference and XLA (test_topk.check), on logits of any float dtype."""
    v, k, chunk = shape
    rng = np.random.default_rng(seed)
    x = _topk_logits(rng, (bt, d, v), kind)
    # the values the kernel sees; + 0.0 drops -0.0, which XLA orders below +0.0 and the reference does not
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) + np.float32(0.0)
    kw = {} if chunk is None else dict(chunk=chunk)
    lp, ids = topk_logprobs_pallas(jnp.asarray(x, dtype), k, interpret=interpret, **kw)
    assert lp.shape == ids.shape == (bt, d, k)
    check_topk(x, k, lp, ids)


# ---- INT4 MoE ---------------------------------------------------------------------------------------------------
INT4_DTYPES = [(np.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, "f32")]  # (x dtype, unpack); None: bf16x2
# for bf16, which the interpreter runs as its jnp stand-in


def _int4(rng, e, n_out, n_in, group):
    """test_int4_moe.random_int4 with the group size drawn as well."""
    return quant_int4(rng.standard_normal((e, n_out, n_in)) / np.sqrt(n_in), group)


@INT4_SETTINGS
@given(p=st.integers(1, 70), e=st.sampled_from([1, 3, 8, 16]), group=st.sampled_from([16, 32, 64, 128]),
       groups=st.integers(1, 3), n_out=st.integers(1, 96), dtype_unpack=st.sampled_from(INT4_DTYPES),
       block_m=st.sampled_from([None, 16, 64]), block_n=st.sampled_from([None, 16]), one_expert=st.booleans(),
       seed=SEEDS)
@pytest.mark.heavy
def test_int4_expert_matmul_matches_float64(interpret, p, e, group, groups, n_out, dtype_unpack, block_m, block_n,
                                           one_expert, seed):
    """Any rows, experts (one included), group size, K (whole groups) and N (any, padded to the tile); rows spread over
    the experts or all on one (spanning row blocks)."""
    dtype, unpack = dtype_unpack
    rng = np.random.default_rng(seed)
    k_in = group * groups
    packed, scale = _int4(rng, e, n_out, k_in, group)
    ids = np.full(p, rng.integers(0, e)) if one_expert else rng.integers(0, e, p)
    ids = ids.astype(np.int32)
    x = as_input(rng.standard_normal((p, k_in)), dtype)
    out = int4_expert_matmul(jnp.asarray(x, dtype), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(ids),
                             block_m=block_m, block_n=block_n, unpack=unpack, interpret=interpret)
    assert out.shape == (p, n_out) and out.dtype == dtype
    assert_int4_close(out, int4_expert_matmul_ref(x, packed, scale, ids), INT4_TOL[dtype], f"P={p} E={e} K={k_in}")


@st.composite
def int4_ffn_shapes(draw):
    """(E, top-k, group, D, I, block_w, split_k): D and I whole groups; split_k divides the gate/up K tiles."""
    e = draw(st.sampled_from([1, 2, 4, 8, 16]))
    top_k = draw(st.integers(1, min(e, 4)))
    group = draw(st.sampled_from([16, 32, 64, 128]))
    d = group * draw(st.integers(1, max(1, 384 // group)))
    inter = group * draw(st.integers(1, max(1, 192 // group)))
    block_w = draw(st.sampled_from([None, 16]))
    bw, words = int4_moe._k_tiling(d, group, block_w)
    split_k = draw(st.sampled_from([s for s in (1, 2, 4) if (words // bw) % s == 0]))
    return e, top_k, group, d, inter, block_w, split_k


@INT4_SETTINGS
@given(shape=int4_ffn_shapes(), m=st.integers(1, 40), dtype_unpack=st.sampled_from(INT4_DTYPES),
       block_m=st.sampled_from([None, 16, 64]), routing=st.sampled_from(["spread", "hot", "absent"]), seed=SEEDS)
@pytest.mark.heavy
@example(shape=(1, 1, 16, 16, 16, None, 1), m=1, dtype_unpack=INT4_DTYPES[0], block_m=None, routing="spread", seed=0)
def test_int4_moe_ffn_matches_float64(interpret, shape, m, dtype_unpack, block_m, routing, seed):
    """Fused gate/up + down kernels with the routing glue: any tokens (one included), experts (one included), top-k,
    widths, K tiling and split-K; routing spread, every token on the same experts, or with absent (other-device)
    pairs."""
    e, top_k, group, d, inter, block_w, split_k = shape
    dtype, unpack = dtype_unpack
    rng = np.random.default_rng(seed)
    w = [*_int4(rng, e, inter, d, group), *_int4(rng, e, inter, d, group), *_int4(rng, e, d, inter, group)]
    if routing == "absent":
        idx, weights = routing_with_absent(rng, m, e, top_k)
    else:
        hot = rng.choice(e, top_k, replace=False) if routing == "hot" else None  # every token on the same experts
        idx, weights = random_routing(rng, m, e, top_k, experts=hot)
    x = as_input(rng.standard_normal((m, d)), dtype)
    out = int4_moe_ffn(jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w),
                       block_m=block_m, block_w=block_w, split_k=split_k, unpack=unpack, interpret=interpret)
    assert out.shape == (m, d) and out.dtype == dtype
    want = int4_moe_ffn_ref(x, *present_only(idx, weights, e), *w)
    assert_int4_close(out, want, INT4_TOL[dtype], f"M={m} E={e} k={top_k} D={d} I={inter} split_k={split_k}")


# ---- engine: greedy ddtree == autoregressive greedy --------------------------------------------------------------
@st.composite
def target_configs(draw):
    """A valid small Kimi-shaped config: routing groups, dense-layer count, head dims, q-LoRA and YaRN all vary."""
    layers = draw(st.integers(1, 2))
    experts = draw(st.sampled_from([4, 8]))
    per_tok = draw(st.integers(1, 3))
    n_group = draw(st.sampled_from([g for g in (1, 2, 4) if g == 1 or experts // g >= 2]))
    per_group = experts // n_group
    topk_group = draw(st.integers(1, n_group).filter(lambda t: t * per_group >= per_tok))
    yarn = draw(st.booleans())
    return config.tiny(
        eos_token_id=(), vocab_size=draw(st.sampled_from([64, 256])), num_hidden_layers=layers,
        first_k_dense_replace=draw(st.integers(0, layers)), n_routed_experts=experts, num_experts_per_tok=per_tok,
        n_group=n_group, topk_group=topk_group, num_attention_heads=draw(st.sampled_from([1, 2, 4])),
        qk_nope_head_dim=draw(st.sampled_from([8, 16])), qk_rope_head_dim=draw(st.sampled_from([4, 8])),
        v_head_dim=draw(st.sampled_from([8, 16])), kv_lora_rank=draw(st.sampled_from([16, 32])),
        q_lora_rank=draw(st.sampled_from([None, 32])),
        rope_scaling=config.tiny().rope_scaling if yarn else config.RopeScaling(),
    )


def _check_greedy(cfg, weights, prompt, out):
    """out must be the float64 model's greedy continuation of prompt (up to a genuine near-tie)."""
    seq = list(prompt) + list(out[:-1])
    logits = reference_forward(cfg, weights, np.asarray(seq))  # [T, V] float64
    for i, tok in enumerate(out):
        row = logits[len(prompt) - 1 + i]
        want = int(np.argmax(row))
        if want != tok:
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"token {i}: got {tok}, greedy {want} (gap {top2[1] - top2[0]:.2e})"
            note(f"near-tie at token {i}; stopped comparing")
            return


# no shrink phase: every shrink step is a new config, i.e. a new ~8 s compile
@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(cfg=target_configs(), block=st.integers(2, 4), budget=st.integers(0, 24), batch=st.integers(1, 2),
       max_new=st.integers(3, 8), seed=SEEDS, data=st.data())
@pytest.mark.heavy
def test_greedy_ddtree_is_autoregressive_greedy(cfg, block, budget, batch, max_new, seed, data):
    """On random configs and prompts, every request's ddtree tokens are the golden model's AR greedy tokens."""
    target = init_random(cfg, seed=seed)
    drafter = random_drafter(drafter_config(cfg, block_size=block), seed)
    prompts = [data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=8), label=f"prompt {b}")
               for b in range(batch)]
    res = Engine(target, drafter, None).generate(prompts, max_new, mode="ddtree", budget=budget)
    weights = random_hf_weights(cfg, seed)  # the same draw init_random mapped into the model
    for prompt, o in zip(prompts, res.outputs):
        assert o.finish_reason == "length" and len(o.token_ids) == max_new
        assert all(1 <= a <= block for a in o.accept_lengths) and sum(o.accept_lengths) >= max_new - 1
        _check_greedy(cfg, weights, prompt, o.token_ids)
