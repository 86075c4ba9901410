"""`ModelConfig` from an HF `config.json` (flat DeepSeek-V3 / Kimi K2, or the K2.5/K2.6 wrapper).

The only place that knows the target's HF field names and layouts: every missing or inconsistent field is a
`ConfigError` that names it, and every key transformers' `DeepseekV3Config` writes is either read or listed in
`IGNORED_KEYS` with the reason it cannot change the output. Kept apart from the dataclass so that code building
configs in Python does not carry the reader.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any

from kdtree_jax.model.config import ConfigError, ModelConfig, QuantConfig, RopeScaling, yarn_get_mscale
from kdtree_jax.model.rope_config import YARN_KEYS, read_number, read_rope


def read_config_json(path: str | os.PathLike) -> tuple[Any, str]:
    """The parsed config.json of a checkpoint directory (or the file itself) and the path it came from."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config.json not found")
    try:
        with open(path) as f:
            return json.load(f), path
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


# ---- which config.json keys matter ------------------------------------------------------------------------------
# Keys of the architecture dict (the flat config, or `text_config` of the wrapper) that cannot change the tokens the
# engine computes, each with the reason. Every other key that transformers' DeepseekV3Config writes
# (src/transformers/models/deepseek_v3/configuration_deepseek_v3.py, plus PreTrainedConfig's own in
# configuration_utils.py) is read by `config_from_hf_dict`, listed in `READ_KEYS`; a key in neither draws a warning.
IGNORED_KEYS: dict[str, str] = {
    "architectures": "names the class that loads the checkpoint; the layout is read from the fields themselves",
    "model_type": "names the config class (deepseek_v3 / kimi_k2); the fields themselves are read",
    "transformers_version": "which transformers wrote the file",
    "auto_map": "remote-code class names for transformers' trust_remote_code",
    "dtype": "storage dtype (transformers >= 5); each tensor's dtype comes from its safetensors header and the "
             "compute dtype is chosen at load",
    "torch_dtype": "storage dtype (transformers < 5 name of `dtype`)",
    "initializer_range": "std of the random init; only for training from scratch",
    "use_cache": "a transformers runtime switch; the engine always keeps its latent cache",
    "pad_token_id": "the engine pads prompts itself and masks the padding out of attention",
    "pretraining_tp": "never read by transformers' DeepseekV3 modeling (a Llama-era split of the same matmuls)",
    "attention_dropout": "dropout, off at inference",
    "aux_loss_alpha": "weight of the expert-balance training loss (DeepSeek's modeling_deepseek.py)",
    "seq_aux": "switch of the sequence-level expert-balance training loss (DeepSeek's modeling_deepseek.py)",
    "ep_size": "expert-parallel world size of DeepSeek's training code; sharding is the engine's own choice",
    "num_nextn_predict_layers": "multi-token-prediction layers after the last decoder layer: not run when decoding, "
                                "their tensors are never read",
    "num_mtp_layers": "transformers' alias of num_nextn_predict_layers",
}

_REQUIRED_INT = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
)
_MOE_INT = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
_MOE_DECISIVE = (  # (name, kind, value for a dense model)
    ("n_shared_experts", int, 0),
    ("first_k_dense_replace", int, 0),
    ("n_group", int, 1),
    ("topk_group", int, 1),
    ("norm_topk_prob", bool, True),
    ("routed_scaling_factor", float, 1.0),
)
_OTHER_READ = (
    "q_lora_rank", "moe_layer_freq", "topk_method", "scoring_func", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "quantization_config", "attention_bias", "hidden_act",
    "rope_parameters", "rope_theta", "rope_scaling", "rope_interleave",
    "num_key_value_heads", "head_dim", "qk_head_dim",  # derived by transformers; checked against the MLA dims
)
READ_KEYS = frozenset(_REQUIRED_INT + _MOE_INT + tuple(n for n, _, _ in _MOE_DECISIVE) + _OTHER_READ)


def config_from_json(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory's config.json (or of the file itself)."""
    raw, path = read_config_json(path)
    return config_from_hf_dict(raw, source=path)


def config_from_hf_dict(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """The `ModelConfig` of a parsed config.json; `source` names the file in errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a JSON object")
    wrapped = "text_config" in raw
    text = raw["text_config"] if wrapped else raw
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' must be an object")
    prefix = "text_config." if wrapped else ""
    where = f"{source}: {prefix}"

    def get(name: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
        if name not in text or text[name] is None:
            if default is dataclasses.MISSING:
                raise ConfigError(f"{where}{name} is missing")
            return default
        value = text[name]
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where}{name} must be true/false, got {value!r}")
            return value
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}{name} must be a non-negative integer, got {value!r}")
            return value
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{where}{name} must be a number, got {value!r}")
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"{where}{name} must be a string, got {value!r}")
            return value
        raise TypeError(kind)

    def present(name: str) -> None:  # the key must be there; an explicit null is meaningful for this field
        if name not in text:
            raise ConfigError(f"{where}{name} is missing")

    fields: dict[str, Any] = {name: get(name, int) for name in _REQUIRED_INT}
    present("n_routed_experts")  # null = dense model (HF's `n_routed_experts is not None`)
    n_routed = get("n_routed_experts", int, 0)
    for name in _MOE_INT:
        fields[name] = get(name, int) if n_routed else get(name, int, 0)
    present("q_lora_rank")  # null = direct q_proj (DeepSeek-V2-Lite style)
    fields["q_lora_rank"] = get("q_lora_rank", int, None)
    # Routing fields decide the semantics and transformers' DeepseekV3Config defaults to DeepSeek-V3's values
    # (n_group 8, topk_group 4, first_k_dense_replace 3, norm_topk_prob true, ...): never guess them for a MoE.
    for name, kind, default in _MOE_DECISIVE:
        fields[name] = get(name, kind) if n_routed else get(name, kind, default)
    fields["moe_layer_freq"] = get("moe_layer_freq", int, 1)
    fields["topk_method"] = get("topk_method", str, "noaux_tc")
    fields["scoring_func"] = get("scoring_func", str, "sigmoid")
    fields["max_position_embeddings"] = get("max_position_embeddings", int)
    fields["rms_norm_eps"] = get("rms_norm_eps", float, 1e-6)
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))  # the wrapper's top level first
    tie_loc = f"{source}: " if "tie_word_embeddings" in raw else where
    if not isinstance(tie, bool):
        raise ConfigError(f"{tie_loc}tie_word_embeddings must be true/false, got {tie!r}")
    if tie:
        raise ConfigError(f"{tie_loc}tie_word_embeddings is true; DeepSeek-V3/Kimi checkpoints have an untied lm_head")
    fields["tie_word_embeddings"] = tie
    vocab = fields["vocab_size"]
    fields["bos_token_id"] = _token_ids(text, raw, "bos_token_id", where, source, vocab, single=True)
    fields["eos_token_id"] = _token_ids(text, raw, "eos_token_id", where, source, vocab, single=False)
    fields["rope_theta"], fields["rope_scaling"] = read_rope(
        text, where, _rope_scaling, _describe, RopeScaling(), legacy="are the legacy rope_theta / rope_scaling")
    _check_interleave(text, where)
    if "quantization_config" in text:
        fields["quantization"] = _quant_from_hf(text["quantization_config"], where)
    else:  # K2.5/K2.6 wrappers carry it at the top level or inside text_config (both occur)
        fields["quantization"] = _quant_from_hf(raw.get("quantization_config"), f"{source}: ")
    if wrapped:
        fields["tensor_prefix"] = "language_model.model."
        fields["lm_head_name"] = "language_model.lm_head.weight"
    if text.get("attention_bias", False) is not False:
        raise ConfigError(f"{where}attention_bias {text['attention_bias']!r} is not supported (MLA has no biases)")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}hidden_act {act!r} is not supported (only 'silu')")
    cfg = ModelConfig(**fields)
    _check_consistent(cfg, where)
    _check_derived_dims(cfg, text, where)
    _warn_unread(text, where)
    return cfg


def _check_interleave(text: dict, where: str) -> None:
    """Only DeepSeek's interleaved rope layout is implemented.

    A missing key is transformers' DeepseekV3Config default (true) and what DeepSeek's / Kimi's modeling_deepseek.py
    (whose configs omit the key) always does. An explicit null is refused: transformers' modeling_deepseek_v3.py
    tests it for truth and so rotates halves, where DeepSeek's code would still rotate pairs."""
    if "rope_interleave" not in text:
        return
    value = text["rope_interleave"]
    if not isinstance(value, bool):
        raise ConfigError(f"{where}rope_interleave must be true/false, got {value!r}")
    if not value:
        raise ConfigError(f"{where}rope_interleave false (rotate the two halves of the rope dims, NeoX style) is not "
                          "supported: the engine rotates DeepSeek's interleaved pairs (x[2i], x[2i+1]) in place")


def _check_derived_dims(cfg: ModelConfig, text: dict, where: str) -> None:
    """Head counts and widths transformers derives and saves (configuration_deepseek_v3.py) must match the MLA dims."""
    derived = (
        # DeepseekV3Attention repeats k/v num_attention_heads / num_key_value_heads times; MLA has a key per head
        ("num_key_value_heads", cfg.num_attention_heads, "num_attention_heads"),
        # the rotary table is sized by head_dim, which DeepseekV3Config sets to qk_rope_head_dim
        ("head_dim", cfg.qk_rope_head_dim, "qk_rope_head_dim"),
        ("qk_head_dim", cfg.qk_head_dim, "qk_nope_head_dim + qk_rope_head_dim"),
    )
    for name, want, source in derived:
        value = text.get(name)
        if value is not None and value != want:
            raise ConfigError(f"{where}{name} ({value!r}) must equal {source} ({want})")


def _warn_unread(text: dict, where: str) -> None:
    """A key neither read nor known to be irrelevant might change the numerics: say so rather than drop it."""
    unread = sorted(set(text) - READ_KEYS - set(IGNORED_KEYS))
    if unread:
        warnings.warn(f"{where}fields {unread} are not read (neither used nor known to be irrelevant to "
                      "inference); check that they do not change the model", stacklevel=3)


def _token_ids(text: dict, raw: dict, name: str, where: str, source: str, vocab: int, *, single: bool):
    """bos (one id or null) / eos (one id, a list of ids, or null) from text_config, else the top level."""
    loc = where if name in text else f"{source}: "
    value = text[name] if name in text else raw.get(name)
    if value is None:
        return None if single else ()
    ids = [value] if single or not isinstance(value, list) else value
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        kind = "an integer or null" if single else "an integer, a list of integers, or null"
        raise ConfigError(f"{loc}{name} must be {kind}, got {value!r}")
    for t in ids:
        if not 0 <= t < vocab:
            raise ConfigError(f"{loc}{name} {t} is outside the vocabulary (0..{vocab - 1})")
    return ids[0] if single else tuple(ids)


# ---- RoPE -------------------------------------------------------------------------------------------------------
# The two spellings are read by `rope_config.read_rope`; here is how one rope object becomes DeepSeek's YaRN.
ROPE_PLAIN = "default"
ROPE_YARN = ("yarn", "deepseek_yarn")
# Defaults applied alike by transformers' `_compute_yarn_parameters` (`beta_fast or 32`, `beta_slow or 1`, a falsy
# mscale_all_dim: no softmax rescale; DeepseekV3Attention reads `mscale_all_dim` with default 0) and DeepSeek's
# modeling_deepseek.py (DeepseekV3YarnRotaryEmbedding: beta_fast=32, beta_slow=1, mscale_all_dim=0).
YARN_BETA_FAST_DEFAULT = 32.0
YARN_BETA_SLOW_DEFAULT = 1.0
YARN_MSCALE_ALL_DIM_DEFAULT = 0.0
_AMPLITUDE_RTOL = 1e-9  # two formulas for one cos/sin amplitude agree when they are the same number


def _rope_type(rs: dict, label: str) -> str:
    """rope_type (or its older spelling "type"); absent only where the object holds no scaling field at all."""
    kinds = {rs[k] for k in ("rope_type", "type") if rs.get(k) is not None}
    if len(kinds) > 1:
        raise ConfigError(f"{label}.rope_type {rs['rope_type']!r} disagrees with its type {rs['type']!r}")
    if not kinds:
        scaling = sorted(k for k in YARN_KEYS if rs.get(k) is not None)
        if scaling:  # transformers would take this as plain RoPE, DeepSeek's modeling_deepseek.py fails: no guess
            raise ConfigError(f"{label}.rope_type is missing but the object holds {scaling}")
        return ROPE_PLAIN  # {"rope_theta": ...} alone: transformers' standardize_rope_params says "default"
    kind = kinds.pop()
    if kind != ROPE_PLAIN and kind not in ROPE_YARN:
        key = "rope_type" if rs.get("rope_type") is not None else "type"
        raise ConfigError(f"{label}.{key} {kind!r} is not supported (only 'yarn' or 'default')")
    return kind


def _rope_scaling(rs: dict, label: str) -> RopeScaling:
    """The YaRN parameters of one rope object; plain RoPE is factor 1."""
    kind = _rope_type(rs, label)
    if rs.get("partial_rotary_factor") is not None and read_number(rs, "partial_rotary_factor", f"{label}.") != 1.0:
        raise ConfigError(f"{label}.partial_rotary_factor {rs['partial_rotary_factor']!r} is not supported (MLA "
                          "rotates all qk_rope_head_dim dims)")
    if kind == ROPE_PLAIN:
        extra = sorted(k for k in YARN_KEYS if rs.get(k) is not None)
        if extra:
            raise ConfigError(f"{label}.rope_type is 'default' (plain RoPE) but the object sets {extra}")
        return RopeScaling()
    for name in ("factor", "original_max_position_embeddings"):
        # both required: transformers' yarn reads rope_parameters[name]; DeepSeek's code defaults the original
        # length to 4096 where transformers >= 5 fills in max_position_embeddings, so it is never guessed
        if rs.get(name) is None:
            raise ConfigError(f"{label}.{name} is missing")
    factor = read_number(rs, "factor", f"{label}.")
    if factor < 1.0:
        raise ConfigError(f"{label}.factor must be >= 1, got {factor}")
    original = rs["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{label}.original_max_position_embeddings must be a positive integer, got {original!r}")

    def optional(name: str, default: float | None) -> float | None:
        return default if rs.get(name) is None else read_number(rs, name, f"{label}.")

    beta_fast = optional("beta_fast", YARN_BETA_FAST_DEFAULT)
    beta_slow = optional("beta_slow", YARN_BETA_SLOW_DEFAULT)
    for name, beta in (("beta_fast", beta_fast), ("beta_slow", beta_slow)):
        if beta <= 0:  # transformers reads `beta or default`, DeepSeek divides by it: they part at 0
            raise ConfigError(f"{label}.{name} must be > 0, got {beta}")
    truncate = rs.get("truncate", True)  # transformers' default; DeepSeek always floors / ceils the ramp ends
    if truncate is not True:
        raise ConfigError(f"{label}.truncate {truncate!r} is not supported (only true: whole-dim YaRN ramp ends)")
    mscale, mscale_all_dim = optional("mscale", None), optional("mscale_all_dim", YARN_MSCALE_ALL_DIM_DEFAULT)
    _check_amplitude(label, factor, mscale, mscale_all_dim, optional("attention_factor", None))
    if factor == 1.0:  # no interpolation and every mscale term is 1: the same numbers as plain RoPE
        return RopeScaling()
    return RopeScaling(factor=factor, original_max_position_embeddings=original, beta_fast=beta_fast,
                       beta_slow=beta_slow, mscale=1.0 if mscale is None else mscale, mscale_all_dim=mscale_all_dim)


def _check_amplitude(label: str, factor: float, mscale: float | None, mscale_all_dim: float,
                     attention_factor: float | None) -> None:
    """The cos/sin multiplier must be the same under transformers' rule and DeepSeek's, or the config is refused.

    transformers (`_compute_yarn_parameters`): attention_factor if set, else mscale(f, mscale) / mscale(f, all_dim)
    when both are non-zero, else mscale(f, 1). DeepSeek (modeling_deepseek.py): always the ratio, mscale default 1.
    """
    ours = yarn_get_mscale(factor, 1.0 if mscale is None else mscale) / yarn_get_mscale(factor, mscale_all_dim)
    if attention_factor is not None:
        theirs = attention_factor
    elif mscale and mscale_all_dim:
        theirs = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    else:
        theirs = yarn_get_mscale(factor)
    if not math.isclose(ours, theirs, rel_tol=_AMPLITUDE_RTOL):
        raise ConfigError(f"{label}: mscale {mscale}, mscale_all_dim {mscale_all_dim}, attention_factor "
                          f"{attention_factor} give a cos/sin amplitude of {theirs:.6g} in transformers' yarn and "
                          f"{ours:.6g} in DeepSeek's modeling_deepseek.py; set mscale and mscale_all_dim so they agree")


def _describe(rs: RopeScaling) -> str:
    if rs.factor == 1.0:
        return "plain RoPE"
    return ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(rs).items())


def _quant_from_hf(q: Any, where: str) -> QuantConfig:
    if q is None:
        return QuantConfig()
    if not isinstance(q, dict):
        raise ConfigError(f"{where}quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"{where}quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
        block = q.get("weight_block_size", [128, 128])
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"{where}quantization_config.weight_block_size must be [rows, cols], got {block!r}")
        return QuantConfig(method="fp8", weight_block_size=tuple(block))
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt != "pack-quantized":
            raise ConfigError(f"{where}quantization_config.format {fmt!r} is not supported (only 'pack-quantized')")
        groups = q.get("config_groups") or {}
        if len(groups) != 1:
            raise ConfigError(f"{where}quantization_config.config_groups must hold exactly one group")
        weights = next(iter(groups.values())).get("weights") or {}
        bits, gs = weights.get("num_bits"), weights.get("group_size")
        if bits != 4 or weights.get("type", "int") != "int" or not weights.get("symmetric", True):
            raise ConfigError(f"{where}quantization_config weights must be symmetric int4, got {weights!r}")
        if weights.get("strategy", "group") != "group" or not isinstance(gs, int) or gs <= 0 or gs % 8:
            raise ConfigError(f"{where}quantization_config weights.group_size must be a multiple of 8, got {gs!r}")
        return QuantConfig(method="compressed-tensors", num_bits=4, group_size=gs, ignore=tuple(q.get("ignore", [])))
    raise ConfigError(
        f"{where}quantization_config.quant_method {method!r} is not supported (fp8 or compressed-tensors)"
    )


def _check_consistent(cfg: ModelConfig, where: str) -> None:
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"{where}{field} {why}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                 "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, name) <= 0:
            raise bad(name, "must be > 0")
    if cfg.qk_rope_head_dim % 2:
        raise bad("qk_rope_head_dim", f"must be even (rotated in pairs), got {cfg.qk_rope_head_dim}")
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise bad("first_k_dense_replace", f"({cfg.first_k_dense_replace}) exceeds num_hidden_layers "
                  f"({cfg.num_hidden_layers})")
    if cfg.moe_layer_freq < 1:
        raise bad("moe_layer_freq", "must be >= 1")
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if dense and cfg.intermediate_size <= 0:
        raise bad("intermediate_size", f"must be > 0 (layer {dense[0]} is a dense MLP layer)")
    if cfg.n_routed_experts:
        if cfg.num_experts_per_tok < 1 or cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise bad("num_experts_per_tok", f"({cfg.num_experts_per_tok}) must be in 1..n_routed_experts "
                      f"({cfg.n_routed_experts})")
        if cfg.n_group < 1 or cfg.n_routed_experts % cfg.n_group:
            raise bad("n_group", f"({cfg.n_group}) must divide n_routed_experts ({cfg.n_routed_experts})")
        if not 1 <= cfg.topk_group <= cfg.n_group:
            raise bad("topk_group", f"({cfg.topk_group}) must be in 1..n_group ({cfg.n_group})")
        per_group = cfg.n_routed_experts // cfg.n_group
        if cfg.n_group > 1 and per_group < 2:
            raise bad("n_group", "leaves fewer than 2 experts per group (group score = sum of top-2)")
        if cfg.topk_group * per_group < cfg.num_experts_per_tok:
            raise bad("topk_group", f"({cfg.topk_group}) keeps {cfg.topk_group * per_group} experts, fewer than "
                      f"num_experts_per_tok ({cfg.num_experts_per_tok})")
        if cfg.moe_intermediate_size <= 0:
            raise bad("moe_intermediate_size", "must be > 0")
        if cfg.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise bad("topk_method", f"{cfg.topk_method!r} is not supported")
        if cfg.scoring_func not in ("sigmoid", "softmax"):
            raise bad("scoring_func", f"{cfg.scoring_func!r} is not supported (sigmoid or softmax)")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
        raise bad("q_lora_rank", "must be > 0 or null")
