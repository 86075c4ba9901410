"""Random checkpoints in the exact HF formats (bf16, FP8-block, INT4 pack-quantized; flat K2 or K2.6 wrapper).

Tests load them through `HFCheckpoint` and compare against the *effective* weights returned here (what the stored
bytes decode to, as float64), so every format is checked end to end without a real multi-hundred-GB model.
"""
from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from kdtree_jax.checkpoint.hf import INDEX_FILE, LM_HEAD, SINGLE_FILE, expected_shapes
from kdtree_jax.model.config import ModelConfig, QuantConfig
from kdtree_jax.model.hf_config import config_from_hf_dict
from kdtree_jax.model.quant import dequant_fp8_block, dequant_int4, quant_fp8_block, quant_int4

FORMATS = ("bf16", "fp8", "int4")
DEFAULT_FP8_BLOCK = (16, 16)  # small so tiny dims get several tiles and ragged edges
INT4_GROUP = 32
K26_IGNORE = ("re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*")
NORM_NOISE = 0.1
BIAS_STD = 0.1
BF16 = np.dtype(ml_dtypes.bfloat16)


def synthetic_config(cfg: ModelConfig, fmt: str, *, fp8_block: tuple[int, int] | None = None) -> ModelConfig:
    """`cfg` with the quantization block of `fmt` (K2 fp8 blocks / K2.6 INT4 group 32 + ignore list)."""
    if fmt == "bf16":
        quant = QuantConfig()
    elif fmt == "fp8":
        block = fp8_block or (cfg.quantization.weight_block_size if cfg.quantization.method == "fp8"
                              else DEFAULT_FP8_BLOCK)
        quant = QuantConfig(method="fp8", weight_block_size=tuple(block))
    elif fmt == "int4":
        quant = QuantConfig(method="compressed-tensors", num_bits=4, group_size=INT4_GROUP, ignore=K26_IGNORE)
    else:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return dataclasses.replace(cfg, quantization=quant)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _is_router(name: str) -> bool:
    return ".mlp.gate." in name


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _random_value(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if _is_norm(name):
        return 1.0 + NORM_NOISE * rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        return BIAS_STD * rng.standard_normal(shape)
    if name == "embed_tokens.weight":
        return rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])  # Linear [out, in]: unit-ish activations


def _encode(name: str, value: np.ndarray, fmt: str, quant: QuantConfig) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Stored tensors (by suffix relative to `name`) and the effective float64 weight they decode to."""
    is_linear = value.ndim == 2 and name not in ("embed_tokens.weight", LM_HEAD) and not _is_router(name)
    if fmt == "fp8" and is_linear:
        w8, scale = quant_fp8_block(value, quant.weight_block_size)
        eff = dequant_fp8_block(w8, scale, quant.weight_block_size)
        return {"": w8, "_scale_inv": scale}, eff.astype(np.float64)
    if fmt == "int4" and is_linear and _is_routed_expert(name):
        packed, scale = quant_int4(value, quant.group_size)
        eff = dequant_int4(packed, scale, quant.group_size)
        return ({"_packed": packed, "_scale": scale, "_shape": np.asarray(value.shape, np.int32)},
                eff.astype(np.float64))
    if name.endswith("e_score_correction_bias"):
        stored = value.astype(np.float32)
    else:
        stored = value.astype(BF16)
    return {"": stored}, stored.astype(np.float64)


def write_synthetic_checkpoint(path: str | os.PathLike, cfg: ModelConfig, *, fmt: str = "bf16", wrapped: bool = False,
                               seed: int = 0, n_shards: int = 2, fp8_block: tuple[int, int] | None = None,
                               extra_files: dict[str, str | bytes] | None = None) -> dict[str, np.ndarray]:
    """Write config.json + safetensors (sharded with an index when n_shards > 1) + `extra_files` into `path`.

    Returns the effective weights (float64) by canonical name. The written config is
    `cfg.to_hf_dict(wrapped=wrapped)` with `fmt`'s quantization block; read it back with `HFCheckpoint.open`.
    """
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = synthetic_config(cfg, fmt, fp8_block=fp8_block)
    hf = cfg.to_hf_dict(wrapped=wrapped)
    cfg = config_from_hf_dict(hf)  # the prefixes the reader will use
    rng = np.random.default_rng(seed)

    stored: list[tuple[str, np.ndarray]] = []
    effective: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(cfg).items():
        parts, eff = _encode(name, _random_value(rng, name, shape), fmt, cfg.quantization)
        effective[name] = eff
        base = cfg.lm_head_name if name == LM_HEAD else cfg.tensor_prefix + name
        stored.extend((base + suffix, arr) for suffix, arr in parts.items())
        if name.endswith("layers.0.self_attn.o_proj.weight"):  # a rope buffer artifact the reader must skip
            inv_freq = np.arange(cfg.qk_rope_head_dim // 2, dtype=np.float32)
            stored.append((base.replace("o_proj.weight", "rotary_emb.inv_freq"), inv_freq))
    if wrapped:
        stored.append(("vision_tower.encoder.blocks.0.wqkv.weight", rng.standard_normal((8, 8)).astype(BF16)))
        stored.append(("mm_projector.proj.0.weight", rng.standard_normal((8, 8)).astype(BF16)))

    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    _write_shards(path, stored, n_shards)
    for fname, content in (extra_files or {}).items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(os.path.join(path, fname), mode) as f:
            f.write(content)
    return effective


def _write_shards(path: str, stored: list[tuple[str, np.ndarray]], n_shards: int) -> None:
    if n_shards == 1:
        save_file({n: np.ascontiguousarray(a) for n, a in stored}, os.path.join(path, SINGLE_FILE))
        return
    # Equal tensor counts per shard (not layer-aligned), so a layer may span two shards as in real checkpoints.
    bounds = np.linspace(0, len(stored), n_shards + 1).round().astype(int)
    weight_map, total = {}, 0
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = stored[bounds[i]: bounds[i + 1]]
        save_file({n: np.ascontiguousarray(a) for n, a in chunk}, os.path.join(path, fname))
        for n, a in chunk:
            weight_map[n] = fname
            total += a.nbytes
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
