"""`python -m kdtree_jax.convert`: exact round trip, atomic writes, and refusal of altered checkpoints."""
from __future__ import annotations

import dataclasses
import glob
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import config
from kdtree_jax.checkpoint_io import CheckpointIntegrityError, load_converted, load_target_any
from kdtree_jax.convert import convert
from kdtree_jax.model import LatentCache, forward_prefill
from kdtree_jax.synthetic import write_synthetic_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_convert_round_trip_exact(fmt, tmp_path, rng):
    src = str(tmp_path / "hf")
    write_synthetic_checkpoint(src, CFG, fmt=fmt, wrapped=False, seed=int(rng.integers(1 << 30)))
    dst = convert(src, str(tmp_path / "out"), dtype="float32", progress=False)
    tokens = rng.integers(0, CFG.vocab_size, size=7).tolist()
    np.testing.assert_array_equal(logits(load_target_any(src), tokens), logits(load_target_any(dst), tokens))


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
    with pytest.raises(ValueError, match="norm.weight"):
        load_target_any(src)


def test_sigkill_mid_conversion_leaves_nothing_loadable(tmp_path):
    src = str(tmp_path / "hf")
    write_synthetic_checkpoint(src, CFG, fmt="fp8", wrapped=False, seed=9)
    dst = str(tmp_path / "dst")
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_jax.convert", src, dst], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    partial = []
    while time.time() < deadline and proc.poll() is None:
        partial = glob.glob(os.path.join(str(tmp_path), ".dst.partial-*"))
        if partial:
            break
        time.sleep(0.02)
    assert partial, "conversion never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not os.path.exists(dst)
    with pytest.raises(FileNotFoundError):
        load_target_any(dst)
    convert(src, dst, progress=False)  # a rerun cleans the leftovers and completes
    assert not glob.glob(os.path.join(str(tmp_path), ".dst.partial-*"))
    assert dataclasses.replace(load_target_any(dst).cfg, quantization=CFG.quantization) == CFG
