"""eval_pair's engine table: every prompt at every batch size (batch 1 included), each mode against ar."""

import numpy as np
import pytest
from engine_utils import random_pair
from script_loader import load_script


def _module():
    return load_script("scripts/eval_pair.py")


@pytest.mark.heavy
def test_engine_table_covers_every_prompt_at_every_batch_size(rng):
    mod = _module()
    target, drafter = random_pair("grouped", int(rng.integers(1 << 30)))
    n_prompts, new = 3, 5
    prompts = rng.integers(3, target.cfg.vocab_size, size=(n_prompts, 6)).astype(np.int32)
    c = mod.EvalConfig(budgets="4", batch_sizes="1,2", max_new_tokens=new, repeats=1, use_pallas="off")
    res = mod.engine_eval(c, target, drafter, None, prompts)
    rows = res["runs"]
    assert [(r["batch"], r["mode"], r["budget"]) for r in rows] == [
        (b, m, k) for b in (1, 2) for m, k in (("ar", None), ("chain", None), ("ddtree", 4))]
    for r in rows:
        assert r["tokens"] == n_prompts * new, r  # batch 1 runs all prompts, one at a time
        assert r["identical_to_ar"] and res["all_identical"]  # greedy float32: every mode is ar
        ar = next(x for x in rows if x["batch"] == r["batch"] and x["mode"] == "ar")
        assert np.isclose(r["speedup_vs_ar"], r["tokens_per_s"] / ar["tokens_per_s"])
        assert 1.0 <= r["mean_acceptance_length"] <= 4.0  # block L = 4
        hist = np.array(r["accept_histogram"])  # rounds accepting 1, 2, ... tokens
        assert len(hist) <= 4 and (r["mode"] == "ar" or hist.sum() >= n_prompts * (new - 1) / 4)
        if r["mode"] != "ar":
            assert np.isclose((hist * np.arange(1, len(hist) + 1)).sum() / hist.sum(), r["mean_acceptance_length"])
    assert all(r["mean_acceptance_length"] == 1.0 for r in rows if r["mode"] == "ar")


def test_markdown_reports_the_chain_walk_only_when_measured(rng):
    mod = _module()
    acc = rng.uniform(0.2, 0.9, size=15).tolist()
    res = {"target": {"heldout_loss": 3.1, "heldout_ppl": 22.2, "unigram_loss": 6.7, "unigram_ppl": 812.4},
           "drafter": {"acc_per_pos": acc, "chain_tau_mean": 5.752, "chain_tau_per_round": 2.417},
           "device": {"device": "cpu", "backend": "cpu"},
           "corpus": {"manifest_sha256": "ab" * 32, "python_version": "3.12.1"}}
    walked = mod.markdown(res)
    assert "| drafter chain acceptance, mean over every anchor | 5.752 |" in walked
    assert "over the same continuations) | 2.417 |" in walked
    assert "| acc | " + " | ".join(f"{x:.3f}" for x in acc) + " |" in walked
    del res["drafter"]["chain_tau_per_round"]  # an anchor stride above 1: no walk
    assert "per round" not in mod.markdown(res)
