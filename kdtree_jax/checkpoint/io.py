"""Converted checkpoints (orbax) and the one entry point that loads a target from either format.

A converted checkpoint is a directory:
    config.json          the HF config it came from (the ModelConfig source of truth)
    params/              orbax StandardCheckpointer tree of the model's parameters (INT4 experts stay packed)
    tokenizer files      copied from the source when present
    kdtree_meta.json     format tag, expert format, dtypes and the sha256 of every other file (written last)
It is written into a hidden temp directory next to the destination and renamed into place only when complete,
so a failed or killed conversion leaves nothing that loads. Loading reads only data files (never pickles or
code), checks every file's hash, and checks kdtree_meta.json's fields (which no hash covers) and every stored
parameter's shape and dtype against orbax's own metadata before restoring.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from kdtree_jax.checkpoint.atomic import atomic_dir
from kdtree_jax.checkpoint.drafter import load_drafter
from kdtree_jax.checkpoint.hf import HFCheckpoint
from kdtree_jax.checkpoint.tokenizer import KimiTokenizer
from kdtree_jax.checkpoint.weights import load_model
from kdtree_jax.model.config import ModelConfig
from kdtree_jax.model.hf_config import config_from_json
from kdtree_jax.model.moe import tile_experts
from kdtree_jax.model.target import KimiModel
from kdtree_jax.parallel.sharding import shard_model, state_shardings

FORMAT = "kdtree-jax/orbax-v2"  # v2: fused qkv_a [D, Rq + A] and MLP gate_up [D, 2, I] (v1 stored them apart)
META = "kdtree_meta.json"
PARAMS = "params"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class CheckpointIntegrityError(ValueError):
    """A converted checkpoint that is incomplete, altered or of the wrong format; the message names the file."""


def is_converted(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, META))


def is_hf_dir(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path)
    )


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != META:
                out.append(rel)
    return sorted(out)


def save_converted(model, dst: str | os.PathLike, *, config_json: dict, extra_files: list[str] = (),
                   expert_format: str = "float", overwrite: bool = False, before_commit: Callable | None = None,
                   progress: bool = False) -> str:
    """Write `model` as a converted checkpoint at `dst`, atomically (with `progress`, a bar over the steps)."""
    dst = os.path.abspath(os.fspath(dst))
    with atomic_dir(dst, overwrite=overwrite) as tmp, _Steps(progress, 2 + len(extra_files)) as steps:
        state = nnx.to_pure_dict(nnx.state(model))
        with steps.step(PARAMS):  # one orbax call: the bar moves per step, not per tensor
            ckptr = ocp.StandardCheckpointer()
            ckptr.save(os.path.join(tmp, PARAMS), state)
            ckptr.wait_until_finished()
        with steps.step("config.json"):
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config_json, f, indent=2)
        for src in extra_files:
            with steps.step(os.path.basename(src)):
                shutil.copy2(src, os.path.join(tmp, os.path.basename(src)))
        flat = _flat(state)
        files = _files(tmp)
        steps.add(len(files))
        digests = {}
        for rel in files:  # hashing ~600 GB is the slow part for a real checkpoint
            with steps.step(f"sha256 {rel}"):
                digests[rel] = file_sha256(os.path.join(tmp, rel))
        meta = {
            "format": FORMAT,
            "expert_format": expert_format,
            "param_dtype": _param_dtype(flat),
            "n_params": _n_params(flat),
            "sha256": digests,
        }
        if before_commit is not None:
            before_commit(tmp)
        with open(os.path.join(tmp, META), "w") as f:  # last: a directory without it never loads
            json.dump(meta, f, indent=2)
    return dst


class _Steps:
    """A tqdm bar over named steps on stderr, or nothing when disabled."""

    def __init__(self, enabled: bool, total: int, desc: str = "saving"):
        self._bar = None
        if enabled:
            self._bar = tqdm(total=total, desc=desc, unit="step", leave=False)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=True)
        yield
        if self._bar is not None:
            self._bar.update(1)

    def add(self, n: int) -> None:
        if self._bar is not None:
            self._bar.total += n
            self._bar.refresh()

    def __enter__(self) -> "_Steps":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()


# ---- parameter trees as {dotted name: (shape, dtype name)} -------------------------------------------------------
def _flat(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """Arrays, ShapeDtypeStructs or orbax ArrayMetadata leaves, keyed like `layers.1.mlp.gate_packed`."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[name] = (tuple(int(d) for d in leaf.shape), jnp.dtype(leaf.dtype).name)
    return out


def _is_weight(name: str, dtype: str) -> bool:
    """A float parameter stored in param_dtype (the f32 selection bias and the bf16 INT4 scales are not)."""
    last = name.rsplit(".", 1)[-1]
    return jnp.issubdtype(jnp.dtype(dtype), jnp.floating) and last != "bias" and not last.endswith("_scale")


def _param_dtype(flat: dict) -> str:
    counts = collections.Counter(dt for name, (_, dt) in flat.items() if _is_weight(name, dt))
    return counts.most_common(1)[0][0] if counts else "float32"


def _expert_format(flat: dict) -> str:
    return "int4" if any(name.endswith("_packed") for name in flat) else "float"


def _n_params(flat: dict) -> int:
    return int(sum(math.prod(shape) for shape, _ in flat.values()))


def read_meta(path: str, *, verify: bool = True) -> dict:
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointIntegrityError(f"{meta_path}: missing; {path} is not a complete converted checkpoint")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointIntegrityError(f"{meta_path}: not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointIntegrityError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}; convert the "
                                       f"HF checkpoint again (python -m kdtree_jax.convert)")
    if verify:
        expected = meta.get("sha256", {})
        present = set(_files(path))
        for rel in sorted(set(expected) - present):
            raise CheckpointIntegrityError(f"{os.path.join(path, rel)}: missing from the checkpoint")
        for rel in sorted(present - set(expected)):
            raise CheckpointIntegrityError(f"{os.path.join(path, rel)}: not part of the checkpoint (unexpected file)")
        for rel, digest in sorted(expected.items()):
            if file_sha256(os.path.join(path, rel)) != digest:
                raise CheckpointIntegrityError(f"{os.path.join(path, rel)}: contents changed (sha256 mismatch)")
    return meta


def load_converted(path: str | os.PathLike, *, dtype: str | None = None, mesh=None, verify: bool = True,
                   moe_impl: str = "auto"):
    """Restore a converted target; with a mesh, each parameter is restored straight into its sharded layout."""
    path = os.path.abspath(os.fspath(path))
    meta = read_meta(path, verify=verify)
    cfg = config_from_json(os.path.join(path, "config.json"))
    stored = _stored_params(path)
    _check_meta(path, meta, stored)
    param_dtype = DTYPES[meta["param_dtype"]]
    compute = DTYPES[dtype] if dtype else param_dtype

    def build():
        return KimiModel(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=compute,
                         expert_format=meta["expert_format"], moe_impl=moe_impl)

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    target = nnx.to_pure_dict(abstract)
    if mesh is not None:
        shardings = nnx.to_pure_dict(state_shardings(abstract, mesh))
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    else:
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), target)
    _check_stored(path, stored, _flat(target))  # orbax would silently cast a stored dtype to the target's
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(path, PARAMS), target)
    except Exception as e:  # orbax/tensorstore raise many types; name the directory
        raise CheckpointIntegrityError(f"{os.path.join(path, PARAMS)}: cannot restore ({type(e).__name__}: {e})") from e
    nnx.replace_by_pure_dict(abstract, restored)
    model = nnx.merge(graphdef, abstract)
    if dtype and DTYPES[dtype] != param_dtype:
        model = cast_params(model, DTYPES[dtype])
    return model


def _stored_params(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every stored parameter's shape and dtype, from orbax's metadata (no tensor data is read)."""
    params = os.path.join(path, PARAMS)
    try:
        md = ocp.StandardCheckpointer().metadata(params)
        return _flat(getattr(md, "item_metadata", md))
    except Exception as e:  # orbax raises many types; name the directory
        raise CheckpointIntegrityError(f"{params}: cannot read the orbax metadata ({type(e).__name__}: {e})") from e


def _check_meta(path: str, meta: dict, stored: dict) -> None:
    """kdtree_meta.json is not covered by a hash: each field must agree with what the params actually hold."""
    actual = {"expert_format": _expert_format(stored), "param_dtype": _param_dtype(stored),
              "n_params": _n_params(stored)}
    for field, value in actual.items():
        if meta.get(field) != value:
            raise CheckpointIntegrityError(
                f"{os.path.join(path, META)}: {field} is {meta.get(field)!r} but the stored parameters "
                f"({os.path.join(path, PARAMS)}) hold {value!r}; the file was edited or belongs to another checkpoint")


def _check_stored(path: str, stored: dict, want: dict) -> None:
    """The stored tree has exactly the model's parameters, each with the model's shape and dtype."""
    where = os.path.join(path, PARAMS, "_METADATA")
    where = where if os.path.isfile(where) else os.path.join(path, PARAMS)
    for names, what in ((sorted(set(want) - set(stored)), "is expected by the model but not stored"),
                        (sorted(set(stored) - set(want)), "is stored but not part of the model")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointIntegrityError(f"{where}: parameter {names[0]!r} {what}{more}")
    for name, (shape, dtype) in want.items():
        got_shape, got_dtype = stored[name]
        if (got_shape, got_dtype) != (shape, dtype):
            raise CheckpointIntegrityError(f"{where}: parameter {name!r} is stored as {got_dtype} {list(got_shape)}, "
                                           f"the model expects {dtype} {list(shape)}")


def cast_params(model, dtype):
    """Float parameters to `dtype` (packed INT4 words and their bf16 scales are left as they are)."""
    graphdef, state = nnx.split(model)

    def cast(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        keep = name == "bias" or name.endswith("_scale")  # selection bias stays f32; INT4 scales stay bf16
        return x if keep or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    state = jax.tree_util.tree_map_with_path(cast, state)
    return nnx.merge(graphdef, state)


def load_target_any(path: str | os.PathLike, *, dtype: str = "float32", mesh=None, progress: bool = False):
    """A target from an HF safetensors directory (read directly) or a converted checkpoint."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    # Sharded: expert-parallel dispatch (each device runs its own experts, one psum); the per-token gather path
    # would make GSPMD all-gather expert weights across devices (docs/sharding.md).
    moe_impl = "auto" if mesh is None else "ep"
    if is_converted(path):
        model = load_converted(path, dtype=dtype, mesh=mesh, moe_impl=moe_impl)
    elif is_hf_dir(path):
        with HFCheckpoint.open(path) as ckpt:
            ckpt.validate()
            source = _with_progress(ckpt, progress)
            model = load_model(source, param_dtype=DTYPES[dtype], dtype=DTYPES[dtype], moe_impl=moe_impl)
    else:
        raise FileNotFoundError(f"{path}: neither an HF safetensors checkpoint (config.json + *.safetensors) nor a "
                                f"converted one ({META})")
    if mesh is not None:
        model = shard_model(model, mesh)
    else:  # one device: the grouped INT4 kernel reads its experts tile-major (BENCHMARKS.md 4a)
        tile_experts(model)
    return model


class _with_progress:
    """An HFCheckpoint view whose `get` advances a progress bar (one step per tensor)."""

    def __init__(self, ckpt, enabled: bool):
        self._ckpt = ckpt
        self.config = ckpt.config
        self._bar = None
        if enabled:
            self._bar = tqdm(total=len(ckpt.names()), desc="loading tensors", unit="tensor", leave=False)

    def get(self, name: str):
        value = self._ckpt.get(name)
        if self._bar is not None:
            self._bar.update(1)
        return value

    def __getattr__(self, item):
        return getattr(self._ckpt, item)


def load_drafter_any(path: str | os.PathLike, *, dtype: str = "float32"):
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such drafter directory")
    return load_drafter(path, DTYPES[dtype])


def load_tokenizer_any(path: str | os.PathLike):
    """The tokenizer shipped with a checkpoint (its own files or a `tokenizer/` folder), or None."""
    path = os.fspath(path)
    for cand in (path, os.path.join(path, "tokenizer")):
        if os.path.isfile(os.path.join(cand, "tiktoken.model")):
            return KimiTokenizer.from_dir(cand)
    return None


# ---- sharded restore ------------------------------------------------------------------------------------------
def abstract_sharded_state(cfg: ModelConfig, mesh: Mesh, *, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16,
                           cache_dtype=None, expert_format: str = "float", moe_impl: str = "auto"):
    """(graphdef, state of ShapeDtypeStructs carrying NamedShardings, the rules of `sharding.py`): an orbax restore
    target, or the per-device bytes of a model too large to build; nothing allocated."""

    def build():
        return KimiModel(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype, cache_dtype=cache_dtype,
                         expert_format=expert_format, moe_impl=moe_impl)

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = state_shardings(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return graphdef, state


def restore_sharded(path: str, cfg: ModelConfig, mesh: Mesh, **model_kw) -> nnx.Module:
    """Restore an orbax StandardCheckpointer tree of `nnx.to_pure_dict(nnx.state(model))` straight into the mesh.

    Every process reads only its own shards; the whole model never sits on one device.
    """
    graphdef, abstract = abstract_sharded_state(cfg, mesh, **model_kw)
    restored = ocp.StandardCheckpointer().restore(path, nnx.to_pure_dict(abstract))
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)
