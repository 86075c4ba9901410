"""DFlash drafter configuration read from a z-lab drafter `config.json` (Qwen3-style fields + `dflash_config`).

`DrafterConfig.from_hf_dict` is the only place that knows the HF field names (the rope keys' two spellings are
`rope_config`'s); every missing or bad field is a `ConfigError` naming it. The rotary tables (`inv_freq`, `rope_amplitude`) are derived here in float64 so the JAX
drafter and the numpy reference share one definition of the *config*, not of the forward.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from kdtree_jax.model.config import ConfigError, ModelConfig
from kdtree_jax.model.hf_config import read_config_json
from kdtree_jax.model.rope_config import read_rope

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
YARN_AMPLITUDES = ("hf", "legacy")
DEFAULT_BLOCK_SIZE = 16  # z-lab DFlashDraftModel default when the config carries no block_size


@dataclasses.dataclass(frozen=True)
class DrafterYarn:
    """HF `rope_parameters` (or legacy `rope_scaling`) of type yarn, as Qwen3RotaryEmbedding reads it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit amplitude; wins over mscale when set
    truncate: bool = True  # round the correction range to whole dims (HF default)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: DrafterYarn | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()  # per layer full_attention / sliding_attention; empty: all full
    sliding_window: int | None = None
    is_causal: bool | None = None  # config `is_causal`: every layer causal inside the block when set
    sliding_causal: bool = False  # is_causal unset: sliding layers causal (newer z-lab code) or not (older code)
    yarn_amplitude: str = "hf"  # "hf": from mscale/mscale_all_dim; "legacy": 0.1*ln(factor)+1 (vllm-ascend)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:  # canonical form: one entry per layer
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        _validate(self, "DrafterConfig: ")

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features the drafter consumes (len(target_layer_ids) * hidden)."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def depth(self) -> int:
        """D = L - 1 draft positions per block."""
        return self.block_size - 1

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    def layer_causal(self, layer: int) -> bool:
        """Block rows see only block rows at <= their position (context rows always precede the block)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.sliding_causal and self.is_sliding(layer)

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def inv_freq(self) -> np.ndarray:
        """[head_dim/2] float64 rotary frequencies (plain, or YaRN-blended as HF `_compute_yarn_parameters`)."""
        dim = self.head_dim
        pos_freqs = self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        extrapolation = 1.0 / pos_freqs
        rs = self.rope_scaling
        if rs is None:
            return extrapolation
        interpolation = 1.0 / (rs.factor * pos_freqs)

        def correction_dim(n_rot: float) -> float:
            return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (
                2 * math.log(self.rope_theta))

        low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep_extrapolation = 1.0 - ramp
        return interpolation * (1.0 - keep_extrapolation) + extrapolation * keep_extrapolation

    @property
    def rope_amplitude(self) -> float:
        """Multiplier on cos/sin. "hf": mscale(f, mscale)/mscale(f, mscale_all_dim) (1.0 for the Kimi drafters);
        "legacy": 0.1*ln(factor)+1 (~1.416 for factor 64), as vllm-ascend forces for the Kimi drafter."""
        rs = self.rope_scaling
        if rs is None:
            return 1.0
        if self.yarn_amplitude == "legacy":
            return _mscale(rs.factor, 1.0)
        if rs.attention_factor is not None:
            return rs.attention_factor
        if rs.mscale and rs.mscale_all_dim:
            return _mscale(rs.factor, rs.mscale) / _mscale(rs.factor, rs.mscale_all_dim)
        return _mscale(rs.factor, 1.0)

    # ---- compatibility -------------------------------------------------------------------------------------
    def check_compatible(self, target: ModelConfig) -> None:
        """Raise ConfigError if this drafter cannot run on `target` (hidden size, vocab, tapped layers)."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter hidden_size ({self.hidden_size}) != target hidden_size "
                              f"({target.hidden_size}): the drafter borrows the target's embedding and lm_head")
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size ({self.vocab_size}) != target vocab_size ({target.vocab_size})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(f"drafter dflash_config.target_layer_ids {bad} are outside the target's layers "
                              f"0..{target.num_hidden_layers - 1}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            raise ConfigError(f"drafter num_target_layers ({self.num_target_layers}) != target num_hidden_layers "
                              f"({target.num_hidden_layers}): it was trained on a different target")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"drafter mask_token_id ({self.mask_token_id}) is not a row of the target embedding "
                              f"(vocab {target.vocab_size})")

    # ---- HF I/O --------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json", yarn_amplitude: str = "hf",
                     sliding_causal: bool = False) -> "DrafterConfig":
        return _from_hf_dict(raw, source, yarn_amplitude, sliding_causal)

    @classmethod
    def from_json(cls, path: str | os.PathLike, *, yarn_amplitude: str = "hf",
                  sliding_causal: bool = False) -> "DrafterConfig":
        raw, path = read_config_json(path)
        return _from_hf_dict(raw, path, yarn_amplitude, sliding_causal)

    def to_hf_dict(self) -> dict[str, Any]:
        """The z-lab `config.json` this config reads back from (yarn_amplitude is a runtime choice, not saved)."""
        rs = self.rope_scaling
        rope = None
        if rs is not None:
            rope = {"rope_type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow,
                    "original_max_position_embeddings": rs.original_max_position_embeddings, "truncate": rs.truncate}
            for name in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(rs, name) is not None:
                    rope[name] = getattr(rs, name)
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
            "torch_dtype": "bfloat16",
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
            if getattr(self, name) != default:
                out["dflash_config"][name] = getattr(self, name)
        if self.final_logit_softcapping is not None:
            out["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab `build_target_layer_ids`: spread over 1..n-3; one draft layer taps the middle layer."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _from_hf_dict(raw: Any, source: str, yarn_amplitude: str, sliding_causal: bool) -> DrafterConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a JSON object")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ConfigError(f"{source}: dflash_config must be an object")

    def get(name: str, kind: type, default: Any = dataclasses.MISSING, *, where: dict | None = None) -> Any:
        # dflash_config entries win over top-level ones, as z-lab's `_draft_value` reads them
        table = where if where is not None else (dflash if name in dflash else raw)
        label = f"{source}: {'dflash_config.' if table is dflash and table is not raw else ''}{name}"
        value = table.get(name)
        if value is None:
            if default is dataclasses.MISSING:
                raise ConfigError(f"{label} is missing")
            return default
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{label} must be an integer, got {value!r}")
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{label} must be a number, got {value!r}")
            return float(value)
        if kind is list and not isinstance(value, list):
            raise ConfigError(f"{label} must be a list, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{label} must be true/false, got {value!r}")
        return value

    hidden = get("hidden_size", int)
    heads = get("num_attention_heads", int)
    n_layers = get("num_hidden_layers", int)
    n_target = get("num_target_layers", int, None)
    ids = get("target_layer_ids", list, None)
    if ids is None:
        if n_target is None:
            raise ConfigError(f"{source}: dflash_config.target_layer_ids is missing and num_target_layers is not "
                              "given to derive it")
        ids = default_target_layer_ids(n_target, n_layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{source}: dflash_config.target_layer_ids must be a list of integers, got {ids!r}")
    layer_types = get("layer_types", list, None, where=raw)
    use_sw = raw.get("use_sliding_window", True)
    window = get("sliding_window", int, None, where=raw) if use_sw is not False else None
    layer_types = layer_types or []
    if window is None:  # HF Qwen3Config drops sliding_window when it is off; those layers then attend fully
        layer_types = [FULL_ATTENTION if t == SLIDING_ATTENTION else t for t in layer_types]
    is_causal = get("is_causal", bool, None)
    theta, yarn = read_rope(raw, f"{source}: ", _yarn_from_hf, _describe, None, legacy="is the legacy rope_theta")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias true is not supported (z-lab drafters have no biases)")
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", int, heads),
        head_dim=get("head_dim", int, hidden // heads if heads else 0),
        vocab_size=get("vocab_size", int),
        target_layer_ids=tuple(ids),
        mask_token_id=get("mask_token_id", int),
        block_size=get("block_size", int, DEFAULT_BLOCK_SIZE),
        num_target_layers=n_target,
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        rope_scaling=yarn,
        max_position_embeddings=get("max_position_embeddings", int, 40960),
        layer_types=tuple(layer_types),
        sliding_window=window,
        is_causal=is_causal,
        sliding_causal=bool(sliding_causal),
        yarn_amplitude=yarn_amplitude,
        input_embedding_scale=get("input_embedding_scale", float, 1.0),
        output_multiplier=get("output_multiplier", float, 1.0),
        final_logit_softcapping=get("final_logit_softcapping", float, None),
    )


def _describe(yarn: DrafterYarn | None) -> str:
    if yarn is None:
        return "plain RoPE"
    return ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(yarn).items() if v is not None)


def _yarn_from_hf(rs: dict, label: str) -> DrafterYarn | None:
    """One rope object (`label` names it; `read_rope` has refused unknown keys): YaRN, or None for plain RoPE."""
    fields = {f.name for f in dataclasses.fields(DrafterYarn)}
    if rs.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ConfigError(f"{label}.partial_rotary_factor {rs['partial_rotary_factor']!r} is not supported")
    kinds = {rs[k] for k in ("rope_type", "type") if rs.get(k) is not None}
    if len(kinds) > 1:
        raise ConfigError(f"{label}.rope_type {rs['rope_type']!r} disagrees with its type {rs['type']!r}")
    scaling = sorted(k for k in fields if rs.get(k) is not None)
    kind = kinds.pop() if kinds else None
    if kind is None:
        if scaling:  # transformers would read it as plain RoPE, a YaRN-trained drafter needs YaRN: no guess
            raise ConfigError(f"{label}.rope_type is missing but the object holds {scaling}")
        return None  # {"rope_theta": ...} alone: transformers' standardize_rope_params reads it as "default"
    if kind == "default":
        if scaling:
            raise ConfigError(f"{label}.rope_type is 'default' (plain RoPE) but the object sets {scaling}")
        return None
    if kind != "yarn":
        key = "rope_type" if rs.get("rope_type") is not None else "type"
        raise ConfigError(f"{label}.{key} {kind!r} is not supported (yarn or default)")
    out: dict[str, Any] = {}
    for name in ("factor", "original_max_position_embeddings"):
        if rs.get(name) is None:
            raise ConfigError(f"{label}.{name} is missing")
    for f in dataclasses.fields(DrafterYarn):
        value = rs.get(f.name)
        if value is None:
            continue
        if f.name == "truncate":
            if not isinstance(value, bool):
                raise ConfigError(f"{label}.truncate must be true/false, got {value!r}")
            out[f.name] = value
            continue
        if f.name == "original_max_position_embeddings":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{label}.{f.name} must be a positive integer, got {value!r}")
            out[f.name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{label}.{f.name} must be a number, got {value!r}")
        out[f.name] = float(value)
    if out["factor"] < 1.0:
        raise ConfigError(f"{label}.factor must be >= 1, got {out['factor']}")
    return DrafterYarn(**out)


def _validate(cfg: DrafterConfig, where: str) -> None:
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"{where}{field} {why}")

    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        if getattr(cfg, name) <= 0:
            raise bad(name, f"must be > 0, got {getattr(cfg, name)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise bad("num_key_value_heads", f"({cfg.num_key_value_heads}) must divide num_attention_heads "
                  f"({cfg.num_attention_heads})")
    if cfg.head_dim % 2:
        raise bad("head_dim", f"must be even (rotate_half), got {cfg.head_dim}")
    if cfg.block_size < 2:
        raise bad("block_size", f"must be >= 2 (bonus + at least one mask), got {cfg.block_size}")
    if not cfg.target_layer_ids:
        raise bad("dflash_config.target_layer_ids", "must not be empty")
    if any(i < 0 for i in cfg.target_layer_ids):
        raise bad("dflash_config.target_layer_ids", f"must be >= 0, got {list(cfg.target_layer_ids)}")
    if cfg.num_target_layers is not None and any(i >= cfg.num_target_layers for i in cfg.target_layer_ids):
        raise bad("dflash_config.target_layer_ids", f"{list(cfg.target_layer_ids)} exceed num_target_layers "
                  f"({cfg.num_target_layers})")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise bad("dflash_config.mask_token_id", f"({cfg.mask_token_id}) must be in 0..vocab_size-1")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise bad("layer_types", f"has {len(cfg.layer_types)} entries, num_hidden_layers is "
                  f"{cfg.num_hidden_layers}")
    unknown = set(cfg.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise bad("layer_types", f"has unknown entries {sorted(unknown)}")
    if SLIDING_ATTENTION in cfg.layer_types and (cfg.sliding_window is None or cfg.sliding_window <= 0):
        raise bad("sliding_window", f"must be > 0 when layer_types has sliding layers, got {cfg.sliding_window}")
    if cfg.yarn_amplitude not in YARN_AMPLITUDES:
        raise bad("yarn_amplitude", f"must be one of {YARN_AMPLITUDES}, got {cfg.yarn_amplitude!r}")
    if cfg.rms_norm_eps <= 0:
        raise bad("rms_norm_eps", "must be > 0")
    if cfg.rope_theta <= 1:
        raise bad("rope_theta", "must be > 1")
