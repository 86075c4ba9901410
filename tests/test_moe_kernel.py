"""MoE impl "kernel" (INT4 experts through `pallas_kernels.int4_moe.int4_moe_ffn`, interpret on CPU) against the XLA
"gather" / "dense" paths and the float64 reference MoE, a whole tiny INT4 model forward with the kernel, "auto"
choosing the kernel only on GPU, Triton lowering of the model forward for an abstract H200, and tile-major experts."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax.checkpoint.weights import build_model, random_hf_weights
from kdtree_jax.model.config import tiny
from kdtree_jax.model.moe import INT4_ARRAYS, MoE, experts_int4_kernel, resolve_impl, route, tile_experts
from kdtree_jax.model.quant import Int4Packed
from kdtree_jax.model.target import KimiModel, LatentCache, forward_prefill, forward_verify
from kdtree_jax.oracles import reference
from pallas_kernels._pallas import lower_for_h200
from pallas_kernels.int4_moe_ref import int4_moe_ffn_ref

CFG = tiny()
LAYER = CFG.first_k_dense_replace  # first MoE layer
PREFIX = f"layers.{LAYER}.mlp."
E, TOP_K, D = CFG.n_routed_experts, CFG.num_experts_per_tok, CFG.hidden_size
N_MOE_LAYERS = sum(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers))
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # relative L2 error; max-abs error gets 4x
MODEL_TOL = 1e-4  # logits, relative to the largest |logit| (as tests/test_model.py)
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def hf_weights(rng):
    """Fresh random HF-named weights of CFG with INT4 pack-quantized routed experts."""
    return random_hf_weights(CFG, int(rng.integers(1 << 30)), int4_experts=True)


def build(weights, impl):
    return build_model(CFG, weights.__getitem__, expert_format="int4", moe_impl=impl)


def float64_weights(weights) -> dict:
    """What every stored tensor decodes to (INT4 exactly dequantized), as float64."""
    return {k: (v.dequant() if isinstance(v, Int4Packed) else np.asarray(v)).astype(np.float64)
            for k, v in weights.items()}


def assert_close(out, ref, tol, what):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    max_abs = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel <= tol and max_abs <= 4 * tol, f"{what}: rel err {rel:.2e}, max-abs/max|ref| {max_abs:.2e} (tol {tol})"


def run_moe(moe: MoE, x: jax.Array) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, v: m(v))(moe, x).astype(jnp.float32))


def routed_ids(moe: MoE, x: np.ndarray) -> np.ndarray:
    flat = jnp.asarray(x, jnp.float32).reshape(-1, D)
    return np.asarray(route(flat @ moe.router[...], moe.bias[...], CFG)[1])


# ---- one MoE layer ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lead,dtype", [((1,), jnp.float32), ((3,), jnp.float32), ((2, 20), jnp.float32),
                                        ((3,), jnp.bfloat16)])
@pytest.mark.heavy
def test_kernel_layer_matches_gather_dense_and_reference(rng, hf_weights, lead, dtype):
    moes = {impl: build(hf_weights, impl).layers[LAYER].mlp for impl in ("kernel", "gather", "dense")}
    x = np.asarray(jnp.asarray(rng.standard_normal((*lead, D)), dtype).astype(jnp.float32))  # as the layer sees it
    n_tokens = int(np.prod(lead))
    if n_tokens * TOP_K < E:  # small counts must leave experts idle (the kernel skips them)
        assert len(np.unique(routed_ids(moes["kernel"], x))) < E
    out = {impl: run_moe(moe, jnp.asarray(x, dtype)) for impl, moe in moes.items()}
    assert out["kernel"].shape == x.shape
    tol = TOL[dtype]
    for impl in ("gather", "dense"):
        assert_close(out["kernel"], out[impl], tol, f"kernel vs {impl}, tokens {lead}")
    want = reference.moe(CFG, float64_weights(hf_weights), PREFIX, x.reshape(-1, D).astype(np.float64))
    assert_close(out["kernel"].reshape(-1, D), want, tol, f"kernel vs float64 reference, tokens {lead}")


def test_kernel_impl_needs_int4_experts():
    with pytest.raises(ValueError, match="INT4 experts only"):
        MoE(CFG, rngs=nnx.Rngs(0), expert_format="float", impl="kernel")


def test_kernel_on_expert_slices_sums_to_all_experts(rng, hf_weights):
    """The expert-parallel contract: each device runs its local experts with foreign pairs passed as absent (their
    local id out of range); the partial outputs sum to the full routed FFN (float64 reference)."""
    moe = build(hf_weights, "kernel").layers[LAYER].mlp
    arrays = {n: getattr(moe, n)[...] for n in INT4_ARRAYS}
    m, n_dev = 6, 2
    idx = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(m)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.5, (m, TOP_K)).astype(np.float32)
    x = rng.standard_normal((m, D)).astype(np.float32)
    e_local = E // n_dev
    total = np.zeros((m, D))
    for dev in range(n_dev):
        lid = idx - dev * e_local
        mine = (lid >= 0) & (lid < e_local)
        local = {n: a[dev * e_local:(dev + 1) * e_local] for n, a in arrays.items()}
        part = jax.jit(experts_int4_kernel)(jnp.asarray(x), jnp.asarray(np.where(mine, weights, 0.0)),
                                            jnp.asarray(lid), local)
        total += np.asarray(part, np.float64)
    want = int4_moe_ffn_ref(x, idx, weights, *(np.asarray(arrays[n]) for n in INT4_ARRAYS))
    assert_close(total, want, TOL[jnp.float32], "sum over expert slices")


@pytest.mark.parametrize("method", ["pairwise", "sorted"])
def test_absent_pairs_take_no_rows(rng, method):
    """Ids outside 0..E-1 get no slot rows and scatter nowhere, and no padded row reads their token (both routing
    methods)."""
    from pallas_kernels import int4_moe
    from pallas_kernels.int4_moe import scatter_rows

    ids = rng.integers(-E, 2 * E, 40).astype(np.int32)
    present = (ids >= 0) & (ids < E)
    layout = getattr(int4_moe, f"route_layout_{method}")(jnp.asarray(ids), E, 16)
    assert int(np.asarray(layout.slot_count).sum()) == int(present.sum())
    dest = np.asarray(layout.dest)
    assert (dest[~present] == layout.rows).all() and (dest[present] < layout.rows).all()
    assert len(np.unique(dest[present])) == int(present.sum())
    rows = np.asarray(scatter_rows(jnp.asarray(rng.standard_normal((40, 3)) + 5.0, jnp.float32), layout))
    assert np.count_nonzero(rows.any(axis=1)) == int(present.sum())
    token = np.asarray(int4_moe.row_tokens(layout, 20, 2))  # 20 tokens x top-2 = the 40 pairs
    np.testing.assert_array_equal(token[dest[present]], np.flatnonzero(present) // 2)
    padding = np.ones(layout.rows, bool)
    padding[dest[present]] = False
    assert (token[padding] == 0).all()


# ---- whole model --------------------------------------------------------------------------------------------------
def test_model_forward_kernel_matches_gather_and_reference(rng, hf_weights):
    b, t = 2, 7
    tokens = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    logits = {}
    for impl in ("kernel", "gather"):
        graphdef, state = nnx.split(build(hf_weights, impl))
        fwd = jax.jit(lambda st, tok: forward_prefill(nnx.merge(graphdef, st), tok, 0,
                                                      LatentCache.zeros(CFG, b, t, jnp.float32)).logits)
        logits[impl] = np.asarray(fwd(state, jnp.asarray(tokens)), np.float64)  # [B, T, V]
    scale = np.abs(logits["gather"]).max()
    assert np.abs(logits["kernel"] - logits["gather"]).max() / scale < MODEL_TOL
    want = reference.reference_forward(CFG, float64_weights(hf_weights), tokens[0])  # [T, V]
    assert np.abs(logits["kernel"][0] - want).max() / np.abs(want).max() < MODEL_TOL


# ---- "auto" and lowering ------------------------------------------------------------------------------------------
def abstract_model(fmt: str, impl: str = "auto", dtype=jnp.bfloat16) -> KimiModel:
    return nnx.eval_shape(lambda: KimiModel(CFG, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype,
                                            expert_format=fmt, moe_impl=impl))


@pytest.mark.parametrize("backend", ["cpu", "gpu"], ids=["cpu_backend", "gpu_backend"])  # a "gpu" id = gpu marker
def test_auto_picks_kernel_only_for_int4_on_gpu(monkeypatch, backend):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    int4, flt = abstract_model("int4").layers[LAYER].mlp, abstract_model("float").layers[LAYER].mlp
    few, many = 1, E  # M*k < E -> gather; else dense
    want_int4 = ("kernel", "kernel") if backend == "gpu" else ("gather", "dense")
    assert (resolve_impl(int4, few), resolve_impl(int4, many)) == want_int4
    assert (resolve_impl(flt, few), resolve_impl(flt, many)) == ("gather", "dense")
    for impl in ("gather", "dense", "kernel"):  # explicit choices are kept
        assert resolve_impl(abstract_model("int4", impl).layers[LAYER].mlp, few) == impl
    abstract = jax.sharding.AbstractMesh((2,), ("expert",))  # any machine, 1 GPU too: no devices needed
    with jax.sharding.use_abstract_mesh(abstract):  # GSPMD would gather experts
        assert resolve_impl(int4, few) == "gather"


@pytest.mark.parametrize("backend,calls", [("gpu", 2 * N_MOE_LAYERS), ("cpu", 0)], ids=["gpu_backend", "cpu_backend"])
def test_model_verify_lowers_for_h200_with_kernel(monkeypatch, backend, calls):
    """INT4 bf16 model, moe_impl "auto", the decode / DDTree verify forward: on a GPU backend each MoE layer lowers
    to the fused gate/up and the down Triton calls (compiled, not interpreted); on CPU "auto" keeps the XLA path."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    graphdef, state = nnx.split(abstract_model("int4"))
    b, n, s = 2, 8, 16

    def logits(st, tokens, positions, start, mask, cache):
        return forward_verify(nnx.merge(graphdef, st), tokens, positions, start, mask, cache).logits

    spec = jax.ShapeDtypeStruct
    cache = jax.eval_shape(lambda: LatentCache.zeros(CFG, b, s, jnp.bfloat16))
    lowered = lower_for_h200(logits, jax.tree.map(lambda a: spec(a.shape, a.dtype), state), spec((b, n), jnp.int32),
                             spec((b, n), jnp.int32), spec((b,), jnp.int32), spec((b, n, n), jnp.bool_), cache)
    assert lowered.as_text().count(TRITON_CALL) == calls


# ---- tile-major experts -----------------------------------------------------------------------------------------------
def test_tile_experts_keeps_every_path_exact(rng):
    """`tile_experts` re-lays a kernel layer's experts tile-major: the kernel gives the same bits, the XLA paths the
    same values; layers that do not run the kernel, and widths the tiles do not divide, stay row-major."""
    cfg = dataclasses.replace(CFG, hidden_size=256, moe_intermediate_size=128)  # whole kernel tiles
    moe = MoE(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))), expert_format="int4", impl="kernel")
    x = jnp.asarray(rng.standard_normal((3, 4, cfg.hidden_size)), jnp.float32)
    row = run_moe(moe, x)
    gather = MoE(cfg, rngs=nnx.Rngs(0), expert_format="int4", impl="gather")
    nnx.update(gather, nnx.state(moe))
    want = run_moe(gather, x)
    assert tile_experts(gather) == 0 and gather.gate_packed.ndim == 3  # XLA path: stays row-major
    assert tile_experts(moe) == 1 and moe.gate_packed.ndim == 5 and moe.down_scale.ndim == 5
    assert tile_experts(moe) == 0  # already tile-major
    np.testing.assert_array_equal(run_moe(moe, x), row)
    moe.impl = "gather"  # the XLA path reads the tile-major arrays too
    np.testing.assert_allclose(run_moe(moe, x), want, rtol=1e-6, atol=1e-6)
    small = MoE(CFG, rngs=nnx.Rngs(0), expert_format="int4", impl="kernel")  # D 64: no whole 16-word K tile
    assert tile_experts(small) == 0 and small.gate_packed.ndim == 3
