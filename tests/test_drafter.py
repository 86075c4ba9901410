"""DFlash drafter: draft/train forwards against a float64 numpy reference, cache rules, HF layout I/O, config."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from drafter_ref import ref_draft
from flax import nnx

from kdtree_jax.checkpoint.drafter import (
    drafter_from_hf_tensors,
    hf_param_names,
    hf_tensors,
    load_drafter,
    save_drafter,
)
from kdtree_jax.model.config import ConfigError, tiny
from kdtree_jax.model.drafter import DFlashDrafter, DrafterCache, draft, train_logits
from kdtree_jax.model.drafter_config import DrafterConfig, DrafterYarn, default_target_layer_ids

RTOL = 1e-4  # fp32 drafter vs float64 reference, relative to the largest logit
POISON = 1e3  # finite garbage: cache rows past length and ctx padding rows


def tiny_cfg(**overrides) -> DrafterConfig:
    """GQA (4 q / 2 kv heads, head_dim != hidden/heads), sliding layers 0 and 2 (window 5), YaRN with amplitude != 1."""
    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=80, target_layer_ids=(0, 2), mask_token_id=77,
                block_size=4, num_target_layers=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=DrafterYarn(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5),
                max_position_embeddings=256,
                layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=5)
    base.update(overrides)
    return DrafterConfig(**base)


def ref_cfg(cfg: DrafterConfig) -> dict:
    """The config as the numpy reference reads it (plain values, no derived tables)."""
    d = dataclasses.asdict(cfg)
    d["causal"] = [cfg.layer_causal(i) for i in range(cfg.num_hidden_layers)]
    return d


def random_tensors(cfg: DrafterConfig, rng) -> dict[str, np.ndarray]:
    """Fresh z-lab HF tensors: linear weights ~ N(0, 1/in), norm weights ~ 1 + N(0, 0.3)."""
    shapes = {name: param_shape for name, param_shape in _hf_shapes(cfg)}
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        else:
            out[name] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _hf_shapes(cfg: DrafterConfig):
    h, dh = cfg.hidden_size, cfg.head_dim
    hq, hk, inter = cfg.num_attention_heads * dh, cfg.num_key_value_heads * dh, cfg.intermediate_size
    linear = {"fc": (h, cfg.feature_dim), "q_proj": (hq, h), "k_proj": (hk, h), "v_proj": (hk, h), "o_proj": (h, hq),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    for name, _, is_linear in hf_param_names(cfg):
        short = name.split(".")[-2]
        if is_linear:
            yield name, linear[short]
        else:
            yield name, (dh,) if short in ("q_norm", "k_norm") else (h,)


def make_drafter(cfg, tensors, dtype=jnp.float32) -> DFlashDrafter:
    return drafter_from_hf_tensors(cfg, tensors, dtype)


jit_draft = nnx.jit(draft)  # one compile per (config, shapes), shared by the tests
jit_train_logits = nnx.jit(train_logits)


def poisoned_cache(cfg, batch, capacity, rng) -> DrafterCache:
    shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return DrafterCache.from_stacked(jnp.asarray(POISON * rng.standard_normal(shape), jnp.float32),
                                     jnp.asarray(POISON * rng.standard_normal(shape), jnp.float32),
                                     jnp.zeros((batch,), jnp.int32))


def padded_ctx(rows: list[np.ndarray], width: int, feat: int, rng) -> np.ndarray:
    """Stack ragged [n_b, F] row blocks into [Bt, width, F]; the padding is large garbage."""
    out = POISON * rng.standard_normal((len(rows), width, feat)).astype(np.float32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out


def assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < rtol, f"relative error {err:.3e} >= {rtol}"


@pytest.fixture
def setup(rng):
    def build(**overrides):
        cfg = tiny_cfg(**overrides)
        tensors = random_tensors(cfg, rng)
        embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
        head = (rng.standard_normal((cfg.hidden_size, cfg.vocab_size)) / np.sqrt(cfg.hidden_size)).astype(np.float32)
        return cfg, tensors, embed, head

    return build


@pytest.mark.parametrize("amp_mode,sliding_causal", [("hf", False), ("legacy", False), ("hf", True)])
def test_draft_matches_reference_two_rounds(setup, rng, amp_mode, sliding_causal):
    cfg, tensors, embed, head = setup(yarn_amplitude=amp_mode, sliding_causal=sliding_causal)
    drafter = make_drafter(cfg, tensors)

    def run(*args):
        return jit_draft(drafter, *args)
    bt, cap, f = 3, 24, cfg.feature_dim
    n1, n2 = np.array([4, 0, 9]), np.array([5, 2, 4])  # request 1 drafts with an empty cache in round 1
    hist = [rng.standard_normal((n1[b] + n2[b], f)).astype(np.float32) for b in range(bt)]
    bonus1, bonus2 = rng.integers(0, cfg.vocab_size, bt), rng.integers(0, cfg.vocab_size, bt)
    cache0 = poisoned_cache(cfg, bt, cap, rng)

    ctx1 = padded_ctx([hist[b][: n1[b]] for b in range(bt)], 9, f, rng)
    logits1, cache1 = run(cache0, jnp.asarray(ctx1), jnp.asarray(n1), jnp.asarray(bonus1), embed, head)
    ctx2 = padded_ctx([hist[b][n1[b]:] for b in range(bt)], 9, f, rng)  # same width: one compile
    logits2, cache2 = run(cache1, jnp.asarray(ctx2), jnp.asarray(n2), jnp.asarray(bonus2), embed, head)

    assert logits1.dtype == jnp.float32 and logits1.shape == (bt, cfg.block_size - 1, cfg.vocab_size)
    np.testing.assert_array_equal(cache1.length, n1)
    np.testing.assert_array_equal(cache2.length, n1 + n2)
    for b in range(bt):
        assert_close(logits1[b], ref_draft(ref_cfg(cfg), tensors, hist[b][: n1[b]], bonus1[b], embed, head,
                                           amp_mode=amp_mode))
        assert_close(logits2[b], ref_draft(ref_cfg(cfg), tensors, hist[b], bonus2[b], embed, head, amp_mode=amp_mode))
        # neither padding rows nor block K/V were written: rows past the committed length keep the poison
        end = n1[b] + n2[b]
        np.testing.assert_array_equal(np.stack(cache2.k)[:, b, :, end:], np.stack(cache0.k)[:, b, :, end:])
        np.testing.assert_array_equal(np.stack(cache2.v)[:, b, :, end:], np.stack(cache0.v)[:, b, :, end:])


def test_two_calls_equal_one_call(setup, rng):
    cfg, tensors, embed, head = setup()
    drafter = make_drafter(cfg, tensors)

    def run(*args):
        return jit_draft(drafter, *args)
    bt, cap, f = 3, 20, cfg.feature_dim
    n1, n2 = np.array([3, 6, 1]), np.array([2, 1, 7])
    hist = [rng.standard_normal((n1[b] + n2[b], f)).astype(np.float32) for b in range(bt)]
    bonus = jnp.asarray(rng.integers(0, cfg.vocab_size, bt))
    cache0 = DrafterCache.zeros(cfg, bt, cap, jnp.float32)

    _, c1 = run(cache0, jnp.asarray(padded_ctx([h[: n] for h, n in zip(hist, n1)], 8, f, rng)), jnp.asarray(n1),
                bonus, embed, head)
    two, c2 = run(c1, jnp.asarray(padded_ctx([h[n:] for h, n in zip(hist, n1)], 8, f, rng)), jnp.asarray(n2),
                  bonus, embed, head)
    one, c_one = run(cache0, jnp.asarray(padded_ctx(hist, 8, f, rng)), jnp.asarray(n1 + n2), bonus, embed, head)

    assert_close(two, one, rtol=1e-5)
    np.testing.assert_array_equal(c2.length, c_one.length)
    for b in range(bt):
        n = n1[b] + n2[b]
        np.testing.assert_allclose(np.stack(c2.k)[:, b, :, :n], np.stack(c_one.k)[:, b, :, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.stack(c2.v)[:, b, :, :n], np.stack(c_one.v)[:, b, :, :n], rtol=1e-5, atol=1e-5)


def test_padding_rows_do_not_matter(setup, rng):
    cfg, tensors, embed, head = setup()
    drafter = make_drafter(cfg, tensors)
    bt, c, f = 2, 6, cfg.feature_dim
    n_ctx = jnp.asarray([2, 5])
    bonus = jnp.asarray(rng.integers(0, cfg.vocab_size, bt))
    real = rng.standard_normal((bt, c, f)).astype(np.float32)
    cache = DrafterCache.zeros(cfg, bt, 16, jnp.float32)
    outs = []
    for scale in (1.0, -300.0):
        ctx = real.copy()
        for b in range(bt):
            ctx[b, int(n_ctx[b]):] = scale * rng.standard_normal((c - int(n_ctx[b]), f))
        outs.append(jit_draft(drafter, cache, jnp.asarray(ctx), n_ctx, bonus, embed, head))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1].k, outs[1][1].k)
    np.testing.assert_array_equal(outs[0][1].v, outs[1][1].v)
    assert not np.any(np.stack(outs[0][1].k)[:, 0, :, 2:])  # padding rows of request 0 were never written


@pytest.mark.parametrize("sliding_causal", [False, True])
def test_train_logits_equal_draft(setup, rng, sliding_causal):
    cfg, tensors, embed, head = setup(sliding_causal=sliding_causal)
    drafter = make_drafter(cfg, tensors)
    bt, t, n_blocks = 2, 14, 3
    hidden = rng.standard_normal((bt, t, cfg.feature_dim)).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab_size, (bt, t))
    anchors = np.stack([np.sort(rng.choice(t, n_blocks, replace=False)) for _ in range(bt)])
    anchors[0, 0] = 0  # a block with no visible context at all
    got = jit_train_logits(drafter, hidden, tokens, anchors, embed, head)
    assert got.shape == (bt, n_blocks, cfg.block_size - 1, cfg.vocab_size)
    cache = DrafterCache.zeros(cfg, bt, t, jnp.float32)
    for j in range(n_blocks):
        a = anchors[:, j]
        want, _ = jit_draft(drafter, cache, jnp.asarray(hidden), jnp.asarray(a), jnp.asarray(tokens[np.arange(bt), a]),
                        embed, head)
        assert_close(got[:, j], want, rtol=1e-5)
    assert_close(got[1, 2], ref_draft(ref_cfg(cfg), tensors, hidden[1, : anchors[1, 2]], tokens[1, anchors[1, 2]],
                                      embed, head))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_round_trip(setup, rng, tmp_path, dtype):
    cfg, tensors, embed, head = setup()
    drafter = make_drafter(cfg, tensors, dtype)
    path = tmp_path / "drafter"
    save_drafter(drafter, cfg, path)
    save_drafter(drafter, cfg, path)  # overwriting an existing dir is atomic too
    assert sorted(os.listdir(tmp_path)) == ["drafter"]  # no temp dirs left behind
    loaded = load_drafter(path, dtype)
    assert loaded.cfg == cfg
    for name, value in hf_tensors(drafter).items():
        np.testing.assert_array_equal(hf_tensors(loaded)[name], value, err_msg=name)
    bt = 2
    ctx = jnp.asarray(rng.standard_normal((bt, 5, cfg.feature_dim)), dtype)
    args = (ctx, jnp.asarray([5, 3]), jnp.asarray(rng.integers(0, cfg.vocab_size, bt)), jnp.asarray(embed, dtype),
            jnp.asarray(head, dtype))
    cache = DrafterCache.zeros(cfg, bt, 12, dtype)
    got = jit_draft(loaded, cache, *args)[0]
    np.testing.assert_array_equal(jit_draft(drafter, cache, *args)[0], got)
    if dtype == jnp.float32:
        assert_close(got[1],
                     ref_draft(ref_cfg(cfg), tensors, np.asarray(ctx[1, :3]), int(args[2][1]), embed, head))


def test_load_errors_name_tensor_and_file(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg, tensors, _, _ = setup()
    path = tmp_path / "d"
    save_drafter(make_drafter(cfg, tensors), cfg, path)
    file = path / "model.safetensors"
    saved = load_file(file)
    broken = dict(saved)
    del broken["layers.1.self_attn.k_norm.weight"]
    save_file(broken, file)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_norm\.weight.*missing") as e:
        load_drafter(path, jnp.float32)
    assert str(path) in str(e.value)
    broken = dict(saved)
    broken["layers.2.mlp.up_proj.weight"] = saved["layers.2.mlp.up_proj.weight"].T.copy()
    save_file(broken, file)
    with pytest.raises(ValueError, match=r"model\.safetensors: drafter tensor .layers\.2\.mlp\.up_proj\.weight. has"):
        load_drafter(path, jnp.float32)


KIMI_K25_DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 6,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 163840,
    "num_target_layers": 61,
    "block_size": 8,
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
    "max_position_embeddings": 262144,
    "rope_theta": 50000,
    "rope_scaling": {"rope_type": "yarn", "factor": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1,
                     "mscale_all_dim": 1, "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_kimi_k25_drafter_config(tmp_path):
    cfg = DrafterConfig.from_hf_dict(KIMI_K25_DRAFTER)
    assert (cfg.block_size, cfg.depth, cfg.mask_token_id) == (8, 7, 163838)
    assert cfg.target_layer_ids == (1, 12, 24, 35, 47, 58)
    assert cfg.feature_dim == 6 * 7168
    assert not any(cfg.is_sliding(i) for i in range(6))
    assert cfg.rope_amplitude == pytest.approx(1.0)
    legacy = DrafterConfig.from_hf_dict(KIMI_K25_DRAFTER, yarn_amplitude="legacy")
    assert legacy.rope_amplitude == pytest.approx(0.1 * np.log(64) + 1) and legacy.rope_amplitude ** 2 > 2.0
    target = tiny(hidden_size=7168, vocab_size=163840, num_hidden_layers=61)
    cfg.check_compatible(target)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert DrafterConfig.from_json(tmp_path) == cfg
    v5 = {k: v for k, v in KIMI_K25_DRAFTER.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(KIMI_K25_DRAFTER["rope_scaling"], rope_theta=50000)  # transformers v5 layout
    assert DrafterConfig.from_hf_dict(v5) == cfg
    # K2.6-style per-layer sliding windows
    k26 = dict(KIMI_K25_DRAFTER, layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=2048)
    cfg26 = DrafterConfig.from_hf_dict(k26)
    assert [cfg26.window(i) for i in range(6)] == [2048] * 5 + [None]


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(61, 6) == (1, 12, 24, 35, 47, 58)
    assert default_target_layer_ids(36, 1) == (18,)
    raw = dict(KIMI_K25_DRAFTER, num_hidden_layers=5, num_target_layers=36, dflash_config={"mask_token_id": 7})
    assert DrafterConfig.from_hf_dict(raw).target_layer_ids == (1, 9, 17, 25, 33)
    assert DrafterConfig.from_hf_dict({k: v for k, v in raw.items() if k != "block_size"}).block_size == 16


def test_incompatible_drafter_is_rejected():
    cfg = tiny_cfg(hidden_size=64, vocab_size=256, target_layer_ids=(0, 2), num_target_layers=3)
    target = tiny()  # hidden 64, vocab 256, 3 layers
    cfg.check_compatible(target)
    with pytest.raises(ConfigError, match="hidden_size"):
        dataclasses.replace(cfg, hidden_size=32).check_compatible(target)
    with pytest.raises(ConfigError, match="vocab_size"):
        dataclasses.replace(cfg, vocab_size=300, mask_token_id=5).check_compatible(target)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        dataclasses.replace(cfg, target_layer_ids=(0, 3), num_target_layers=None).check_compatible(target)
    with pytest.raises(ConfigError, match="num_target_layers"):
        dataclasses.replace(cfg, num_target_layers=61).check_compatible(target)


def test_config_errors_name_the_field():
    for field, value, pattern in [("mask_token_id", None, "mask_token_id is missing"),
                                  ("hidden_size", "big", "hidden_size must be an integer"),
                                  ("layer_types", ["sliding_attention"], "layer_types has 1 entries")]:
        raw = json.loads(json.dumps(KIMI_K25_DRAFTER))
        if field == "mask_token_id":
            del raw["dflash_config"]["mask_token_id"]
        else:
            raw[field] = value
        with pytest.raises(ConfigError, match=pattern):
            DrafterConfig.from_hf_dict(raw, source="drafter/config.json")
    with pytest.raises(ConfigError, match="rope_scaling.factor"):
        DrafterConfig.from_hf_dict(dict(KIMI_K25_DRAFTER, rope_scaling={"rope_type": "yarn",
                                                                         "original_max_position_embeddings": 4096}))
    with pytest.raises(ConfigError, match="yarn_amplitude"):
        DrafterConfig.from_hf_dict(KIMI_K25_DRAFTER, yarn_amplitude="vllm")


def _v5_drafter() -> dict:
    """KIMI_K25_DRAFTER with its rope keys as transformers >= 5 writes them (rope_theta inside rope_parameters)."""
    raw = {k: v for k, v in copy.deepcopy(KIMI_K25_DRAFTER).items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = dict(KIMI_K25_DRAFTER["rope_scaling"], rope_theta=KIMI_K25_DRAFTER["rope_theta"])
    return raw


def test_drafter_rope_forms_read_alike_and_must_agree():
    legacy = DrafterConfig.from_hf_dict(KIMI_K25_DRAFTER)
    new = DrafterConfig.from_hf_dict(_v5_drafter())
    assert new == legacy and new.rope_theta == 50000.0 and new.rope_scaling.factor == 64.0
    np.testing.assert_array_equal(new.inv_freq, legacy.inv_freq)
    both = dict(_v5_drafter(), rope_theta=50000, rope_scaling=KIMI_K25_DRAFTER["rope_scaling"])  # agreeing: fine
    assert DrafterConfig.from_hf_dict(both) == legacy
    src = "drafter/config.json"
    with pytest.raises(ConfigError, match=re.escape(f"{src}: rope_parameters.rope_theta (50000) and rope_theta "
                                                    "(1000000.0) disagree")):
        DrafterConfig.from_hf_dict(dict(_v5_drafter(), rope_theta=1000000.0), source=src)
    other = dict(KIMI_K25_DRAFTER["rope_scaling"], factor=32)
    with pytest.raises(ConfigError, match=re.escape(f"{src}: rope_parameters (factor 64.0, ") + ".*"
                       + re.escape(") and rope_scaling (factor 32.0, ") + ".*disagree"):
        DrafterConfig.from_hf_dict(dict(_v5_drafter(), rope_scaling=other), source=src)
    plain = dict(_v5_drafter(), rope_parameters={"rope_type": "default", "rope_theta": 50000})
    assert DrafterConfig.from_hf_dict(plain).rope_scaling is None
    with pytest.raises(ConfigError, match=re.escape(f"{src}: rope_parameters (plain RoPE) and rope_scaling (")):
        DrafterConfig.from_hf_dict(dict(plain, rope_scaling=KIMI_K25_DRAFTER["rope_scaling"]), source=src)


@pytest.mark.parametrize("edit,pattern", [
    ({"rope_type": "llama3"}, "rope_parameters.rope_type 'llama3' is not supported"),
    ({"rope_type": None, "type": "dynamic"}, "rope_parameters.type 'dynamic' is not supported"),
    ({"rope_type": None}, r"rope_parameters.rope_type is missing but the object holds \['beta_fast'"),
    ({"type": "default"}, "rope_parameters.rope_type 'yarn' disagrees with its type 'default'"),
    ({"rope_type": "default"}, r"rope_parameters.rope_type is 'default' \(plain RoPE\) but the object sets"),
    ({"factor": None}, "rope_parameters.factor is missing"),
    ({"original_max_position_embeddings": 4096.5}, "rope_parameters.original_max_position_embeddings must be a "
                                                   "positive integer"),
    ({"low_freq_factor": 1.0}, r"rope_parameters has fields \['low_freq_factor'\] that are not supported"),
    ({"partial_rotary_factor": 0.5}, "rope_parameters.partial_rotary_factor 0.5 is not supported"),
    ({"rope_theta": "1e6"}, "rope_parameters.rope_theta must be a number"),
])
def test_drafter_rope_parameters_errors_name_the_field(edit, pattern):
    raw = _v5_drafter()
    for key, value in edit.items():
        if value is None:
            raw["rope_parameters"].pop(key, None)
        else:
            raw["rope_parameters"][key] = value
    with pytest.raises(ConfigError, match=re.escape("drafter/config.json: ") + pattern):
        DrafterConfig.from_hf_dict(raw, source="drafter/config.json")


def test_drafter_without_rope_theta_is_refused():
    """transformers' Qwen3Config defaults the base to 10000 and Qwen3 checkpoints use 1e6: never guessed."""
    raw = {k: v for k, v in KIMI_K25_DRAFTER.items() if k not in ("rope_theta", "rope_scaling")}
    with pytest.raises(ConfigError, match=re.escape("drafter/config.json: rope_parameters is missing (and so is the "
                                                    "legacy rope_theta)")):
        DrafterConfig.from_hf_dict(raw, source="drafter/config.json")
    raw["rope_parameters"] = {"rope_type": "default"}
    with pytest.raises(ConfigError, match="rope_theta is unknown"):
        DrafterConfig.from_hf_dict(raw, source="drafter/config.json")
