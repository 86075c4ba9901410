"""Cross-check against transformers' DeepseekV3ForCausalLM on checkpoints that transformers itself saved.

Runs only where torch + transformers are installed (marker `torch`; the GPU machine has them). Each checkpoint is
made the way a user's would be: a DeepseekV3ForCausalLM built from a config, given random weights, then written by
the installed transformers' own `save_pretrained`, so whatever config.json layout that version writes
(`rope_parameters` + `rope_interleave` in transformers >= 5, `rope_theta` + `rope_scaling` before) is what our
reader parses. Two checks on those files:
- the float64 reference forward (read through `HFCheckpoint`) equals the transformers model's logits and hidden
  states, and the config we parse gives transformers' own inv_freq, cos/sin amplitude and softmax scale;
- greedy AR tokens of `Engine` (float32) equal `generate(do_sample=False)` of transformers, in the flat layout and
  in the Kimi K2.6 wrapper (`text_config` = the config.json transformers wrote, INT4 pack-quantized routed experts).

Version hazards, each handled where it arises:
- transformers 4.5x derives the YaRN factor as max_position_embeddings / original_max_position_embeddings, so the
  configs set max_position_embeddings = factor * original.
- routed experts: ModuleList of per-expert Linears (4.x) or fused `experts.gate_up_proj` / `experts.down_proj`
  (5.x). The state dict is filled by key and shape; moe_intermediate_size is chosen so 2I != hidden, which keeps
  the fused orientation unambiguous.
- hidden_states[-1] is post-final-norm in HF, so only layers 0..L-2 are compared as hidden states.
All configs route with sigmoid: transformers' DeepseekV3 has no softmax routing.
"""
import copy
import dataclasses
import inspect
import json

import numpy as np
import pytest

from kdtree_jax.checkpoint.hf import HFCheckpoint
from kdtree_jax.checkpoint.synthetic import synthetic_config, write_synthetic_checkpoint
from kdtree_jax.model.config import ModelConfig, RopeScaling, tiny
from kdtree_jax.model.hf_config import config_from_json
from kdtree_jax.oracles.reference import reference_forward, reference_weights, softmax_scale, yarn_inv_freq

REL_TOL = 1e-4
T = 12
N_PROMPTS = 3
PROMPT_LENS = (5, 9, 14)
NEW_TOKENS = 16
K26_TEXT_PREFIX = "language_model."


def _yarn(factor: float, original: int, **kw) -> RopeScaling:
    return RopeScaling(factor=factor, original_max_position_embeddings=original, **kw)


def _fit_positions(cfg: ModelConfig) -> ModelConfig:
    """max_position_embeddings = factor * original (transformers 4.5x takes the YaRN factor from that ratio)."""
    rs = cfg.rope_scaling
    if rs.factor == 1.0:
        return cfg
    return dataclasses.replace(cfg, max_position_embeddings=int(rs.factor * rs.original_max_position_embeddings))


# moe_intermediate_size 48: 2I = 96 != hidden 64, so the fused-expert orientation is unambiguous. No stop token, so
# every greedy request runs its full length in both engines.
CONFIGS = {name: _fit_positions(cfg) for name, cfg in {
    # q_lora, n_group 4 / topk_group 2, one dense layer, YaRN factor 8 with mscale == mscale_all_dim
    "tiny": tiny(moe_intermediate_size=48, eos_token_id=()),
    # direct q_proj, n_group 2 / topk_group 1, no dense layer, mscale != mscale_all_dim: cos/sin amplitude != 1
    "direct_q": tiny(moe_intermediate_size=48, q_lora_rank=None, n_group=2, topk_group=1, first_k_dense_replace=0,
                     eos_token_id=(), rope_scaling=_yarn(4.0, 256, beta_fast=16.0, beta_slow=2.0, mscale=0.8,
                                                         mscale_all_dim=1.2)),
}.items()}
# The K2.6 wrapper with INT4 routed experts (group 32: moe_intermediate_size 96 is a multiple, and 2I != hidden).
K26_CONFIGS = {name: _fit_positions(cfg) for name, cfg in {
    # K2.6 routing (one group) and YaRN amplitude 1, factor 16
    "k26_yarn": tiny(moe_intermediate_size=96, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                     eos_token_id=(), rope_scaling=_yarn(16.0, 32, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                                         mscale_all_dim=1.0)),
    # plain RoPE (rope_type "default"), q_proj, two dense layers
    "k26_plain": tiny(moe_intermediate_size=96, q_lora_rank=None, first_k_dense_replace=2, eos_token_id=(),
                      rope_theta=10000.0, rope_scaling=RopeScaling()),
}.items()}


def _amplitude(cfg) -> float:
    """cos/sin multiplier mscale(factor, mscale) / mscale(factor, mscale_all_dim) (HF's yarn attention_factor)."""
    rs = cfg.rope_scaling
    m = [0.1 * v * np.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0 for v in (rs.mscale, rs.mscale_all_dim)]
    return m[0] / m[1]


def test_configs_differ_where_intended():  # runs without torch too: guards each config's purpose
    a, b = CONFIGS["tiny"], CONFIGS["direct_q"]
    assert a.q_lora_rank and b.q_lora_rank is None
    assert (a.n_group, a.topk_group, a.first_k_dense_replace) == (4, 2, 1)
    assert (b.n_group, b.topk_group, b.first_k_dense_replace) == (2, 1, 0)
    assert _amplitude(a) == 1.0 and abs(_amplitude(b) - 1.0) > 0.02
    k, p = K26_CONFIGS["k26_yarn"], K26_CONFIGS["k26_plain"]
    assert k.rope_scaling.factor > 1 and p.rope_scaling.factor == 1.0 and p.q_lora_rank is None
    for cfg in (*CONFIGS.values(), *K26_CONFIGS.values()):
        assert cfg.scoring_func == "sigmoid" and cfg.eos_token_id == ()
        assert 2 * cfg.moe_intermediate_size != cfg.hidden_size
        rs = cfg.rope_scaling
        assert rs.factor == 1.0 or cfg.max_position_embeddings == rs.factor * rs.original_max_position_embeddings
    assert all(c.moe_intermediate_size % 32 == 0 for c in K26_CONFIGS.values())  # INT4 group size
    assert max(PROMPT_LENS) + NEW_TOKENS <= min(c.max_position_embeddings for c in K26_CONFIGS.values())


# ---- building and saving the transformers model ----------------------------------------------------------------
def _hf_config(cfg: ModelConfig):
    """A DeepseekV3Config with `cfg`'s values, given in the rope spelling the installed transformers takes."""
    from transformers import DeepseekV3Config

    d = cfg.to_hf_dict(wrapped=False)
    for key in ("quantization_config", "model_type", "torch_dtype", "rope_scaling", "rope_theta",
                "architectures"):  # the class writes its own type, dtype and rope layout
        d.pop(key, None)
    d.update(rope_interleave=True, use_cache=True)  # eos_token_id None: no stop token (the class default is 1)
    rs = cfg.rope_scaling
    scaling = None if rs.factor == 1.0 else {"rope_type": "yarn", **dataclasses.asdict(rs)}
    if "rope_parameters" in inspect.signature(DeepseekV3Config.__init__).parameters:  # transformers >= 5
        d["rope_parameters"] = dict(scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
    else:
        d.update(rope_theta=cfg.rope_theta, rope_scaling=scaling)
    hf = DeepseekV3Config(**d)
    hf._attn_implementation = "eager"  # fp32 eager softmax: no fused-kernel differences
    return hf


def _fill_state_dict(model, cfg, weights):
    """Our canonical float64 weights -> the model's own state-dict layout (per-expert or fused experts)."""
    import torch

    ours = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): w for n, w in weights.items()}
    used, sd = set(), {}
    d, inter, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    for key, param in model.state_dict().items():
        if key.endswith("inv_freq"):
            sd[key] = param
            continue
        if key in ours:
            value = ours[key]
            used.add(key)
        elif key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            base = key[: -len("gate_up_proj" if key.endswith("gate_up_proj") else "down_proj")]
            if key.endswith("gate_up_proj"):
                names = [(f"{base}{e}.gate_proj.weight", f"{base}{e}.up_proj.weight") for e in range(n_exp)]
                value = np.stack([np.concatenate([ours[g], ours[u]], axis=0) for g, u in names])  # [E, 2I, d]
                used.update(n for pair in names for n in pair)
                if tuple(param.shape) == (n_exp, d, 2 * inter):
                    value = value.transpose(0, 2, 1)
            else:
                names = [f"{base}{e}.down_proj.weight" for e in range(n_exp)]
                value = np.stack([ours[n] for n in names])  # [E, d, I]
                used.update(names)
                if tuple(param.shape) == (n_exp, inter, d):
                    value = value.transpose(0, 2, 1)
        else:
            raise AssertionError(f"transformers parameter {key} {tuple(param.shape)} has no source weight")
        assert tuple(param.shape) == value.shape, f"{key}: model {tuple(param.shape)} vs ours {value.shape}"
        sd[key] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    unused = sorted(set(ours) - used)
    assert not unused, f"weights the transformers model did not take: {unused[:5]}"
    model.load_state_dict(sd, strict=True)


def _require_interleaved_deepseek():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    if "interleave" not in inspect.getsource(modeling_deepseek_v3):
        pytest.skip("this transformers' DeepseekV3 has no interleaved (DeepSeek) rope layout")


def _saved_by_transformers(path, cfg: ModelConfig, weights: dict[str, np.ndarray]):
    """The fp32 transformers model holding `weights`, written to `path` by its own save_pretrained."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(_hf_config(cfg)).to(torch.float32).eval()
    _fill_state_dict(model, cfg, weights)
    model.save_pretrained(path)
    return model


def _synthetic_weights(tmp_path, cfg: ModelConfig, seed: int, **kw) -> dict[str, np.ndarray]:
    """Random weights as a checkpoint of ours stores them (bf16, or INT4 experts), decoded to float64."""
    return write_synthetic_checkpoint(tmp_path / "synthetic", cfg, seed=seed, **kw)


def _check_rope_matches(model, cfg: ModelConfig) -> None:
    """What we parsed from transformers' config.json gives transformers' own rotary tables and softmax scale."""
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(inv_freq, yarn_inv_freq(cfg), rtol=1e-6,
                               err_msg="transformers built different RoPE frequencies than the config we parsed")
    assert float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) == pytest.approx(cfg.rope_amplitude,
                                                                                            rel=1e-6)
    scaling = getattr(model.model.layers[0].self_attn, "scaling", None)
    if scaling is not None:
        assert scaling == pytest.approx(softmax_scale(cfg), rel=1e-6), "attention softmax scale differs"
        assert cfg.softmax_scale == pytest.approx(softmax_scale(cfg), rel=1e-12)


def _same_model(parsed: ModelConfig, intended: ModelConfig) -> None:
    """The config read back from transformers' file is the one the model was built from."""
    keep = ("quantization", "tensor_prefix", "lm_head_name")
    assert dataclasses.replace(parsed, **{k: getattr(intended, k) for k in keep}) == intended


# ---- 1. the float64 reference on transformers' own files ----------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_transformers(tmp_path, rng, name):
    import torch

    _require_interleaved_deepseek()
    cfg = CONFIGS[name]
    model = _saved_by_transformers(tmp_path / "hf", cfg, _synthetic_weights(tmp_path, cfg, int(rng.integers(2**31))))
    ck = HFCheckpoint.open(tmp_path / "hf")
    ck.validate()
    _same_model(ck.config, cfg)
    _check_rope_matches(model, ck.config)
    weights = reference_weights(ck)

    tokens = rng.integers(0, cfg.vocab_size, size=T)
    with torch.no_grad():
        out = model(torch.from_numpy(tokens)[None], output_hidden_states=True, use_cache=False)
    logits = out.logits[0].double().numpy()
    ref_logits, ref_hidden = reference_forward(ck.config, weights, tokens, return_hidden=True)
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err < REL_TOL, f"logits relative error {err:.2e}"
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1  # [embeddings, layer 0, ..., final (normed)]
    for layer in range(cfg.num_hidden_layers - 1):
        hs = out.hidden_states[layer + 1][0].double().numpy()
        err = np.abs(hs - ref_hidden[layer]).max() / np.abs(ref_hidden[layer]).max()
        assert err < REL_TOL, f"layer {layer} hidden relative error {err:.2e}"


# ---- 2. greedy tokens of the engine == transformers' generate ----------------------------------------------
def _prompts(rng, vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENS[:N_PROMPTS]]


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate, one unpadded prompt at a time, exactly NEW_TOKENS new tokens each."""
    import torch

    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=0, use_cache=True)
        out.append(seq[0, len(p):].tolist())
    assert all(len(t) == NEW_TOKENS for t in out), out  # no stop token: every request runs its full length
    return out


def _top2_margin(model, tokens: list[int]) -> float:
    """transformers' gap between its best and second-best next-token logit after `tokens` (near 0: a tie)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _assert_same_tokens(model, prompts, ours, theirs, label: str) -> None:
    for i, (p, a, b) in enumerate(zip(prompts, ours, theirs)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            margin = _top2_margin(model, p + b[:j])
            raise AssertionError(f"{label} prompt {i}: engine {a} != transformers {b}; first difference at new token "
                                 f"{j}, where transformers' top-2 logit margin is {margin:.3g}")
    print(f"{label}: {len(prompts)} prompts x {NEW_TOKENS} greedy tokens identical to transformers: {ours}")


def _engine_greedy(path, prompts) -> list[list[int]]:
    from kdtree_jax.decode.engine import Engine

    engine = Engine.load(path, dtype="float32")
    res = engine.generate(prompts, NEW_TOKENS, mode="ar", temperature=0.0)
    assert all(len(t) == NEW_TOKENS for t in res.token_ids), res.token_ids
    return res.token_ids


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_greedy_equals_transformers_flat(tmp_path, rng, name):
    _require_interleaved_deepseek()
    cfg = CONFIGS[name]
    model = _saved_by_transformers(tmp_path / "hf", cfg, _synthetic_weights(tmp_path, cfg, int(rng.integers(2**31))))
    with open(tmp_path / "hf" / "config.json") as f:
        written = json.load(f)
    print(f"{name}: transformers wrote rope keys {sorted(k for k in written if k.startswith('rope'))}")
    parsed = config_from_json(tmp_path / "hf")
    _same_model(parsed, cfg)
    _check_rope_matches(model, parsed)
    prompts = _prompts(rng, cfg.vocab_size)
    _assert_same_tokens(model, prompts, _engine_greedy(tmp_path / "hf", prompts), _hf_greedy(model, prompts),
                        f"flat/{name}")


def _k26_wrapper(text_config: dict, quant: dict, cfg: ModelConfig) -> dict:
    """The Kimi K2.6 config.json layout around an architecture dict (moonshotai/Kimi-K2.6 config.json)."""
    text = dict(copy.deepcopy(text_config), quantization_config=quant)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "bos_token_id": cfg.bos_token_id, "eos_token_id": None, "pad_token_id": cfg.vocab_size - 1,
        "tie_word_embeddings": False, "text_config": text,
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 1},
    }


@pytest.mark.torch
@pytest.mark.parametrize("name", list(K26_CONFIGS))
def test_engine_greedy_equals_transformers_k26_int4(tmp_path, rng, name):
    """K2.6 wrapper: text_config is transformers' config.json; tensors INT4 experts under language_model."""
    _require_interleaved_deepseek()
    cfg = K26_CONFIGS[name]
    # our INT4 checkpoint in the wrapper layout; the transformers model holds exactly what its bytes decode to
    weights = _synthetic_weights(tmp_path, cfg, int(rng.integers(2**31)), fmt="int4", wrapped=True, n_shards=2)
    model = _saved_by_transformers(tmp_path / "hf", cfg, weights)
    with open(tmp_path / "hf" / "config.json") as f:
        text_config = json.load(f)
    quant = synthetic_config(cfg, "int4").to_hf_dict()["quantization_config"]
    wrapped = tmp_path / "synthetic"
    with open(wrapped / "config.json", "w") as f:
        json.dump(_k26_wrapper(text_config, quant, cfg), f, indent=2)
    ck = HFCheckpoint.open(wrapped)
    ck.validate()
    assert ck.config.tensor_prefix == K26_TEXT_PREFIX + "model." and ck.config.quantization.method == \
        "compressed-tensors"
    assert ck.kind("layers.2.mlp.experts.0.up_proj.weight") == "int4"
    _same_model(ck.config, cfg)
    _check_rope_matches(model, ck.config)
    ck.close()
    prompts = _prompts(rng, cfg.vocab_size)
    _assert_same_tokens(model, prompts, _engine_greedy(wrapped, prompts), _hf_greedy(model, prompts),
                        f"k26-int4/{name}")
