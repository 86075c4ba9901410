"""verify_attn kernel vs the float64 numpy reference (interpret on CPU, compiled on GPU); Triton lowering for H200."""
import functools
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import verify_attn as va
from pallas_kernels import verify_attn_mgpu as vm
from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.verify_attn import _make_plan, verify_attn
from pallas_kernels.verify_attn_ref import verify_attn_ref

TOL = {np.float32: 1e-5, jnp.bfloat16: 2e-2}
GARBAGE = 1e4  # scale of the junk in cache rows past each prefix; any leak would dominate the output


def ancestor_mask(rng, n):
    """Random tree over n slots (parent slot < child slot): row i sees i and its ancestors."""
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        vis[i] |= vis[rng.integers(0, i)]
    return vis


def make_case(rng, *, prefix, n, h, r, dr, s, mask="ancestor", dtype=np.float32):
    """Fresh random inputs; cache rows past prefix_len[b] hold large finite junk."""
    bt, a = len(prefix), r + dr
    q = rng.standard_normal((bt, n, h, a))
    cache = rng.standard_normal((bt, s, a))
    for b, p in enumerate(prefix):
        cache[b, p:] = GARBAGE * rng.standard_normal((s - p, a))
    tree_kv = rng.standard_normal((bt, n, a))
    if mask == "ancestor":
        tree_mask = np.stack([ancestor_mask(rng, n) for _ in range(bt)])
    elif mask == "causal":
        tree_mask = np.broadcast_to(np.tril(np.ones((n, n), bool)), (bt, n, n)).copy()
    else:
        raise ValueError(mask)
    cast = lambda x: np.array(jnp.asarray(x, dtype))  # noqa: E731  (inputs as the kernel sees them)
    return dict(q=cast(q), cache=cast(cache), prefix_len=np.asarray(prefix, np.int32), tree_kv=cast(tree_kv),
                tree_mask=tree_mask)


def run(case, *, interpret, r, **kw):
    scale = 1.5 / math.sqrt(case["q"].shape[-1])
    args = [jnp.asarray(case[k]) for k in ("q", "cache", "prefix_len", "tree_kv", "tree_mask")]
    out = verify_attn(*args, scale=scale, kv_lora_rank=r, interpret=interpret, **kw)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape[:3] + (r,)
    ref = verify_attn_ref(*(case[k] for k in ("q", "cache", "prefix_len", "tree_kv", "tree_mask")), scale=scale,
                          kv_lora_rank=r)
    return np.asarray(out.astype(jnp.float32), np.float64), ref


def assert_close(out, ref, tol, what=""):
    assert not np.isnan(out).any(), f"{what}: NaN in output"
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    max_abs = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel <= tol and max_abs <= tol, f"{what}: rel err {rel:.2e}, max-abs/max|ref| {max_abs:.2e} > {tol}"


# (prefix per request, N, H, R, Dr, S, mask, num_splits): AR row, chain, trees; tiny-engine A = 40 (not a power of
# two), K2's 512 + 64; N*H not a multiple of the query tile; prefixes 0, partial blocks, and the whole cache.
CASES = [
    ([50, 96], 1, 4, 32, 8, 96, "causal", None),
    ([77, 0], 5, 4, 32, 8, 200, "ancestor", 3),
    ([129], 17, 4, 32, 8, 130, "ancestor", None),
    ([0, 150, 300], 17, 8, 64, 16, 300, "causal", 2),
    ([100, 37], 5, 4, 512, 64, 160, "ancestor", None),
    ([40, 5], 5, 4, 32, 8, 300, "ancestor", 4),  # short prefixes: idle splits write nothing, the combine skips them
]


@pytest.mark.parametrize("prefix,n,h,r,dr,s,mask,splits", CASES)
def test_matches_reference_fp32(rng, interpret, prefix, n, h, r, dr, s, mask, splits):
    case = make_case(rng, prefix=prefix, n=n, h=h, r=r, dr=dr, s=s, mask=mask)
    out, ref = run(case, interpret=interpret, r=r, num_splits=splits)
    assert_close(out, ref, TOL[np.float32], f"prefix={prefix} N={n} H={h}")


@pytest.mark.parametrize("layer", [0, 2])
def test_layer_of_the_whole_cache(rng, interpret, layer):
    """cache [L, Bt, S, A] + static layer reads that layer in place: equal to passing the slice, and to float64."""
    cases = [make_case(rng, prefix=[70, 9], n=5, h=4, r=32, dr=8, s=96) for _ in range(3)]
    whole = np.stack([c["cache"] for c in cases])  # [L, Bt, S, A]: the other layers differ
    case = cases[layer]
    args = [jnp.asarray(case[k]) for k in ("q", "cache", "prefix_len", "tree_kv", "tree_mask")]
    kw = dict(scale=0.2, kv_lora_rank=32, interpret=interpret)
    got = verify_attn(args[0], jnp.asarray(whole), *args[2:], layer=layer, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(verify_attn(*args, **kw)))
    ref = verify_attn_ref(*(case[k] for k in ("q", "cache", "prefix_len", "tree_kv", "tree_mask")), scale=0.2,
                          kv_lora_rank=32)
    assert_close(np.asarray(got, np.float64), ref, TOL[np.float32], f"layer {layer} of the whole cache")


@pytest.mark.parametrize("splits", [1, 3])
def test_matches_reference_bf16(rng, interpret, splits):
    case = make_case(rng, prefix=[200, 33], n=17, h=8, r=64, dr=16, s=256, dtype=jnp.bfloat16)
    out, ref = run(case, interpret=interpret, r=64, num_splits=splits)
    assert_close(out, ref, TOL[jnp.bfloat16], f"bf16 splits={splits}")


@pytest.mark.parametrize("programs,max_splits,resident", [
    (8, 128, 1), (4, 128, 1), (64, 32, 1), (256, 32, 1), (544, 32, 1), (1, 32, 1), (3, 1, 1), (8, 128, 2), (64, 32, 2)])
def test_split_count_fills_whole_waves(programs, max_splits, resident):
    """The default split count is within WAVE_SLACK of the best predicted time over every allowed count, and no
    smaller count is: e.g. 8 programs get 16 splits (128 blocks, one wave) rather than 17 (136: a second wave).
    Time, in cache rows: waves x rows per split."""
    seq, wave = 32768, va.SM_COUNT * resident

    def time(sp):
        return -(-programs * sp // wave) * seq / sp

    best = min(time(sp) for sp in range(1, max_splits + 1))
    got = va._default_splits(programs, max_splits, resident, seq)
    assert 1 <= got <= max_splits and time(got) <= best * (1 + va.WAVE_SLACK)
    assert all(time(sp) > best * (1 + va.WAVE_SLACK) for sp in range(1, got))
    if (programs, max_splits, resident) == (8, 128, 1):
        assert programs * got <= wave < programs * -(-wave // programs)  # the old cdiv rule overflowed the wave


@pytest.mark.parametrize("seed", range(6))
def test_makespan_is_list_scheduling(seed):
    """`_makespan` in closed form equals a simulation: each program, in order, starts on the first SM to free up."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        sms, n1, n2 = (int(x) for x in rng.integers((1, 0, 0), (20, 60, 60)))
        w1, w2 = (int(x) for x in rng.integers(1, 50, size=2))
        free = [0] * sms
        for w in [w1] * n1 + [w2] * n2:
            heapq.heappush(free, heapq.heappop(free) + w)
        assert va._makespan(n1, w1, n2, w2, sms) == max(free), (sms, n1, w1, n2, w2)


@pytest.mark.parametrize("items,seq,sms", [(136, 4096, 132), (136, 32768, 132), (1088, 4096, 132), (8, 32768, 132),
                                           (14, 2048, 12), (30, 1024, 12), (5, 4096, 12), (25, 512, 12)])
def test_tail_plan_is_the_best_plan(items, seq, sms):
    """The wgmma path's plan is within WAVE_SLACK of the best of every plan there is (any number of tail tiles, any
    two busy split counts), never slower than the best equal split, and no plan with fewer programs is within the
    slack. 136 tiles (a batch-8 B = 16 verify) on 132 SMs: equal splits leave a partial last wave; the plan gives
    the last tiles more splits and is predicted 1.25x as fast at 4k, 1.09x at 32k (measured 1.23x, 1.15x)."""
    costs = (va.verify_attn_mgpu.PROGRAM_ROWS, va.verify_attn_mgpu.MERGE_ROWS)
    args = (seq, va.verify_attn_mgpu.BLOCK_K, *costs, sms)
    got = va._tail_plan(items, *args)
    min_blocks, n_blocks = -(-va.MIN_SPLIT_ROWS // args[1]), -(-seq // args[1])
    counts = sorted({va._busy_splits(n_blocks, sp, min_blocks) for sp in range(1, seq // va.MIN_SPLIT_ROWS + 1)})
    plan = functools.partial(vm.SplitPlan, items=items, min_split_blocks=min_blocks)
    every = [plan(splits=sp, tail_items=tail, tail_splits=tsp) for sp in counts for tsp in counts
             for tail in range(items + 1)]
    cost = {p: va._plan_cost(p, *args) for p in every}
    best, equal = min(cost.values()), min(cost[plan(splits=sp)] for sp in counts)
    assert va._plan_cost(got, *args) <= min(best * (1 + va.WAVE_SLACK), equal)
    assert all(cost[p] > best * (1 + va.WAVE_SLACK) for p in every if p.programs < got.programs)
    if items == 136 and sms == 132:
        assert got.tail_items > 0 and va._plan_cost(got, *args) <= {4096: 0.8, 32768: 0.92}[seq] * equal


@pytest.mark.parametrize("n_blocks,splits,min_blocks", [(512, 122, 4), (128, 31, 4), (512, 16, 4), (9, 3, 4),
                                                         (10, 4, 1), (7, 16, 4), (0, 8, 4), (1000, 33, 1)])
def test_busy_splits_leave_no_split_idle(n_blocks, splits, min_blocks):
    """At prefix = S every split of the trimmed count reads a block, none reads more than the untrimmed count gave it,
    and the blocks are all read: e.g. 512 blocks over 122 splits -> 103 splits of 5 (19 would have idled)."""
    def reads(sp):
        per = max(-(-n_blocks // sp), min_blocks)
        return [min(n_blocks, (j + 1) * per) - min(n_blocks, j * per) for j in range(sp)]

    got = va._busy_splits(n_blocks, splits, min_blocks)
    assert 1 <= got <= splits
    assert sum(reads(got)) == n_blocks and max(reads(got)) <= max(reads(splits))
    assert n_blocks == 0 or min(reads(got)) > 0
    if (n_blocks, splits) == (512, 122):
        assert got == 103 and reads(splits).count(0) == 19


def test_long_prefix(rng, interpret):
    """A 2047-row prefix (not a block multiple) in a 2100-row cache, with the default (size-driven) split count."""
    case = make_case(rng, prefix=[2047], n=5, h=4, r=32, dr=8, s=2100)
    out, ref = run(case, interpret=interpret, r=32)
    assert_close(out, ref, TOL[np.float32], "prefix 2047")


@pytest.mark.parametrize("splits", [1, 2])
def test_rows_that_see_nothing_are_zero(rng, interpret, splits):
    """Padding slots (mask rows all false) see only the prefix; with prefix 0 they see nothing and must be 0.

    Interpret mode starts Pallas outputs as NaN (see test_interpret_outputs_start_poisoned), so an unwritten row
    would fail here rather than pass as zeros.
    """
    n, n_real = 8, 5
    case = make_case(rng, prefix=[0, 40], n=n, h=4, r=32, dr=8, s=64)
    case["tree_mask"][:, n_real:, :] = False
    out, ref = run(case, interpret=interpret, r=32, num_splits=splits)
    assert not np.isnan(out).any()
    assert np.all(out[0, n_real:] == 0.0), "request 0 (prefix 0): padding rows must be exactly 0"
    assert np.abs(out[1, n_real:]).min() > 0.0, "request 1: padding rows still see the prefix"
    assert_close(out, ref, TOL[np.float32], "padding rows")


def test_garbage_past_prefix_does_not_leak(rng, interpret):
    """Changing every cache row past prefix_len (incl. the rows the tree will overwrite) leaves out bit-identical."""
    case = make_case(rng, prefix=[30, 3], n=8, h=4, r=32, dr=8, s=64)  # shapes of the test above: no recompile
    out1, _ = run(case, interpret=interpret, r=32, num_splits=2)
    for b, p in enumerate(case["prefix_len"]):
        case["cache"][b, p:] = -3 * GARBAGE * rng.random(case["cache"][b, p:].shape)
    out2, _ = run(case, interpret=interpret, r=32, num_splits=2)
    np.testing.assert_array_equal(out1, out2)


def test_interpret_outputs_start_poisoned():
    """The premise of the zero-row tests: an output element the kernel never writes reads back as NaN."""
    def body(x_ref, o_ref):
        o_ref[pl.ds(0, 8)] = x_ref[pl.ds(0, 8)]

    x = jnp.arange(16, dtype=jnp.float32) + 1.0
    out = np.asarray(pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(x))
    np.testing.assert_array_equal(out[:8], np.arange(8) + 1.0)
    assert np.isnan(out[8:]).all()


def test_reference_matches_direct_softmax(rng):
    """The float64 reference against a per-row loop over an explicit key list (guards the golden model itself)."""
    case = make_case(rng, prefix=[6, 0], n=3, h=2, r=4, dr=2, s=8)
    case["tree_mask"][1, 2, :] = False
    scale, r = 0.7, 4
    ref = verify_attn_ref(**case, scale=scale, kv_lora_rank=r)
    case = {k: np.asarray(v, np.float64) if v.dtype == np.float32 else v for k, v in case.items()}
    bt, n, h, _ = case["q"].shape
    for b in range(bt):
        p = int(case["prefix_len"][b])
        for i in range(n):
            keys = list(case["cache"][b, :p]) + [case["tree_kv"][b, j] for j in range(n) if case["tree_mask"][b, i, j]]
            for hh in range(h):
                if not keys:
                    np.testing.assert_array_equal(ref[b, i, hh], 0.0)
                    continue
                logits = np.array([float(case["q"][b, i, hh] @ k) * scale for k in keys])
                w = np.exp(logits - logits.max())
                want = sum(wk * k[:r] for wk, k in zip(w / w.sum(), keys))
                np.testing.assert_allclose(ref[b, i, hh], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bt,n,h,r,dr,s,dtype,splits,split", [
    (1, 17, 64, 512, 64, 4096, jnp.bfloat16, None, True),  # engine sizes; few tiles -> split-K + XLA merge
    (1, 65, 64, 512, 64, 4096, jnp.bfloat16, None, False),  # 130 query tiles fill a wave of 132 SMs: no split
    (2, 257, 64, 512, 64, 4096, jnp.bfloat16, None, False),  # many tiles -> one split, no merge
    (2, 17, 4, 32, 8, 100, jnp.float32, None, False),  # tiny engine config: A = 40, padded internally
    (2, 17, 4, 32, 8, 100, jnp.bfloat16, 3, True),
    (1, 1, 4, 32, 8, 7, jnp.bfloat16, None, False),  # AR, fewer cache rows than one dot tile
])
def test_lowers_for_h200(bt, n, h, r, dr, s, dtype, splits, split):
    a = r + dr
    spec = jax.ShapeDtypeStruct
    fn = functools.partial(verify_attn, scale=0.1, kv_lora_rank=r, num_splits=splits, interpret=False,
                           backend="triton")
    lowered = lower_for_h200(fn, spec((bt, n, h, a), dtype), spec((bt, s, a), dtype), spec((bt,), jnp.int32),
                             spec((bt, n, a), dtype), spec((bt, n, n), jnp.bool_))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1  # split-K partials are merged by XLA, no 2nd kernel
    r_pad, dr_pad = max(r, 16), max(dr, 16)
    plan = _make_plan(bt, n, h, s, r_pad, dr_pad, None, None, splits, jnp.dtype(dtype).itemsize)
    assert (plan.n_splits > 1) == split


def valid_args():
    return dict(q=jnp.ones((2, 3, 4, 40)), cache=jnp.ones((2, 16, 40)), prefix_len=jnp.ones((2,), jnp.int32),
                tree_kv=jnp.ones((2, 3, 40)), tree_mask=jnp.ones((2, 3, 3), bool))


@pytest.mark.parametrize("field,shape", [("cache", (2, 16, 41)), ("tree_kv", (2, 4, 40)), ("tree_mask", (2, 3, 4)),
                                         ("prefix_len", (3,))])
def test_bad_shapes_name_the_tensor(field, shape):
    args = valid_args()
    args[field] = jnp.ones(shape, args[field].dtype)
    with pytest.raises(ValueError, match=f"{field} must have shape"):
        verify_attn(**args, scale=0.1, kv_lora_rank=32, interpret=True)


@pytest.mark.parametrize("kw,match", [(dict(kv_lora_rank=32, layer=0), "layer=0"),
                                      (dict(kv_lora_rank=40), "kv_lora_rank"),
                                      (dict(kv_lora_rank=32, block_k=24), "block_k"),
                                      (dict(kv_lora_rank=32, num_splits=0), "num_splits")])
def test_bad_arguments_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        verify_attn(**valid_args(), scale=0.1, interpret=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("prefix,n,h,dtype", [
    ([4000, 1234], 17, 64, jnp.bfloat16),  # split-K + combine
    ([4096], 65, 64, jnp.bfloat16),
    ([2500], 257, 64, jnp.bfloat16),  # one split
    ([3001, 0], 17, 8, np.float32),  # IEEE fp32 dots: 1e-5
    ([4096, 4000, 3001, 4096, 100, 0, 2048, 4096], 17, 64, jnp.bfloat16),  # a batch-8 B = 16 verify: a tail plan
])
def test_compiled_engine_sizes(rng, prefix, n, h, dtype, backend):
    """Compiled kernels at K2 sizes (A 576, S 4096) against the float64 reference; mosaic where it applies (136
    query tiles take a plan whose last tiles have more splits, `_tail_plan`)."""
    if backend == "mosaic" and not va.verify_attn_mgpu.supports(dtype, 512, 64, 4096):
        pytest.skip("the wgmma kernel takes bf16/fp16 only")
    if len(prefix) * n * h == 136 * vm.ROWS:
        assert va._tail_plan(136, 4096, vm.BLOCK_K, vm.PROGRAM_ROWS, vm.MERGE_ROWS).tail_items > 0
    case = make_case(rng, prefix=prefix, n=n, h=h, r=512, dr=64, s=4096, dtype=dtype)
    out, ref = run(case, interpret=False, r=512, backend=backend)
    assert_close(out, ref, TOL[dtype], f"compiled {backend} prefix={prefix} N={n} H={h}")


def test_merge_splits_is_one_softmax(rng):
    """The flash-decoding merge of split outputs (normalised, with log-sum-exps), an idle split and the mosaic
    path's unnormalised tree part equals one softmax over all their keys (float64); a row that saw nothing in any
    part gets 0, not NaN."""
    bt, rows, r, sizes = 2, 5, 8, (7, 0, 4, 3)  # three prefix splits (one idle), then the tree's keys
    s = rng.standard_normal((bt, rows, sum(sizes))) * 3
    v = rng.standard_normal((bt, sum(sizes), r))
    edges = np.cumsum((0,) + sizes)
    o, lse = np.zeros((bt, 3, rows, r)), np.full((bt, 3, rows), va.NEG)
    for j in range(3):
        lo, hi = edges[j], edges[j + 1]
        if hi > lo:
            lse[:, j] = np.log(np.exp(s[..., lo:hi]).sum(-1))
            o[:, j] = np.einsum("brk,bkd->brd", np.exp(s[..., lo:hi] - lse[:, j, :, None]), v[:, lo:hi])
    t = slice(edges[3], edges[4])
    m_t = s[..., t].max(-1)
    p_t = np.exp(s[..., t] - m_t[..., None])
    tree = (np.einsum("brk,bkd->brd", p_t, v[:, t]), m_t, p_t.sum(-1))
    m_t[1, 0], tree[2][1, 0], tree[0][1, 0] = va.NEG, 0.0, 0.0  # request 1, row 0 sees no tree key ...
    lse[1, :, 0], o[1, :, 0] = va.NEG, 0.0  # ... and no prefix key
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    got = np.asarray(va._merge_splits(f32(o), f32(lse), tuple(map(f32, tree))), np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("brk,bkd->brd", p / p.sum(-1, keepdims=True), v)
    want[1, 0] = 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got[1, 0] == 0).all()
