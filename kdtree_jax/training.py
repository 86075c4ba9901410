"""Shared training utilities for the kdtree-mini target and its DFlash drafter (scripts/train_*.py, eval_pair.py).

Data: the stdlib corpus tokenized once (cached next to the text), packed into shuffled fixed-length windows.
Target: a training forward that also reports each MoE layer's expert load (for the aux-loss-free bias rule),
AdamW with the router correction bias frozen out of the optimizer, and an exporter to the exact HF Kimi layout
(the inverse of `weights.params_from_hf`). Drafter: DFlash anchors, position-decayed block CE (+ optional KL to
the target), greedy target continuations for `regen` data. Plus config-dataclass CLI flags and curve logging.

Axes: B batch, T sequence, V vocab, E experts, n anchors per sequence, L drafter block, F tapped feature width.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx

from kdtree_jax.atomic import atomic_dir
from kdtree_jax.checkpoint_io import file_sha256
from kdtree_jax.config import ModelConfig
from kdtree_jax.drafter import train_logits
from kdtree_jax.hf_checkpoint import LM_HEAD, SINGLE_FILE, TOKENIZER_FILES, expected_shapes
from kdtree_jax.layers import rms_norm, rope_cos_sin, yarn_inv_freq
from kdtree_jax.mla import mla_prefill
from kdtree_jax.model import KimiModel, LatentCache, forward_prefill, forward_verify
from kdtree_jax.moe import route
from kdtree_jax.weights import build_model, random_hf_weights

BF16 = np.dtype(ml_dtypes.bfloat16)
TOKEN_CACHE_SUFFIX = ".tokens.npy"
FINGERPRINT_CHARS = 16
FROZEN, DECAY, NO_DECAY = "frozen", "decay", "no_decay"
ROUTER_BIAS = "bias"  # MoE attribute holding e_score_correction_bias (updated outside the gradient)


# ---- CLI from one config dataclass ---------------------------------------------------------------------------
def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per dataclass field (type from the default value), so every default lives in the dataclass."""
    for f in dataclasses.fields(cls):
        default = f.default
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, dest=f.name, type=type(default), default=None, choices=choices,
                                help=f"{help_text} (default {default!r})")


def config_from_args(cls: type, args: argparse.Namespace, base: Any | None = None) -> Any:
    """`base` (or cls()) with every flag the user actually passed applied on top."""
    base = cls() if base is None else base
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **given)


# ---- files ---------------------------------------------------------------------------------------------------
def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomic JSON write (temp file + rename)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


# ---- corpus --------------------------------------------------------------------------------------------------
def corpus_info(corpus_dir: str) -> dict[str, Any]:
    """Manifest hash + Python version of the corpus (the GPU host's stdlib may differ slightly)."""
    manifest = os.path.join(corpus_dir, "manifest.json")
    if not os.path.isfile(manifest):
        raise FileNotFoundError(f"{manifest}: corpus manifest missing; run `python scripts/build_corpus.py "
                                f"--out {corpus_dir}` first")
    with open(manifest) as f:
        m = json.load(f)
    return {"manifest_sha256": file_sha256(manifest), "python_version": m.get("python_version"),
            "outputs": m.get("outputs")}


def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = os.path.join(tokenizer_dir, name)
        if os.path.isfile(p):
            h.update(name.encode() + b"\0" + open(p, "rb").read())
    return h.hexdigest()


def load_tokens(text_path: str, tokenizer, tokenizer_dir: str, *, use_cache: bool = True) -> np.ndarray:
    """Token ids [N] int32 of a corpus text file; cached as <file>.<text+tokenizer hash>.tokens.npy."""
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"{text_path}: corpus text missing; run scripts/build_corpus.py")
    key = hashlib.sha256((file_sha256(text_path) + tokenizer_fingerprint(tokenizer_dir)).encode()).hexdigest()
    cache = f"{text_path}.{key[:FINGERPRINT_CHARS]}{TOKEN_CACHE_SUFFIX}"
    if use_cache and os.path.isfile(cache):
        return np.load(cache)
    with open(text_path, encoding="utf-8") as f:
        ids = np.asarray(tokenizer.encode(f.read(), allow_special=False), np.int32)
    if use_cache:
        tmp = f"{cache}.tmp{os.getpid()}.npy"
        np.save(tmp, ids)
        os.replace(tmp, cache)
    return ids


class PackedBatches:
    """Endless [B, T] windows of a token stream: each epoch cuts it at a random offset into non-overlapping
    windows and shuffles them (seeded numpy, so a run is reproducible)."""

    def __init__(self, tokens: np.ndarray, window: int, batch: int, seed: int):
        if len(tokens) < window * batch:
            raise ValueError(f"token stream of {len(tokens)} tokens is too short for batch {batch} x window {window}")
        self.tokens, self.window, self.batch = tokens, window, batch
        self.rng = np.random.default_rng(seed)
        self.epoch, self._order, self._pos, self._offset = -1, np.zeros(0, np.int64), 0, 0

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._offset = int(self.rng.integers(self.window))
        n = (len(self.tokens) - self._offset) // self.window
        self._order, self._pos = self.rng.permutation(n), 0

    @property
    def epochs_seen(self) -> float:
        return max(self.epoch, 0) + self._pos / max(len(self._order), 1)

    def next(self) -> np.ndarray:
        if self._pos + self.batch > len(self._order):
            self._new_epoch()
        idx = self._order[self._pos: self._pos + self.batch]
        self._pos += self.batch
        starts = self._offset + idx * self.window
        return self.tokens[starts[:, None] + np.arange(self.window)].astype(np.int32)  # [B, T]


def eval_windows(tokens: np.ndarray, window: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows [N, window] from the start of `tokens`, evenly thinned to at most max_windows."""
    n = len(tokens) // window
    if n == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window ({window})")
    keep = np.unique(np.linspace(0, n - 1, min(n, max_windows)).round().astype(np.int64))
    return tokens[keep[:, None] * window + np.arange(window)].astype(np.int32)


def unigram_log_probs(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Add-one smoothed unigram log-probabilities [V] (float64) from training counts."""
    counts = np.bincount(tokens, minlength=vocab).astype(np.float64)
    return np.log((counts + 1.0) / (counts.sum() + vocab))


def unigram_nll(log_probs: np.ndarray, windows: np.ndarray) -> float:
    """Mean unigram NLL over the same predicted tokens as the model's eval (columns 1..T-1)."""
    return float(-log_probs[windows[:, 1:]].mean())


# ---- target --------------------------------------------------------------------------------------------------
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
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = lin(f32(at["q_proj"]).reshape(d, h * cfg.qk_head_dim))
        else:
            out[a + "q_a_proj.weight"] = lin(at["q_a"])
            out[a + "q_a_layernorm.weight"] = f32(at["q_a_norm"])
            out[a + "q_b_proj.weight"] = lin(f32(at["q_b"]).reshape(cfg.q_lora_rank, h * cfg.qk_head_dim))
        out[a + "kv_a_proj_with_mqa.weight"] = lin(at["kv_a"])
        out[a + "kv_a_layernorm.weight"] = f32(at["kv_a_norm"])
        kv_b = np.concatenate([f32(at["w_uk"]), f32(at["w_uv"])], axis=1)  # [H, Dn + Dv, R]
        out[a + "kv_b_proj.weight"] = kv_b.reshape(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r)
        out[a + "o_proj.weight"] = lin(f32(at["o_proj"]).reshape(h * cfg.v_head_dim, d))
        mlp, m = lp["mlp"], pre + "mlp."
        if not cfg.is_moe_layer(i):
            out.update(_swiglu_hf(m, mlp, lin))
            continue
        if "gate" not in mlp:
            raise ValueError(f"layer {i}: routed experts are not float (INT4 export is not supported)")
        out[m + "gate.weight"] = lin(mlp["router"])
        if cfg.topk_method == "noaux_tc":
            out[m + "gate.e_score_correction_bias"] = f32(mlp[ROUTER_BIAS])
        for e in range(cfg.n_routed_experts):
            out.update(_swiglu_hf(f"{m}experts.{e}.", {k: mlp[k][e] for k in ("gate", "up", "down")}, lin))
        if cfg.n_shared_experts:
            out.update(_swiglu_hf(m + "shared_experts.", mlp["shared"], lin))
    shapes = expected_shapes(cfg)
    if set(shapes) != set(out):
        raise ValueError(f"export mismatch: missing {sorted(set(shapes) - set(out))[:5]}, "
                         f"unexpected {sorted(set(out) - set(shapes))[:5]}")
    for name, shape in shapes.items():
        if out[name].shape != tuple(shape):
            raise ValueError(f"export: tensor {name!r} has shape {out[name].shape}, expected {tuple(shape)}")
    return out


def _swiglu_hf(prefix: str, w: dict, lin) -> dict[str, np.ndarray]:
    return {prefix + "gate_proj.weight": lin(w["gate"]), prefix + "up_proj.weight": lin(w["up"]),
            prefix + "down_proj.weight": lin(w["down"])}


def save_target_hf(model: KimiModel, out_dir: str, tokenizer_dir: str, *, extra_json: dict | None = None) -> int:
    """Write the target as an HF Kimi checkpoint dir (flat K2 config.json, bf16 tensors under the stored names,
    router bias f32, tokenizer files copied in), atomically. Returns the bytes of model.safetensors."""
    from safetensors.numpy import save_file

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


# ---- greedy continuation (regen data, eval) -------------------------------------------------------------------
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


# ---- drafter -------------------------------------------------------------------------------------------------
def dflash_position_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..L-1 -> [L-1] float32."""
    return np.exp(-np.arange(block_size - 1, dtype=np.float64) / gamma).astype(np.float32)


def sample_anchors(rng: np.random.Generator, lo: np.ndarray, hi: int, n: int) -> np.ndarray:
    """n distinct anchors per row, uniformly from [lo_b, hi] -> [B, n] int32 (sorted per row)."""
    out = np.empty((len(lo), n), np.int32)
    for b, low in enumerate(lo):
        if hi - low + 1 < n:
            raise ValueError(f"row {b}: anchor range [{low}, {hi}] holds fewer than n_anchors={n} positions")
        out[b] = np.sort(rng.choice(np.arange(low, hi + 1), size=n, replace=False))
    return out


def block_labels(tokens: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """True continuation tokens[a + k], k = 1..L-1: tokens [B, T], anchors [B, n] -> [B, n, L-1]."""
    idx = anchors[..., None] + jnp.arange(1, block_size, dtype=jnp.int32)  # [B, n, L-1]
    b = tokens.shape[0]
    return jnp.take_along_axis(tokens, idx.reshape(b, -1), axis=1).reshape(idx.shape)


def block_target_logits(target_logits: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """The target's predictive logits for block positions k = 1..L-1 (its row a + k - 1) -> [B, n, L-1, V]."""
    b, _, v = target_logits.shape
    idx = anchors[..., None] + jnp.arange(block_size - 1, dtype=jnp.int32)  # [B, n, L-1]
    rows = jnp.take_along_axis(target_logits, idx.reshape(b, -1)[..., None], axis=1)
    return rows.reshape(idx.shape + (v,))


def dflash_loss(draft_logits: jax.Array, labels: jax.Array, weights: jax.Array,
                target_logits: jax.Array | None = None, distill_weight: float = 0.0
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Position-weighted CE on draft logits [B, n, L-1, V] vs labels [B, n, L-1], plus optional
    distill_weight * KL(p_target || q_draft) with the same weights. Returns (loss, metrics)."""
    w = weights / weights.sum()  # [L-1]
    ce_k = token_nll(draft_logits, labels).mean(axis=(0, 1))  # [L-1]
    ce = (ce_k * w).sum()
    metrics = {"ce": ce, "ce_per_pos": ce_k,
               "acc_per_pos": (jnp.argmax(draft_logits, -1) == labels).mean(axis=(0, 1))}
    loss = ce
    if target_logits is not None and distill_weight > 0:
        logp_t = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
        kl_k = (jnp.exp(logp_t) * (logp_t - logq)).sum(-1).mean(axis=(0, 1))  # [L-1]
        kl = (kl_k * w).sum()
        metrics["kl"] = kl
        loss = loss + distill_weight * kl
    return loss, metrics


def chain_acceptance(draft_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """DFlash chain acceptance length per block (1 + leading matches), draft_ids / labels [..., L-1]."""
    return 1 + np.cumprod(draft_ids == labels, axis=-1).sum(-1)


def chain_walk(taus: np.ndarray, start: int) -> list[int]:
    """The acceptance lengths a chain decode takes over one sequence, given every anchor's acceptance `taus[a]`:
    each round's block starts where the last one's accepted tokens end (a -> a + taus[a]).

    Why: the mean of `taus` weighs every position once, but a decode spends one round per block, so a stretch of
    long acceptances is crossed in few rounds; the per-round mean is what the engine reports."""
    out, a = [], start
    while a < len(taus):
        out.append(int(taus[a]))
        a += int(taus[a])
    return out


# ---- logging -------------------------------------------------------------------------------------------------
class CurveLog:
    """Collects per-step records; writes <name>_curve.json and (matplotlib permitting) <name>_curve.png."""

    def __init__(self, log_dir: str, name: str):
        self.log_dir, self.name = log_dir, name
        self.records: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        os.makedirs(log_dir, exist_ok=True)

    def add(self, step: int, **values: Any) -> dict[str, Any]:
        rec = {"step": step, "time_s": round(time.perf_counter() - self.t0, 3)}
        rec.update({k: (float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()) for k, v in values.items()})
        self.records.append(rec)
        return rec

    def save(self, plot_keys: Sequence[str] = ("loss",)) -> dict[str, str | None]:
        json_path = os.path.join(self.log_dir, f"{self.name}_curve.json")
        write_json(json_path, {"name": self.name, "records": self.records})
        return {"curve_json": json_path, "curve_png": self._plot(plot_keys)}

    def _plot(self, keys: Sequence[str]) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: skipping the PNG curve")
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in keys:
            pts = [(r["step"], r[k]) for r in self.records if isinstance(r.get(k), float)]
            if pts:
                ax.plot(*zip(*pts), label=k)
        ax.set_xlabel("step")
        ax.set_ylabel("nats / token")
        ax.set_title(self.name)
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(self.log_dir, f"{self.name}_curve.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def device_summary() -> dict[str, Any]:
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": getattr(d, "device_kind", str(d)), "count": jax.device_count(),
            "jax": jax.__version__}


def perplexity(nll: float) -> float:
    return float(math.exp(min(nll, 700.0)))


# ---- evaluation ----------------------------------------------------------------------------------------------
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


def global_norm(tree) -> jax.Array:
    """L2 norm over all leaves (optax renamed its helper across versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def drafter_block_argmax_fn(tgraph, dgraph, taps: Sequence[int], block_size: int):
    """jitted (target_state, drafter_state, tokens [B, T], anchors [B, n]) -> drafter argmax ids [B, n, L-1]."""

    @jax.jit
    def run(tstate, dstate, tokens, anchors):
        target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
        cache = LatentCache.zeros(target.cfg, tokens.shape[0], tokens.shape[1], target.cache_dtype)
        out = forward_prefill(target, tokens, 0, cache, taps=taps)
        logits = train_logits(drafter, out.hidden, tokens, anchors, target.embed_table(), target.lm_head_table())
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return run


def drafter_agreement(target: KimiModel, drafter, seqs: np.ndarray, lo: int, stride: int, batch: int,
                      walk_from: int | None = None) -> dict[str, Any]:
    """Drafter top-1 vs the sequence's own continuation (for greedy target continuations: the target's choice)
    at every block position, anchors lo, lo + stride, ... <= T - L; plus the chain acceptance length it implies,
    per anchor and (stride 1, `walk_from` = the position of a decode's first round, i.e. the prompt length) per
    round of a chain decode over these sequences."""
    if walk_from is not None and (stride != 1 or walk_from < lo):
        raise ValueError(f"a chain walk needs stride 1 and walk_from >= lo (stride={stride}, lo={lo}, "
                         f"walk_from={walk_from})")
    L = drafter.cfg.block_size
    n_seq, t = seqs.shape
    anchors = np.arange(lo, t - L + 1, stride, dtype=np.int32)
    if len(anchors) == 0:
        raise ValueError(f"no anchor fits: lo={lo}, sequence length {t}, block {L}")
    tgraph, tstate = nnx.split(target)
    dgraph, dstate = nnx.split(drafter)
    fn = drafter_block_argmax_fn(tgraph, dgraph, tuple(drafter.cfg.target_layer_ids), L)
    hits, taus = [], []
    for s in range(0, n_seq, batch):
        chunk = seqs[s: s + batch]
        n = len(chunk)
        if n < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
        anc = np.broadcast_to(anchors, (batch, len(anchors)))
        ids = np.asarray(fn(tstate, dstate, jnp.asarray(chunk), jnp.asarray(anc)))[:n]
        labels = chunk[:n][:, anchors[:, None] + np.arange(1, L)]  # [n, n_anchors, L-1]
        hits.append((ids == labels).reshape(-1, L - 1))
        taus.append(chain_acceptance(ids, labels))
    hits, taus = np.concatenate(hits), np.concatenate(taus)  # taus [n_seq, n_anchors]
    res = {"acc_per_pos": hits.mean(0).tolist(), "chain_tau_mean": float(taus.mean()),
           "n_blocks": int(taus.size), "anchor_stride": stride}
    if walk_from is not None:
        rounds = [r for row in taus for r in chain_walk(row, walk_from - lo)]
        res.update(chain_tau_per_round=float(np.mean(rounds)), chain_rounds=len(rounds))
    return res
