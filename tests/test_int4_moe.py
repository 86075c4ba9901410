"""INT4 grouped expert matmul / fused MoE FFN vs the float64 numpy reference (interpret on CPU, compiled on GPU),
the routing layout's invariants, the XLA baselines, and Triton lowering for an abstract H200."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.model.quant import quant_int4
from pallas_kernels import int4_moe
from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.int4_moe import (
    bf16_gather_ffn,
    bf16_ragged_dot_ffn,
    dequant_then_matmul_ffn,
    grouped_int4_matmul,
    int4_expert_matmul,
    int4_moe_ffn,
    route_layout,
    route_layout_pairwise,
    route_layout_sorted,
)
from pallas_kernels.int4_moe_ref import int4_expert_matmul_ref, int4_moe_ffn_ref

TOL = {np.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}
GROUP = 32
E, TOP_K = 8, 2


def random_int4(rng, e, n_out, n_in):
    """Quantize fresh N(0, 1/n_in) weights: (packed int32 [e, out, in/8], scale bf16 [e, out, in/32])."""
    return quant_int4(rng.standard_normal((e, n_out, n_in)) / np.sqrt(n_in), GROUP)


def random_routing(rng, m, e=E, k=TOP_K, experts=None):
    """Distinct experts per token drawn from `experts` (default all), positive weights."""
    pool = np.arange(e) if experts is None else np.asarray(experts)
    idx = np.stack([rng.choice(pool, k, replace=False) for _ in range(m)]).astype(np.int32)
    return idx, rng.uniform(0.2, 1.5, (m, k)).astype(np.float32)


def as_input(x, dtype):
    """What the kernel sees, as a float32 numpy array (bf16 inputs rounded first so the reference sees them too)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def assert_close(out, ref, tol, what=""):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output (an unwritten row stays NaN in interpret mode)"
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    max_abs = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel <= tol and max_abs <= 4 * tol, f"{what}: rel err {rel:.2e}, max-abs/max|ref| {max_abs:.2e} (tol {tol})"


# ---- grouped matmul ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,k_in,n_out,dtype", [(1, 64, 32, np.float32), (5, 256, 128, jnp.bfloat16),
                                                    (33, 128, 48, np.float32)])
def test_expert_matmul_matches_reference(rng, interpret, dtype, tokens, k_in, n_out):
    packed, scale = random_int4(rng, E, n_out, k_in)
    idx, _ = random_routing(rng, tokens)
    ids = idx.reshape(-1)
    x = as_input(rng.standard_normal((ids.size, k_in)), dtype)
    out = int4_expert_matmul(jnp.asarray(x, dtype), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(ids),
                             interpret=interpret)
    assert out.shape == (ids.size, n_out) and out.dtype == dtype
    assert_close(out, int4_expert_matmul_ref(x, packed, scale, ids), TOL[dtype], f"tokens {tokens}")


def test_all_rows_to_one_expert_spans_row_blocks(rng, interpret):
    """70 rows on one expert (5 blocks of 16, the last partial) and nothing elsewhere."""
    packed, scale = random_int4(rng, E, 32, 128)
    ids = np.full(70, 5, np.int32)
    x = rng.standard_normal((70, 128)).astype(np.float32)
    out = int4_expert_matmul(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(ids), block_m=16,
                             interpret=interpret)
    assert_close(out, int4_expert_matmul_ref(x, packed, scale, ids), TOL[np.float32], "one expert")


def test_untouched_experts_are_never_read(rng, interpret):
    """Experts without rows are skipped: NaN scales there (which would poison any product) leave y unchanged."""
    packed, scale = random_int4(rng, E, 32, 128)
    ids = rng.choice([2, 6], 12).astype(np.int32)
    x = rng.standard_normal((12, 128)).astype(np.float32)
    scale_nan = scale.copy()
    scale_nan[[0, 1, 3, 4, 5, 7]] = np.nan
    out = int4_expert_matmul(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scale_nan), jnp.asarray(ids),
                             interpret=interpret)
    assert_close(out, int4_expert_matmul_ref(x, packed, scale, ids), TOL[np.float32], "skipped experts")


# ---- routing layout -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,e,block_m", [(1, 8, 16), (37, 8, 16), (200, 384, 32), (64, 4, 16)])
def test_route_layout_invariants(rng, p, e, block_m):
    ids = rng.integers(0, e, p).astype(np.int32)
    layout = jax.jit(route_layout, static_argnums=(1, 2))(jnp.asarray(ids), e, block_m)
    lay = jax.tree.map(np.asarray, layout)
    counts = np.bincount(ids, minlength=e)
    used = lay.slot_count > 0
    np.testing.assert_array_equal(lay.slot_expert[used], np.nonzero(counts)[0])  # touched experts, ascending
    np.testing.assert_array_equal(lay.slot_count[used], counts[counts > 0])
    assert (lay.slot_start % block_m == 0).all()
    ends = lay.slot_start + -(-lay.slot_count // block_m) * block_m
    assert ends.max() <= lay.rows and (lay.slot_start[1:] >= ends[:-1]).all(), "slots overlap or leave the rows"
    assert len(set(lay.dest.tolist())) == p, "two pairs share a row"
    slot_of = {int(x): s for s, x in enumerate(lay.slot_expert) if lay.slot_count[s] > 0}
    for row, ex in zip(lay.dest, ids):
        s = slot_of[int(ex)]
        assert lay.slot_start[s] <= row < lay.slot_start[s] + lay.slot_count[s]
    # the per-block view, rebuilt row by row: a block holds the pairs of one expert, padding rows last
    held = np.full(lay.rows, -1)
    held[lay.dest] = ids
    blocks = held.reshape(-1, block_m)
    want_rows = (blocks >= 0).sum(axis=1)
    np.testing.assert_array_equal(lay.block_rows, want_rows)
    live = want_rows > 0
    np.testing.assert_array_equal(lay.block_expert[live], blocks[live, 0])
    assert all((blk[:n] == blk[0]).all() and (blk[n:] < 0).all() for blk, n in zip(blocks, want_rows))


# ---- fused FFN --------------------------------------------------------------------------------------------------
def make_ffn(rng, d, inter, e=E):
    gate, up = random_int4(rng, e, inter, d), random_int4(rng, e, inter, d)
    return (*gate, *up, *random_int4(rng, e, d, inter))


@pytest.mark.parametrize("tokens,d,inter,dtype", [(1, 64, 32, jnp.bfloat16), (5, 256, 128, np.float32),
                                                 (33, 128, 64, jnp.bfloat16)])
def test_ffn_matches_reference(rng, interpret, dtype, tokens, d, inter):
    w = make_ffn(rng, d, inter)
    idx, weights = random_routing(rng, tokens)
    x = as_input(rng.standard_normal((tokens, d)), dtype)
    out = int4_moe_ffn(jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w),
                       interpret=interpret)
    assert out.shape == (tokens, d) and out.dtype == dtype
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[dtype], f"ffn tokens {tokens}")


@pytest.mark.heavy
def test_ffn_all_tokens_one_expert_and_idle_experts(rng, interpret):
    """Every token's first expert is 3 (20 rows: two blocks), the second comes from {1, 6}; 5 experts idle."""
    d, inter, m = 128, 64, 20
    w = make_ffn(rng, d, inter)
    idx = np.stack([np.full(m, 3), rng.choice([1, 6], m)], axis=1).astype(np.int32)
    weights = rng.uniform(0.2, 1.5, (m, 2)).astype(np.float32)
    x = rng.standard_normal((m, d)).astype(np.float32)
    out = int4_moe_ffn(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w), block_m=16,
                       interpret=interpret)
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[np.float32], "one expert")


@pytest.mark.heavy
def test_xla_baselines_match_reference(rng):
    """The benchmark's baselines compute the same FFN (so their timings compare like with like)."""
    d, inter, m = 64, 32, 6
    w = make_ffn(rng, d, inter)
    idx, weights = random_routing(rng, m)
    x = rng.standard_normal((m, d)).astype(np.float32)
    ref = int4_moe_ffn_ref(x, idx, weights, *w)
    args = (jnp.asarray(x), jnp.asarray(idx), jnp.asarray(weights))
    assert_close(dequant_then_matmul_ffn(*args, *map(jnp.asarray, w)), ref, 1e-5, "dequant_then_matmul")
    from kdtree_jax.model.quant import dequant_int4
    dense = [jnp.asarray(np.swapaxes(dequant_int4(w[i], w[i + 1], GROUP), -1, -2)) for i in (0, 2, 4)]  # [E, in, out]
    assert_close(bf16_ragged_dot_ffn(*args, *dense), ref, 1e-5, "ragged_dot")
    assert_close(bf16_gather_ffn(*args, *dense), ref, 1e-5, "gather")


def test_bad_shapes_name_the_tensor(rng):
    w = list(map(jnp.asarray, make_ffn(rng, 64, 32)))
    x, idx, weights = jnp.ones((3, 64)), jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2))
    with pytest.raises(ValueError, match="down packed"):
        int4_moe_ffn(x, idx, weights, *w[:4], w[0], w[5])
    with pytest.raises(ValueError, match="idx"):
        int4_moe_ffn(x, idx[:2], weights, *w)
    with pytest.raises(ValueError, match="block_m"):
        int4_expert_matmul(jnp.ones((4, 64)), w[4][:, :, :4], w[5][:, :, :1], jnp.zeros(4, jnp.int32), block_m=24)
    layout = route_layout(idx.reshape(-1), w[0].shape[0], 16)
    with pytest.raises(ValueError, match=rf"row_token must be int32 \[{layout.rows}\]"):
        grouped_int4_matmul(x, ((w[4], w[5]),), layout, row_token=jnp.zeros(layout.rows - 1, jnp.int32))


# ---- Triton lowering for H200 -------------------------------------------------------------------------------------
def ffn_specs(m, d, inter, e, k, dtype):
    spec = jax.ShapeDtypeStruct
    return (spec((m, d), dtype), spec((m, k), jnp.int32), spec((m, k), jnp.float32),
            spec((e, inter, d // 8), jnp.int32), spec((e, inter, d // GROUP), jnp.bfloat16),
            spec((e, inter, d // 8), jnp.int32), spec((e, inter, d // GROUP), jnp.bfloat16),
            spec((e, d, inter // 8), jnp.int32), spec((e, d, inter // GROUP), jnp.bfloat16))


@pytest.mark.parametrize("m,d,inter,e,k,dtype", [
    (1, 7168, 2048, 384, 8, jnp.bfloat16), (64, 7168, 2048, 384, 8, jnp.bfloat16),
    (512, 7168, 2048, 384, 8, jnp.bfloat16), (5, 64, 32, 8, 2, jnp.float32), (33, 256, 128, 8, 2, jnp.bfloat16),
])
def test_lowers_for_h200(m, d, inter, e, k, dtype):
    lowered = lower_for_h200(functools.partial(int4_moe_ffn, interpret=False), *ffn_specs(m, d, inter, e, k, dtype))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 2  # fused gate/up + down


@pytest.mark.gpu
def test_k26_shape_on_gpu(rng):
    """K2.6 expert shapes (D 7168, I 2048, 384 experts, top-8), bf16, 4 tokens, vs the float64 reference."""
    d, inter, e, k, m = 7168, 2048, 384, 8, 4
    w = _k26_weights(jax.random.key(int(rng.integers(1 << 30))), d, inter, e)
    idx, weights = random_routing(rng, m, e, k)
    x = as_input(rng.standard_normal((m, d)), jnp.bfloat16)
    out = int4_moe_ffn(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(weights), *w)
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[jnp.bfloat16], "K2.6 shape")


# ---- unpack variants ----------------------------------------------------------------------------------------------
def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): output byte i = byte (selector >> 4i) & 7 of the 8 bytes {b, a}."""
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    return sum(src[(selector >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _halves(bits: np.ndarray, dtype=jnp.bfloat16) -> tuple[np.ndarray, np.ndarray]:
    """A 16-bit-pair register's (low, high) lanes in `dtype` (bf16x2 or fp16x2), as float64."""
    lane = lambda h: (h & 0xFFFF).astype(np.uint16).view(dtype).astype(np.float64)  # noqa: E731
    return lane(bits), lane(bits >> 16)


def test_bf16x2_bit_recipe_decodes_every_nibble(rng):
    """The constants the inline PTX uses, replayed in numpy on random words: prmt gathers the byte of both words,
    the mask / magic OR gives 128 + nib per lane, minus the bias it is nib - 8, for all eight planes."""
    w0, w1 = (rng.integers(0, 1 << 32, 4096, dtype=np.uint64) for _ in range(2))
    bias = _halves(np.array(int4_moe.BF16X2_BIAS, np.uint64))[0]
    for k in range(8):
        sel = int4_moe.prmt_selector(k // 2)
        assert f"{sel:#x}" in int4_moe._bf16x2_asm(k)
        t = _prmt(w0, w1, sel) >> (int4_moe.NIBBLE_BITS * (k % 2))
        lo, hi = _halves((t & int4_moe.BF16X2_NIBBLE_MASK) | int4_moe.BF16X2_MAGIC)
        np.testing.assert_array_equal(lo - bias, ((w0 >> (4 * k)) & 0xF).astype(np.float32) - 8, f"plane {k} low")
        np.testing.assert_array_equal(hi - bias, ((w1 >> (4 * k)) & 0xF).astype(np.float32) - 8, f"plane {k} high")


@pytest.mark.heavy
def test_unpack_variants_agree_bitwise_and_match_reference(rng, interpret):
    """bf16 activations: both unpack paths give the same output bits (same bf16 weights), close to float64."""
    packed, scale = random_int4(rng, E, 128, 256)
    idx, _ = random_routing(rng, 9)
    ids = idx.reshape(-1)
    x = as_input(rng.standard_normal((ids.size, 256)), jnp.bfloat16)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(ids))
    outs = {u: np.asarray(int4_expert_matmul(*args, unpack=u, interpret=interpret).astype(jnp.float32))
            for u in ("f32", "bf16x2")}
    np.testing.assert_array_equal(outs["bf16x2"], outs["f32"])
    assert_close(outs["bf16x2"], int4_expert_matmul_ref(x, packed, scale, ids), TOL[jnp.bfloat16], "bf16x2")


@pytest.mark.heavy
def test_fp16_unpack_forms_the_exact_weights(rng, interpret):
    """fp16 activations: the fp16 unpack and the fp32 one give the same bits (both form the exact weights: (nib - 8)
    * scale fits fp16), within fp16 rounding of float64; bf16 activations are refused at the matmul."""
    packed, scale = random_int4(rng, E, 128, 256)
    ids = random_routing(rng, 9)[0].reshape(-1)
    x = as_input(rng.standard_normal((ids.size, 256)), jnp.float16)
    args = (jnp.asarray(x, jnp.float16), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(ids))
    outs = {u: np.asarray(int4_expert_matmul(*args, unpack=u, interpret=interpret).astype(jnp.float32))
            for u in ("f32", "fp16", None)}
    np.testing.assert_array_equal(outs["fp16"], outs["f32"])
    np.testing.assert_array_equal(outs[None], outs["fp16"])  # the default for fp16 activations
    assert_close(outs["fp16"], int4_expert_matmul_ref(x, packed, scale, ids), TOL[jnp.float16], "fp16")
    with pytest.raises(ValueError, match="float16 activations"):
        int4_expert_matmul(args[0].astype(jnp.bfloat16), *args[1:], unpack="fp16", interpret=interpret)


@pytest.mark.heavy
def test_ffn_fp16_is_closer_to_float64_than_bf16x2(rng, interpret):
    """A bf16 FFN through the fp16 kernels (x converted, h in fp16, y back in bf16): exact weights and an 11-bit h
    put it nearer the float64 reference than bf16x2's rounded weights and 8-bit h."""
    w = make_ffn(rng, 256, 256)
    idx, weights = random_routing(rng, 7)
    x = as_input(rng.standard_normal((7, 256)), jnp.bfloat16)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w))
    ref = int4_moe_ffn_ref(x, idx, weights, *w)
    err = {}
    for u in ("bf16x2", "fp16"):
        out = int4_moe_ffn(*args, unpack=u, interpret=interpret)
        assert out.dtype == jnp.bfloat16
        assert_close(out, ref, TOL[jnp.bfloat16], u)
        got = np.asarray(out.astype(jnp.float32), np.float64)
        err[u] = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err["fp16"] < err["bf16x2"], err


def test_fp16_saturates_instead_of_overflowing(rng, interpret):
    """Activations past fp16's range: x is clipped to +-65504 on the way in (not turned into infinities), so the FFN
    equals the one on the clipped x, and stays finite."""
    w = make_ffn(rng, 256, 128)
    idx, weights = random_routing(rng, 3)
    x = rng.standard_normal((3, 256))
    x[0, :5] = [1e6, -3e5, 7e4, 65504.0, -1e9]
    rest = (jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w))
    out = np.asarray(int4_moe_ffn(jnp.asarray(x, jnp.bfloat16), *rest, unpack="fp16", interpret=interpret)
                     .astype(jnp.float32))
    clipped = jnp.asarray(np.clip(x, -65504.0, 65504.0), jnp.bfloat16)
    want = np.asarray(int4_moe_ffn(clipped, *rest, unpack="fp16", interpret=interpret).astype(jnp.float32))
    assert np.isfinite(out).all() and np.abs(out[0]).max() > 1e3
    np.testing.assert_array_equal(out, want)


def test_fp16x2_bit_recipe_decodes_every_nibble(rng):
    """The fp16 unpack's constants replayed in numpy on random words: prmt gathers the byte, the low or high nibble
    kept in place with 1024.0 ORed in is 1024 + nib or 1024 + 16 nib, and the sub / fma leave nib - 8."""
    w0, w1 = (rng.integers(0, 1 << 32, 4096, dtype=np.uint64) for _ in range(2))
    halves = functools.partial(_halves, dtype=np.float16)
    low_bias = halves(np.array(int4_moe.FP16X2_LOW_BIAS, np.uint64))[0]
    sixteenth, high_bias = (halves(np.array(c, np.uint64))[0] for c in (int4_moe.FP16X2_SIXTEENTH,
                                                                       int4_moe.FP16X2_HIGH_BIAS))
    for k in range(8):
        asm = int4_moe._fp16x2_asm(k)
        sel = int4_moe.prmt_selector(k // 2)
        assert f"{sel:#x}" in asm and "shr" not in asm
        t = _prmt(w0, w1, sel)
        lanes = halves((t & int4_moe.FP16X2_MASKS[k % 2]) | int4_moe.FP16X2_MAGIC)
        for lane, word in zip(lanes, (w0, w1)):
            got = lane * sixteenth + high_bias if k % 2 else lane - low_bias
            np.testing.assert_array_equal(got, ((word >> (4 * k)) & 0xF).astype(np.float64) - 8, f"plane {k}")


@pytest.mark.heavy
def test_ffn_bf16x2_matches_reference(rng, interpret):
    w = make_ffn(rng, 256, 128)
    idx, weights = random_routing(rng, 7)
    x = as_input(rng.standard_normal((7, 256)), jnp.bfloat16)
    out = int4_moe_ffn(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w),
                       unpack="bf16x2", interpret=interpret)
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[jnp.bfloat16], "ffn bf16x2")


def test_bf16x2_rejects_fp32_activations_and_unknown_modes(rng):
    w = list(map(jnp.asarray, make_ffn(rng, 64, 32)))
    x, idx, weights = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32), jnp.zeros((3, 2), jnp.int32), \
        jnp.ones((3, 2))
    with pytest.raises(ValueError, match="bfloat16"):
        int4_moe_ffn(x, idx, weights, *w, unpack="bf16x2")
    with pytest.raises(ValueError, match="unpack"):
        int4_moe_ffn(x, idx, weights, *w, unpack="int8")


@pytest.mark.parametrize("unpack", ["bf16x2", "fp16"])
@pytest.mark.parametrize("m", [1, 64])
def test_bf16x2_lowers_for_h200(m, unpack):
    fn = functools.partial(int4_moe_ffn, unpack=unpack, interpret=False)
    text = lower_for_h200(fn, *ffn_specs(m, 7168, 2048, 384, 8, jnp.bfloat16)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def _k26_weights(key, d, inter, e):
    """Random K2.6-sized packed words (every bit pattern) and bf16 scales, made on the device."""
    w = []
    for i, (n_out, n_in) in enumerate(((inter, d), (inter, d), (d, inter))):
        kb, ks = jax.random.split(jax.random.fold_in(key, i))
        bits = jax.random.bits(kb, (e, n_out, n_in // 8), jnp.uint32)
        scale = jax.random.uniform(ks, (e, n_out, n_in // GROUP), jnp.float32, 0.5, 1.5) / (4.0 * n_in**0.5)
        w += [jax.lax.bitcast_convert_type(bits, jnp.int32), scale.astype(jnp.bfloat16)]
    return w


K26_REF_MAX_TOKENS = 4  # the float64 reference dequantizes every touched expert on the host: ~0.3 s each


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 64])
def test_k26_unpack_variants_bitwise_on_gpu(rng, m):
    """Compiled: the inline-PTX bf16x2 unpack and the fp32 unpack give identical output bits at K2.6 shapes; at
    small token counts both also match the float64 reference."""
    d, inter, e, k = 7168, 2048, 384, 8
    w = _k26_weights(jax.random.key(int(rng.integers(1 << 30))), d, inter, e)
    idx, weights = random_routing(rng, m, e, k)
    x = as_input(rng.standard_normal((m, d)), jnp.bfloat16)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(weights), *w)
    outs = {u: np.asarray(jax.jit(functools.partial(int4_moe_ffn, unpack=u))(*args).astype(jnp.float32))
            for u in int4_moe.UNPACK_MODES}
    assert np.isfinite(outs["f32"]).all() and np.abs(outs["f32"]).max() > 0
    np.testing.assert_array_equal(outs["bf16x2"], outs["f32"])
    if m <= K26_REF_MAX_TOKENS:
        ref = int4_moe_ffn_ref(x, idx, weights, *w)
        for u in ("bf16x2", "fp16"):
            assert_close(outs[u], ref, TOL[jnp.bfloat16], f"K2.6 {u} m={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("unpack,dtype", [("bf16x2", jnp.bfloat16), ("fp16", jnp.float16)])
def test_bf16x2_compiled_matches_interpreted(rng, unpack, dtype):
    """The inline PTX against its jnp stand-in (what CPU runs) on a small expert matmul. The weights they form are the
    same bits, but the tensor cores and the CPU dot add the fp32 products in different orders, so a rare output can
    round to the neighbouring 16-bit value (1 of 3072 in one H200 run): at most 1 ulp apart, and almost all equal. A
    wrong nibble or scale would move whole rows by many ulps."""
    packed, scale = random_int4(rng, E, 128, 256)
    ids = rng.integers(0, E, 24).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((24, 256)), dtype)
    args = (x, jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(ids))
    got = int4_expert_matmul(*args, unpack=unpack, interpret=False)
    want = int4_expert_matmul(*args, unpack=unpack, interpret=True)
    bits = [np.asarray(jax.lax.bitcast_convert_type(a, jnp.int16)).astype(np.int32) for a in (got, want)]
    ulps = np.abs(bits[0] - bits[1])
    assert np.isfinite(np.asarray(want.astype(jnp.float32))).all() and np.abs(bits[1]).max() > 0
    assert ulps.max() <= 1 and (ulps > 0).mean() < 0.01, f"max {ulps.max()} ulp, {(ulps > 0).mean():.2%} differ"


# ---- decode glue: pairwise routing, one-gather rows, split-K ---------------------------------------------------
LAYOUT_FIELDS = ("slot_expert", "slot_start", "slot_count", "dest", "block_expert", "block_rows")


def routing_with_absent(rng, m, e, k, absent_frac=0.3):
    """Distinct experts per token, then a fraction moved outside 0..E-1 (another device's experts); the first pair
    stays present so the output is never all zeros."""
    idx, weights = random_routing(rng, m, e, k)
    shift = rng.choice([-e, e], idx.shape) * (rng.random(idx.shape) < absent_frac)
    shift[0, 0] = 0
    return (idx + shift).astype(np.int32), weights


def present_only(idx, weights, e):
    """What the float64 reference sees for absent pairs: a valid id with weight 0 (they contribute nothing)."""
    present = (idx >= 0) & (idx < e)
    return np.where(present, idx, 0).astype(np.int32), np.where(present, weights, 0.0)


@pytest.mark.parametrize("p,e,block_m,absent", [(1, 8, 16, False), (8, 384, 16, False), (37, 8, 16, True),
                                                (128, 384, 32, True), (64, 4, 16, False), (12, 8, 64, True)])
def test_pairwise_route_equals_sorted_route(rng, p, e, block_m, absent):
    """The [P, P]-comparison layout is the sort-based one, field for field (absent ids included)."""
    ids = rng.integers(-e if absent else 0, 2 * e if absent else e, p).astype(np.int32)
    got = jax.jit(route_layout_pairwise, static_argnums=(1, 2))(jnp.asarray(ids), e, block_m)
    want = jax.jit(route_layout_sorted, static_argnums=(1, 2))(jnp.asarray(ids), e, block_m)
    assert (got.rows, got.block_m) == (want.rows, want.block_m)
    for f in LAYOUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), f)


@pytest.mark.heavy
@pytest.mark.parametrize("m,k,e", [(1, 8, 384), (5, 2, 8), (80, 8, 384)])  # 80 x 8 > PAIRWISE_ROUTE_MAX_PAIRS
def test_row_tokens_read_the_scattered_rows(rng, m, k, e):
    """Token rows read through `row_tokens` = the repeat + scatter of the pairs, on every row that holds a pair."""
    idx, _ = routing_with_absent(rng, m, e, k)
    x = jnp.asarray(rng.standard_normal((m, 96)) + 3.0, jnp.bfloat16)
    layout = route_layout(jnp.asarray(idx.reshape(-1)), e, int4_moe.default_block_m(idx.size, e))
    token = np.asarray(int4_moe.row_tokens(layout, m, k))
    assert token.shape == (layout.rows,) and ((token >= 0) & (token < m)).all()
    held = np.asarray(layout.dest)[((idx >= 0) & (idx < e)).reshape(-1)]
    want = np.asarray(int4_moe.scatter_rows(jnp.repeat(x, k, axis=0), layout).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32))[token[held]], want[held])


def ffn_scatter_path(x, idx, weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale, *,
                     interpret):
    """The FFN as it was composed before the decode glue: sorted route, repeat + scatter, wrapper reorders."""
    m, k = idx.shape
    e = gate_packed.shape[0]
    layout = route_layout_sorted(idx.reshape(-1), e, int4_moe.default_block_m(idx.size, e))
    rows = int4_moe.scatter_rows(jnp.repeat(x, k, axis=0), layout)
    h = int4_moe.grouped_int4_matmul(rows, ((gate_packed, gate_scale), (up_packed, up_scale)), layout, swiglu=True,
                                     interpret=interpret)
    y = int4_moe.grouped_int4_matmul(h, ((down_packed, down_scale),), layout, interpret=interpret)
    return int4_moe.moe_combine(y, layout, weights, x.dtype)


@pytest.mark.parametrize("tokens,d,inter,e,k,dtype", [(1, 64, 32, 8, 2, jnp.bfloat16), (5, 256, 128, 8, 2, np.float32),
                                                     (6, 160, 96, 16, 4, jnp.bfloat16)])
@pytest.mark.heavy
def test_ffn_bitwise_equals_scatter_path_and_matches_reference(rng, interpret, tokens, d, inter, e, k, dtype):
    """The decode glue (pairwise layout, token rows gathered in the kernel) changes no output bit against padded rows
    scattered in XLA (absent pairs included), and the FFN still matches float64."""
    w = make_ffn(rng, d, inter, e)
    idx, weights = routing_with_absent(rng, tokens, e, k)
    x = as_input(rng.standard_normal((tokens, d)), dtype)
    args = (jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w))
    got = np.asarray(int4_moe_ffn(*args, interpret=interpret).astype(jnp.float32))
    want = np.asarray(ffn_scatter_path(*args, interpret=interpret).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert_close(got, int4_moe_ffn_ref(x, *present_only(idx, weights, e), *w), TOL[dtype], f"ffn tokens {tokens}")


@pytest.mark.heavy
@pytest.mark.parametrize("split_k,dtype", [(2, np.float32), (4, jnp.bfloat16), (8, np.float32)])
def test_ffn_split_k_matches_reference(rng, interpret, split_k, dtype):
    """Split-K gate/up (fp32 partials added before SwiGLU): within the usual tolerance of float64 and of the unsplit
    kernel (not bit-identical: the fp32 sums are grouped differently)."""
    d, inter, tokens = 1024, 64, 3  # 128 words: 8 K tiles of 16
    w = make_ffn(rng, d, inter)
    idx, weights = random_routing(rng, tokens)
    x = as_input(rng.standard_normal((tokens, d)), dtype)
    args = (jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w))
    out = int4_moe_ffn(*args, block_w=16, split_k=split_k, interpret=interpret)
    ref = int4_moe_ffn_ref(x, idx, weights, *w)
    assert_close(out, ref, TOL[dtype], f"split_k {split_k}")
    unsplit = np.asarray(int4_moe_ffn(*args, block_w=16, interpret=interpret).astype(jnp.float32), np.float64)
    assert_close(out, unsplit, TOL[dtype], f"split_k {split_k} vs unsplit")


def test_split_k_must_divide_the_k_tiles(rng):
    w = list(map(jnp.asarray, make_ffn(rng, 256, 64)))  # 32 words: 1 K tile of 32
    x, (idx, weights) = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32), random_routing(rng, 2)
    with pytest.raises(ValueError, match="split_k"):
        int4_moe_ffn(x, jnp.asarray(idx), jnp.asarray(weights), *w, split_k=2)


@pytest.mark.parametrize("m,split_k,stages", [(1, 4, 3), (16, 2, 4), (1, 1, 4)])
def test_split_k_and_stages_lower_for_h200(m, split_k, stages):
    fn = functools.partial(int4_moe_ffn, split_k=split_k, num_stages=stages, block_n=32, interpret=False)
    text = lower_for_h200(fn, *ffn_specs(m, 7168, 2048, 384, 8, jnp.bfloat16)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


# ---- tile-major weights ---------------------------------------------------------------------------------------------
def _tiled(w, **tiles):
    """Tile-major weights: in the given tiles, or in the engine's (`tile_ffn_int4`)."""
    if not tiles:
        return list(int4_moe.tile_ffn_int4(*map(jnp.asarray, w)))
    return [a for p, s in zip(w[::2], w[1::2]) for a in int4_moe.tile_int4(jnp.asarray(p), jnp.asarray(s), **tiles)]


def _ffn_case(rng, tokens, d, inter, dtype):
    """Row-major INT4 gate, up ([inter, d]) and down ([d, inter]) experts, routing and x for `tokens` tokens:
    (w, x, idx, weights, the FFN's first three arguments in dtype)."""
    w = [a for n_out, n_in in ((inter, d), (inter, d), (d, inter)) for a in random_int4(rng, E, n_out, n_in)]
    idx, weights = random_routing(rng, tokens)
    x = as_input(rng.standard_normal((tokens, d)), dtype)
    return w, x, idx, weights, (jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(weights))


def _k26_case(rng, m):
    """Row-major K2.6 experts made on the device and FFN inputs (x bf16, idx, weights) for m tokens at top-8."""
    w = _k26_weights(jax.random.key(int(rng.integers(1 << 30))), 7168, 2048, 384)
    idx, weights = random_routing(rng, m, 384, 8)
    return w, (jnp.asarray(rng.standard_normal((m, 7168)), jnp.bfloat16), jnp.asarray(idx), jnp.asarray(weights))


@pytest.mark.parametrize("tokens,d,inter,split_k,dtype", [(3, 512, 256, 1, np.float32), (9, 256, 128, 2, jnp.bfloat16)])
def test_tile_major_weights_give_row_major_bits(rng, interpret, tokens, d, inter, split_k, dtype):
    """Same kernel, weights re-laid tile by tile: the same output bits, several N and K tiles per call, both kernels."""
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, dtype)
    kw = dict(block_w=16, split_k=split_k, interpret=interpret)
    tiled = _tiled(w, block_n=32, block_w=16)
    assert tiled[0].shape == (E, inter // 32, d // 8 // 16, 32, 16) and tiled[1].shape[-1] == 16 // (GROUP // 8)
    row = int4_moe_ffn(*args, *map(jnp.asarray, w), block_n=32, **kw)
    tile = int4_moe_ffn(*args, *tiled, **kw)
    np.testing.assert_array_equal(np.asarray(tile.astype(jnp.float32)), np.asarray(row.astype(jnp.float32)))
    assert_close(tile, int4_moe_ffn_ref(x, idx, weights, *w), TOL[dtype], "tile-major")


def test_tile_int4_round_trip_and_errors(rng):
    packed, scale = random_int4(rng, 3, 128, 256)
    tp, ts = int4_moe.tile_int4(jnp.asarray(packed), jnp.asarray(scale), block_n=64, block_w=16)
    assert tp.shape == (3, 2, 2, 64, 16) and ts.shape == (3, 2, 2, 64, 4)
    np.testing.assert_array_equal(np.asarray(tp[1, 1, 0]), packed[1, 64:128, 0:16])  # tile (n 1, k 0) of expert 1
    bp, bs = int4_moe.untile_int4(tp, ts)
    np.testing.assert_array_equal(np.asarray(bp), packed)
    np.testing.assert_array_equal(np.asarray(bs).view(np.uint16), np.asarray(scale).view(np.uint16))
    assert int4_moe.int4_dims(tp) == (3, 128, 32) and int4_moe.int4_scale_groups(ts) == 8
    with pytest.raises(ValueError, match="multiples of the tiles"):
        int4_moe.tile_int4(jnp.asarray(packed[:, :96]), jnp.asarray(scale[:, :96]), block_n=64)
    with pytest.raises(ValueError, match=r"packed must be \[E, N, K/8\]"):
        int4_moe.tile_int4(tp, ts)
    layout = route_layout(jnp.zeros((4,), jnp.int32), 3, 16)
    rows = jnp.ones((layout.rows, 256), jnp.float32)
    with pytest.raises(ValueError, match="differ from the tile-major"):
        int4_moe.grouped_int4_matmul(rows, ((tp, ts),), layout, block_n=32)


@pytest.mark.parametrize("m", [1, 64])
def test_tile_major_lowers_for_h200(m):
    d, inter, e = 7168, 2048, 384
    specs = list(ffn_specs(m, d, inter, e, 8, jnp.bfloat16))
    specs[3:9] = jax.eval_shape(int4_moe.tile_ffn_int4, *specs[3:9])  # tile-major in the engine's tiles
    text = lower_for_h200(functools.partial(int4_moe_ffn, interpret=False), *specs).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def _row_major_per_kernel_tiles(x, idx, weights, w, interpret=None):
    """The FFN on row-major weights with each kernel in the engine's tiles and launch (`ffn_tiles`), from the
    public pieces: what tile-major weights in those tiles must reproduce bit for bit."""
    gate_t, _, down_t = int4_moe.ffn_tiles(w[0].shape[1], w[2].shape[1], w[4].shape[1])
    ws = list(map(jnp.asarray, w))
    group = x.shape[1] // ws[1].shape[-1]
    launch = lambda t: dict(num_warps=t.num_warps, num_stages=t.num_stages, n_per_program=t.n_per_program,  # noqa: E731
                            swap_ab=t.swap_ab, acc_in_dot=t.acc_in_dot)
    layout, xt, token = int4_moe.moe_route(x, idx, ws[0].shape[0], group_size=group, block_w=gate_t["block_w"])
    h = int4_moe.moe_gate_up(xt, layout, token, (ws[0], ws[1]), (ws[2], ws[3]), interpret=interpret, **gate_t,
                             **launch(int4_moe.GATE_UP_LAUNCH))
    y = int4_moe.moe_down(h, layout, (ws[4], ws[5]), interpret=interpret, **down_t, **launch(int4_moe.DOWN_LAUNCH))
    return int4_moe.moe_combine(y, layout, weights, x.dtype)


@pytest.mark.parametrize("pairs", [8, 512, 4352, 8704])  # AR batch 1 and 64; batch 32 and 64 with B = 16
def test_ffn_row_block_fits_each_kernels_launch(pairs):
    """The FFN's row block is the routing default capped by both launches: on tile-major weights (4-warp programs) at
    most 32 rows; row-major weights keep the default, up to 64."""
    e = 384
    row_major = jax.ShapeDtypeStruct((e, 2048, 7168 // 8), jnp.int32), jax.ShapeDtypeStruct((e, 7168, 256), jnp.int32)
    scales = jax.ShapeDtypeStruct((e, 2048, 224), jnp.bfloat16), jax.ShapeDtypeStruct((e, 7168, 64), jnp.bfloat16)
    tiled = jax.eval_shape(int4_moe.tile_ffn_int4, row_major[0], scales[0], row_major[0], scales[0], row_major[1],
                           scales[1])
    default = int4_moe.default_block_m(pairs, e)
    assert int4_moe.ffn_block_m(pairs, e, *row_major) == default
    assert int4_moe.ffn_block_m(pairs, e, tiled[0], tiled[4]) == min(default, 32)


def test_engine_tiles_give_row_major_bits(rng, interpret):
    """`tile_ffn_int4` (gate/up and down in their own tiles, down walking several N tiles per program) gives the
    bits of row-major weights run in the same tiles, and matches the float64 reference."""
    tokens, d, inter = 6, 512, 512  # down: 8 N tiles of 64, one K tile of 64 words
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, jnp.bfloat16)
    tiled = _tiled(w)
    assert tiled[4].shape[3:] == (int4_moe.DOWN_LAUNCH.block_n, int4_moe.DOWN_LAUNCH.block_w)
    out = np.asarray(int4_moe_ffn(*args, *tiled, interpret=interpret).astype(jnp.float32))
    want = _row_major_per_kernel_tiles(*args, w, interpret=interpret)
    np.testing.assert_array_equal(out, np.asarray(want.astype(jnp.float32)))
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[jnp.bfloat16], "engine tiles")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_k26_tile_major_bitwise_on_gpu(rng, m):
    """Compiled at K2.6 shapes: tile-major weights in the engine's tiles give the bits of row-major weights run in
    the same tiles and launch."""
    w, args = _k26_case(rng, m)
    row = np.asarray(jax.jit(_row_major_per_kernel_tiles)(*args, w).astype(jnp.float32))
    tile = np.asarray(jax.jit(int4_moe_ffn)(*args, *_tiled(w)).astype(jnp.float32))
    assert np.isfinite(row).all() and np.abs(row).max() > 0
    np.testing.assert_array_equal(tile, row)


# ---- several N tiles per program ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiled,dtype", [(False, np.float32), (True, jnp.bfloat16)])
def test_n_per_program_gives_one_tile_per_program_bits(rng, interpret, tiled, dtype):
    """A program walking 2 or 4 N tiles in one flat loop writes the bits of one program per tile, both kernels, with
    row blocks spanning experts of several rows."""
    tokens, d, inter = 11, 256, 128
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, dtype)
    ws = _tiled(w, block_n=32, block_w=16) if tiled else list(map(jnp.asarray, w))
    kw = dict(block_w=16, interpret=interpret) | ({} if tiled else dict(block_n=32))
    one = np.asarray(int4_moe_ffn(*args, *ws, gate_up_n_per_program=1, down_n_per_program=1, **kw)
                     .astype(jnp.float32))
    for gate_up_n, down_n in ((2, 4), (4, 8)):
        out = int4_moe_ffn(*args, *ws, gate_up_n_per_program=gate_up_n, down_n_per_program=down_n, **kw)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), one, f"n per program {gate_up_n}/{down_n}")
    assert_close(one, int4_moe_ffn_ref(x, idx, weights, *w), TOL[dtype], "one tile per program")


def test_n_per_program_must_divide_the_n_tiles(rng):
    w = [a for n_out, n_in in ((128, 256), (128, 256), (256, 128)) for a in random_int4(rng, E, n_out, n_in)]
    idx, weights = random_routing(rng, 2)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    with pytest.raises(ValueError, match="n_per_program=3 must divide the 4 N tiles"):
        int4_moe_ffn(x, jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w), block_n=32,
                     gate_up_n_per_program=3)
    with pytest.raises(ValueError, match="needs split_k=1"):
        int4_moe_ffn(x, jnp.asarray(idx), jnp.asarray(weights), *map(jnp.asarray, w), block_n=32, block_w=16,
                     split_k=2, gate_up_n_per_program=2)


@pytest.mark.parametrize("m", [8, 64])
def test_n_per_program_lowers_for_h200(m):
    specs = list(ffn_specs(m, 7168, 2048, 384, 8, jnp.bfloat16))
    fn = functools.partial(int4_moe_ffn, gate_up_n_per_program=2, down_n_per_program=4, interpret=False)
    assert lower_for_h200(fn, *specs).as_text().count("__gpu$xla.gpu.triton") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64])
def test_k26_n_per_program_bitwise_on_gpu(rng, m):
    """Compiled at K2.6 shapes, tile-major: 2 and 4 N tiles per program give one tile per program's bits."""
    w, args = _k26_case(rng, m)
    w = _tiled(w)
    one = jax.jit(functools.partial(int4_moe_ffn, gate_up_n_per_program=1, down_n_per_program=1))(*args, *w)
    one = np.asarray(one.astype(jnp.float32))
    many = jax.jit(functools.partial(int4_moe_ffn, gate_up_n_per_program=2, down_n_per_program=4))(*args, *w)
    assert np.isfinite(one).all() and np.abs(one).max() > 0
    np.testing.assert_array_equal(np.asarray(many.astype(jnp.float32)), one)


# ---- MMA orientation and accumulation --------------------------------------------------------------------------------
MMA_VARIANTS = [dict(swap_ab=swap, acc_in_dot=acc) for swap in (False, True) for acc in (False, True)]


def _ffn_by_parts(args, ws, e, *, gate_up=None, down=None, route_w=16, **kw):
    """The FFN from its kernels, each with its own launch options (dicts), h written nibble-major as the FFN does."""
    x, idx, weights = args
    layout, xt, token = int4_moe.moe_route(x, idx, e, group_size=GROUP, block_w=route_w)
    h = int4_moe.moe_gate_up(xt, layout, token, (ws[0], ws[1]), (ws[2], ws[3]), out_nibble_major=True,
                             **(gate_up or {}), **kw)
    y = int4_moe.moe_down(h, layout, (ws[4], ws[5]), nibble_major=True, **(down or {}), **kw)
    return int4_moe.moe_combine(y, layout, weights, x.dtype)


def _ffn_parts_flat(*a, variant, **kw):
    """`_ffn_by_parts` on (x, idx, weights, *tile-major weights) with one variant for both kernels."""
    return _ffn_by_parts(a[:3], a[3:], a[3].shape[0], gate_up=variant, down=variant, route_w=a[3].shape[4], **kw)


@pytest.mark.parametrize("variant", MMA_VARIANTS)
@pytest.mark.parametrize("tiled,dtype", [(False, np.float32), (True, jnp.bfloat16)])
def test_mma_variants_match_reference(rng, interpret, tiled, dtype, variant):
    """Each of x W^T / y^T = W x^T, with the add after each dot or the accumulator inside it: both kernels (several N
    tiles a program, row blocks of several experts) match the float64 reference and the launches' defaults within
    the dtype's tolerance."""
    tokens, d, inter = 13, 256, 128
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, dtype)
    ws = _tiled(w, block_n=32, block_w=16) if tiled else list(map(jnp.asarray, w))
    kw = dict(interpret=interpret) | ({} if tiled else dict(block_n=32, block_w=16))
    ref = int4_moe_ffn_ref(x, idx, weights, *w)
    base = _ffn_by_parts(args, ws, E, gate_up=dict(n_per_program=2), down=dict(n_per_program=4), **kw)
    out = _ffn_by_parts(args, ws, E, gate_up=dict(n_per_program=2, **variant), down=dict(n_per_program=4, **variant),
                        **kw)
    assert_close(out, ref, TOL[dtype], f"{variant}")
    assert_close(out, np.asarray(base.astype(jnp.float32), np.float64), TOL[dtype], f"{variant} vs default")


@pytest.mark.parametrize("variant", [v for v in MMA_VARIANTS if v["swap_ab"]])
def test_mma_variants_with_split_k_match_reference(rng, interpret, variant):
    """Split-K gate/up stores each fp32 partial transposed back (swap_ab) before XLA adds them."""
    tokens, d, inter = 6, 512, 128
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, np.float32)
    out = _ffn_by_parts(args, list(map(jnp.asarray, w)), E, gate_up=dict(split_k=2, **variant), down=variant,
                        block_n=32, block_w=16, interpret=interpret)
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[np.float32], f"split-K {variant}")


@pytest.mark.parametrize("m", [8, 1088])  # 16- and 32-row blocks (AR batch 8; batch-8 B = 16 verify)
def test_mma_variants_and_loads_only_lower_for_h200(m):
    specs = list(ffn_specs(m, 7168, 2048, 384, 8, jnp.bfloat16))
    specs[3:9] = jax.eval_shape(int4_moe.tile_ffn_int4, *specs[3:9])
    for variant in [*MMA_VARIANTS, dict(loads_only=True)]:
        fn = functools.partial(_ffn_parts_flat, variant=variant, interpret=False)
        assert lower_for_h200(fn, *specs).as_text().count("__gpu$xla.gpu.triton") == 2, variant


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 136])
def test_k26_mma_variants_on_gpu(rng, m):
    """Compiled at K2.6 shapes in the engine's tiles: each variant against the float64 reference and the defaults."""
    w, args = _k26_case(rng, m)
    x = np.asarray(args[0].astype(jnp.float32))
    ref = int4_moe_ffn_ref(x, np.asarray(args[1]), np.asarray(args[2]), *map(np.asarray, w))
    ws = _tiled(w)
    base = np.asarray(jax.jit(int4_moe_ffn)(*args, *ws).astype(jnp.float32), np.float64)
    for variant in MMA_VARIANTS:
        out = jax.jit(functools.partial(_ffn_parts_flat, variant=variant))(*args, *ws)
        assert_close(out, ref, TOL[jnp.bfloat16], f"{variant}")
        assert_close(out, base, TOL[jnp.bfloat16], f"{variant} vs default")


def _loads_checksum(x_rows, ids, sets):
    """float64 checksum `loads_only` writes for rows x_rows [P, K] of experts ids [P]: per (packed, scale) set
    sum_i x + sum_j (word & 1) + sum_g scale, the sets added."""
    out = 0
    for packed, scale in sets:
        w = (np.asarray(packed) & 1).sum(axis=2) + np.asarray(jnp.asarray(scale).astype(jnp.float32), np.float64).sum(2)
        out = out + x_rows.sum(axis=1, keepdims=True) + w[ids]
    return out


@pytest.mark.parametrize("tiled,swap_ab", [(False, False), (True, True)])
def test_loads_only_writes_the_checksum_of_its_loads(rng, interpret, tiled, swap_ab):
    """The benchmarks' loads-only kernels (no unpack, no MMA) read every word, scale and x row a real call reads:
    gate/up (token rows gathered, two sets) and down, each used row's checksum against numpy's."""
    tokens, d, inter = 9, 256, 128
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, np.float32)
    ws = _tiled(w, block_n=32, block_w=16) if tiled else list(map(jnp.asarray, w))
    kw = dict(interpret=interpret, loads_only=True, swap_ab=swap_ab) | ({} if tiled else dict(block_n=32, block_w=16))
    layout, xt, token = int4_moe.moe_route(args[0], args[1], E, group_size=GROUP, block_w=16)
    h = int4_moe.moe_gate_up(xt, layout, token, (ws[0], ws[1]), (ws[2], ws[3]), **kw)
    pair_ids = idx.reshape(-1)
    x_pairs = np.repeat(x, TOP_K, axis=0).astype(np.float64)
    want = _loads_checksum(x_pairs, pair_ids, [(w[0], w[1]), (w[2], w[3])])
    np.testing.assert_allclose(np.asarray(h)[np.asarray(layout.dest)], want, rtol=1e-5, atol=1e-4)  # fp32 sums
    hx = jnp.asarray(rng.standard_normal(h.shape), jnp.float32)  # any rows: down's checksum reads them as they are
    y = int4_moe.moe_down(hx, layout, (ws[4], ws[5]), **kw)
    rows = np.asarray(hx)[np.asarray(layout.dest)].astype(np.float64)
    np.testing.assert_allclose(np.asarray(y)[np.asarray(layout.dest)], _loads_checksum(rows, pair_ids, [(w[4], w[5])]),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="loads_only needs split_k=1"):
        int4_moe.moe_gate_up(xt, layout, token, (ws[0], ws[1]), (ws[2], ws[3]), split_k=2, **kw)


# ---- h written in the down kernel's column order ----------------------------------------------------------------------
def _gate_up_both_orders(args, w, e, split_k, route_w, **kw):
    """gate/up h of the used rows, plain then written nibble-major (the FFN's order), as float32 numpy; route_w: the
    gate/up K tile the tokens are laid out for."""
    x, idx = args[0], args[1]
    layout, xt, token = int4_moe.moe_route(x, idx, e, group_size=GROUP, block_w=route_w)
    hs = [int4_moe.moe_gate_up(xt, layout, token, (w[0], w[1]), (w[2], w[3]), split_k=split_k,
                               out_nibble_major=nib, **kw)[layout.dest] for nib in (False, True)]
    return [np.asarray(h.astype(jnp.float32)) for h in hs]


@pytest.mark.parametrize("tiled,split_k,dtype", [(False, 1, np.float32), (True, 1, jnp.bfloat16),
                                                 (True, 2, jnp.bfloat16)])
def test_gate_up_writes_h_nibble_major_bit_for_bit(rng, interpret, tiled, split_k, dtype):
    """out_nibble_major: the kernel's own transposed store (split-K: the XLA epilogue) gives exactly the plain h
    reordered nibble-major, rows of several experts and blocks alike; the FFN built on it matches the reference."""
    tokens, d, inter = 13, 256, 128
    w, x, idx, weights, args = _ffn_case(rng, tokens, d, inter, dtype)
    ws = _tiled(w, block_n=32, block_w=16) if tiled else list(map(jnp.asarray, w))
    kw = dict(interpret=interpret) | ({} if tiled else dict(block_n=32, block_w=16))
    plain, nib = _gate_up_both_orders(args, ws, E, split_k, 16, **kw)
    assert np.abs(plain).max() > 0
    want = np.asarray(int4_moe._nibble_major(jnp.asarray(plain), inter // 8))
    np.testing.assert_array_equal(nib, want)
    assert not np.array_equal(nib, plain)  # the order did change
    assert int4_moe._h_nibble_major(ws[0], ws[4], ws[5], 32, 16)
    out = int4_moe_ffn(*args, *ws, split_k=split_k, **({} if tiled else dict(block_n=32)), block_w=16,
                       interpret=interpret)
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[dtype], "FFN on nibble-major h")


def test_h_stays_plain_where_the_tiles_do_not_fit(rng, interpret):
    """An expert width that is not whole tiles (96: gate/up N tiles of 64, down K tiles of 16 words = 128 columns)
    keeps the plain h and the reorder, and still matches the reference; asking for the nibble-major store there
    names N."""
    d, inter = 256, 96
    w = [a for n_out, n_in in ((inter, d), (inter, d), (d, inter)) for a in random_int4(rng, E, n_out, n_in)]
    ws = list(map(jnp.asarray, w))
    assert not int4_moe._h_nibble_major(ws[0], ws[4], ws[5], None, None)
    idx, weights = random_routing(rng, 3)
    x = as_input(rng.standard_normal((3, d)), np.float32)
    out = int4_moe_ffn(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(weights), *ws, interpret=interpret)
    assert_close(out, int4_moe_ffn_ref(x, idx, weights, *w), TOL[np.float32], "FFN on plain h")
    layout, xt, token = int4_moe.moe_route(jnp.asarray(x), jnp.asarray(idx), E, group_size=GROUP)
    with pytest.raises(ValueError, match="out_nibble_major needs N=96"):
        int4_moe.moe_gate_up(xt, layout, token, (ws[0], ws[1]), (ws[2], ws[3]), out_nibble_major=True)


def test_k26_ffn_writes_h_nibble_major():
    """At K2.6 widths, in the engine's tiles and row-major alike, the FFN takes the nibble-major store."""
    specs = ffn_specs(8, 7168, 2048, 384, 8, jnp.bfloat16)[3:]
    tiled = jax.eval_shape(int4_moe.tile_ffn_int4, *specs)
    assert int4_moe._h_nibble_major(tiled[0], tiled[4], tiled[5], None, None)
    assert int4_moe._h_nibble_major(specs[0], specs[4], specs[5], None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_k26_gate_up_nibble_major_bitwise_on_gpu(rng, m):
    """Compiled at K2.6 shapes in the engine's tiles: the transposed store gives the plain h reordered, bit for bit."""
    w, args = _k26_case(rng, m)
    w = _tiled(w)
    plain, nib = _gate_up_both_orders(args, w, 384, 1, 32)
    assert np.isfinite(plain).all() and np.abs(plain).max() > 0
    np.testing.assert_array_equal(nib, np.asarray(int4_moe._nibble_major(jnp.asarray(plain), 2048 // 8)))
