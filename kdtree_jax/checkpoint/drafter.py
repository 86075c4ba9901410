"""The z-lab HF layout of a DFlash drafter (config.json + safetensors): tensor names, load and atomic save."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from kdtree_jax.checkpoint.atomic import atomic_dir
from kdtree_jax.model.drafter import DFlashDrafter
from kdtree_jax.model.drafter_config import DrafterConfig


def hf_param_names(cfg: DrafterConfig) -> Iterator[tuple[str, tuple[str | int, ...], bool]]:
    """(HF tensor name, module path, is_linear) for every drafter weight; linear weights are [out, in] in HF."""
    yield "fc.weight", ("fc",), True
    yield "hidden_norm.weight", ("hidden_norm",), False
    for i in range(cfg.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"layers.{i}.self_attn.{proj}.weight", ("layers", i, "self_attn", proj), True
        for norm in ("q_norm", "k_norm"):
            yield f"layers.{i}.self_attn.{norm}.weight", ("layers", i, "self_attn", norm), False
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"layers.{i}.{norm}.weight", ("layers", i, norm), False
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"layers.{i}.mlp.{proj}.weight", ("layers", i, "mlp", proj), True
    yield "norm.weight", ("norm",), False


def _module_at(drafter: DFlashDrafter, path: tuple[str | int, ...]) -> nnx.Module:
    mod: Any = drafter
    for part in path:
        mod = mod[part] if isinstance(part, int) else getattr(mod, part)
    return mod


def _param(mod: nnx.Module, is_linear: bool) -> nnx.Param:
    return mod.kernel if is_linear else mod.weight


def hf_tensors(drafter: DFlashDrafter) -> dict[str, np.ndarray]:
    """Drafter weights as z-lab HF tensors ([out, in]), in the parameter dtype."""
    out = {}
    for name, path, is_linear in hf_param_names(drafter.cfg):
        value = np.asarray(_param(_module_at(drafter, path), is_linear)[...])
        out[name] = np.ascontiguousarray(value.T) if is_linear else value
    return out


def set_hf_tensors(drafter: DFlashDrafter, tensors: dict[str, np.ndarray], *, source: str = "tensors",
                   files: dict[str, str] | None = None) -> None:
    """Load z-lab HF tensors into `drafter` in place; missing / unexpected / mis-shaped tensors raise naming them
    (and the file each came from, when `files` maps tensor name -> file)."""
    files = files or {}
    expected = {name for name, _, _ in hf_param_names(drafter.cfg)}
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ValueError(f"{files.get(unexpected[0], source)}: unexpected drafter tensors {unexpected[:8]} "
                         "(not a plain DFlashDraftModel?)")
    for name, path, is_linear in hf_param_names(drafter.cfg):
        if name not in tensors:
            raise ValueError(f"{source}: drafter tensor {name!r} is missing")
        param = _param(_module_at(drafter, path), is_linear)
        want = param.shape[::-1] if is_linear else param.shape
        value = tensors[name]
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"{files.get(name, source)}: drafter tensor {name!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(want)} (from config.json)")
        value = np.asarray(value)
        if value.dtype != param.dtype:
            value = value.astype(np.float32)
        param.set_value(jnp.asarray(value.T if is_linear else value, dtype=param.dtype))


def _read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of an HF safetensors dir (single file or sharded with model.safetensors.index.json), and the file
    each came from. Plain safetensors suffices: drafters are never quantized."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files")
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            raise FileNotFoundError(f"{fpath}: listed in the index but missing")
        with safe_open(fpath, framework="np") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
                origin[name] = fpath
    return tensors, origin


def load_drafter(path: str | os.PathLike, dtype: Any = jnp.bfloat16, *, compute_dtype: Any = None,
                 yarn_amplitude: str = "hf", sliding_causal: bool = False) -> DFlashDrafter:
    """A z-lab drafter dir (config.json + safetensors) -> DFlashDrafter with params in `dtype`."""
    path = os.fspath(path)
    cfg = DrafterConfig.from_json(path, yarn_amplitude=yarn_amplitude, sliding_causal=sliding_causal)
    tensors, files = _read_safetensors(path)
    return drafter_from_hf_tensors(cfg, tensors, dtype, compute_dtype=compute_dtype, source=path, files=files)


def drafter_from_hf_tensors(cfg: DrafterConfig, tensors: dict[str, np.ndarray], dtype: Any = jnp.bfloat16, *,
                            compute_dtype: Any = None, source: str = "tensors",
                            files: dict[str, str] | None = None) -> DFlashDrafter:
    """Build the module abstractly (no random init) and fill it from z-lab HF tensors."""
    drafter = nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0), param_dtype=dtype,
                                                   compute_dtype=compute_dtype or dtype))
    set_hf_tensors(drafter, tensors, source=source, files=files)
    return drafter


def save_drafter(drafter: DFlashDrafter, cfg: DrafterConfig, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors in z-lab layout; atomic (temp dir in the same parent, then rename)."""
    with atomic_dir(path) as tmp:
        tensors = {}
        for name, value in hf_tensors(drafter).items():
            keep = value.dtype in (np.float32, np.float16) or value.dtype == ml_dtypes.bfloat16
            tensors[name] = np.ascontiguousarray(value if keep else value.astype(np.float32))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        hf = cfg.to_hf_dict()
        hf["torch_dtype"] = "bfloat16" if any(t.dtype == ml_dtypes.bfloat16 for t in tensors.values()) else "float32"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
