"""eval_pair's engine table: every prompt at every batch size (batch 1 included), each mode against ar."""
import importlib.util
import os
import sys

import numpy as np
from engine_utils import random_pair

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _module():
    sys.path.insert(0, SCRIPTS)  # eval_pair imports bench_engine from its own directory
    spec = importlib.util.spec_from_file_location("_eval_pair", os.path.join(SCRIPTS, "eval_pair.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


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
    assert all(r["mean_acceptance_length"] == 1.0 for r in rows if r["mode"] == "ar")
