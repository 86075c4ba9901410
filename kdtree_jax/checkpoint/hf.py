"""Lazy, memory-mapped reader for HF safetensors checkpoints (bf16, FP8-block, INT4 pack-quantized).

Headers are parsed here (8-byte little-endian length + JSON) rather than by `safetensors`, whose numpy backend
cannot return F8_E4M3. Opening reads only config.json, the index and the headers; tensor bytes are mapped on
first `get`. Names are canonical: `cfg.tensor_prefix` stripped (`layers.0.self_attn.q_a_proj.weight`,
`embed_tokens.weight`, `norm.weight`) and `cfg.lm_head_name` -> `lm_head.weight`; a quantized Linear is one
canonical `X.weight` whatever its stored form (`X.weight` + `X.weight_scale_inv`, or `X.weight_packed` +
`X.weight_scale` + `X.weight_shape`).
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import struct

import ml_dtypes
import numpy as np

from kdtree_jax.model.config import ConfigError, ModelConfig
from kdtree_jax.model.hf_config import config_from_json
from kdtree_jax.model.quant import Int4Packed, dequant_fp8_block, fp8_scale_shape

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "tokenization_kimi.py",
                   "special_tokens_map.json", "generation_config.json", "tokenizer.json")
SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
SKIP_SUFFIXES = (".rotary_emb.inv_freq",)
LM_HEAD = "lm_head.weight"

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FP8_DTYPE = "F8_E4M3"

_FP8_SCALE = "_scale_inv"  # X.weight -> X.weight_scale_inv
_INT4_PARTS = ("_packed", "_scale", "_shape")  # X.weight -> X.weight_packed / _scale / _shape


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the config describes; the message names the file and/or tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `start`/`end` are absolute byte offsets in `file`."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly (and checked against the file size), data mapped lazily."""

    def __init__(self, path: str):
        self.path = path
        self._mmap: mmap.mmap | None = None
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated file ({size} bytes, no safetensors header)")
            (hlen,) = struct.unpack("<Q", head)
            if 8 + hlen > size:
                raise CheckpointError(f"{path}: truncated file (header claims {hlen} bytes, file has {size})")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header must be a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + hlen
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (lo, hi) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: header entry for tensor {name!r} is malformed: {entry!r}") from None
            if not 0 <= lo <= hi:
                raise CheckpointError(f"{path}: tensor {name!r} has bad data_offsets {[lo, hi]}")
            if base + hi > size:
                raise CheckpointError(f"{path}: truncated file: tensor {name!r} needs bytes up to {base + hi}, "
                                      f"file has {size}")
            if dtype in DTYPES and hi - lo != DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has {hi - lo} bytes")
            self.tensors[name] = TensorInfo(name, path, dtype, shape, base + lo, base + hi)

    def read(self, name: str) -> np.ndarray:
        """A read-only array view on the mapped bytes (no copy)."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info.dtype!r} "
                                  f"(supported: {', '.join(DTYPES)})")
        dtype = DTYPES[info.dtype]
        count = (info.end - info.start) // dtype.itemsize
        if count == 0:
            return np.zeros(info.shape, dtype)
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=info.start).reshape(info.shape)

    def close(self) -> None:
        # Arrays handed out keep the mapping alive through their buffer; dropping our reference is enough.
        self._mmap = None


def tokenizer_files(path: str | os.PathLike) -> list[str]:
    """Tokenizer / chat-template files present in a checkpoint dir (copied along by the converter)."""
    path = os.fspath(path)
    return [os.path.join(path, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]


def _stack_shared(cfg: ModelConfig) -> int:
    return cfg.moe_intermediate_size * cfg.n_shared_experts


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the forward needs, with its logical (dequantized) shape."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        LM_HEAD: (cfg.vocab_size, d),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = (h * cfg.qk_head_dim, d)
        else:
            out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, d)
            out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
        out[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
        out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[a + "o_proj.weight"] = (d, h * cfg.v_head_dim)
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            out.update(_swiglu_shapes(m, d, cfg.intermediate_size))
            continue
        out[m + "gate.weight"] = (cfg.n_routed_experts, d)
        if cfg.topk_method == "noaux_tc":
            out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            out.update(_swiglu_shapes(f"{m}experts.{e}.", d, cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            out.update(_swiglu_shapes(m + "shared_experts.", d, _stack_shared(cfg)))
    return out


def _swiglu_shapes(prefix: str, d: int, inter: int) -> dict[str, tuple[int, int]]:
    return {prefix + "gate_proj.weight": (inter, d), prefix + "up_proj.weight": (inter, d),
            prefix + "down_proj.weight": (d, inter)}


def expected_names(cfg: ModelConfig) -> list[str]:
    return list(expected_shapes(cfg))


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """How one canonical tensor is stored: kind in {"plain", "fp8", "int4"} and the stored tensors it uses."""

    kind: str
    main: TensorInfo  # plain / fp8: the weight; int4: weight_packed
    aux: tuple[TensorInfo, ...] = ()  # fp8: (scale_inv,); int4: (scale, shape)


class HFCheckpoint:
    """A checkpoint directory: `config`, `names()`, `get(name)`, `shape(name)`, `validate()`."""

    def __init__(self, path: str, config: ModelConfig, files: dict[str, SafetensorsFile],
                 where: dict[str, TensorInfo]):
        self.path = path
        self.config = config
        self._files = files
        self._where = where  # stored name -> header entry
        self._names = self._canonical_names()
        self._name_set = frozenset(self._names)

    # ---- opening -----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike) -> "HFCheckpoint":
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a checkpoint directory")
        try:
            config = config_from_json(os.path.join(path, CONFIG_FILE))
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if CONFIG_FILE in msg else f"{os.path.join(path, CONFIG_FILE)}: {msg}") from None
        weight_map = _weight_map(path)
        files: dict[str, SafetensorsFile] = {}  # by full path
        for fname in dict.fromkeys(weight_map.values()):
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                example = next(n for n, f in weight_map.items() if f == fname)
                raise CheckpointError(f"{fpath}: shard file named by {INDEX_FILE} is missing (it holds e.g. "
                                      f"tensor {example!r})")
            files[fpath] = SafetensorsFile(fpath)
        where: dict[str, TensorInfo] = {}
        for name, fname in weight_map.items():
            fpath = os.path.join(path, fname)
            info = files[fpath].tensors.get(name)
            if info is None:
                raise CheckpointError(f"{fpath}: tensor {name!r} is listed in {INDEX_FILE} but not "
                                      "in this file")
            where[name] = info
        return cls(path, config, files, where)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- names -------------------------------------------------------------------------------------------
    def _stored(self, name: str) -> str:
        return self.config.lm_head_name if name == LM_HEAD else self.config.tensor_prefix + name

    def _canonical(self, stored: str) -> str | None:
        if stored.startswith(SKIP_PREFIXES) or stored.endswith(SKIP_SUFFIXES):
            return None
        if stored == self.config.lm_head_name:
            return LM_HEAD
        if not stored.startswith(self.config.tensor_prefix):
            return None
        name = stored[len(self.config.tensor_prefix):]
        for suffix in (_FP8_SCALE, *_INT4_PARTS):
            if name.endswith(".weight" + suffix):
                return name[: -len(suffix)]
        return name

    def _canonical_names(self) -> list[str]:
        return list(dict.fromkeys(n for n in map(self._canonical, self._where) if n is not None))

    def names(self) -> list[str]:
        """Canonical names of every model tensor stored (vision tower, projector and rope buffers skipped)."""
        return list(self._names)

    def stored_names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._name_set

    # ---- format resolution (headers only) ----------------------------------------------------------------
    def is_ignored(self, name: str) -> bool:
        """compressed-tensors `ignore`: exact module names, or `re:` regexes matched (re.match) against the
        stored module name without `.weight`."""
        module = self._stored(name)
        module = module[: -len(".weight")] if module.endswith(".weight") else module
        for rule in self.config.quantization.ignore:
            if rule.startswith("re:"):
                if re.match(rule[3:], module):
                    return True
            elif rule == module:
                return True
        return False

    def _resolve(self, name: str) -> _Resolved:
        stored = self._stored(name)
        method = self.config.quantization.method
        w = self._where.get(stored)
        packed = self._where.get(stored + _INT4_PARTS[0])
        scale_inv = self._where.get(stored + _FP8_SCALE)
        if packed is not None:
            if method != "compressed-tensors":
                raise CheckpointError(f"{packed.file}: tensor {packed.name!r} is INT4 pack-quantized but the config's "
                                      f"quantization method is {method!r}")
            if self.is_ignored(name):
                raise CheckpointError(f"{packed.file}: tensor {packed.name!r} is INT4 pack-quantized but its module "
                                      "is in the config's quantization ignore list")
            if w is not None:
                raise CheckpointError(f"{w.file}: tensor {stored!r} is stored both plain and INT4-packed")
            aux = []
            for part in _INT4_PARTS[1:]:
                info = self._where.get(stored + part)
                if info is None:
                    raise CheckpointError(f"{packed.file}: tensor {stored + part!r} is missing (needed with "
                                          f"{packed.name!r})")
                aux.append(info)
            _check_dtype(packed, ("I32",))
            _check_dtype(aux[0], ("BF16", "F16", "F32"))
            return _Resolved("int4", packed, tuple(aux))
        if w is None:
            raise CheckpointError(f"{self.path}: tensor {stored!r} (canonical {name!r}) is missing from the checkpoint")
        if scale_inv is not None:
            if method != "fp8":
                raise CheckpointError(f"{scale_inv.file}: tensor {scale_inv.name!r} is an FP8 block scale but the "
                                      f"config's quantization method is {method!r}")
            _check_dtype(w, (FP8_DTYPE,))
            _check_dtype(scale_inv, ("F32", "BF16"))
            return _Resolved("fp8", w, (scale_inv,))
        if w.dtype == FP8_DTYPE:
            raise CheckpointError(f"{w.file}: tensor {stored!r} is {FP8_DTYPE} without {stored + _FP8_SCALE!r}")
        _check_dtype(w, _FLOAT_DTYPES)  # every model weight is a float; an int here is a corrupt/foreign file
        return _Resolved("plain", w)

    def kind(self, name: str) -> str:
        """'plain', 'fp8' or 'int4'."""
        return self._resolve(name).kind

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical (dequantized) shape; reads only the tiny INT4 `weight_shape` tensor."""
        r = self._resolve(name)
        if r.kind != "int4":
            return r.main.shape
        return self._int4_shape(r)

    def _read(self, info: TensorInfo) -> np.ndarray:
        return self._files[info.file].read(info.name)

    def _int4_shape(self, r: _Resolved) -> tuple[int, int]:
        shape_info = r.aux[1]
        values = np.asarray(self._read(shape_info)).reshape(-1).tolist()
        if len(values) != 2:
            raise CheckpointError(f"{shape_info.file}: tensor {shape_info.name!r} must hold (out, in), got {values}")
        return int(values[0]), int(values[1])

    # ---- reading -----------------------------------------------------------------------------------------
    def get(self, name: str) -> np.ndarray | Int4Packed:
        """Plain: stored dtype (read-only view); FP8: float32 dequantized; INT4: `Int4Packed` (still packed)."""
        r = self._resolve(name)
        if r.kind == "plain":
            return self._read(r.main)
        if r.kind == "fp8":
            block = self.config.quantization.weight_block_size
            try:
                return dequant_fp8_block(self._read(r.main), self._read(r.aux[0]), block)
            except ValueError as e:
                raise CheckpointError(f"{r.main.file}: tensor {r.main.name!r}: {e}") from None
        shape = self._int4_shape(r)
        scale = self._read(r.aux[0])
        if scale.dtype != np.dtype(ml_dtypes.bfloat16):
            scale = scale.astype(ml_dtypes.bfloat16)
        try:
            return Int4Packed(self._read(r.main), scale, shape, self.config.quantization.group_size)
        except ValueError as e:
            raise CheckpointError(f"{r.main.file}: tensor {r.main.name!r}: {e}") from None

    def get_float(self, name: str, dtype=np.float32) -> np.ndarray:
        """Any tensor fully dequantized to `dtype` (INT4 unpacked too)."""
        value = self.get(name)
        if isinstance(value, Int4Packed):
            value = value.dequant()
        return np.asarray(value).astype(dtype)

    # ---- validation --------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every tensor the config needs exists in a consistent format with the right logical shape."""
        problems = []
        for name, want in expected_shapes(self.config).items():
            try:
                got = self.shape(name)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            if tuple(got) != tuple(want):
                where = self._where.get(self._stored(name)) or self._where.get(self._stored(name) + _INT4_PARTS[0])
                problems.append(f"{where.file}: tensor {self._stored(name)!r} has shape {list(got)}, expected "
                                f"{list(want)}")
                continue
            r = self._resolve(name)
            if r.kind == "fp8":
                want_s = fp8_scale_shape(r.main.shape, self.config.quantization.weight_block_size)
                if r.aux[0].shape != want_s:
                    problems.append(f"{r.aux[0].file}: tensor {r.aux[0].name!r} has shape {list(r.aux[0].shape)}, "
                                    f"expected {list(want_s)}")
            elif r.kind == "int4":
                out, n_in = got
                gs = self.config.quantization.group_size
                if r.main.shape != (out, n_in // 8) or r.aux[0].shape != (out, n_in // gs):
                    problems.append(f"{r.main.file}: INT4 tensor {r.main.name!r} packed {list(r.main.shape)} / "
                                    f"scale {list(r.aux[0].shape)} do not fit shape {[out, n_in]} group {gs}")
        if problems:
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise CheckpointError(f"{self.path}: checkpoint does not match its config:\n  "
                                  + "\n  ".join(problems[:10]) + more)


_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def _check_dtype(info: TensorInfo, allowed: tuple[str, ...]) -> None:
    if info.dtype not in DTYPES:
        raise CheckpointError(f"{info.file}: tensor {info.name!r} has unsupported dtype {info.dtype!r} "
                              f"(supported: {', '.join(DTYPES)})")
    if info.dtype not in allowed:
        raise CheckpointError(f"{info.file}: tensor {info.name!r} has dtype {info.dtype}, expected one of {allowed}")


def _weight_map(path: str) -> dict[str, str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        return wm
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return {name: SINGLE_FILE for name in SafetensorsFile(single).tensors}
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
