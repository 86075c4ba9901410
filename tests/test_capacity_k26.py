"""benchmarks/capacity_k26.py: cache bytes against the formula, and the capacity arithmetic on a made-up config."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import capacity_k26 as cap  # noqa: E402

from kdtree_jax.decode.speculative import CACHE_ROW_ALIGN  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.model.drafter_config import DrafterConfig  # noqa: E402
from kdtree_jax.parallel import sharding as sh  # noqa: E402


def _small_drafter(cfg) -> DrafterConfig:
    return DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=cfg.vocab_size,
                         target_layer_ids=(0, 1), mask_token_id=cfg.vocab_size - 1, block_size=4,
                         num_target_layers=cfg.num_hidden_layers, max_position_embeddings=512)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page_size", [16, 64])
def test_k26_bytes_per_token_match_formula(page_size):
    d = cap.k26_drafter_config()
    assert (d.num_hidden_layers, d.num_key_value_heads, d.head_dim) == (6, 8, 128)
    assert [d.window(i) for i in range(6)] == [2048] * 5 + [None]
    b = cap.cache_bytes(kimi_k2_6(), d, page_size)
    assert b["latent_token"] == 61 * 576 * 2 == 70_272
    # k and v, every drafter layer (sliding ones too: the pool keeps all rows), bf16
    assert b["drafter_token"] == d.num_hidden_layers * 2 * d.num_key_value_heads * d.head_dim * 2 == 24_576
    assert b["token"] == 94_848
    assert b["page"] == page_size * b["token"]
    assert cap.cache_bytes(kimi_k2_6(), None, page_size)["token"] == 70_272


@pytest.mark.timeout(120)
@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4), (2, 2, 2)])
def test_page_is_whole_on_every_gpu_of_its_group(shape):
    """The latent has no head axis: a page is replicated over tensor x expert, and owned by one data group."""
    cfg, d = tiny(), _small_drafter(tiny())
    mesh = sh.make_mesh(shape)
    assert cap.page_bytes_per_gpu(cfg, d, 16, mesh) == cap.cache_bytes(cfg, d, 16)["page"]


@pytest.mark.timeout(60)
def test_capacity_arithmetic_on_a_made_up_config():
    cfg, d = tiny(), _small_drafter(tiny())
    b = cap.cache_bytes(cfg, d, 16)
    # tiny: 3 layers x latent (32 + 8) x bf16; drafter: 1 layer x (k, v) x 1 head x 16 x bf16
    assert (b["latent_token"], b["drafter_token"], b["token"], b["page"]) == (240, 64, 304, 4864)
    assert CACHE_ROW_ALIGN == 8  # the hand numbers below round slots to 8 rows
    rows = cap.capacity_rows(100_000, 304, 4864, 16, data=2, contexts=[64, 256], fills=[0.25, 0.5], slack=5,
                             ahead=16)
    # 100000 // 4864 = 20 pages per data group, 2 groups
    assert [(r["pages_per_group"], r["pages"], r["tokens"]) for r in rows] == [(20, 40, 640)] * 2
    r64, r256 = rows
    # slot: aligned(64 + 5) = 72 rows = 21888 B -> 4 per group; paged full: 5 pages -> 4 per group
    assert (r64["slot_rows"], r64["slot_table"], r64["paged_full"]) == (72, 8, 8)
    # 25%: 16 + 16 + 5 = 37 rows -> 3 pages -> 6 per group; 50%: 32 + 21 = 53 -> 4 pages -> 5 per group
    assert [(p["rows"], p["requests"]) for p in r64["paged"].values()] == [(48, 12), (64, 10)]
    # slot: aligned(261) = 264 rows = 80256 B -> 1 per group; paged full: 17 pages -> 1 per group
    assert (r256["slot_rows"], r256["slot_table"], r256["paged_full"]) == (264, 2, 2)
    # 25%: 64 + 21 = 85 -> 6 pages -> 3 per group; 50%: 128 + 21 = 149 -> 10 pages -> 2 per group
    assert [(p["rows"], p["requests"]) for p in r256["paged"].values()] == [(96, 6), (160, 4)]
    # a pool short of one page holds nothing; a fill past the slot's rows is capped at a full slot's pages
    assert all(r["slot_table"] == r["pages"] == 0 for r in cap.capacity_rows(-5, 304, 4864, 16, 1, [64], [0.5], 5,
                                                                            16))
    assert cap.request_rows(64, 1.0, 16, 5, 16) == 80 == 16 * math.ceil(72 / 16)


@pytest.mark.timeout(300)
@pytest.mark.multidevice
def test_script_k26_table(tmp_path):
    """The script end to end on K2.6 (abstract): weights per GPU as docs/sharding.md, and its table's counts."""
    out = tmp_path / "cap.json"
    cap.main(["--meshes", "1x1x8", "--contexts", "8192", "131072", "--json", str(out)])
    res = json.loads(out.read_text())
    a, m = res["assumptions"], res["meshes"]["1x1x8"]
    assert res["bytes"]["token"] == 94_848 and a["slack_rows"] == 33 and a["ahead_rows"] == 128
    assert 75e9 < m["target_weights_per_gpu"] < 77e9  # 76.2 GB (docs/sharding.md)
    assert 6e9 < res["bytes"]["drafter_weights"] < 8e9
    assert m["pool_bytes_per_gpu"] == a["usable_bytes"] - m["target_weights_per_gpu"] - res["bytes"]["drafter_weights"]
    assert m["page_bytes_per_gpu"] == res["bytes"]["page"]
    for r in m["rows"]:
        assert r["pages"] == m["pool_bytes_per_gpu"] // res["bytes"]["page"]
        assert r["slot_table"] == m["pool_bytes_per_gpu"] // (r["slot_rows"] * res["bytes"]["token"])
        for p in r["paged"].values():
            assert p["rows"] >= p["fill"] * r["max_context"] and p["rows"] % 64 == 0
            assert p["requests"] == r["pages"] // (p["rows"] // 64) > r["slot_table"]
