"""Training the target: a training forward that also reports each MoE layer's expert load (for DeepSeek-V3's
aux-loss-free bias rule), AdamW with the router correction bias frozen out of the optimizer, the training init,
an exporter to the exact HF Kimi layout (the inverse of `weights.params_from_hf`), held-out NLL and greedy
continuations (the drafter's `regen` data and evaluation).

Axes: B batch, T sequence, V vocab, E experts, D hidden.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file

from kdtree_jax.checkpoint.atomic import atomic_dir
from kdtree_jax.checkpoint.hf import LM_HEAD, SINGLE_FILE, TOKENIZER_FILES, expected_shapes
from kdtree_jax.checkpoint.weights import build_model, random_hf_weights
from kdtree_jax.model.config import ModelConfig
from kdtree_jax.model.layers import rms_norm, rope_cos_sin, yarn_inv_freq
from kdtree_jax.model.mla import mla_prefill
from kdtree_jax.model.moe import route
from kdtree_jax.model.target import KimiModel, LatentCache, forward_prefill, forward_verify

BF16 = np.dtype(ml_dtypes.bfloat16)
FROZEN, DECAY, NO_DECAY = "frozen", "decay", "no_decay"
ROUTER_BIAS = "bias"  # MoE attribute holding e_score_correction_bias (updated outside the gradient)


@flax.struct.dataclass
class TrainForward:
    logits: jax.Array  # [B, T, V] f32
    hidden: jax.Array  # [B, T, len(taps) * D]
    loads: jax.Array  # [n_moe_layers, E] tokens routed to each expert in this batch


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def expert_load(moe, x: jax.Array) -> jax.Array:
    """Tokens per expert [E] (f32) under the router's biased top-k selection for inputs x [..., D]."""
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [M, D]
    bias = moe.bias[...] if moe.cfg.topk_method == "noaux_tc" else None
    _, idx = route(flat @ moe.router[...].astype(jnp.float32), bias, moe.cfg)  # [M, k]
    return jnp.zeros((moe.cfg.n_routed_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)


def target_forward(model: KimiModel, tokens: jax.Array, *, taps: Sequence[int] = ()) -> TrainForward:
    """Causal forward over fresh sequences tokens [B, T] from position 0 — the same math as `forward_prefill`
    with an empty cache (tests check that) — plus every MoE layer's expert load for the bias update."""
    cfg, dt = model.cfg, model.dtype
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_cos_sin(positions, yarn_inv_freq(cfg), cfg.rope_amplitude)  # [B, T, P/2]
    empty = jnp.zeros((b, t, cfg.latent_dim), model.cache_dtype)  # [B, T, A]
    h = model.embed[...][tokens].astype(dt)  # [B, T, D]
    loads, tapped = [], {}
    for i, layer in enumerate(model.layers):
        a, _ = mla_prefill(layer.attn, rms_norm(h, layer.input_norm[...], cfg.rms_norm_eps), cos, sin, 0, empty)
        h = h + a
        x = rms_norm(h, layer.post_norm[...], cfg.rms_norm_eps)
        if cfg.is_moe_layer(i):
            loads.append(expert_load(layer.mlp, x))
        h = h + layer.mlp(x)
        tapped[i] = h
    hidden = jnp.concatenate([tapped[k] for k in taps], axis=-1) if taps else jnp.zeros((b, t, 0), dt)
    logits = jnp.einsum("btd,dv->btv", rms_norm(h, model.norm[...], cfg.rms_norm_eps),
                        model.lm_head[...].astype(dt), preferred_element_type=jnp.float32)
    loads = jnp.stack(loads) if loads else jnp.zeros((0, max(cfg.n_routed_experts, 1)), jnp.float32)
    return TrainForward(logits=logits, hidden=hidden, loads=loads)


def token_nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross entropy: logits [..., V] (f32), labels [...] int -> [...] f32."""
    logits = logits.astype(jnp.float32)
    gold = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - gold


def aux_free_bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free balancing: bias_i += rate * sign(mean load - load_i) (outside the gradient)."""
    return bias + rate * jnp.sign(jnp.mean(load) - load)


def _path_keys(path) -> list:
    return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]


def apply_bias_updates(state, loads: jax.Array, cfg: ModelConfig, rate: float):
    """Return `state` (nnx.State of a KimiModel) with every MoE layer's correction bias moved by the rule."""
    row = {layer: j for j, layer in enumerate(moe_layers(cfg))}

    def upd(path, leaf):
        keys = _path_keys(path)
        if len(keys) >= 4 and keys[0] == "layers" and keys[2] == "mlp" and keys[3] == ROUTER_BIAS:
            return aux_free_bias_update(leaf, loads[row[int(keys[1])]], rate)
        return leaf

    return jax.tree_util.tree_map_with_path(upd, state)


def param_labels(state) -> Any:
    """optax label per leaf: router bias frozen (its gradient is zero and weight decay must not touch it),
    matrices decayed, vectors (norms) not."""

    def label(path, leaf):
        if ROUTER_BIAS in _path_keys(path):
            return FROZEN
        return DECAY if leaf.ndim >= 2 else NO_DECAY

    return jax.tree_util.tree_map_with_path(label, state)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    grad_clip: float
    min_lr_ratio: float
    b1: float = 0.9
    b2: float = 0.95


def make_optimizer(oc: OptimConfig, state) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (warmup + cosine) with decay on matrices only; frozen leaves get 0."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, oc.lr, max(1, min(oc.warmup_steps, oc.total_steps - 1)), max(oc.total_steps, 2),
        end_value=oc.lr * oc.min_lr_ratio)
    adamw = lambda wd: optax.adamw(schedule, b1=oc.b1, b2=oc.b2, weight_decay=wd)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(oc.grad_clip),
        optax.multi_transform({DECAY: adamw(oc.weight_decay), NO_DECAY: adamw(0.0), FROZEN: optax.set_to_zero()},
                              param_labels(state)),
    )


def init_target(cfg: ModelConfig, seed: int, *, dtype=jnp.float32) -> KimiModel:
    """Training init: `random_hf_weights` (N(0, 1/fan_in) linears) with unit norms and a zero router bias
    (the test-oriented random norms / bias of `init_random` would only slow training down)."""
    weights = random_hf_weights(cfg, seed)
    for name, value in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones_like(value)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = np.zeros_like(value)
    return build_model(cfg, weights.__getitem__, param_dtype=jnp.float32, dtype=dtype, moe_impl="dense")


def hf_tensors_from_model(model: KimiModel) -> dict[str, np.ndarray]:
    """Canonical HF tensors (float32, Linear [out, in]) of a float-expert model: inverse of `params_from_hf`."""
    cfg = model.cfg
    h, d, r = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank
    p = nnx.to_pure_dict(nnx.state(model))

    def f32(x) -> np.ndarray:
        return np.asarray(x, np.float32)

    def lin(x) -> np.ndarray:  # [in, out] -> [out, in]
        return np.ascontiguousarray(f32(x).T)

    out = {"embed_tokens.weight": f32(p["embed"]), "norm.weight": f32(p["norm"]), LM_HEAD: lin(p["lm_head"])}
    for i in range(cfg.num_hidden_layers):
        lp, pre = p["layers"][i], f"layers.{i}."
        at, a = lp["attn"], pre + "self_attn."
        out[pre + "input_layernorm.weight"] = f32(lp["input_norm"])
        out[pre + "post_attention_layernorm.weight"] = f32(lp["post_norm"])
        rq = cfg.q_lora_rank or 0
        qkv_a = f32(at["qkv_a"])  # [D, R_q + A]
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = lin(f32(at["q_proj"]).reshape(d, h * cfg.qk_head_dim))
        else:
            out[a + "q_a_proj.weight"] = lin(qkv_a[:, :rq])
            out[a + "q_a_layernorm.weight"] = f32(at["q_a_norm"])
            out[a + "q_b_proj.weight"] = lin(f32(at["q_b"]).reshape(rq, h * cfg.qk_head_dim))
        out[a + "kv_a_proj_with_mqa.weight"] = lin(qkv_a[:, rq:])
        out[a + "kv_a_layernorm.weight"] = f32(at["kv_a_norm"])
        kv_b = np.concatenate([f32(at["w_uk"]), f32(at["w_uv"])], axis=1)  # [H, Dn + Dv, R]
        out[a + "kv_b_proj.weight"] = kv_b.reshape(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r)
        out[a + "o_proj.weight"] = lin(f32(at["o_proj"]).reshape(h * cfg.v_head_dim, d))
        mlp, m = lp["mlp"], pre + "mlp."
        if not cfg.is_moe_layer(i):
            out.update(_mlp_hf(m, mlp, lin))
            continue
        if "gate" not in mlp:
            raise ValueError(f"layer {i}: routed experts are not float (INT4 export is not supported)")
        out[m + "gate.weight"] = lin(mlp["router"])
        if cfg.topk_method == "noaux_tc":
            out[m + "gate.e_score_correction_bias"] = f32(mlp[ROUTER_BIAS])
        for e in range(cfg.n_routed_experts):
            out.update(_swiglu_hf(f"{m}experts.{e}.", *(mlp[k][e] for k in ("gate", "up", "down")), lin))
        if cfg.n_shared_experts:
            out.update(_mlp_hf(m + "shared_experts.", mlp["shared"], lin))
    shapes = expected_shapes(cfg)
    if set(shapes) != set(out):
        raise ValueError(f"export mismatch: missing {sorted(set(shapes) - set(out))[:5]}, "
                         f"unexpected {sorted(set(out) - set(shapes))[:5]}")
    for name, shape in shapes.items():
        if out[name].shape != tuple(shape):
            raise ValueError(f"export: tensor {name!r} has shape {out[name].shape}, expected {tuple(shape)}")
    return out


def _swiglu_hf(prefix: str, gate, up, down, lin) -> dict[str, np.ndarray]:
    return {prefix + "gate_proj.weight": lin(gate), prefix + "up_proj.weight": lin(up),
            prefix + "down_proj.weight": lin(down)}


def _mlp_hf(prefix: str, w: dict, lin) -> dict[str, np.ndarray]:
    """HF tensors of an `MLP` (gate_up [D, 2, I] holds gate then up)."""
    gate_up = np.asarray(w["gate_up"])
    return _swiglu_hf(prefix, gate_up[:, 0], gate_up[:, 1], w["down"], lin)


def save_target_hf(model: KimiModel, out_dir: str, tokenizer_dir: str, *, extra_json: dict | None = None) -> int:
    """Write the target as an HF Kimi checkpoint dir (flat K2 config.json, bf16 tensors under the stored names,
    router bias f32, tokenizer files copied in), atomically. Returns the bytes of model.safetensors."""
    cfg = model.cfg
    tensors = {}
    for name, value in hf_tensors_from_model(model).items():
        stored = cfg.lm_head_name if name == LM_HEAD else cfg.tensor_prefix + name
        keep_f32 = name.endswith("e_score_correction_bias")
        tensors[stored] = np.ascontiguousarray(value if keep_f32 else value.astype(BF16))
    copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
    if "tiktoken.model" not in copied:
        raise FileNotFoundError(f"{tokenizer_dir}: tiktoken.model missing (tokenizer dir)")
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg.to_hf_dict(), f, indent=2)
        for n in copied:
            shutil.copyfile(os.path.join(tokenizer_dir, n), os.path.join(tmp, n))
        for n, obj in (extra_json or {}).items():
            with open(os.path.join(tmp, n), "w") as f:
                json.dump(obj, f, indent=2)
        size = os.path.getsize(os.path.join(tmp, SINGLE_FILE))
    return size


def round_params_bf16(model: nnx.Module) -> nnx.Module:
    """A copy of `model` whose float params went through bf16 and back: what a bf16 checkpoint of it holds
    (the router correction bias is stored f32 and stays as is)."""
    graphdef, state = nnx.split(model)

    def rnd(path, x):
        if ROUTER_BIAS in _path_keys(path) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(jnp.bfloat16).astype(x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(rnd, state))


@functools.partial(jax.jit, static_argnums=0)
def _nll_sum(graphdef, state, tokens, valid):
    """Summed next-token NLL of tokens [B, T] over rows with valid [B] = 1 (compiled once per model structure)."""
    m = nnx.merge(graphdef, state)
    cache = LatentCache.zeros(m.cfg, tokens.shape[0], tokens.shape[1], m.cache_dtype)
    out = forward_prefill(m, tokens, 0, cache)
    nll = token_nll(out.logits[:, :-1], tokens[:, 1:])  # [B, T-1]
    return (nll.sum(-1) * valid).sum()


def heldout_nll(model: KimiModel, windows: np.ndarray, batch: int) -> float:
    """Mean next-token NLL of the target over windows [N, T] (columns 1..T-1), through `forward_prefill`."""
    graphdef, state = nnx.split(model)
    n, t = windows.shape
    total = 0.0
    for s in range(0, n, batch):
        chunk = windows[s: s + batch]
        valid = np.zeros(batch, np.float32)
        valid[: len(chunk)] = 1.0
        if len(chunk) < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), axis=0)])
        total += float(_nll_sum(graphdef, state, jnp.asarray(chunk), jnp.asarray(valid)))
    return total / (n * (t - 1))


def greedy_continue_fn(graphdef, n_new: int):
    """jitted (state, prompts [B, P]) -> [B, P + n_new]: prompt + the target's greedy continuation.

    Prefill with plain MLA, then n_new - 1 absorbed single-token steps (the engine's AR path) in a fori_loop.
    """

    @jax.jit
    def run(state, prompts):
        model = nnx.merge(graphdef, state)
        b, p = prompts.shape
        total = p + n_new
        cache = LatentCache.zeros(model.cfg, b, total, model.cache_dtype)
        out = forward_prefill(model, prompts, 0, cache)
        tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompts)
        tokens = tokens.at[:, p].set(jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32))
        one = jnp.ones((b, 1, 1), bool)

        def step(i, carry):
            tokens, cache = carry
            pos = p + i
            cur = jax.lax.dynamic_slice_in_dim(tokens, pos, 1, axis=1)  # [B, 1]
            o = forward_verify(model, cur, jnp.full((b, 1), pos, jnp.int32), jnp.full((b,), pos, jnp.int32), one,
                               cache)
            nxt = jnp.argmax(o.logits[:, 0], axis=-1).astype(jnp.int32)
            return jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], pos + 1, axis=1), o.cache

        tokens, _ = jax.lax.fori_loop(0, n_new - 1, step, (tokens, out.cache))
        return tokens

    return run


def greedy_continue(model: KimiModel, prompts: np.ndarray, n_new: int, batch: int) -> np.ndarray:
    """Greedy continuations [N, P + n_new] for prompts [N, P], `batch` rows per compiled call (last one padded)."""
    graphdef, state = nnx.split(model)
    fn = greedy_continue_fn(graphdef, n_new)
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s: s + batch]
        pad = batch - len(chunk)
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)]) if pad else chunk
        out.append(np.asarray(fn(state, jnp.asarray(padded, jnp.int32)))[: len(chunk)])
    return np.concatenate(out)
