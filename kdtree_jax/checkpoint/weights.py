"""HF tensor names -> `KimiModel` parameters (and random construction for tests and training).

The only place that knows how HF packs MLA and MoE weights: Linear weights are [out, in] and become [in, out];
q_b rows are head-major [nope | rope]; kv_a rows are [c_kv | k_pe]; kv_b rows are head-major [k_nope | v] and split
into W_UK / W_UV; o_proj columns are head-major; routed experts are stacked along a leading E axis (INT4 experts stay
packed). Every tensor's shape is checked, and errors name the tensor.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.checkpoint.hf import expected_shapes
from kdtree_jax.model.config import ModelConfig
from kdtree_jax.model.layers import NORM_INIT_NOISE
from kdtree_jax.model.quant import Int4Packed, quant_int4
from kdtree_jax.model.target import KimiModel

BIAS_INIT_STD = 0.1  # router correction bias: large enough to change some expert choices

Getter = Callable[[str], "np.ndarray | Int4Packed"]


class WeightError(ValueError):
    """A tensor is missing, has the wrong shape, or mixes formats; the message names the tensor."""


def random_hf_weights(cfg: ModelConfig, seed: int = 0, *, int4_experts: bool = False) -> dict:
    """Random weights under their canonical HF names ([out, in] Linear layout), drawn with numpy.

    Norms are 1 + noise and the router bias is non-zero so tests notice a skipped norm or bias; with
    `int4_experts` the routed experts are pack-quantized (`Int4Packed`, group `cfg.quantization.group_size`).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            value = 1.0 + NORM_INIT_NOISE * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            value = BIAS_INIT_STD * rng.standard_normal(shape)
        elif name == "embed_tokens.weight":
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        if int4_experts and ".mlp.experts." in name:
            packed, scale = quant_int4(value, cfg.quantization.group_size)
            out[name] = Int4Packed(packed, scale, tuple(shape), cfg.quantization.group_size)
        else:
            out[name] = value.astype(np.float32)
    return out


def init_random(cfg: ModelConfig, seed: int = 0, *, param_dtype=jnp.float32, dtype=jnp.float32, cache_dtype=None,
                expert_format: str = "float", moe_impl: str = "auto") -> KimiModel:
    """A random model (tests, smoke runs): `random_hf_weights` mapped through `params_from_hf`.

    Drawn in numpy rather than with the modules' jax initialisers: on CPU every distinct random op compiles
    separately, which costs seconds even for the tiny config.
    """
    weights = random_hf_weights(cfg, seed, int4_experts=expert_format == "int4")
    return build_model(cfg, weights.__getitem__, param_dtype=param_dtype, dtype=dtype, cache_dtype=cache_dtype,
                       expert_format=expert_format, moe_impl=moe_impl)


def detect_expert_format(cfg: ModelConfig, get: Getter) -> str:
    """'int4' when the first routed expert is pack-quantized, else 'float'."""
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    if not moe_layers:
        return "float"
    first = _fetch(get, f"layers.{moe_layers[0]}.mlp.experts.0.gate_proj.weight")
    return "int4" if isinstance(first, Int4Packed) else "float"


def load_model(source, *, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, cache_dtype=None,
               moe_impl: str = "auto") -> KimiModel:
    """Build a `KimiModel` from an `HFCheckpoint` (anything with `.config` and `.get(canonical_name)`)."""
    cfg = source.config
    return build_model(cfg, source.get, param_dtype=param_dtype, dtype=dtype, cache_dtype=cache_dtype,
                       expert_format=detect_expert_format(cfg, source.get), moe_impl=moe_impl)


def build_model(cfg: ModelConfig, get: Getter, *, param_dtype=jnp.float32, dtype=jnp.float32, cache_dtype=None,
                expert_format: str = "float", moe_impl: str = "auto") -> KimiModel:
    """`KimiModel` whose parameters come from `get(canonical_name)`; modules are only traced, never initialised."""

    def build():
        return KimiModel(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype, cache_dtype=cache_dtype,
                         expert_format=expert_format, moe_impl=moe_impl)

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    pure = params_from_hf(cfg, get, param_dtype=param_dtype, expert_format=expert_format)
    _check_against(abstract, pure)
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graphdef, abstract)


def params_from_hf(cfg: ModelConfig, get: Getter, *, param_dtype=jnp.float32, expert_format: str = "float") -> dict:
    """Pure-dict parameter tree (as `nnx.to_pure_dict(nnx.state(model))`) from canonical HF names."""
    h, d = cfg.num_attention_heads, cfg.hidden_size
    dn, dv, dq, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim, cfg.kv_lora_rank

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        value = _fetch(get, name)
        if isinstance(value, Int4Packed):
            raise WeightError(f"tensor {name!r} is INT4 pack-quantized; only routed experts may be")
        value = np.asarray(value)
        if tuple(value.shape) != tuple(shape):
            raise WeightError(f"tensor {name!r} has shape {list(value.shape)}, expected {list(shape)}")
        return value.astype(np.float32)

    def param(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, dtype=param_dtype)

    def linear(name: str, n_out: int, n_in: int) -> np.ndarray:
        return fetch(name, (n_out, n_in)).T  # [in, out]

    def swiglu(prefix: str, inter: int) -> dict:
        gate_up = np.stack([linear(prefix + "gate_proj.weight", inter, d), linear(prefix + "up_proj.weight", inter, d)],
                           axis=1)  # [D, 2, I]
        return {"gate_up": param(gate_up), "down": param(linear(prefix + "down_proj.weight", d, inter))}

    layers = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        attn = {}
        q_a = np.zeros((d, 0), np.float32)
        if cfg.q_lora_rank is None:
            attn["q_proj"] = param(linear(a + "q_proj.weight", h * dq, d).reshape(d, h, dq))
        else:
            rq = cfg.q_lora_rank
            q_a = linear(a + "q_a_proj.weight", rq, d)
            attn["q_a_norm"] = param(fetch(a + "q_a_layernorm.weight", (rq,)))
            attn["q_b"] = param(linear(a + "q_b_proj.weight", h * dq, rq).reshape(rq, h, dq))
        kv_a = linear(a + "kv_a_proj_with_mqa.weight", r + cfg.qk_rope_head_dim, d)
        attn["qkv_a"] = param(np.concatenate([q_a, kv_a], axis=1))  # [D, R_q + A]: `mla.MLA`'s fused layout
        attn["kv_a_norm"] = param(fetch(a + "kv_a_layernorm.weight", (r,)))
        kv_b = fetch(a + "kv_b_proj.weight", (h * (dn + dv), r)).reshape(h, dn + dv, r)
        attn["w_uk"], attn["w_uv"] = param(kv_b[:, :dn]), param(kv_b[:, dn:])
        attn["o_proj"] = param(linear(a + "o_proj.weight", d, h * dv).reshape(h, dv, d))
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            mlp = _moe_params(cfg, get, m, fetch, param, expert_format)
            if cfg.n_shared_experts:
                mlp["shared"] = swiglu(m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            mlp = swiglu(m, cfg.intermediate_size)
        layers[i] = {"input_norm": param(fetch(p + "input_layernorm.weight", (d,))), "attn": attn,
                     "post_norm": param(fetch(p + "post_attention_layernorm.weight", (d,))), "mlp": mlp}
    return {
        "embed": param(fetch("embed_tokens.weight", (cfg.vocab_size, d))),
        "layers": layers,
        "norm": param(fetch("norm.weight", (d,))),
        "lm_head": param(linear("lm_head.weight", cfg.vocab_size, d)),
    }


def _moe_params(cfg: ModelConfig, get: Getter, m: str, fetch, param, expert_format: str) -> dict:
    d, e, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    out = {"router": param(fetch(m + "gate.weight", (e, d)).T)}
    if cfg.topk_method == "noaux_tc":
        out["bias"] = jnp.asarray(fetch(m + "gate.e_score_correction_bias", (e,)), jnp.float32)
    shapes = {"gate": (inter, d), "up": (inter, d), "down": (d, inter)}
    for proj, shape in shapes.items():
        names = [f"{m}experts.{j}.{proj}_proj.weight" for j in range(e)]
        if expert_format == "float":
            out[proj] = param(np.stack([fetch(n, shape).T for n in names]))  # [E, in, out]
            continue
        packed, scale = [], []
        for n in names:
            value = _fetch(get, n)
            if not isinstance(value, Int4Packed):
                raise WeightError(f"tensor {n!r} is not INT4 pack-quantized but other routed experts are")
            if tuple(value.shape) != shape or value.group_size != cfg.quantization.group_size:
                raise WeightError(f"tensor {n!r} has INT4 shape {list(value.shape)} group {value.group_size}, "
                                  f"expected {list(shape)} group {cfg.quantization.group_size}")
            packed.append(np.asarray(value.packed, np.int32))
            scale.append(np.asarray(value.scale))
        out[proj + "_packed"] = jnp.asarray(np.stack(packed))  # [E, out, in/8] int32
        out[proj + "_scale"] = jnp.asarray(np.stack(scale), jnp.bfloat16)  # [E, out, in/group]
    return out


def _fetch(get: Getter, name: str):
    try:
        return get(name)
    except KeyError:
        raise WeightError(f"tensor {name!r} is missing") from None


def _check_against(abstract: nnx.State, pure: dict) -> None:
    """Every model leaf gets a value of the right shape, and no value is left over."""
    want = {k: v for k, v in _flatten(nnx.to_pure_dict(abstract))}
    got = {k: v for k, v in _flatten(pure)}
    if set(want) != set(got):
        raise WeightError(f"parameter tree mismatch: missing {sorted(set(want) - set(got))[:5]}, "
                          f"unexpected {sorted(set(got) - set(want))[:5]}")
    for k, v in want.items():
        if tuple(v.shape) != tuple(got[k].shape):
            raise WeightError(f"parameter {k} has shape {tuple(got[k].shape)}, model expects {tuple(v.shape)}")


def _flatten(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from _flatten(v, path)
        else:
            yield path, v
