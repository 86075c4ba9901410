"""The JAX target model end to end: synthetic HF checkpoint -> HFCheckpoint -> weights.py -> forward, against the
float64 reference (`reference_forward`), and the cache invariants between plain prefill and absorbed verify.

Compilation dominates CPU time, so shapes are shared between tests (B = 2, S = 16, prefill chunks of 4, ...) and
the jitted entry points below take the graphdef as a static argument (one compile per model structure and shape).
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax.checkpoint.hf import HFCheckpoint
from kdtree_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kdtree_jax.checkpoint.weights import WeightError, load_model, params_from_hf
from kdtree_jax.model.config import RopeScaling, tiny
from kdtree_jax.model.target import LatentCache, forward_prefill, forward_verify
from kdtree_jax.oracles.reference import reference_forward

B, S = 2, 16  # batch, cache capacity
CHUNK = 4  # traced-start prefill chunk
T_REF = 3 * CHUNK  # one-shot prefill length
TOL = 1e-4  # relative to the largest |logit|

CONFIGS = {
    # K2.6-like: wrapped layout, grouped noaux_tc routing (n_group 4, topk_group 2), YaRN factor 8, beta_fast 32.
    "k26_grouped": (tiny(), "bf16", True),
    # DeepSeek-V2-Lite-like attention (direct q_proj), all-MoE layers, FP8 blocks, odd head dims, YaRN with
    # mscale != mscale_all_dim (rope amplitude != 1), 2 groups keep 1.
    "fp8_direct_q": (tiny(first_k_dense_replace=0, q_lora_rank=None, num_attention_heads=2, qk_nope_head_dim=8,
                          qk_rope_head_dim=16, v_head_dim=24, n_group=2, topk_group=1,
                          rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=32, beta_fast=16.0,
                                                   beta_slow=2.0, mscale=0.8, mscale_all_dim=0.6)),
                     "fp8", False),
    # Two dense layers, plain RoPE, softmax greedy routing over 3 experts, two shared experts, wider latent.
    "dense2_softmax": (tiny(num_hidden_layers=4, first_k_dense_replace=2, n_group=1, topk_group=1,
                            topk_method="greedy", scoring_func="softmax", num_experts_per_tok=3, n_shared_experts=2,
                            kv_lora_rank=48, rope_scaling=RopeScaling()), "bf16", False),
}
SEED = int.from_bytes(os.urandom(4), "little")  # module fixtures share one fresh seed (printed on failure)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---- jitted entry points (graphdef static) ---------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0, static_argnames=("start", "taps"))
def prefill_static(graphdef, state, tokens, cache, *, start, taps=()):
    return forward_prefill(nnx.merge(graphdef, state), tokens, start, cache, taps=taps)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("taps",))
def prefill_traced(graphdef, state, tokens, start, cache, *, taps=()):
    return forward_prefill(nnx.merge(graphdef, state), tokens, start, cache, taps=taps)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("taps", "use_pallas", "interpret"))
def verify(graphdef, state, tokens, positions, start, mask, cache, *, taps=(), use_pallas=False, interpret=None):
    return forward_verify(nnx.merge(graphdef, state), tokens, positions, start, mask, cache, taps=taps,
                          use_pallas=use_pallas, interpret=interpret)


class Loaded:
    """A checkpoint written, read back and loaded; reference logits cached per token sequence."""

    def __init__(self, path, cfg, fmt, wrapped, *, dtype=jnp.float32):
        self.eff = write_synthetic_checkpoint(path, cfg, fmt=fmt, wrapped=wrapped, seed=SEED, n_shards=2)
        self.ckpt = HFCheckpoint.open(path)
        self.cfg = self.ckpt.config
        self.model = load_model(self.ckpt, param_dtype=dtype, dtype=dtype)
        self.graphdef, self.state = nnx.split(self.model)
        self.dtype = dtype
        self._ref = {}

    def ref(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(int(t) for t in tokens)
        if key not in self._ref:
            self._ref[key] = reference_forward(self.cfg, self.eff, np.asarray(key), return_hidden=True)
        return self._ref[key]

    def poisoned_cache(self, rng) -> LatentCache:
        """Finite garbage everywhere: anything read outside the valid rows shows up in the logits."""
        shape = (self.cfg.num_hidden_layers, B, S, self.cfg.latent_dim)
        return LatentCache.from_stacked(jnp.asarray(rng.standard_normal(shape), self.dtype))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    print(f"SEED={SEED}")
    cache = {}

    def get(name: str) -> Loaded:
        if name not in cache:
            cfg, fmt, wrapped = CONFIGS[name]
            cache[name] = Loaded(tmp_path_factory.mktemp(name), cfg, fmt, wrapped)
        return cache[name]

    return get


def _taps(cfg) -> tuple[int, ...]:
    """The same taps in every one-shot prefill, so the compiled function is shared between tests."""
    return (0, cfg.num_hidden_layers - 1)


def _tokens(rng, cfg, n) -> np.ndarray:
    return rng.integers(0, cfg.vocab_size, (B, n)).astype(np.int32)


# ---- logits and taps against the reference --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_taps_match_reference(loaded, rng, name):
    m = loaded(name)
    cfg = m.cfg
    taps = _taps(cfg)
    tokens = _tokens(rng, cfg, T_REF)
    out = prefill_static(m.graphdef, m.state, tokens, m.poisoned_cache(rng), start=0, taps=taps)
    assert out.logits.dtype == jnp.float32 and out.hidden.shape == (B, T_REF, len(taps) * cfg.hidden_size)
    for b in range(B):
        logits, hidden = m.ref(tokens[b])
        assert _rel(out.logits[b], logits) < TOL
        want_hidden = np.concatenate([hidden[t] for t in taps], axis=-1)  # [T, len(taps) * d]
        assert _rel(out.hidden[b], want_hidden) < TOL


# ---- absorbed verify == plain prefill --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["k26_grouped", "fp8_direct_q"])
def test_absorbed_decode_matches_plain_forward(loaded, rng, name):
    """Prefill 2 chunks (plain MLA), then decode one token (absorbed, N = 1): equals the reference at that token.

    Multi-row verify (chain / tree masks) is covered by the tree test below.
    """
    m = loaded(name)
    tokens = _tokens(rng, m.cfg, 2 * CHUNK + 1)
    cache = m.poisoned_cache(rng)
    for c in range(2):
        out = prefill_traced(m.graphdef, m.state, tokens[:, c * CHUNK:(c + 1) * CHUNK], jnp.int32(c * CHUNK), cache)
        cache = out.cache
    start = 2 * CHUNK
    step = verify(m.graphdef, m.state, tokens[:, start:], np.full((B, 1), start), np.full((B,), start),
                  np.ones((B, 1, 1), bool), cache)
    for b in range(B):
        assert _rel(step.logits[b, 0], m.ref(tokens[b])[0][start]) < TOL
    assert _rel(step.cache.stacked()[:, :, :start], cache.stacked()[:, :, :start]) == 0  # prefix rows untouched


def test_chunked_prefill_equals_one_shot(loaded, rng):
    m = loaded("k26_grouped")
    tokens = _tokens(rng, m.cfg, 3 * CHUNK)
    cache0 = m.poisoned_cache(rng)
    cache, logits = cache0, []
    for c in range(3):
        out = prefill_traced(m.graphdef, m.state, tokens[:, c * CHUNK:(c + 1) * CHUNK], jnp.int32(c * CHUNK), cache)
        cache = out.cache
        logits.append(out.logits)
    one = prefill_static(m.graphdef, m.state, tokens, cache0, start=0, taps=_taps(m.cfg))
    assert _rel(jnp.concatenate(logits, axis=1), one.logits) < 1e-5
    n = 3 * CHUNK
    assert _rel(cache.stacked()[:, :, :n], one.cache.stacked()[:, :, :n]) < 1e-5
    np.testing.assert_array_equal(cache.stacked()[:, :, n:], cache0.stacked()[:, :, n:])  # rows past the tokens untouched
    assert _rel(one.logits[0], m.ref(tokens[0])[0]) < TOL


def test_greedy_generation_with_cache_matches_full_forward(loaded, rng):
    m = loaded("k26_grouped")
    seqs = [list(p) for p in _tokens(rng, m.cfg, CHUNK)]
    out = prefill_traced(m.graphdef, m.state, np.asarray(seqs), jnp.int32(0), m.poisoned_cache(rng))
    cache, logits = out.cache, np.asarray(out.logits[:, -1])
    for _ in range(6):
        for b in range(B):
            want = m.ref(seqs[b])[0][-1]
            assert _rel(logits[b], want) < TOL
            assert int(np.argmax(logits[b])) == int(np.argmax(want))
            seqs[b].append(int(np.argmax(logits[b])))
        n = len(seqs[0])
        step = verify(m.graphdef, m.state, np.asarray(seqs)[:, -1:], np.full((B, 1), n - 1), np.full((B,), n - 1),
                      np.ones((B, 1, 1), bool), cache)
        cache, logits = step.cache, np.asarray(step.logits[:, 0])


# ---- tree verify -----------------------------------------------------------------------------------------------
def random_tree(rng, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """parents [n] (root -1, parent < child), depths [n], ancestor-or-self mask [n, n]."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    depths = np.zeros(n, np.int64)
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    return parents, depths, vis


def root_path(parents, i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _tree_inputs(m, rng, n_nodes=7):
    """Prompts of different valid lengths per request (right-padded, prefilled in 2 chunks) and a random tree."""
    starts = np.array([3, 2 * CHUNK - 2])
    prompts = _tokens(rng, m.cfg, 2 * CHUNK)
    cache = m.poisoned_cache(rng)
    for c in range(2):
        cache = prefill_traced(m.graphdef, m.state, prompts[:, c * CHUNK:(c + 1) * CHUNK], jnp.int32(c * CHUNK),
                               cache).cache
    trees = [random_tree(rng, n_nodes) for _ in range(B)]
    tokens = _tokens(rng, m.cfg, n_nodes)
    positions = np.stack([starts[b] + trees[b][1] for b in range(B)])
    mask = np.stack([t[2] for t in trees])
    return starts, prompts, cache, trees, tokens, positions, mask


@pytest.mark.parametrize("name", ["k26_grouped", "fp8_direct_q"])
def test_tree_verify_matches_root_paths(loaded, rng, name):
    """Every node's logits equal a causal forward over prompt + its root path; the written latents are reusable."""
    m = loaded(name)
    starts, prompts, cache, trees, tokens, positions, mask = _tree_inputs(m, rng)
    out = verify(m.graphdef, m.state, tokens, positions, starts, mask, cache, taps=(1,))
    latent = np.array(out.cache.stacked())
    for b in range(B):  # only rows [start_b, start_b + N) are written
        keep = np.ones(S, bool)
        keep[starts[b]:starts[b] + tokens.shape[1]] = False
        np.testing.assert_array_equal(latent[:, b, keep], np.asarray(cache.stacked())[:, b, keep])
    next_tok = _tokens(rng, m.cfg, 1)
    for b in range(B):
        parents = trees[b][0]
        prefix = list(prompts[b, :starts[b]])
        for i in range(len(parents)):
            seq = prefix + [int(tokens[b, j]) for j in root_path(parents, i)]
            want_logits, want_hidden = m.ref(seq)
            assert _rel(out.logits[b, i], want_logits[-1]) < TOL, (b, i)
            assert _rel(out.hidden[b, i], want_hidden[1][-1]) < TOL, (b, i)
        # accept the deepest node's path: compact its rows to [start, start + len(path)), as the engine does
        path = root_path(parents, int(np.argmax(trees[b][1])))
        latent[:, b, starts[b]:starts[b] + len(path)] = latent[:, b, starts[b] + np.asarray(path)]
    new_start = np.array([starts[b] + trees[b][1].max() + 1 for b in range(B)])
    step = verify(m.graphdef, m.state, next_tok, new_start[:, None], new_start, np.ones((B, 1, 1), bool),
                  LatentCache.from_stacked(jnp.asarray(latent)))
    for b in range(B):
        path = root_path(trees[b][0], int(np.argmax(trees[b][1])))
        seq = list(prompts[b, :starts[b]]) + [int(tokens[b, j]) for j in path] + [int(next_tok[b, 0])]
        assert _rel(step.logits[b, 0], m.ref(seq)[0][-1]) < TOL


@pytest.mark.gpu  # interpret mode over the whole model is slow on CPU; tests/test_layers.py checks one layer
def test_pallas_verify_matches_jnp(loaded, rng, interpret):
    pytest.importorskip("pallas_kernels.verify_attn")
    m = loaded("k26_grouped")
    starts, _, cache, _, tokens, positions, mask = _tree_inputs(m, rng)
    want = verify(m.graphdef, m.state, tokens, positions, starts, mask, cache)
    got = verify(m.graphdef, m.state, tokens, positions, starts, mask, cache, use_pallas=True, interpret=interpret)
    assert _rel(got.logits, want.logits) < 1e-4
    np.testing.assert_array_equal(got.cache.latent[0], want.cache.latent[0])  # layer 0 latents precede attention
    assert _rel(got.cache.stacked(), want.cache.stacked()) < 1e-4


# ---- formats ---------------------------------------------------------------------------------------------------
def test_int4_experts_stay_packed_and_match_dequantized_reference(tmp_path, rng):
    m = Loaded(tmp_path, tiny(), "int4", True)
    moe = m.model.layers[1].mlp
    assert moe.gate_packed[...].dtype == jnp.int32 and moe.gate_scale[...].dtype == jnp.bfloat16
    assert moe.gate_packed[...].shape == (m.cfg.n_routed_experts, m.cfg.moe_intermediate_size,
                                          m.cfg.hidden_size // 8)
    tokens = _tokens(rng, m.cfg, T_REF)
    # M * k >= E here, so the dense expert path runs; tests/test_layers.py covers the INT4 gather path.
    out = prefill_static(m.graphdef, m.state, tokens, m.poisoned_cache(rng), start=0, taps=_taps(m.cfg))
    for b in range(B):
        want = m.ref(tokens[b])[0]  # eff = dequantized INT4 experts, bf16 elsewhere
        assert _rel(out.logits[b], want) < TOL


def test_flat_and_wrapped_layouts_give_identical_logits(loaded, tmp_path, rng):
    wrapped = loaded("k26_grouped")
    cfg, fmt, _ = CONFIGS["k26_grouped"]
    flat = Loaded(tmp_path, cfg, fmt, False)
    assert flat.cfg.tensor_prefix != wrapped.cfg.tensor_prefix
    for a, b in zip(jax.tree.leaves(flat.state), jax.tree.leaves(wrapped.state)):
        np.testing.assert_array_equal(a, b)
    tokens = _tokens(rng, cfg, T_REF)
    cache = wrapped.poisoned_cache(rng)
    got = prefill_static(wrapped.graphdef, flat.state, tokens, cache, start=0, taps=_taps(cfg))
    want = prefill_static(wrapped.graphdef, wrapped.state, tokens, cache, start=0, taps=_taps(cfg))
    np.testing.assert_array_equal(got.logits, want.logits)
    assert _rel(got.logits[0], wrapped.ref(tokens[0])[0]) < TOL


def test_bf16_model_stays_close_to_reference(loaded, rng):
    ref_model = loaded("k26_grouped")
    m = Loaded.__new__(Loaded)
    m.__dict__.update(ref_model.__dict__)
    m.model = load_model(ref_model.ckpt, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    m.graphdef, m.state = nnx.split(m.model)
    m.dtype = jnp.bfloat16
    assert m.model.layers[0].attn.q_b[...].dtype == jnp.bfloat16
    tokens = _tokens(rng, m.cfg, T_REF)
    out = prefill_static(m.graphdef, m.state, tokens, m.poisoned_cache(rng), start=0, taps=_taps(m.cfg))
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    assert out.cache.dtype == jnp.bfloat16
    # bf16 noise may flip a near-tied expert choice (routing is discontinuous); one flip early in a sequence moves
    # every later token of it through attention. So require a quarter of the tokens to be close rather than all:
    # a wrong cast or layout breaks every token of every sequence.
    per_token = []
    for b in range(B):
        want = m.ref(tokens[b])[0]
        per_token.extend(np.abs(np.asarray(out.logits[b], np.float64) - want).max(-1) / np.abs(want).max(-1))
    assert np.percentile(per_token, 25) < 3e-2
    assert np.median(per_token) < 0.6


# ---- full-size structure ---------------------------------------------------------------------------------------
def test_kimi_k2_6_abstract_model_has_the_int4_checkpoint_size():
    """Shapes only (nnx.eval_shape): bf16 everywhere except packed INT4 routed experts ≈ the 594 GB K2.6 release."""
    from kdtree_jax.model.config import kimi_k2_6
    from kdtree_jax.model.target import KimiModel

    cfg = kimi_k2_6()
    abstract = nnx.eval_shape(lambda: KimiModel(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                                                expert_format="int4"))
    state = nnx.state(abstract)
    total = sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    assert 590e9 < total < 598e9
    moe = abstract.layers[1].mlp
    assert moe.gate_packed.shape == (384, 2048, 7168 // 8) and moe.down_scale.shape == (384, 7168, 2048 // 32)
    assert abstract.layers[0].attn.w_uk.shape == (64, 128, 512) and abstract.layers[0].attn.o_proj.shape == (
        64, 128, 7168)


# ---- loader errors ---------------------------------------------------------------------------------------------
def test_loader_names_missing_and_misshapen_tensors(loaded):
    m = loaded("k26_grouped")
    weights = dict(m.eff)
    missing = "layers.1.self_attn.kv_b_proj.weight"
    del weights[missing]
    with pytest.raises(WeightError, match=missing):
        params_from_hf(m.cfg, weights.__getitem__)
    weights = dict(m.eff)
    bad = "layers.2.mlp.experts.3.down_proj.weight"
    weights[bad] = weights[bad][:, :-1]
    with pytest.raises(WeightError, match=bad):
        params_from_hf(m.cfg, weights.__getitem__)
