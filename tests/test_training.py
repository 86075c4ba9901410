"""Training utilities and the two training scripts at toy scale (CPU): the target run lowers the loss and its HF
export reloads to the same logits; the drafter loss falls and its z-lab export reloads to the same logits; the
aux-loss-free bias rule moves the router toward balance; the DFlash block helpers match numpy."""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from script_loader import load_script

from kdtree_jax import train as T
from kdtree_jax.checkpoint.drafter import drafter_from_hf_tensors, hf_tensors, load_drafter, save_drafter
from kdtree_jax.checkpoint.hf import HFCheckpoint
from kdtree_jax.checkpoint.tokenizer import KimiTokenizer
from kdtree_jax.checkpoint.weights import load_model, params_from_hf
from kdtree_jax.model.config import tiny
from kdtree_jax.model.drafter import DFlashDrafter, train_logits
from kdtree_jax.model.drafter_config import DrafterConfig
from kdtree_jax.model.target import LatentCache, forward_prefill

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "checkpoints", "kdtree-mini", "tokenizer")
WORDS = ("def", "return", "self", "import", "class", "value", "for", "in", "if", "else", "None", "print")


def _script(name: str):
    return load_script(f"scripts/{name}.py", f"kdtree_scripts_{name}")


def _write_corpus(path: str, rng: np.random.Generator) -> None:
    """A small learnable corpus: random lines over a 12-word vocabulary."""
    os.makedirs(path, exist_ok=True)
    for split, n_lines in (("train", 1500), ("heldout", 150)):
        lines = (" ".join(rng.choice(WORDS, size=rng.integers(3, 9))) for _ in range(n_lines))
        with open(os.path.join(path, f"{split}.txt"), "w") as f:
            f.write("\n".join(lines))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({"python_version": "test", "outputs": {}}, f)


@functools.partial(jax.jit, static_argnums=0)
def _prefill_jit(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    return forward_prefill(model, tokens, 0, LatentCache.zeros(model.cfg, *tokens.shape, model.cache_dtype)).logits


def _prefill_logits(model, tokens: np.ndarray) -> np.ndarray:
    """Jitted (compiled once per model structure): eager op-by-op dispatch is slower on CPU."""
    return np.asarray(_prefill_jit(*nnx.split(model), jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def target_run(tmp_path_factory):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    tmp = tmp_path_factory.mktemp("target")
    _write_corpus(str(tmp / "corpus"), rng)
    tt = _script("train_target")
    cfg = dataclasses.replace(tt.TargetTrainConfig(), **tt.TINY)
    cfg = dataclasses.replace(cfg, steps=15, seq_len=32, batch_size=8, lr=1e-2, corpus=str(tmp / "corpus"),
                              tokenizer=TOKENIZER_DIR, out=str(tmp / "target"), log_dir=str(tmp / "logs"),
                              eval_windows=4, eval_batch=4, max_train_seconds=1e9, deterministic=False)
    result = tt.run(cfg)
    return tt, cfg, result


@pytest.mark.heavy
def test_target_training_lowers_loss_on_a_fixed_batch(target_run):
    tt, cfg, result = target_run
    tok = KimiTokenizer.from_dir(TOKENIZER_DIR)
    tokens = T.load_tokens(os.path.join(cfg.corpus, "train.txt"), tok, TOKENIZER_DIR)
    batch = jnp.asarray(T.PackedBatches(tokens, cfg.seq_len + 1, 4, seed=123).next())
    init = T.init_target(result["model"].cfg, cfg.seed)

    @functools.partial(jax.jit, static_argnums=0)
    def loss_jit(graphdef, state):
        logits = T.target_forward(nnx.merge(graphdef, state), batch[:, :-1]).logits
        return T.token_nll(logits, batch[:, 1:]).mean()

    def loss(model):
        return float(loss_jit(*nnx.split(model)))

    before, after = loss(init), loss(result["model"])
    assert after < before - 1.0, (before, after)
    m = result["metrics"]
    assert np.isfinite(m["heldout_loss"]) and m["heldout_loss"] < m["unigram_loss"] + 1.0
    curve = json.load(open(result["paths"]["curve_json"]))["records"]
    assert curve[-1]["loss"] < curve[0]["loss"]


@pytest.mark.heavy
def test_target_hf_export_reloads_with_identical_logits(target_run, rng):
    _, cfg, result = target_run
    trained = result["model"]
    with HFCheckpoint.open(cfg.out) as ckpt:
        assert ckpt.config == trained.cfg
        loaded = load_model(ckpt, param_dtype=jnp.float32, dtype=jnp.float32)
    tokens = rng.integers(0, trained.cfg.vocab_size, size=(2, 24))
    want = _prefill_logits(T.round_params_bf16(trained), tokens)  # what a bf16 checkpoint can hold
    np.testing.assert_allclose(_prefill_logits(loaded, tokens), want, rtol=1e-5, atol=1e-5)
    # the reference really is the trained model at bf16 precision: each param within bf16 rounding of it
    # (a logits bound would be seed-dependent: one flipped expert choice moves a token's logits far)
    rounded = nnx.to_pure_dict(nnx.state(T.round_params_bf16(trained)))
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(trained))),
                                 jax.tree_util.tree_leaves_with_path(rounded)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(b, a, rtol=2.0**-8, atol=0, err_msg=str(path))
    assert os.path.isfile(os.path.join(cfg.out, "tiktoken.model"))


def test_hf_tensor_export_inverts_params_from_hf(rng):
    cfg = tiny()
    model = T.init_target(cfg, int(rng.integers(1 << 30)))
    state = nnx.state(model)
    state = jax.tree.map(lambda x: x + jnp.asarray(rng.standard_normal(x.shape), x.dtype), state)  # no unit norms
    nnx.update(model, state)
    back = params_from_hf(cfg, T.hf_tensors_from_model(model).__getitem__)
    want = nnx.to_pure_dict(nnx.state(model))
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_target_forward_matches_forward_prefill(rng):
    cfg = tiny(num_hidden_layers=2)
    model = T.init_target(cfg, int(rng.integers(1 << 30)))
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 16))
    taps = (1, 0)
    out = T.target_forward(model, jnp.asarray(tokens), taps=taps)
    cache = LatentCache.zeros(cfg, 2, 16, model.cache_dtype)
    ref = forward_prefill(model, jnp.asarray(tokens), 0, cache, taps=taps)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(ref.hidden), rtol=1e-5, atol=1e-5)
    n_moe = len(T.moe_layers(cfg))
    np.testing.assert_array_equal(np.asarray(out.loads).sum(-1), [tokens.size * cfg.num_experts_per_tok] * n_moe)


def test_aux_free_bias_update_rule_and_balance(rng):
    bias = rng.standard_normal(8).astype(np.float32)
    load = rng.integers(0, 50, size=8).astype(np.float32)
    rate = 0.01
    got = np.asarray(T.aux_free_bias_update(jnp.asarray(bias), jnp.asarray(load), rate))
    np.testing.assert_allclose(got, bias + rate * np.sign(load.mean() - load), rtol=1e-6)

    # On a skewed router, repeated updates (inputs fixed) must even out the expert loads.
    cfg = tiny(n_group=1, topk_group=1)
    model = T.init_target(cfg, int(rng.integers(1 << 30)))
    moe = model.layers[cfg.first_k_dense_replace].mlp
    moe.bias[...] = jnp.asarray(np.linspace(0.0, 1.0, cfg.n_routed_experts), jnp.float32)  # favour high ids
    x = jnp.asarray(rng.standard_normal((512, cfg.hidden_size)), jnp.float32)

    def imbalance() -> float:
        load = np.asarray(T.expert_load(moe, x))
        return float(load.max() / load.mean())

    start = imbalance()
    for _ in range(150):
        moe.bias[...] = T.aux_free_bias_update(moe.bias[...], T.expert_load(moe, x), 0.01)
    assert imbalance() < start - 0.3, (start, imbalance())


@pytest.mark.heavy
def test_router_bias_moves_only_by_the_rule_during_training(target_run):
    """The bias starts at 0 and is frozen in AdamW (no step, no decay), so after n steps every entry must be an
    integer multiple of the rule's rate, at most n of them, and it must have moved."""
    _, cfg, result = target_run
    model = result["model"]
    labels = T.param_labels(nnx.state(model))
    for layer in T.moe_layers(model.cfg):
        assert labels["layers"][layer]["mlp"]["bias"] == T.FROZEN
        assert labels["layers"][layer]["mlp"]["router"] == T.DECAY
        assert labels["layers"][layer]["post_norm"] == T.NO_DECAY
        units = np.asarray(model.layers[layer].mlp.bias[...]) / cfg.bias_update_rate
        np.testing.assert_allclose(units, np.round(units), atol=1e-3)
        assert np.abs(units).max() <= result["metrics"]["steps_done"] + 1e-3 and np.abs(units).sum() > 0


def test_dflash_block_helpers_match_numpy(rng):
    b, t, v, L, n = 2, 40, 11, 8, 5
    tokens = rng.integers(0, v, size=(b, t))
    logits = rng.standard_normal((b, t, v)).astype(np.float32)
    anchors = T.sample_anchors(rng, np.array([1, 20]), t - L, n)
    assert anchors.shape == (b, n) and anchors[1].min() >= 20 and anchors.max() <= t - L
    assert all(len(set(row)) == n for row in anchors)
    labels = np.asarray(T.block_labels(jnp.asarray(tokens), jnp.asarray(anchors), L))
    tl = np.asarray(T.block_target_logits(jnp.asarray(logits), jnp.asarray(anchors), L))
    for i in range(b):
        for j, a in enumerate(anchors[i]):
            np.testing.assert_array_equal(labels[i, j], tokens[i, a + 1: a + L])
            np.testing.assert_array_equal(tl[i, j], logits[i, a: a + L - 1])
    w = T.dflash_position_weights(L, 4.0)
    np.testing.assert_allclose(w, [np.exp(-(k - 1) / 4.0) for k in range(1, L)], rtol=1e-6)
    draft = rng.standard_normal((b, n, L - 1, v)).astype(np.float32)
    loss, m = T.dflash_loss(jnp.asarray(draft), jnp.asarray(labels), jnp.asarray(w), jnp.asarray(tl), 0.5)
    lq = draft - np.log(np.exp(draft).sum(-1, keepdims=True))
    lp = tl - np.log(np.exp(tl).sum(-1, keepdims=True))
    ce_k = -np.take_along_axis(lq, labels[..., None], -1)[..., 0].mean((0, 1))
    kl_k = (np.exp(lp) * (lp - lq)).sum(-1).mean((0, 1))
    wn = w / w.sum()
    np.testing.assert_allclose(float(loss), (ce_k * wn).sum() + 0.5 * (kl_k * wn).sum(), rtol=1e-4)
    ids = rng.integers(0, 3, size=(50, L - 1))
    lab = rng.integers(0, 3, size=(50, L - 1))
    want = [1 + next((k for k in range(L - 1) if ids[r, k] != lab[r, k]), L - 1) for r in range(50)]
    np.testing.assert_array_equal(T.chain_acceptance(ids, lab), want)


def test_chain_walk_starts_each_block_where_the_last_accepted_tokens_end():
    taus = np.array([3, 1, 1, 2, 5, 1, 4, 1])
    assert T.chain_walk(taus, 0) == [3, 2, 1, 4]  # anchors 0, 3, 5, 6; the last round runs past the end
    assert T.chain_walk(taus, 1) == [1, 1, 2, 1, 4]
    assert T.chain_walk(taus, 8) == []
    seqs = np.zeros((1, 40), np.int32)
    for stride, walk_from in ((2, 10), (1, 8)):  # a walk needs every anchor, from a position at or after lo
        with pytest.raises(ValueError, match=f"stride={stride}, lo=9, walk_from={walk_from}"):
            T.drafter_agreement(None, None, seqs, 9, stride, 1, walk_from=walk_from)


@pytest.mark.heavy
def test_drafter_training_lowers_loss_and_export_reloads(tmp_path, rng):
    td = _script("train_drafter")
    tcfg = tiny(num_hidden_layers=2)
    target = T.init_target(tcfg, int(rng.integers(1 << 30)))
    L = 8
    dcfg = DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=tcfg.vocab_size,
                         target_layer_ids=(1,), mask_token_id=tcfg.vocab_size - 2, block_size=L,
                         num_target_layers=tcfg.num_hidden_layers, max_position_embeddings=512)
    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    dgraph, dstate = nnx.split(drafter)
    tgraph, tstate = nnx.split(target)
    tx = T.make_optimizer(T.OptimConfig(lr=1e-2, warmup_steps=1, total_steps=30, weight_decay=0.0, grad_clip=1.0,
                                        min_lr_ratio=1.0), dstate)
    opt_state = tx.init(dstate)
    step = td.make_step(dgraph, tgraph, tx, T.dflash_position_weights(L, 4.0), 0.5, dcfg.target_layer_ids, L)
    period = rng.integers(0, tcfg.vocab_size, size=7)  # a periodic sequence: learnable from context
    tokens = jnp.asarray(np.stack([np.roll(np.tile(period, 6), s)[:40] for s in (0, 3)]))
    anchors = jnp.asarray(T.sample_anchors(rng, np.array([1, 1]), 40 - L, 6))
    losses = []
    for _ in range(15):
        dstate, opt_state, m = step(dstate, opt_state, tstate, tokens, anchors)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 1.0, losses

    trained = nnx.merge(dgraph, dstate)
    bf16 = {k: v.astype(T.BF16) for k, v in hf_tensors(trained).items()}
    save_drafter(drafter_from_hf_tensors(dcfg, bf16, jnp.bfloat16), dcfg, tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter", jnp.float32)
    in_memory = drafter_from_hf_tensors(dcfg, bf16, jnp.float32)
    @functools.partial(jax.jit, static_argnums=0)
    def logits_jit(dgraph, dstate):
        hidden = forward_prefill(target, tokens, 0, LatentCache.zeros(tcfg, 2, 40, target.cache_dtype),
                                 taps=dcfg.target_layer_ids).hidden
        return train_logits(nnx.merge(dgraph, dstate), hidden, tokens, anchors, target.embed_table(),
                            target.lm_head_table())

    def logits(d):
        return np.asarray(logits_jit(*nnx.split(d)))

    np.testing.assert_array_equal(logits(loaded), logits(in_memory))
    np.testing.assert_allclose(logits(in_memory), logits(trained), atol=0.1)
    assert loaded.cfg.to_hf_dict() == dcfg.to_hf_dict()


def test_greedy_continue_matches_argmax_reforward(rng):
    cfg = tiny(num_hidden_layers=2)
    model = T.init_target(cfg, int(rng.integers(1 << 30)))
    p, n_new = 5, 6
    prompts = rng.integers(0, cfg.vocab_size, size=(3, p))
    seqs = T.greedy_continue(model, prompts, n_new, batch=2)  # 2 calls, the last one padded
    assert seqs.shape == (3, p + n_new)
    np.testing.assert_array_equal(seqs[:, :p], prompts)
    # causal: one plain forward over the result gives, at row i, the logits for token i + 1 given seqs[:, :i + 1]
    ref = _prefill_logits(model, seqs)[:, p - 1: -1].argmax(-1)
    np.testing.assert_array_equal(seqs[:, p:], ref)
