"""The target model's architecture as one frozen dataclass, `ModelConfig`, plus presets for tests and sizing.

It carries every field the forward needs and the values derived from them (head dims, YaRN scales), so model code
depends on this small module only; reading an HF `config.json` into it is `hf_config`'s job, and `to_hf_dict`
writes the file back for tests and synthetic checkpoints.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A config.json that is missing a field or whose fields disagree; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """DeepSeek YaRN parameters (`rope_parameters` or legacy `rope_scaling` of rope_type "yarn"); factor 1 = plain
    RoPE. The defaults here serve configs built in code; the reader (`hf_config`) sets every field from the file."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's linear weights are stored: none (bf16/fp32), fp8 blocks, or INT4 pack-quantized."""

    method: str = "none"  # "none" | "fp8" | "compressed-tensors"
    weight_block_size: tuple[int, int] = (128, 128)  # fp8
    num_bits: int = 4  # compressed-tensors
    group_size: int = 32  # compressed-tensors
    ignore: tuple[str, ...] = ()  # compressed-tensors: module names / "re:" regexes left unquantized


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: direct q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense-layer SwiGLU width
    moe_intermediate_size: int  # routed / shared expert width
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    quantization: QuantConfig = QuantConfig()
    tensor_prefix: str = "model."  # "language_model.model." for the K2.5/K2.6 wrapper
    lm_head_name: str = "lm_head.weight"  # "language_model.lm_head.weight" for the wrapper

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the absorbed-MLA cache: c_kv (after norm) + k_pe (after rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        """m = 0.1 * mscale_all_dim * ln(factor) + 1 (1 when factor <= 1 or mscale_all_dim == 0)."""
        return yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """(Dn + Dr)^-0.5 * m^2: belongs to the logical 192-dim head, also in the absorbed form."""
        return self.qk_head_dim**-0.5 * self.yarn_mscale**2

    @property
    def rope_amplitude(self) -> float:
        """cos/sin multiplier mscale(factor, mscale) / mscale(factor, mscale_all_dim); 1.0 for Kimi targets."""
        rs = self.rope_scaling
        return yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(rs.factor, rs.mscale_all_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    # ---- HF I/O --------------------------------------------------------------------------------------------
    def to_hf_dict(self, *, wrapped: bool = False) -> dict[str, Any]:
        """The HF config.json this config reads back from (flat K2 layout, or the K2.5/K2.6 wrapper)."""
        rs = self.rope_scaling
        text = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "topk_method": self.topk_method,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "rope_theta": self.rope_theta,
            "rope_scaling": None
            if rs.factor == 1.0
            else {
                "type": "yarn",
                "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow,
                "mscale": rs.mscale,
                "mscale_all_dim": rs.mscale_all_dim,
            },
            "rope_interleave": True,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "num_nextn_predict_layers": 0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_to_hf(self.eos_token_id),
            "torch_dtype": "bfloat16",
        }
        quant = _quant_to_hf(self.quantization)
        if not wrapped:
            if quant is not None:
                text["quantization_config"] = quant
            return text
        text["model_type"] = "kimi_k2"
        text.pop("architectures")
        if quant is not None:
            text["quantization_config"] = quant
        return {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": text["eos_token_id"],
            "pad_token_id": self.vocab_size - 1,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
            "vision_config": {"hidden_size": 32, "num_hidden_layers": 1},
        }


def _eos_to_hf(ids: tuple[int, ...]) -> int | list[int] | None:
    """One id, a list of ids, or null for none (the reader takes an empty list for a mistake)."""
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _quant_to_hf(q: QuantConfig) -> dict[str, Any] | None:
    if q.method == "none":
        return None
    if q.method == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(q.weight_block_size),
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": q.num_bits,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": q.group_size,
                    "dynamic": False,
                    "observer": "minmax",
                    "actorder": None,
                    "block_structure": None,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(q.ignore),
    }


def tiny(**overrides: Any) -> ModelConfig:
    """A small Kimi-shaped config for tests: 1 dense + 2 MoE layers, grouped routing, YaRN."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_theta=50000.0,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def kimi_k2_6() -> ModelConfig:
    """Kimi K2.6 text-model shapes (for abstract sizing and full-width benchmarks; no weights here)."""
    return ModelConfig(
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=384,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        rope_theta=50000.0,
        rope_scaling=RopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=262144,
        rms_norm_eps=1e-5,
        bos_token_id=163584,
        eos_token_id=(163586,),
        quantization=QuantConfig(
            method="compressed-tensors",
            ignore=("re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                    "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"),
        ),
        tensor_prefix="language_model.model.",
        lm_head_name="language_model.lm_head.weight",
    )
