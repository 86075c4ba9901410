"""`python -m kdtree_jax.convert`: exact round trip, atomic writes, and refusal of altered checkpoints."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax.checkpoint.io import (
    META,
    CheckpointIntegrityError,
    load_converted,
    load_target_any,
    load_tokenizer_any,
    read_meta,
    save_converted,
)
from kdtree_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kdtree_jax.checkpoint.weights import init_random
from kdtree_jax.convert import convert
from kdtree_jax.model import config
from kdtree_jax.model.target import LatentCache, forward_prefill

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_TOKENIZER = os.path.join(REPO, "tests", "data", "kimi_toy")
CFG = config.tiny()


def logits(model, tokens):
    toks = jnp.asarray([tokens], jnp.int32)
    return np.asarray(forward_prefill(model, toks, 0, LatentCache.zeros(model.cfg, 1, len(tokens))).logits)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    src = str(root / "hf_int4")
    write_synthetic_checkpoint(src, CFG, fmt="int4", wrapped=True, seed=11)
    dst = str(root / "converted")
    convert(src, dst, dtype="float32", progress=False)
    return src, dst


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_convert_round_trip_exact(fmt, tmp_path, rng):
    src = str(tmp_path / "hf")
    write_synthetic_checkpoint(src, CFG, fmt=fmt, wrapped=False, seed=int(rng.integers(1 << 30)))
    dst = convert(src, str(tmp_path / "out"), dtype="float32", progress=False)
    tokens = rng.integers(0, CFG.vocab_size, size=7).tolist()
    np.testing.assert_array_equal(logits(load_target_any(src), tokens), logits(load_target_any(dst), tokens))


@pytest.mark.heavy
def test_int4_experts_stay_packed_and_match(converted, rng):
    src, dst = converted
    model = load_converted(dst)
    layer = next(i for i in range(CFG.num_hidden_layers) if CFG.is_moe_layer(i))
    assert model.layers[layer].mlp.gate_packed[...].dtype == jnp.int32
    tokens = rng.integers(0, CFG.vocab_size, size=6).tolist()
    np.testing.assert_array_equal(logits(load_target_any(src), tokens), logits(model, tokens))


def test_existing_destination_not_overwritten(converted):
    src, dst = converted
    with pytest.raises(FileExistsError, match="already exists"):
        convert(src, dst, progress=False)


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_flipped_byte_refused_naming_file(converted, tmp_path):
    bad = _copy(converted[1], str(tmp_path / "flipped"))
    data_files = [f for f in glob.glob(os.path.join(bad, "params", "**", "*"), recursive=True)
                  if os.path.isfile(f) and os.path.getsize(f) > 64]
    victim = max(data_files, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointIntegrityError, match=os.path.basename(victim)):
        load_target_any(bad)


def test_missing_file_and_unexpected_code_refused(converted, tmp_path):
    bad = _copy(converted[1], str(tmp_path / "missing"))
    os.remove(os.path.join(bad, "config.json"))
    with pytest.raises(CheckpointIntegrityError, match="config.json"):
        load_target_any(bad)
    planted = _copy(converted[1], str(tmp_path / "planted"))
    marker = tmp_path / "executed"
    with open(os.path.join(planted, "modeling_deepseek.py"), "w") as f:
        f.write(f"open({str(marker)!r}, 'w').write('pwned')\n")
    with pytest.raises(CheckpointIntegrityError, match="modeling_deepseek.py"):
        load_target_any(planted)
    assert not marker.exists()


def test_hf_dir_with_code_loads_without_running_it(converted, tmp_path, rng):
    src = _copy(converted[0], str(tmp_path / "hf_code"))
    marker = tmp_path / "executed"
    for name in ("modeling_deepseek.py", "tokenization_kimi.py", "configuration_deepseek.py"):
        with open(os.path.join(src, name), "w") as f:
            f.write(f"open({str(marker)!r}, 'w').write('pwned')\n")
    model = load_target_any(src)
    assert model.cfg.vocab_size == CFG.vocab_size and not marker.exists()


def test_wrong_dtype_tensor_refused(tmp_path):
    """A norm weight stored as int32 is refused with the tensor's name."""
    import json

    from safetensors.numpy import load_file, save_file

    src = str(tmp_path / "hf")
    write_synthetic_checkpoint(src, CFG, fmt="bf16", wrapped=False, seed=5, n_shards=2)
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    name = "model.norm.weight"
    shard = os.path.join(src, weight_map[name])
    tensors = load_file(shard)
    tensors[name] = np.arange(tensors[name].size, dtype=np.int32)
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=re.escape(os.path.basename(shard)) + r": tensor 'model\.norm\.weight' has "
                       r"dtype I32, expected one of"):
        load_target_any(src)


# The child converts as `python -m kdtree_jax.convert` does, but holds still when it starts hashing (params and
# config.json written, kdtree_meta.json not yet), so the kill always lands mid-conversion: anywhere from the first
# params file orbax writes to that point, never after the commit, however slow or fast the machine is.
_STALLED_CONVERT = """
import sys, time
from kdtree_jax.checkpoint import io as checkpoint_io
def _stall(path):
    time.sleep(600)
checkpoint_io.file_sha256 = _stall
from kdtree_jax.convert import main
main(sys.argv[1:])
"""


def _partial_params_files(root: str, name: str) -> list[str]:
    pattern = os.path.join(root, f".{name}.partial-*", "params*", "**", "*")
    return [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]


def test_sigkill_mid_conversion_leaves_nothing_loadable(tmp_path):
    src = str(tmp_path / "hf")
    write_synthetic_checkpoint(src, CFG, fmt="fp8", wrapped=False, seed=9)
    dst = str(tmp_path / "dst")
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)
    log = tmp_path / "child.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _STALLED_CONVERT, src, dst], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not _partial_params_files(str(tmp_path), "dst"):
            time.sleep(0.005)
        written = _partial_params_files(str(tmp_path), "dst")
        assert written and proc.poll() is None, (
            f"no params file appeared under the partial directory (exit {proc.poll()}): {log.read_text()[-2000:]}")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not os.path.exists(dst)
    with pytest.raises(FileNotFoundError, match=re.escape(dst)):
        load_target_any(dst)
    (partial,) = glob.glob(os.path.join(str(tmp_path), ".dst.partial-*"))
    assert not os.path.exists(os.path.join(partial, META))
    with pytest.raises(FileNotFoundError, match=re.escape(partial) + ": neither an HF .* nor a converted one"):
        load_target_any(partial)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(os.path.join(partial, META)) + ": missing"):
        load_converted(partial)
    convert(src, dst, progress=False)  # a rerun cleans the leftovers and completes
    assert not glob.glob(os.path.join(str(tmp_path), ".dst.partial-*"))
    assert dataclasses.replace(load_target_any(dst).cfg, quantization=CFG.quantization) == CFG


def test_convert_progress_bars_and_tokenizer_files(tmp_path, rng, capsys):
    """Progress on: stderr shows the loading and the saving bar; tokenizer files travel; the result loads."""
    src, dst = str(tmp_path / "hf"), str(tmp_path / "out")
    tok_files = {}
    for name in ("tiktoken.model", "tokenizer_config.json"):
        with open(os.path.join(TOY_TOKENIZER, name), "rb") as f:
            tok_files[name] = f.read()
    write_synthetic_checkpoint(src, CFG, fmt="bf16", seed=int(rng.integers(1 << 30)), extra_files=tok_files)
    capsys.readouterr()
    convert(src, dst, dtype="float32", progress=True)
    err = capsys.readouterr().err
    assert re.search(r"loading tensors: +\d+%.*\d+/\d+", err), err[-500:]
    assert re.search(r"saving: +\d+%.*params", err) and "sha256 config.json" in err, err[-500:]
    for name, content in tok_files.items():
        with open(os.path.join(dst, name), "rb") as f:
            assert f.read() == content, name
    assert set(tok_files) <= set(read_meta(dst)["sha256"])  # hashed like every other file
    text = "".join(rng.choice(list("abcdef ghij\n")) for _ in range(40))
    assert load_tokenizer_any(dst).encode(text) == load_tokenizer_any(src).encode(text)
    ours, theirs = nnx.state(load_target_any(dst)), nnx.state(load_target_any(src))  # logits: round-trip test
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert x.dtype == y.dtype == jnp.float32
        np.testing.assert_array_equal(x, y)


def _config_json(converted_dir: str) -> dict:
    with open(os.path.join(converted_dir, "config.json")) as f:
        return json.load(f)


def test_failed_commit_leaves_nothing_behind(converted, tmp_path, rng):
    """`before_commit` raising (a late failure, after params and hashes are written) leaves no trace: no
    destination, no partial/temp directory, and an existing checkpoint being replaced stays intact."""
    model = init_random(CFG, seed=int(rng.integers(1 << 30)))
    cfg_json = _config_json(converted[1])
    root = tmp_path / "ckpts"
    root.mkdir()
    seen = []

    def fail(tmp):
        seen.append(tmp)
        assert os.path.isdir(os.path.join(tmp, "params")) and os.path.isfile(os.path.join(tmp, "config.json"))
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_converted(model, root / "new", config_json=cfg_json, before_commit=fail)
    assert os.listdir(root) == [] and not os.path.exists(seen[-1])
    existing = _copy(converted[1], str(root / "existing"))
    with pytest.raises(OSError, match="disk full"):
        save_converted(model, existing, config_json=cfg_json, overwrite=True, before_commit=fail)
    assert os.listdir(root) == ["existing"] and not os.path.exists(seen[-1])
    assert read_meta(existing) == read_meta(converted[1])  # every file's hash still matches
    assert load_converted(existing).layers[1].mlp.gate_packed[...].dtype == jnp.int32  # still the INT4 original


def test_failed_commit_rename_restores_the_replaced_checkpoint(converted, tmp_path, rng, monkeypatch):
    """Replacing a checkpoint moves the old one aside, then renames the new one in; if that last rename fails, the
    old one is put back (before, it was left in a hidden `.NAME.old-*` directory and the name was gone)."""
    from kdtree_jax.checkpoint import atomic

    model = init_random(CFG, seed=int(rng.integers(1 << 30)))
    root = tmp_path / "ckpts"
    root.mkdir()
    existing = _copy(converted[1], str(root / "existing"))
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".existing.partial-") and dst == existing:
            raise OSError("rename failed: read-only file system")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="read-only"):
        save_converted(model, existing, config_json=_config_json(converted[1]), overwrite=True)
    monkeypatch.undo()
    assert os.listdir(root) == ["existing"]
    assert read_meta(existing) == read_meta(converted[1])


@pytest.mark.parametrize("field,value", [("param_dtype", "bfloat16"), ("expert_format", "float"),
                                         ("n_params", 1), ("param_dtype", "float16")])
def test_edited_meta_refused_naming_file(converted, tmp_path, field, value):
    """kdtree_meta.json has no hash of its own: an edit that would load silently (param_dtype bfloat16 restored a
    float32 checkpoint as bf16) is refused because each field must agree with orbax's metadata."""
    bad = _copy(converted[1], str(tmp_path / "edited"))
    meta_path = os.path.join(bad, META)
    with open(meta_path) as f:
        meta = json.load(f)
    meta[field] = value
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointIntegrityError, match=re.escape(meta_path) + f": {field} is {value!r} but the "
                       "stored parameters .* hold"):
        load_target_any(bad)


def test_converted_wrong_dtype_refused_naming_file(converted, tmp_path, rng):
    """A converted checkpoint whose tree holds a tensor of the wrong dtype (hashes consistent: written that way) is
    refused naming the params metadata file and the tensor; orbax alone would cast it silently."""
    model = load_converted(converted[1])
    model.norm.set_value(jnp.asarray(rng.integers(-3, 4, size=model.norm[...].shape), jnp.int32))
    bad = save_converted(model, tmp_path / "bad", config_json=_config_json(converted[1]), expert_format="int4")
    with pytest.raises(CheckpointIntegrityError, match=re.escape(os.path.join(bad, "params", "_METADATA")) +
                       r": parameter 'norm' is stored as int32 \[64\], the model expects float32 \[64\]"):
        load_target_any(bad)
