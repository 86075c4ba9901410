"""The Mosaic GPU (wgmma) verify_attn path vs the float64 reference: in Mosaic GPU's interpreter on CPU (which
simulates the three warpgroups, shared memory, TMA and barriers), lowered for an abstract H200, compiled on GPU.

Where the interpreted kernel is followed by more ops, kernel and ops run as one jitted program, as in the engine. Run
op by op, the ops queued behind the kernel can take every in-flight slot of the CPU client, and the interpreter's own
nested programs then wait for a slot forever."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import verify_attn_mgpu as vm
from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.verify_attn import _merge_splits, _verify_attn_mosaic, pick_backend, verify_attn
from pallas_kernels.verify_attn_ref import verify_attn_ref
from tests.test_verify_attn import TOL, assert_close, make_case, run

H = vm.ROWS  # 64 heads: one query tile per tree node


# (prefix per request, N, H, R, Dr, S, num_splits): partial last blocks, an empty prefix, a prefix that ends on a
# block edge, more splits than blocks (idle splits), a tree wider than one tile, and N*H that is not a whole number
# of 64-row tiles (8 heads as under 8-way tensor parallelism: rows padded to a tile).
CASES = [
    ([200, 0], 3, H, 128, 64, 200, None),
    ([130, 64], 1, H, 128, 64, 192, 3),
    ([257, 100], 2, H, 256, 64, 304, 2),
    ([64], 5, H, 128, 64, 64, 1),
    ([150, 9], 1, 8, 128, 64, 160, None),
    ([100, 33], 17, 8, 128, 64, 136, 2),
]


@pytest.mark.heavy
@pytest.mark.parametrize("prefix,n,h,r,dr,s,splits", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_matches_reference(rng, interpret, prefix, n, h, r, dr, s, splits, dtype):
    case = make_case(rng, prefix=prefix, n=n, h=h, r=r, dr=dr, s=s, dtype=dtype)
    out, ref = run(case, interpret=interpret, r=r, backend="mosaic", num_splits=splits)
    assert_close(out, ref, TOL[jnp.bfloat16], f"mosaic prefix={prefix} N={n} H={h} splits={splits}")


@pytest.mark.heavy
def test_wide_tree_in_the_kernel_matches_reference(rng, interpret):
    """A tree of 70 nodes at H = 64: the kernel's tree blocks read both mask words of a block and a second,
    partial block (nodes 64..69), on a single split and on three."""
    case = make_case(rng, prefix=[90], n=70, h=H, r=128, dr=64, s=96, dtype=jnp.bfloat16)
    for splits in (1, 3):
        out, ref = run(case, interpret=interpret, r=128, backend="mosaic", num_splits=splits)
        assert_close(out, ref, TOL[jnp.bfloat16], f"mosaic wide tree, {splits} splits")


def test_tree_in_the_kernel_and_in_xla_agree(rng, interpret):
    """The tree block inside the kernel (H = 64) and in XLA on one input, both against float64; in the kernel is
    refused where a query tile spans nodes (H = 8)."""
    case = make_case(rng, prefix=[130, 0], n=3, h=H, r=128, dr=64, s=136, dtype=jnp.bfloat16)
    inside, ref = run(case, interpret=interpret, r=128, backend="mosaic", num_splits=2)
    outside, _ = run(case, interpret=interpret, r=128, backend="mosaic", num_splits=2, tree_in_kernel=False)
    for out, where in ((inside, "kernel"), (outside, "XLA")):
        assert_close(out, ref, TOL[jnp.bfloat16], f"tree in {where}")
    assert_close(inside, outside, 2 * TOL[jnp.bfloat16], "tree in kernel vs XLA")
    narrow = make_case(rng, prefix=[40], n=8, h=8, r=128, dr=64, s=40, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="tree_in_kernel=True needs H % 64"):
        run(narrow, interpret=interpret, r=128, backend="mosaic", tree_in_kernel=True)


def test_agrees_with_triton_path(rng, interpret):
    """Both backends on one input: they share no kernel code, only the reference's definition."""
    case = make_case(rng, prefix=[150, 70], n=2, h=H, r=128, dr=64, s=160, dtype=jnp.bfloat16)
    mosaic, ref = run(case, interpret=interpret, r=128, backend="mosaic")
    triton, _ = run(case, interpret=interpret, r=128, backend="triton")
    assert_close(mosaic, triton, 2 * TOL[jnp.bfloat16], "mosaic vs triton")
    assert np.linalg.norm(mosaic - ref) < np.linalg.norm(ref) * TOL[jnp.bfloat16]


def test_layer_of_the_whole_cache(rng, interpret):
    case = make_case(rng, prefix=[100, 40], n=1, h=H, r=128, dr=64, s=128, dtype=jnp.bfloat16)
    layers = np.stack([np.asarray(jnp.asarray(rng.standard_normal(case["cache"].shape), jnp.bfloat16)),
                       case["cache"]])
    args = [jnp.asarray(case[k]) for k in ("q", "cache", "prefix_len", "tree_kv", "tree_mask")]
    one = verify_attn(*args, scale=0.1, kv_lora_rank=128, interpret=interpret, backend="mosaic")
    args[1] = jnp.asarray(layers)
    whole = verify_attn(*args, scale=0.1, kv_lora_rank=128, layer=1, interpret=interpret, backend="mosaic")
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(whole, np.float32))


def test_interpreter_outputs_start_poisoned():
    """The premise of the idle-split test: an output element a Mosaic GPU kernel never writes reads back as NaN."""
    def body(x_ref, o_ref):
        o_ref.at[pl.ds(0, 128)][...] = x_ref.at[pl.ds(0, 128)][...]

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((256,), jnp.float32),
                          interpret=plgpu.InterpretGPUParams())
    out = np.asarray(kernel(jnp.arange(256, dtype=jnp.float32) + 1.0))
    np.testing.assert_array_equal(out[:128], np.arange(128) + 1.0)
    assert np.isnan(out[128:]).all()


def test_tree_bits_hold_each_tiles_mask_row(rng):
    """Bit c of word w of item (b, node, head tile) is tree_mask[b, node, 32 w + c], for a mask wider than a block."""
    bt, n, per_node = 2, 70, 2
    mask = rng.random((bt, n, n)) < 0.5
    bits = np.asarray(vm.tree_bits(jnp.asarray(mask), per_node)).view(np.uint32)
    words = 2 * -(-n // vm.BLOCK_K)
    assert bits.shape == (bt * n * per_node, words)
    got = (bits[:, :, None] >> np.arange(vm.BIT_WORD, dtype=np.uint32)) & 1  # [items, words, 32]
    got = got.reshape(bt, n, per_node, words * vm.BIT_WORD).astype(bool)
    for t in range(per_node):
        np.testing.assert_array_equal(got[:, :, t, :n], mask)
    assert not got[..., n:].any()


def _visible_tree(tree_kv, mask, b, node):
    return tree_kv[b, np.flatnonzero(mask[b, node])]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("plan", [vm.SplitPlan(items=4, splits=3), vm.SplitPlan(items=4, splits=2, tail_items=1,
                                                                                 tail_splits=3)])
@pytest.mark.parametrize("with_tree", [False, True])
def test_split_outputs_match_reference(rng, interpret, dtype, plan, with_tree):
    """Each program's own output, normalised over its split's blocks, and its log-sum-exp against float64, for equal
    splits and for a plan whose last tile takes more splits; a split with no blocks writes o = 0 and lse = NEG.
    With the tree, each tile's last split also attends to the tree rows its node sees (one node a tile: H = 64).
    Outputs start as NaN-filled buffers, so an unwritten one would show. Two tiles per request: item = b * 2 + t."""
    r, scale, tiles = 128, 0.1, 2
    prefix = np.array([300, 70])  # 5 blocks (2 + 2 + 1 per split, a partial last one) and 2 (1 + 1 + idle)
    q = jnp.asarray(rng.standard_normal((2, tiles * H, 192)), dtype)
    cache = jnp.asarray(rng.standard_normal((1, 2, 320, 192)), dtype)
    tree_kv = jnp.asarray(rng.standard_normal((2, vm.BLOCK_K, 192)), dtype)  # nodes 0, 1, then rows none sees
    mask = np.zeros((2, tiles, tiles), bool)
    mask[:, 0, 0] = mask[:, 1, 1] = True
    mask[0, 1, 0] = True  # request 0: node 1 is node 0's child; request 1: two roots
    tree = (tree_kv, vm.tree_bits(jnp.asarray(mask), 1)) if with_tree else None
    parts, lse = map(np.asarray, vm.prefix_attn(q, cache, jnp.asarray(prefix, jnp.int32), scale=scale,
                                                value_width=r, plan=plan, tree=tree, interpret=interpret))
    assert parts.shape == (plan.programs, 2, H, r) and lse.shape == (plan.programs, H)
    o_hi, o_lo = parts[:, 0].astype(np.float64), parts[:, 1].astype(np.float64)
    assert np.isfinite(o_hi).all() and np.isfinite(o_lo).all() and np.isfinite(lse).all()
    o = o_hi + o_lo
    q64, kv64 = np.asarray(q, np.float64), np.asarray(cache[0], np.float64)
    programs = [(i0 + item, j, sp) for _, i0, n, sp in plan.groups() for item in range(n) for j in range(sp)]
    assert len(programs) == plan.programs
    for p, (item, j, splits) in enumerate(programs):
        b, t = divmod(item, tiles)
        n_blocks = -(-prefix[b] // vm.BLOCK_K)
        per_split = -(-n_blocks // splits)
        lo, hi = j * per_split * vm.BLOCK_K, min((j + 1) * per_split * vm.BLOCK_K, prefix[b])
        keys = kv64[b, lo:hi]
        if with_tree and j == splits - 1:
            keys = np.concatenate([keys, _visible_tree(np.asarray(tree_kv, np.float64), mask, b, t)])
        if not len(keys):
            assert (o[p] == 0).all() and (lse[p] < -1e29).all()
            continue
        rows = q64[b, t * H:(t + 1) * H]
        s = rows @ keys.T * scale
        want_lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
        want_o = np.exp(s - want_lse[:, None]) @ keys[:, :r]
        np.testing.assert_allclose(lse[p], want_lse, atol=TOL[jnp.bfloat16])
        assert_close(o[p], want_o, TOL[jnp.bfloat16], f"request {b} tile {t} split {j} of {splits}")
        # lo is what hi misses: their sum keeps ~16 significant bits where hi alone keeps the dtype's (one key:
        # o is that key's value, exact in the dtype)
        assert np.abs(o_lo[p]).max() <= np.abs(o_hi[p]).max() * 2.0 ** -7
        assert (np.abs(o_lo[p]).max() > 0) == (len(keys) > 1)


def test_tail_plan_matches_reference(rng, interpret):
    """verify_attn's wgmma path with a plan whose last tiles take more splits than the rest (the default plan at
    serving sizes: `_tail_plan`), against float64: three requests of two 64-row tiles, the last three tiles in 4."""
    case = make_case(rng, prefix=[200, 0, 130], n=2, h=H, r=128, dr=64, s=200, dtype=jnp.bfloat16)
    names = ("q", "cache", "prefix_len", "tree_kv", "tree_mask")
    q, cache, prefix, tree_kv, tree_mask = (jnp.asarray(case[k]) for k in names)
    plan = vm.SplitPlan(items=6, splits=1, tail_items=3, tail_splits=4)
    out = _verify_attn_mosaic(q, cache[None], prefix, tree_kv, tree_mask, scale=0.1, r=128, layer=0,
                              num_splits=None, interpret=interpret, plan=plan)
    ref = verify_attn_ref(*(case[k] for k in names), scale=0.1, kv_lora_rank=128)
    assert_close(np.asarray(out.astype(jnp.float32), np.float64), ref, TOL[jnp.bfloat16], "tail plan")


def test_pick_backend():
    assert pick_backend(None, jnp.bfloat16, 64, 512, 64, 4096, interpret=True) == "triton"  # interpreter: Triton's
    assert pick_backend("mosaic", jnp.bfloat16, 8, 512, 64, 4096, interpret=True) == "mosaic"  # rows padded
    with pytest.raises(ValueError, match="32 \\+ 64"):
        pick_backend("mosaic", jnp.bfloat16, 64, 32, 64, 4096, interpret=False)
    with pytest.raises(ValueError, match="float32"):
        pick_backend("mosaic", jnp.float32, 64, 512, 64, 4096, interpret=False)
    with pytest.raises(ValueError, match="S=4097"):
        pick_backend("mosaic", jnp.bfloat16, 64, 512, 64, 4097, interpret=False)
    with pytest.raises(ValueError, match="backend='cutlass'"):
        pick_backend("cutlass", jnp.bfloat16, 64, 512, 64, 4096, interpret=False)


@pytest.mark.parametrize("rows,hopper,want", [(64, True, "mosaic"), (17 * 64, True, "mosaic"), (8, True, "triton"),
                                              (136, True, "triton"), (64, False, "triton")])
def test_auto_backend_rule(monkeypatch, rows, hopper, want):
    """Compiled (interpret=False) on an sm_90 device: whole 64-row tiles take wgmma, padded ones stay on Triton."""
    from pallas_kernels import verify_attn as va

    monkeypatch.setattr(va, "_is_hopper", lambda: hopper)
    assert pick_backend(None, jnp.bfloat16, rows, 512, 64, 4096, interpret=False) == want
    assert pick_backend(None, jnp.float32, rows, 512, 64, 4096, interpret=False) == "triton"


@pytest.mark.parametrize("bt,n,h,s", [(2, 1, H, 4096), (1, 17, H, 8192), (4, 1, 8, 4096)])
def test_lowers_for_h200(bt, n, h, s):
    """Mosaic GPU lowering at K2 widths for an abstract H200: shared-memory budget, wgmma operand swizzles and TMA
    divisibility are all checked here, without a GPU."""
    spec, a = jax.ShapeDtypeStruct, 576
    fn = functools.partial(verify_attn, scale=0.1, kv_lora_rank=512, interpret=False, backend="mosaic")
    text = lower_for_h200(fn, spec((bt, n, h, a), jnp.bfloat16), spec((bt, s, a), jnp.bfloat16),
                          spec((bt,), jnp.int32), spec((bt, n, a), jnp.bfloat16), spec((bt, n, n), jnp.bool_)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1 and "__gpu$xla.gpu.triton" not in text


def _wide_pair(seed: int, **overrides):
    """A tiny Kimi-shaped pair whose verify calls take the wgmma path: 64 heads, 128 + 64 latent, bf16 cache."""
    from engine_utils import drafter_config, random_drafter

    from kdtree_jax.checkpoint.weights import init_random
    from kdtree_jax.model import config

    cfg = config.tiny(eos_token_id=(), num_attention_heads=H, kv_lora_rank=128, qk_rope_head_dim=64,
                      num_hidden_layers=2, **overrides)
    return (init_random(cfg, seed=seed, cache_dtype=jnp.bfloat16),
            random_drafter(drafter_config(cfg, block_size=4), seed))


def test_engine_refuses_a_backend_that_cannot_serve_the_target(rng):
    """Checked when the engine is built, naming the config fields, before any compile."""
    from engine_utils import random_pair

    from kdtree_jax.decode.engine import Engine
    from kdtree_jax.generate import ATTENTION_BACKENDS
    from pallas_kernels.verify_attn import BACKENDS

    assert ATTENTION_BACKENDS == ("auto", *BACKENDS)
    target, drafter = random_pair("grouped", int(rng.integers(1 << 30)))  # fp32 cache, kv_lora_rank 32
    with pytest.raises(ValueError, match="attn_backend='cuda'"):
        Engine(target, drafter, None, attn_backend="cuda")
    with pytest.raises(ValueError, match="float32 cache, kv_lora_rank=32, qk_rope_head_dim=8"):
        Engine(target, drafter, None, attn_backend="mosaic")


@pytest.mark.heavy
def test_model_forward_takes_the_chosen_backend(rng, interpret):
    """forward_verify's attn_backend reaches verify_attn: the 64-head model's logits agree on both backends (and
    a backend that does not exist is refused from inside the forward). Every layer is dense: the two backends
    round differently in bf16, and a random router's near-tie then picks other experts (logits 27% apart for a
    seed that CI drew), which says nothing about attention. The forward is one program (see the module docstring)."""
    from kdtree_jax.model.target import LatentCache, forward_verify

    target, _ = _wide_pair(int(rng.integers(1 << 30)), first_k_dense_replace=2)
    cfg, bt, n, s = target.cfg, 2, 3, 64
    cache = LatentCache.from_stacked(jnp.asarray(rng.standard_normal((cfg.num_hidden_layers, bt, s, cfg.latent_dim)),
                                           jnp.bfloat16))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (bt, n)), jnp.int32)
    start = jnp.array([40, 17], jnp.int32)
    positions = start[:, None] + jnp.arange(n)[None, :]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (bt, n, n))
    forward = jax.jit(functools.partial(forward_verify, use_pallas=True, interpret=interpret),
                      static_argnames="attn_backend")
    logits = {b: np.asarray(forward(target, tokens, positions, start, mask, cache, attn_backend=b).logits, np.float64)
              for b in ("triton", "mosaic")}
    assert_close(logits["mosaic"], logits["triton"], TOL[jnp.bfloat16], "logits mosaic vs triton")
    with pytest.raises(ValueError, match="backend='cuda'"):
        forward_verify(target, tokens, positions, start, mask, cache, use_pallas=True, interpret=interpret,
                       attn_backend="cuda")


@pytest.mark.gpu
def test_engine_greedy_ddtree_equals_ar_on_the_wgmma_kernel(rng):
    from kdtree_jax.decode.engine import Engine

    target, drafter = _wide_pair(int(rng.integers(1 << 30)))
    engine = Engine(target, drafter, None, attn_backend="mosaic")
    prompts = [rng.integers(0, target.cfg.vocab_size - 1, size=k).tolist() for k in (70, 9, 33)]
    ar = engine.generate(prompts, 24, mode="ar").token_ids
    for budget in (4, 16):
        assert engine.generate(prompts, 24, mode="ddtree", budget=budget).token_ids == ar


@pytest.mark.heavy
def test_split_layout_barely_moves_the_output(rng, interpret):
    """The AR call and a tree call split one prefix differently; greedy ddtree == ar needs their outputs to agree
    closely. Before the final cast, one prefix over 1 and over 5 splits agrees to <= 1.4e-3 relative: the rest is
    P's bf16 rounding inside the kernel (~8e-4). A split output kept in one bf16 part alone would add its own 2^-9
    per element (2.3e-3 measured), which this bound rejects."""
    r, a = 128, 192
    q = jnp.asarray(rng.standard_normal((2, H, a)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((1, 2, 640, a)), jnp.bfloat16)
    prefix = jnp.array([640, 400], jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)  # one program: see the module docstring
    def merged(splits):
        parts, lse = vm.prefix_attn(q, cache, prefix, scale=0.1, value_width=r, plan=splits, interpret=interpret)
        (_, o, lse), = vm.split_outputs(vm.join_parts(parts), lse, vm.SplitPlan(items=2, splits=splits))
        return _merge_splits(o, lse)

    one, five = (np.asarray(merged(k), np.float64) for k in (1, 5))
    assert np.linalg.norm(one - five) / np.linalg.norm(one) <= 1.4e-3
