"""HF checkpoint reading: three formats x two layouts, exact decoding, sharding, and every error path."""
import dataclasses
import json
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from kdtree_jax.checkpoint.hf import (
    CheckpointError,
    HFCheckpoint,
    expected_names,
    expected_shapes,
    tokenizer_files,
)
from kdtree_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kdtree_jax.model.config import ConfigError, tiny
from kdtree_jax.model.quant import Int4Packed, dequant_int4
from kdtree_jax.oracles.reference import reference_forward, reference_weights

FORMATS = ("bf16", "fp8", "int4")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _seed(rng) -> int:
    return int(rng.integers(0, 2**31))


def _read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def _write_raw(path, header, data):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _edit_header(path, fn):
    header, data = _read_header(path)
    fn(header)
    _write_raw(path, header, data)


def _shard_of(ckdir, stored_name):
    with open(os.path.join(ckdir, "model.safetensors.index.json")) as f:
        return os.path.join(ckdir, json.load(f)["weight_map"][stored_name])


def _raw_tensor(path, name):
    """Independent raw read (no HFCheckpoint code): header entry + np.frombuffer on the byte range."""
    header, data = _read_header(path)
    e = header[name]
    dt = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16, "I32": np.int32}
    lo, hi = e["data_offsets"]
    return np.frombuffer(data[lo:hi], dtype=dt[e["dtype"]]).reshape(e["shape"])


@pytest.mark.parametrize("wrapped", [False, True], ids=["flat", "wrapped"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_load_validate_exact(tmp_path, rng, fmt, wrapped):
    cfg = tiny()
    eff = write_synthetic_checkpoint(tmp_path, cfg, fmt=fmt, wrapped=wrapped, seed=_seed(rng))
    ck = HFCheckpoint.open(tmp_path)
    ck.validate()
    assert ck.config.tensor_prefix == ("language_model.model." if wrapped else "model.")
    assert sorted(ck.names()) == sorted(expected_names(ck.config)) == sorted(eff)
    assert not any("vision_tower" in n or "mm_projector" in n or "inv_freq" in n for n in ck.names())
    if wrapped:
        assert any(n.startswith("vision_tower.") for n in ck.stored_names())
    kinds = {n: ck.kind(n) for n in ck.names()}
    for name, want in eff.items():
        value = ck.get(name)
        if kinds[name] == "int4":
            assert isinstance(value, Int4Packed) and value.shape == expected_shapes(ck.config)[name]
            assert value.scale.dtype == np.dtype(ml_dtypes.bfloat16) and value.packed.dtype == np.int32
        elif kinds[name] == "fp8":
            assert value.dtype == np.float32
        elif name.endswith("e_score_correction_bias"):
            assert value.dtype == np.float32
        else:
            assert value.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(ck.get_float(name, np.float64), want, err_msg=name)
    n_quant = sum(k != "plain" for k in kinds.values())
    if fmt == "bf16":
        assert n_quant == 0
    elif fmt == "int4":  # exactly the routed experts
        assert {n for n, k in kinds.items() if k == "int4"} == {n for n in eff if ".mlp.experts." in n}
    else:  # every Linear except router / embeddings / lm_head
        fp8 = {n for n, k in kinds.items() if k == "fp8"}
        assert not any(".mlp.gate.weight" in n or n in ("embed_tokens.weight", "lm_head.weight") for n in fp8)
        assert "layers.0.self_attn.kv_b_proj.weight" in fp8 and "layers.1.mlp.experts.3.down_proj.weight" in fp8
        bo, bi = ck.config.quantization.weight_block_size
        assert any(ck.shape(n)[0] % bo or ck.shape(n)[1] % bi for n in fp8), "no ragged FP8 edge exercised"


def test_fp8_and_int4_decode_from_raw_bytes(tmp_path, rng):
    """The loader's FP8/INT4 values equal a decode of the raw stored bytes (read here without the loader)."""
    cfg = tiny()
    d8, d4 = tmp_path / "fp8", tmp_path / "int4"
    write_synthetic_checkpoint(d8, cfg, fmt="fp8", seed=_seed(rng))
    write_synthetic_checkpoint(d4, cfg, fmt="int4", seed=_seed(rng))
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]: ragged rows with block 16
    w8 = _raw_tensor(_shard_of(d8, name), name)
    s = _raw_tensor(_shard_of(d8, name + "_scale_inv"), name + "_scale_inv")
    assert w8.shape == (40, 64) and s.shape == (3, 4)
    want = w8.astype(np.float32) * np.kron(s, np.ones((16, 16), np.float32))[:40, :64]
    np.testing.assert_array_equal(HFCheckpoint.open(d8).get("layers.0.self_attn.kv_a_proj_with_mqa.weight"), want)
    name = "model.layers.2.mlp.experts.5.down_proj"
    packed = _raw_tensor(_shard_of(d4, name + ".weight_packed"), name + ".weight_packed")
    scale = _raw_tensor(_shard_of(d4, name + ".weight_scale"), name + ".weight_scale")
    shape = _raw_tensor(_shard_of(d4, name + ".weight_shape"), name + ".weight_shape")
    assert shape.tolist() == [64, 32] and packed.shape == (64, 4) and scale.shape == (64, 1)
    words = packed.view(np.uint32)
    nib = np.stack([(words >> (4 * k)) & 0xF for k in range(8)], axis=-1).reshape(64, 32)
    want = (nib.astype(np.float32) - 8) * scale.astype(np.float32)
    got = HFCheckpoint.open(d4).get("layers.2.mlp.experts.5.down_proj.weight")
    np.testing.assert_array_equal(got.dequant(), want)
    np.testing.assert_array_equal(dequant_int4(got.packed, got.scale, 32), want)


def test_plain_tensors_match_safetensors_reader(tmp_path, rng):
    """Our header parser agrees with the safetensors library on every non-FP8 tensor."""
    write_synthetic_checkpoint(tmp_path, tiny(), fmt="int4", wrapped=True, seed=_seed(rng), n_shards=3)
    ck = HFCheckpoint.open(tmp_path)
    seen = 0
    for fname in sorted(os.listdir(tmp_path)):
        if not fname.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(tmp_path, fname), framework="numpy") as f:
            for stored in f.keys():
                ours = ck._files[os.path.join(tmp_path, fname)].read(stored)
                theirs = f.get_tensor(stored)
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, stored
                np.testing.assert_array_equal(ours, theirs, err_msg=stored)
                seen += 1
    assert seen == len(ck.stored_names())


def test_flat_and_wrapped_identical(tmp_path, rng):
    seed = _seed(rng)
    for fmt in FORMATS:
        write_synthetic_checkpoint(tmp_path / f"{fmt}_flat", tiny(), fmt=fmt, seed=seed)
        write_synthetic_checkpoint(tmp_path / f"{fmt}_wrap", tiny(), fmt=fmt, wrapped=True, seed=seed, n_shards=3)
        a, b = HFCheckpoint.open(tmp_path / f"{fmt}_flat"), HFCheckpoint.open(tmp_path / f"{fmt}_wrap")
        assert a.names() == b.names()
        assert a.config.softmax_scale == b.config.softmax_scale and a.config.quantization == b.config.quantization
        for name in a.names():
            x, y = a.get(name), b.get(name)
            if isinstance(x, Int4Packed):
                np.testing.assert_array_equal(x.packed, y.packed)
                np.testing.assert_array_equal(x.scale, y.scale)
                assert x.shape == y.shape
            else:
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y, err_msg=f"{fmt} {name}")


def test_sharding_spans_layers_and_tokenizer_files(tmp_path, rng):
    write_synthetic_checkpoint(tmp_path, tiny(), fmt="int4", seed=_seed(rng), n_shards=2,
                               extra_files={"tiktoken.model": "YQ== 0\n", "tokenizer_config.json": "{}"})
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert len(files) == 2
    by_layer = {}
    for name, fname in index["weight_map"].items():
        parts = name.split(".")
        if "layers" in parts:
            by_layer.setdefault(parts[parts.index("layers") + 1], set()).add(fname)
    assert any(len(v) == 2 for v in by_layer.values()), "no layer spans two shards"
    assert index["metadata"]["total_size"] == sum(
        np.prod(e["shape"]) * {"BF16": 2, "F32": 4, "I32": 4}[e["dtype"]]
        for fname in files for e in _read_header(tmp_path / fname)[0].values() if "dtype" in e)
    assert [os.path.basename(p) for p in tokenizer_files(tmp_path)] == ["tiktoken.model", "tokenizer_config.json"]
    HFCheckpoint.open(tmp_path).validate()


def test_single_file_checkpoint(tmp_path, rng):
    eff = write_synthetic_checkpoint(tmp_path, tiny(), fmt="fp8", seed=_seed(rng), n_shards=1)
    assert os.listdir(tmp_path).count("model.safetensors") == 1
    ck = HFCheckpoint.open(tmp_path)
    ck.validate()
    np.testing.assert_array_equal(ck.get_float("layers.0.mlp.down_proj.weight", np.float64),
                                  eff["layers.0.mlp.down_proj.weight"])


def test_make_synthetic_checkpoint_script(tmp_path, rng):
    """The CLI writes a sharded K2.6-style INT4 checkpoint with an index and the tokenizer; it validates, holds the
    same weights as `write_synthetic_checkpoint` with those arguments, and gives finite reference logits."""
    out, seed = tmp_path / "ckpt", _seed(rng)
    toy = os.path.join(REPO, "tests", "data", "kimi_toy")
    run = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_synthetic_checkpoint.py"), str(out),
                          "--fmt", "int4", "--wrapped", "--seed", str(seed), "--shards", "3", "--layers", "2",
                          "--tokenizer-from", toy], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"wrote {out}:" in run.stdout and "fmt=int4, wrapped=True" in run.stdout
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with open(out / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)
    assert [os.path.basename(p) for p in tokenizer_files(out)] == ["tiktoken.model", "tokenizer_config.json",
                                                                    "chat_template.jinja"]
    ck = HFCheckpoint.open(out)
    ck.validate()
    cfg = ck.config
    assert cfg.num_hidden_layers == 2 and cfg.tensor_prefix == "language_model.model."
    assert cfg.quantization.method == "compressed-tensors"
    assert ck.kind("layers.1.mlp.experts.0.up_proj.weight") == "int4"
    want = write_synthetic_checkpoint(tmp_path / "in_process", dataclasses.replace(tiny(), num_hidden_layers=2),
                                      fmt="int4", wrapped=True, seed=seed, n_shards=3)
    weights = reference_weights(ck)
    assert weights.keys() == want.keys()
    for name, w in want.items():
        np.testing.assert_array_equal(weights[name], w, err_msg=name)
    logits = reference_forward(cfg, weights, rng.integers(0, cfg.vocab_size, size=5))
    assert logits.shape == (5, cfg.vocab_size) and np.isfinite(logits).all() and logits.std() > 0.1


# ---- errors ----------------------------------------------------------------------------------------------------
@pytest.fixture
def bf16_dir(tmp_path, rng):
    write_synthetic_checkpoint(tmp_path, tiny(), fmt="bf16", seed=_seed(rng), n_shards=2)
    return tmp_path


def test_missing_shard(bf16_dir):
    os.remove(bf16_dir / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*missing.*tensor 'model\."):
        HFCheckpoint.open(bf16_dir)


def test_truncated_file(bf16_dir):
    path = bf16_dir / "model-00001-of-00002.safetensors"
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: truncated"):
        HFCheckpoint.open(bf16_dir)


def test_bad_header_json(bf16_dir):
    path = bf16_dir / "model-00002-of-00002.safetensors"
    header, data = _read_header(path)
    raw = b"{not json" + b" " * 10
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: .*not valid JSON"):
        HFCheckpoint.open(bf16_dir)


def test_missing_tensor(bf16_dir):
    name = "model.layers.1.mlp.experts.4.up_proj.weight"
    path = _shard_of(bf16_dir, name)
    _edit_header(path, lambda h: h.pop(name))
    idx = bf16_dir / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    index["weight_map"].pop(name)
    idx.write_text(json.dumps(index))
    ck = HFCheckpoint.open(bf16_dir)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight'.*missing"):
        ck.validate()
    with pytest.raises(CheckpointError, match="experts.4.up_proj"):
        ck.get("layers.1.mlp.experts.4.up_proj.weight")


def test_index_names_absent_tensor(bf16_dir):
    idx = bf16_dir / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: tensor 'model\.layers\.0\.extra"):
        HFCheckpoint.open(bf16_dir)


def test_shape_mismatch(bf16_dir):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    path = _shard_of(bf16_dir, name)

    def reshape(h):  # same byte count, wrong shape
        h[name]["shape"] = [h[name]["shape"][1], h[name]["shape"][0]]

    _edit_header(path, reshape)
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight' has shape \[32, 128\], expected \[128, 32\]"):
        HFCheckpoint.open(bf16_dir).validate()


def test_unknown_quant_method(bf16_dir):
    cfg_path = bf16_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json.*quant_method 'awq'"):
        HFCheckpoint.open(bf16_dir)


def test_unknown_dtype(bf16_dir):
    name = "model.layers.2.post_attention_layernorm.weight"
    path = _shard_of(bf16_dir, name)
    _edit_header(path, lambda h: h[name].update(dtype="F8_E5M2FNUZ"))
    ck = HFCheckpoint.open(bf16_dir)  # lazy: only fails when the tensor is needed
    with pytest.raises(CheckpointError, match=r"post_attention_layernorm\.weight' has unsupported dtype 'F8_E5M2FNUZ'"):
        ck.get("layers.2.post_attention_layernorm.weight")
    with pytest.raises(CheckpointError, match="F8_E5M2FNUZ"):
        ck.validate()


def test_int4_under_fp8_config_is_error(tmp_path, rng):
    write_synthetic_checkpoint(tmp_path, tiny(), fmt="int4", seed=_seed(rng))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = HFCheckpoint.open(tmp_path)
    ck.get("layers.0.self_attn.o_proj.weight")  # plain bf16 Linear under an fp8 config is fine
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight_packed' is INT4.*'fp8'"):
        ck.get("layers.1.mlp.experts.0.gate_proj.weight")


def test_ignored_module_must_be_plain(tmp_path, rng):
    write_synthetic_checkpoint(tmp_path, tiny(), fmt="int4", wrapped=True, seed=_seed(rng))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["text_config"]["quantization_config"]["ignore"].append(r"re:.*layers\.2\.mlp\.experts\.1\..*")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = HFCheckpoint.open(tmp_path)
    assert ck.is_ignored("layers.0.self_attn.q_b_proj.weight") and ck.is_ignored("lm_head.weight")
    assert ck.is_ignored("layers.0.mlp.gate_proj.weight") and not ck.is_ignored("layers.1.mlp.experts.1.up_proj.weight")
    assert isinstance(ck.get("layers.1.mlp.experts.1.up_proj.weight"), Int4Packed)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.1\.up_proj\.weight_packed'.*ignore"):
        ck.get("layers.2.mlp.experts.1.up_proj.weight")


def test_fp8_without_scale_is_error(tmp_path, rng):
    write_synthetic_checkpoint(tmp_path, tiny(), fmt="fp8", seed=_seed(rng), n_shards=1)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _edit_header(tmp_path / "model.safetensors", lambda h: h.update({name + "_renamed": h.pop(name)}))
    ck = HFCheckpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight' is F8_E4M3 without"):
        ck.get("layers.0.self_attn.o_proj.weight")
