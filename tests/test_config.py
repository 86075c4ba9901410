"""`ModelConfig` from HF config.json: flat and K2.5/K2.6-wrapped layouts, every error path, the real K2.6 values,
and the config.json transformers 5.17 writes (`rope_parameters`) against the legacy rope keys."""
import copy
import dataclasses
import json
import os
import re
import warnings

import numpy as np
import pytest

from kdtree_jax.model.config import ConfigError, ModelConfig, QuantConfig, RopeScaling, kimi_k2_6, tiny
from kdtree_jax.model.hf_config import IGNORED_KEYS, READ_KEYS, config_from_hf_dict, config_from_json
from kdtree_jax.model.layers import yarn_inv_freq

SOURCE = "ckpt/config.json"
LAYOUTS = [False, True]  # flat K2, K2.5/K2.6 wrapper


def _text(raw: dict) -> dict:
    """The dict that holds the architecture fields (text_config in the wrapper)."""
    return raw["text_config"] if "text_config" in raw else raw


def _expect(raw: dict, field: str, wrapped: bool, why: str = "") -> None:
    """Parsing `raw` fails with a ConfigError naming the file and the (text_config.-prefixed) field."""
    prefix = "text_config." if wrapped else ""
    with pytest.raises(ConfigError, match=re.escape(f"{SOURCE}: {prefix}{field}") + why) as e:
        config_from_hf_dict(raw, source=SOURCE)
    if not wrapped:
        assert "text_config" not in str(e.value)


# Every field without a default. The MoE routing fields are required too: transformers' DeepseekV3Config would
# fill them with DeepSeek-V3's values (n_group 8, topk_group 4, first_k_dense_replace 3, norm_topk_prob true,
# q_lora_rank 1536, ...), so a guessed default would silently change the routing.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "max_position_embeddings",
            "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "q_lora_rank", "n_shared_experts",
            "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
@pytest.mark.parametrize("field", REQUIRED)
def test_missing_field_is_named(field, wrapped):
    raw = tiny().to_hf_dict(wrapped=wrapped)
    del _text(raw)[field]
    _expect(raw, field, wrapped, " is missing")


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_null_means_missing_except_where_null_has_a_meaning(wrapped):
    raw = tiny().to_hf_dict(wrapped=wrapped)
    _text(raw)["n_group"] = None
    _expect(raw, "n_group", wrapped, " is missing")
    raw = tiny().to_hf_dict(wrapped=wrapped)
    _text(raw)["q_lora_rank"] = None  # DeepSeek-V2-Lite style: a direct q_proj
    assert config_from_hf_dict(raw).q_lora_rank is None
    raw = tiny().to_hf_dict(wrapped=wrapped)
    text = _text(raw)
    text["n_routed_experts"] = None  # dense model: the MoE fields are not needed
    for name in ("moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
                 "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace"):
        del text[name]
    cfg = config_from_hf_dict(raw)
    assert cfg.n_routed_experts == 0 and not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_rope_factor_missing_is_named():
    raw = tiny().to_hf_dict(wrapped=True)
    del raw["text_config"]["rope_scaling"]["factor"]
    _expect(raw, "rope_scaling.factor", True, " is missing")


# (edit of the architecture dict, the field the error must name, what it must say)
INCONSISTENT = [
    ({"topk_group": 5}, "topk_group", r" \(5\) must be in 1\.\.n_group \(4\)"),
    ({"topk_group": 0}, "topk_group", r" \(0\) must be in 1\.\.n_group"),
    ({"n_group": 3}, "n_group", r" \(3\) must divide n_routed_experts \(8\)"),
    ({"n_group": 8, "topk_group": 1}, "n_group", " leaves fewer than 2 experts per group"),
    ({"num_experts_per_tok": 3, "topk_group": 1}, "topk_group", r" \(1\) keeps 2 experts, fewer than"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace", r" \(4\) exceeds num_hidden_layers \(3\)"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", r" \(9\) must be in 1\.\.n_routed_experts \(8\)"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok", r" \(0\) must be in 1\.\."),
    ({"moe_layer_freq": 0}, "moe_layer_freq", " must be >= 1"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size", " must be > 0"),
    ({"intermediate_size": 0}, "intermediate_size", r" must be > 0 \(layer 0 is a dense MLP layer\)"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim", " must be even"),
    ({"hidden_size": 0}, "hidden_size", " must be > 0"),
    ({"v_head_dim": 0}, "v_head_dim", " must be > 0"),
    ({"q_lora_rank": 0}, "q_lora_rank", " must be > 0 or null"),
    ({"num_hidden_layers": -1}, "num_hidden_layers", " must be a non-negative integer"),
    ({"vocab_size": True}, "vocab_size", " must be a non-negative integer"),
    ({"kv_lora_rank": 32.0}, "kv_lora_rank", " must be a non-negative integer"),
    ({"norm_topk_prob": 1}, "norm_topk_prob", " must be true/false"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor", " must be a number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps", " must be a number"),
    ({"topk_method": "aux_free"}, "topk_method", " 'aux_free' is not supported"),
    ({"scoring_func": "relu"}, "scoring_func", " 'relu' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act", " 'gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias", " True is not supported"),
    ({"eos_token_id": 256}, "eos_token_id", r" 256 is outside the vocabulary \(0\.\.255\)"),
    ({"eos_token_id": [2, -1]}, "eos_token_id", " -1 is outside the vocabulary"),
    ({"eos_token_id": "2"}, "eos_token_id", " must be an integer, a list of integers, or null"),
    ({"bos_token_id": [1]}, "bos_token_id", " must be an integer or null"),
    ({"bos_token_id": 300}, "bos_token_id", " 300 is outside the vocabulary"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type", " 'linear' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}},
     "rope_scaling.factor", " must be >= 1"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": "32"}},
     "rope_scaling.beta_fast", " must be a number"),
    ({"rope_scaling": [4.0]}, "rope_scaling", " must be an object or null"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method", " 'awq' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "quantization_config.fmt",
     " 'e5m2' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "quantization_config.weight_block_size", " must be"),
    ({"quantization_config": dict(kimi_k2_6().to_hf_dict()["quantization_config"], format="naive-quantized")},
     "quantization_config.format", " 'naive-quantized' is not supported"),
]


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
@pytest.mark.parametrize("edit,field,why", INCONSISTENT, ids=[f"{c[1]}-{i}" for i, c in enumerate(INCONSISTENT)])
def test_inconsistent_field_is_named(edit, field, why, wrapped):
    raw = tiny().to_hf_dict(wrapped=wrapped)
    _text(raw).update(copy.deepcopy(edit))
    _expect(raw, field, wrapped, why)


def test_int4_group_size_checked():
    raw = kimi_k2_6().to_hf_dict(wrapped=True)
    raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 12
    _expect(raw, "quantization_config weights.group_size", True, " must be a multiple of 8, got 12")


def test_top_level_fields_of_the_wrapper_are_named_without_prefix():
    raw = tiny().to_hf_dict(wrapped=True)  # the wrapper keeps tie_word_embeddings at its top level
    raw["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match=re.escape(f"{SOURCE}: tie_word_embeddings is true")):
        config_from_hf_dict(raw, source=SOURCE)
    raw = tiny().to_hf_dict(wrapped=True)
    raw["quantization_config"] = {"quant_method": "gptq"}  # only at the top level: named there
    with pytest.raises(ConfigError, match=re.escape(f"{SOURCE}: quantization_config.quant_method 'gptq'")):
        config_from_hf_dict(raw, source=SOURCE)
    raw = tiny().to_hf_dict(wrapped=True)
    del raw["text_config"]["eos_token_id"]
    raw["eos_token_id"] = 9999  # taken from the top level when text_config has none
    with pytest.raises(ConfigError, match=re.escape(f"{SOURCE}: eos_token_id 9999 is outside")):
        config_from_hf_dict(raw, source=SOURCE)
    for bad, what in (([], "top level must be a JSON object"), ({"text_config": 3}, "'text_config' must be")):
        with pytest.raises(ConfigError, match=re.escape(f"{SOURCE}: ") + ".*" + re.escape(what)):
            config_from_hf_dict(bad, source=SOURCE)


def test_errors_from_a_file_name_its_path(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(ConfigError, match=re.escape(f"{path}: config.json not found")):
        config_from_json(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid JSON")):
        config_from_json(tmp_path)
    raw = tiny().to_hf_dict(wrapped=True)
    del raw["text_config"]["kv_lora_rank"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: text_config.kv_lora_rank is missing")):
        config_from_json(tmp_path)


def _random_config(rng) -> ModelConfig:
    n_group = int(rng.choice([1, 2, 4]))
    n_exp = n_group * int(rng.integers(2, 5))
    topk_group = int(rng.integers(1, n_group + 1))
    layers = int(rng.integers(1, 5))
    eos = tuple(int(t) for t in rng.choice(200, size=int(rng.integers(1, 3)), replace=False))
    return tiny(
        vocab_size=int(rng.integers(200, 400)), num_hidden_layers=layers,
        q_lora_rank=None if rng.random() < 0.5 else int(rng.integers(8, 64)),
        qk_rope_head_dim=2 * int(rng.integers(1, 8)), n_routed_experts=n_exp, n_group=n_group,
        topk_group=topk_group, num_experts_per_tok=int(rng.integers(1, topk_group * n_exp // n_group + 1)),
        first_k_dense_replace=int(rng.integers(0, layers + 1)), norm_topk_prob=bool(rng.random() < 0.5),
        routed_scaling_factor=float(rng.uniform(0.5, 3.0)), rms_norm_eps=float(rng.choice([1e-5, 1e-6])),
        rope_scaling=RopeScaling(factor=float(rng.uniform(1.0, 64.0)), original_max_position_embeddings=64,
                                 beta_fast=float(rng.uniform(1, 32)), beta_slow=1.0,
                                 mscale=float(rng.uniform(0.5, 1.5)), mscale_all_dim=float(rng.uniform(0, 1.5))),
        bos_token_id=int(rng.integers(0, 200)), eos_token_id=eos,
        quantization=[QuantConfig(), QuantConfig(method="fp8", weight_block_size=(16, 32))][int(rng.integers(2))],
    )


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_to_hf_dict_round_trip(rng, wrapped):
    for _ in range(20):
        cfg = _random_config(rng)
        if wrapped:
            cfg = dataclasses.replace(cfg, tensor_prefix="language_model.model.",
                                      lm_head_name="language_model.lm_head.weight")
        raw = json.loads(json.dumps(cfg.to_hf_dict(wrapped=wrapped)))  # through JSON, as on disk
        assert config_from_hf_dict(raw) == cfg


# moonshotai/Kimi-K2.6 config.json with its published values (the model card's files on the Hugging Face hub):
# quantization_config inside text_config, eos 163586, yarn factor 64 / beta_fast 32, rms_norm_eps 1e-5.
K26_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None},
        "input_activations": None, "output_activations": None}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
}
K26_TEXT = {
    "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 0,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
    "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 262144, "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True,
    "pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586, "tie_word_embeddings": False,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
    "quantization_config": K26_QUANT,
}
K26 = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                 "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
    "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "tie_word_embeddings": False, "text_config": K26_TEXT,
    "vision_config": {"num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "num_attention_heads": 16, "patch_size": 14, "merge_kernel_size": [2, 2],
                      "mm_projector_type": "patchmerger", "text_hidden_size": 7168},
}


def test_published_k26_config_equals_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(K26, indent=2))
    cfg = config_from_json(tmp_path)
    assert cfg == kimi_k2_6()
    assert cfg.softmax_scale == pytest.approx(0.1446796, abs=1e-7)  # format doc §1.4
    assert cfg.rope_amplitude == 1.0 and cfg.latent_dim == 576
    assert [i for i in range(61) if not cfg.is_moe_layer(i)] == [0]


def test_quantization_config_inside_or_outside_text_config():
    inner = copy.deepcopy(K26)
    outer = copy.deepcopy(K26)
    outer["quantization_config"] = outer["text_config"].pop("quantization_config")
    a, b = config_from_hf_dict(inner), config_from_hf_dict(outer)
    assert a == b == kimi_k2_6()
    assert b.quantization.method == "compressed-tensors" and b.quantization.group_size == 32
    assert "re:.*lm_head.*" in b.quantization.ignore
    both = copy.deepcopy(inner)
    both["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert config_from_hf_dict(both).quantization == a.quantization  # text_config's wins
    none = copy.deepcopy(outer)
    del none["quantization_config"]
    assert config_from_hf_dict(none).quantization == QuantConfig()


# ---- RoPE as transformers >= 5 writes it (`rope_parameters`, `rope_interleave`) vs the legacy keys --------------
HF5_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "transformers_5.17")
with open(os.path.join(HF5_DIR, "expected.json")) as _f:
    HF5_EXPECTED = json.load(_f)  # what transformers 5.17 itself computed from these files (make_configs.py)


def _hf5(name: str = "deepseek_v3_yarn") -> dict:
    """A config.json exactly as transformers 5.17's save_pretrained wrote it (tests/data/transformers_5.17)."""
    with open(os.path.join(HF5_DIR, name, "config.json")) as f:
        return json.load(f)


def _to_legacy(raw: dict) -> dict:
    """The same values in the legacy keys: top-level rope_theta, the rest under rope_scaling (null when plain)."""
    out = copy.deepcopy(raw)
    text = _text(out)
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    rope.pop("type", None)
    text["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return out


def _wrap_k26(text: dict) -> dict:
    """The Kimi K2.6 wrapper around an architecture dict, with K2.6's INT4 quantization_config inside."""
    out = copy.deepcopy(K26)
    out["text_config"] = dict(copy.deepcopy(text), quantization_config=K26_QUANT)
    return out


def _parse(raw: dict) -> ModelConfig:
    """Parse, failing on any warning: every key of these files is either read or known to be irrelevant."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return config_from_hf_dict(raw, source=SOURCE)


@pytest.mark.parametrize("name", ["deepseek_v3_yarn", "deepseek_v3_plain"])
def test_transformers_5_config_gives_transformers_numbers(name):
    cfg = config_from_json(os.path.join(HF5_DIR, name))
    want = HF5_EXPECTED[name]
    np.testing.assert_allclose(yarn_inv_freq(cfg), want["inv_freq"], rtol=1e-6)
    assert cfg.rope_amplitude == pytest.approx(want["attention_scaling"], rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(want["softmax_scale"], rel=1e-12)


def test_transformers_5_yarn_config_fields():
    raw = _hf5()
    assert "rope_scaling" not in raw and "rope_theta" not in raw and raw["rope_interleave"] is True
    assert "dtype" in raw and "torch_dtype" not in raw
    cfg = _parse(raw)
    assert cfg.rope_theta == 50000.0  # not the 10000 a reader of only the legacy keys falls back to
    assert cfg.rope_scaling == RopeScaling(factor=8.0, original_max_position_embeddings=64, beta_fast=32.0,
                                           beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    m = 0.1 * 1.0 * np.log(8.0) + 1.0
    assert cfg.yarn_mscale == pytest.approx(m) and cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5 * m * m)
    assert cfg.max_position_embeddings == 512 and cfg.tensor_prefix == "model."
    assert (cfg.n_group, cfg.topk_group, cfg.q_lora_rank, cfg.eos_token_id) == (4, 2, 32, (2,))


@pytest.mark.parametrize("name", ["deepseek_v3_yarn", "deepseek_v3_plain", "deepseek_v3_kimi_keys"])
def test_transformers_5_config_equals_its_legacy_form(name):
    raw = _hf5(name)
    new, old = _parse(raw), _parse(_to_legacy(raw))
    assert new == old
    np.testing.assert_array_equal(yarn_inv_freq(new), yarn_inv_freq(old))
    assert (new.softmax_scale, new.rope_amplitude) == (old.softmax_scale, old.rope_amplitude)
    wrapped = _parse(_wrap_k26(raw))  # the K2.6 text_config layout, with rope_parameters inside
    assert dataclasses.replace(wrapped, quantization=new.quantization, tensor_prefix=new.tensor_prefix,
                               lm_head_name=new.lm_head_name) == new
    assert wrapped.tensor_prefix == "language_model.model." and wrapped.quantization.method == "compressed-tensors"


def test_transformers_5_plain_rope():
    cfg = _parse(_hf5("deepseek_v3_plain"))
    assert cfg.rope_theta == 20000.0 and cfg.rope_scaling.factor == 1.0
    assert cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5) and cfg.rope_amplitude == 1.0


def test_every_key_transformers_writes_is_classified():
    """The one list in hf_config.py (IGNORED_KEYS, with reasons) plus what the reader reads covers every key."""
    for name in ("deepseek_v3_yarn", "deepseek_v3_plain", "deepseek_v3_kimi_keys"):
        assert set(_hf5(name)) <= READ_KEYS | set(IGNORED_KEYS), name
    assert set(K26_TEXT) <= READ_KEYS | set(IGNORED_KEYS)
    assert not READ_KEYS & set(IGNORED_KEYS)
    assert all(isinstance(why, str) and len(why) > 10 for why in IGNORED_KEYS.values())


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_unclassified_key_warns_naming_it(wrapped):
    raw = _wrap_k26(_hf5()) if wrapped else _hf5()
    _text(raw)["rope_scaling_mode"] = "ntk"
    with pytest.warns(UserWarning, match=re.escape(f"{SOURCE}: {'text_config.' if wrapped else ''}fields "
                                                   "['rope_scaling_mode'] are not read")):
        config_from_hf_dict(raw, source=SOURCE)


def test_k26_wrapper_with_rope_parameters_equals_preset():
    raw = copy.deepcopy(K26)
    text = raw["text_config"]
    text["rope_parameters"] = dict(text.pop("rope_scaling"), rope_type="yarn", rope_theta=text.pop("rope_theta"))
    text["rope_interleave"] = True
    assert _parse(raw) == kimi_k2_6()


def _yarn_edit(**rope) -> dict:
    """The 5.17 yarn config with its rope_parameters fields replaced (None: removed)."""
    raw = _hf5()
    params = raw["rope_parameters"]
    for key, value in rope.items():
        if value is None:
            params.pop(key, None)
        else:
            params[key] = value
    return raw


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_config_with_neither_rope_form_is_refused(wrapped):
    raw = _hf5()
    del raw["rope_parameters"]
    _expect(_wrap_k26(raw) if wrapped else raw, "rope_parameters", wrapped,
            re.escape(" is missing (and so are the legacy rope_theta / rope_scaling)"))
    raw = _hf5()  # an object without the base in it, and none at the top level: the same
    raw["rope_parameters"].pop("rope_theta")
    _expect(_wrap_k26(raw) if wrapped else raw, "rope_parameters", wrapped, " is missing")


# (rope_parameters edit, the field the error must name, what it must say)
ROPE_ERRORS = [
    ({"rope_type": "llama3", "type": None}, "rope_parameters.rope_type", " 'llama3' is not supported"),
    ({"rope_type": "dynamic", "type": "dynamic"}, "rope_parameters.rope_type", " 'dynamic' is not supported"),
    ({"rope_type": None, "type": "linear"}, "rope_parameters.type", " 'linear' is not supported"),
    ({"type": "default"}, "rope_parameters.rope_type", " 'yarn' disagrees with its type 'default'"),
    ({"rope_type": None, "type": None}, "rope_parameters.rope_type", " is missing but the object holds"),
    ({"rope_type": "default", "type": None}, "rope_parameters.rope_type", " is 'default' .* but the object sets"),
    ({"factor": None}, "rope_parameters.factor", " is missing"),
    ({"original_max_position_embeddings": None}, "rope_parameters.original_max_position_embeddings", " is missing"),
    ({"original_max_position_embeddings": 64.5}, "rope_parameters.original_max_position_embeddings",
     " must be a positive integer"),
    ({"factor": 0.5}, "rope_parameters.factor", " must be >= 1"),
    ({"beta_fast": 0}, "rope_parameters.beta_fast", " must be > 0"),
    ({"beta_slow": "1"}, "rope_parameters.beta_slow", " must be a number"),
    ({"truncate": False}, "rope_parameters.truncate", " False is not supported"),
    ({"partial_rotary_factor": 0.5}, "rope_parameters.partial_rotary_factor", " 0.5 is not supported"),
    ({"low_freq_factor": 1.0}, "rope_parameters", r" has fields \['low_freq_factor'\] that are not supported"),
    ({"rope_theta": "50000"}, "rope_parameters.rope_theta", " must be a number"),
    ({"rope_theta": 1.0}, "rope_parameters.rope_theta", " must be > 1"),
    # cos/sin amplitude where transformers' rule and DeepSeek's differ: never guessed
    ({"mscale": None}, "rope_parameters", ": mscale None, mscale_all_dim 1.0, attention_factor None give"),
    ({"mscale": 0.8, "mscale_all_dim": 0.0}, "rope_parameters", ": mscale 0.8, mscale_all_dim 0.0"),
    ({"mscale": 0.8, "mscale_all_dim": None}, "rope_parameters", ": mscale 0.8, mscale_all_dim 0.0"),
    ({"attention_factor": 1.5}, "rope_parameters", r": .*attention_factor 1.5 give a cos/sin amplitude of 1.5 in "
                                                   r"transformers' yarn and 1 in DeepSeek's"),
]


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
@pytest.mark.parametrize("edit,field,why", ROPE_ERRORS, ids=[f"{c[1]}-{i}" for i, c in enumerate(ROPE_ERRORS)])
def test_rope_parameters_errors_name_the_field(edit, field, why, wrapped):
    raw = _yarn_edit(**edit)
    _expect(_wrap_k26(raw) if wrapped else raw, field, wrapped, why)


def test_rope_parameters_not_an_object():
    raw = _hf5()
    raw["rope_parameters"] = [50000.0]
    _expect(raw, "rope_parameters", False, " must be an object or null")
    raw["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}  # per layer type
    _expect(raw, "rope_parameters", False, r" has fields \['full_attention'\].*per-layer-type")


def test_legacy_unknown_rope_type_is_named():
    raw = _to_legacy(_hf5())
    raw["rope_scaling"]["type"] = "longrope"
    _expect(raw, "rope_scaling.type", False, " 'longrope' is not supported")


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_both_rope_forms_must_agree(wrapped):
    def check(raw, why):
        _expect(_wrap_k26(raw) if wrapped else raw, "rope_parameters", wrapped, why)

    raw = _hf5()
    raw["rope_theta"] = 10000.0  # legacy top-level base next to the new object's
    prefix = re.escape("text_config." if wrapped else "")
    check(raw, r".rope_theta \(50000.0\) and " + prefix + r"rope_theta \(10000.0\) disagree")
    raw = _hf5()
    raw["rope_scaling"] = dict(_to_legacy(raw)["rope_scaling"], factor=4.0)
    check(raw, r" \(factor 8.0, .*\) and " + prefix + r"rope_scaling \(factor 4.0, .*\) disagree")
    raw = _hf5()
    raw["rope_scaling"] = None  # null: absent, as transformers reads it
    raw["rope_theta"] = 50000.0  # the same base spelled twice
    assert _parse(raw) == _parse(_hf5())
    legacy = _to_legacy(_hf5())
    raw = dict(_hf5(), rope_theta=legacy["rope_theta"], rope_scaling=legacy["rope_scaling"])
    assert _parse(_wrap_k26(raw) if wrapped else raw).rope_scaling == _parse(_hf5()).rope_scaling
    raw = _to_legacy(_hf5("deepseek_v3_plain"))
    raw["rope_parameters"] = _hf5()["rope_parameters"]  # plain in the legacy keys, YaRN in the new: refused
    raw["rope_scaling"] = {"type": "default"}
    raw["rope_theta"] = 50000.0
    check(raw, r" \(factor 8.0, .*\) and " + prefix + r"rope_scaling \(plain RoPE\) disagree")


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_rope_interleave(wrapped):
    raw = _hf5()
    raw["rope_interleave"] = False
    _expect(_wrap_k26(raw) if wrapped else raw, "rope_interleave", wrapped,
            re.escape(" false (rotate the two halves of the rope dims, NeoX style) is not supported"))
    for bad in ("yes", None):  # null: transformers would rotate halves, DeepSeek's code pairs
        raw["rope_interleave"] = bad
        _expect(_wrap_k26(raw) if wrapped else raw, "rope_interleave", wrapped, " must be true/false")
    del raw["rope_interleave"]  # transformers' default (true), and what DeepSeek's own code always does
    assert _parse(raw) == _parse(_hf5())


def test_yarn_defaults_are_the_ones_transformers_applies():
    """beta_fast 32, beta_slow 1, mscale_all_dim 0 (no softmax rescale), mscale 1 when mscale_all_dim is 0:
    transformers' `_compute_yarn_parameters` / `yarn_apply_mscale` and DeepSeek's code both use these."""
    full = _parse(_hf5())
    cfg = _parse(_yarn_edit(beta_fast=None, beta_slow=None))
    assert (cfg.rope_scaling.beta_fast, cfg.rope_scaling.beta_slow) == (32.0, 1.0)
    np.testing.assert_array_equal(yarn_inv_freq(cfg), yarn_inv_freq(full))
    bare = _parse(_yarn_edit(mscale=None, mscale_all_dim=None))
    factor = full.rope_scaling.factor
    assert bare.softmax_scale == pytest.approx((16 + 8) ** -0.5)  # transformers: mscale_all_dim 0 -> no rescale
    assert bare.rope_amplitude == pytest.approx(0.1 * np.log(factor) + 1.0)  # transformers: get_mscale(factor)
    assert _parse(_yarn_edit(mscale=1.0, mscale_all_dim=0.0)) == bare
    agreed = _parse(_yarn_edit(attention_factor=1.0))  # the amplitude both rules give: accepted
    assert agreed == full and agreed.rope_amplitude == 1.0
    plain = _hf5("deepseek_v3_plain")
    del plain["rope_parameters"]["rope_type"]  # {"rope_theta": ...} alone: transformers' "default"
    assert _parse(plain) == _parse(_hf5("deepseek_v3_plain"))
    unit = _parse(_yarn_edit(factor=1.0))  # YaRN of factor 1 computes plain RoPE, and reads as it
    assert unit.rope_scaling == RopeScaling()
    assert _parse(dict(_yarn_edit(factor=1.0), rope_scaling={"type": "default"})) == unit  # so both forms agree


@pytest.mark.parametrize("wrapped", LAYOUTS, ids=["flat", "wrapped"])
def test_derived_dims_must_match(wrapped):
    for field, value, why in (("num_key_value_heads", 2, r" \(2\) must equal num_attention_heads \(4\)"),
                              ("head_dim", 16, r" \(16\) must equal qk_rope_head_dim \(8\)"),
                              ("qk_head_dim", 16, r" \(16\) must equal qk_nope_head_dim \+ qk_rope_head_dim")):
        raw = _hf5()
        raw[field] = value
        _expect(_wrap_k26(raw) if wrapped else raw, field, wrapped, why)


def test_no_stop_token_round_trips():
    raw = tiny(eos_token_id=()).to_hf_dict()
    assert raw["eos_token_id"] is None
    assert config_from_hf_dict(json.loads(json.dumps(raw))).eos_token_id == ()
