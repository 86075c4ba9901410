"""prefix_ttft_k26 --tiny on the CPU: the hit request finds the prefix's full pages, draws the tokens of the same
prompt computed cold, and the results file holds what the GPU run reports."""
import json

import pytest
from script_loader import load_script

PAGE = 16
PREFIX = 250  # not a whole number of pages: the hit stops at the last full page, 240
SUFFIX = 16


def _load():
    return load_script("benchmarks/prefix_ttft_k26.py")


@pytest.mark.timeout(300)
def test_tiny_run_hits_the_prefix_and_matches_the_cold_tokens(tmp_path):
    out = tmp_path / "prefix_ttft.json"
    status = _load().main(["--tiny", "--prefix-tokens", str(PREFIX), "--suffix-tokens", str(SUFFIX), "--page-size",
                           str(PAGE), "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, result.get("summary")
    rows = {(r["repeat"], r["case"]): r for r in result["rows"]}
    assert sorted(rows) == [(i, c) for i in range(2) for c in ("cold", "hit", "off")]
    for i in range(2):
        cold, hit, off = (rows[(i, c)] for c in ("cold", "hit", "off"))
        assert hit["cached_tokens"] == PREFIX // PAGE * PAGE
        assert cold["cached_tokens"] == off["cached_tokens"] == 0
        assert hit["computed_tokens"] == PREFIX + SUFFIX - hit["cached_tokens"]
        assert hit["first_tokens"] == off["first_tokens"]  # greedy: the same prompt, computed cold
        assert len(hit["first_tokens"]) == result["max_new_tokens"]
        assert all(r["ttft_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in (cold, hit, off))
    s = result["summary"]
    assert s["hits_found_prefix"] and s["hit_tokens_equal_off"] and s["cold_and_off_found_nothing"]
    assert s["cases"]["hit"]["cached_tokens"] == [PREFIX // PAGE * PAGE] * 2
    assert len(s["ttft_ratio_off_over_hit"]["per_repeat"]) == 2
    assert {"ttft_min_s", "ttft_median_s", "prefill_tokens_per_s_median"} <= set(s["cases"]["off"])
    assert result["prefix_cache"]["hits"] == 3 * (PREFIX // PAGE * PAGE)  # the hits of the warm-up and 2 repeats
    for field in ("device", "layers", "dtype", "shapes", "weight_bytes", "serve", "warmup", "git_commit",
                  "git_label", "git_dirty"):
        assert field in result, field
    assert result["serve"]["page_size"] == PAGE and result["layers"] == 3 and result["dtype"] == "float32"
