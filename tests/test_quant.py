"""FP8-block and INT4 pack-quantized decoding against independent loop-based decoders, plus round trips."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kdtree_jax.model.quant import (
    Int4Packed,
    dequant_fp8_block,
    dequant_int4,
    dequant_int4_jnp,
    fp8_scale_shape,
    quant_fp8_block,
    quant_int4,
    stack_int4,
)


def _random_words(rng, shape) -> np.ndarray:
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def _random_bf16_scales(rng, shape) -> np.ndarray:
    return (rng.uniform(0.01, 2.0, size=shape) * rng.choice([-1, 1], size=shape)).astype(ml_dtypes.bfloat16)


def _int4_by_loops(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """Direct reading of the spec: nibble k of word j is column 8j+k in bits [4k, 4k+4); W = (nibble - 8) * s."""
    out, words = packed.shape
    w = np.empty((out, words * 8), np.float32)
    for o in range(out):
        for j in range(words):
            word = int(packed[o, j]) & 0xFFFFFFFF
            for k in range(8):
                col = 8 * j + k
                nib = (word >> (4 * k)) & 0xF
                w[o, col] = np.float32(nib - 8) * np.float32(scale[o, col // group])
    return w


def _fp8_by_blocks(w8: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    bo, bi = block
    out = np.full(w8.shape, np.nan, np.float32)
    for a in range(scale.shape[0]):
        for b in range(scale.shape[1]):
            rows, cols = slice(a * bo, (a + 1) * bo), slice(b * bi, (b + 1) * bi)
            out[rows, cols] = w8[rows, cols].astype(np.float32) * scale[a, b]
    return out


def _random_fp8(rng, shape) -> np.ndarray:
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # drop the NaN codes
    return bits.view(ml_dtypes.float8_e4m3fn)


# ---- INT4 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [32, 8])
def test_int4_dequant_matches_loops(rng, group):
    packed = _random_words(rng, (6, 64 // 8))
    scale = _random_bf16_scales(rng, (6, 64 // group))
    want = _int4_by_loops(packed, scale, group)
    got = dequant_int4(packed, scale, group)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(Int4Packed(packed, scale, (6, 64), group).dequant(), want)


def test_int4_hand_built_word():
    # Columns 0..7 hold q = -8, -3, 0, 7, 1, -1, 5, -6 -> nibbles q + 8, lowest bits = column 0.
    q = [-8, -3, 0, 7, 1, -1, 5, -6]
    word = sum((v + 8) << (4 * k) for k, v in enumerate(q))
    assert word == 0x2D79F850  # nibbles, high to low: 2 D 7 9 F 8 5 0
    second = 0xF0000000  # only column 15 set: nibble 15 -> q = 7; top bit set, so the int32 is negative
    packed = np.array([[word, second]], dtype=np.uint32).view(np.int32)
    assert packed[0, 1] < 0
    scale = np.array([[0.5, 2.0]], dtype=ml_dtypes.bfloat16)  # group 8: one scale per word
    got = dequant_int4(packed, scale, 8)
    np.testing.assert_array_equal(got[0, :8], np.array(q, np.float32) * 0.5)
    np.testing.assert_array_equal(got[0, 8:], np.array([-8] * 7 + [7], np.float32) * 2.0)
    got_j = dequant_int4_jnp(jnp.asarray(packed), jnp.asarray(scale), 8, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got_j), got)


def test_int4_jnp_batched_in_jit(rng):
    group = 32
    packed = _random_words(rng, (3, 5, 64 // 8))  # [E, out, in/8]
    scale = _random_bf16_scales(rng, (3, 5, 64 // group))
    want = np.stack([_int4_by_loops(packed[e], scale[e], group) for e in range(3)])
    f32 = jax.jit(lambda p, s: dequant_int4_jnp(p, s, group, jnp.float32))(packed, scale)
    np.testing.assert_array_equal(np.asarray(f32), want)
    bf16 = jax.jit(lambda p, s: dequant_int4_jnp(p, s, group, jnp.bfloat16))(packed, scale)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), want.astype(ml_dtypes.bfloat16))
    tree = stack_int4([Int4Packed(packed[e], scale[e], (5, 64), group) for e in range(3)])
    np.testing.assert_array_equal(tree.packed, packed)
    np.testing.assert_array_equal(tree.dequant(), want)
    leaves = jax.tree_util.tree_leaves(tree)  # a pytree: the arrays are the leaves, shape/group are static
    assert len(leaves) == 2 and leaves[0] is tree.packed
    via_tree = jax.jit(lambda t: dequant_int4_jnp(t.packed, t.scale, t.group_size, jnp.float32))(tree)
    np.testing.assert_array_equal(np.asarray(via_tree), want)


def test_int4_round_trip(rng):
    group = 32
    w = rng.standard_normal((7, 96)) * rng.uniform(0.1, 3.0, size=(7, 1))
    packed, scale = quant_int4(w, group)
    assert packed.dtype == np.int32 and packed.shape == (7, 12)
    assert scale.dtype == np.dtype(ml_dtypes.bfloat16) and scale.shape == (7, 3)
    absmax = np.abs(w.reshape(7, 3, group)).max(-1)
    np.testing.assert_array_equal(scale, (absmax / 7).astype(ml_dtypes.bfloat16))
    deq = dequant_int4(packed, scale, group).astype(np.float64)
    s = np.repeat(scale.astype(np.float64), group, axis=1)
    assert np.all(np.abs(deq - w) <= s / 2 * (1 + 1e-6))
    nib = _int4_by_loops(packed, np.ones_like(scale), group) + 8  # scale 1: recovers the stored nibbles
    assert nib.min() >= 1 and nib.max() <= 15  # symmetric writer: level -8 (nibble 0) unused
    np.testing.assert_array_equal(deq / s, np.round(deq / s))


def test_int4_bad_shapes(rng):
    packed = _random_words(rng, (4, 8))
    with pytest.raises(ValueError, match="scale shape"):
        dequant_int4(packed, _random_bf16_scales(rng, (4, 3)), 32)
    with pytest.raises(ValueError, match="Int4Packed"):
        Int4Packed(packed, _random_bf16_scales(rng, (4, 2)), (4, 128), 32)


# ---- FP8 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((37, 45), (16, 16)), ((5, 130), (128, 128)), ((48, 32), (16, 16))])
def test_fp8_dequant_matches_blocks(rng, shape, block):
    w8 = _random_fp8(rng, shape)
    scale = rng.uniform(1e-4, 1e-1, size=fp8_scale_shape(shape, block)).astype(np.float32)
    got = dequant_fp8_block(w8, scale, block)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _fp8_by_blocks(w8, scale, block))


def test_fp8_scale_shape_checked(rng):
    w8 = _random_fp8(rng, (37, 45))
    with pytest.raises(ValueError, match=r"want \(3, 3\)"):
        dequant_fp8_block(w8, np.ones((2, 3), np.float32), (16, 16))


def test_fp8_round_trip(rng):
    block = (16, 16)
    w = rng.standard_normal((37, 45)) * rng.uniform(0.01, 5.0, size=(37, 1))
    w8, scale = quant_fp8_block(w, block)
    assert w8.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and scale.shape == (3, 3) and scale.dtype == np.float32
    deq = dequant_fp8_block(w8, scale, block).astype(np.float64)
    s = np.repeat(np.repeat(scale, 16, 0), 16, 1)[:37, :45].astype(np.float64)
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; subnormal spacing 2^-9 (in scaled units).
    assert np.all(np.abs(deq - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * s)
    tile_max = np.abs(w8.astype(np.float32)).max()
    assert tile_max == 448.0  # the tile absmax maps to the top of the e4m3 range
