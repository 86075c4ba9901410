"""benchmarks/bench_round.py: the timed parts are the real round (chained, they rebuild the fused round's state), the
timing loop runs every call on unchanged inputs, and the shared prefill cut to each spec is that spec's prefill.

CPU smoke only (kernels in the Pallas interpreter); the full sweep is a GPU command (see the script's docstring).
"""
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import bench_round  # noqa: E402

from pallas_kernels.tree_build import topk_logprobs  # noqa: E402

SMOKE = ["--batches", "1", "--budgets", "4", "--modes", "ddtree", "--reps", "2", "--calls", "2",
         "--prompt-tokens", "16", "--max-new-tokens", "16", "--warm-rounds", "1"]
PARTS = ("round", "tree", "verify", "select", "accept", "commit", "drafter", "topk")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_round")
    result = bench_round.main(SMOKE + ["--out", str(out / "round.json"), "--trace-dir", str(out / "trace")])
    return result, out


@pytest.mark.heavy
def test_smoke_times_every_part_and_parts_rebuild_the_round(smoke):
    result, out = smoke
    assert not result["skipped"]
    (row,) = result["rows"]
    assert (row["batch"], row["mode"], row["budget"], row["n_slots"]) == (1, "ddtree", 4, 5)
    for part in PARTS:
        assert math.isfinite(row["ms"][part]) and row["ms"][part] > 0, part
        assert row["net_ms"][part] == max(row["ms"][part] - row["loop_ms"], 0.0)
    assert row["loop_ms"] > 0
    # every part's output, fed to the next part, rebuilds the whole round's state (ints exactly, floats to 1e-5 rel)
    assert row["parts_vs_round"]["int_mismatch"] == 0
    assert row["parts_vs_round"]["float_max"] <= 1e-5
    assert row["parts_match_round"]
    # the last of the --calls calls returned what the first did: the loop ran the part on unchanged inputs
    assert set(row["steady"]) == set(PARTS)
    assert row["steady_ok"]
    assert 1 <= row["acceptance_length"] <= 16  # 1 + accepted drafts (depth D = 15), mean over running requests
    assert row["cache_rows"] >= 16 + 1  # prompt + at least the first token and one warm round
    shares = sum(row["share"].values())
    assert shares == pytest.approx(row["sum_parts_over_round"])
    on_disk = json.loads((out / "round.json").read_text())
    assert on_disk["rows"][0]["ms"] == row["ms"]
    assert set(on_disk["compile_s"]) >= {"prefill", "loop", *PARTS}
    traces = [f for _, _, files in os.walk(out / "trace") for f in files if f.endswith(".xplane.pb")]
    assert traces


@pytest.mark.heavy
def test_markdown_has_one_line_per_row(smoke):
    result, _ = smoke
    table = bench_round.markdown(result["rows"], "### t")
    lines = [line for line in table.splitlines() if line.startswith("| 1 |")]
    assert len(lines) == 1 and "| ddtree | 4 | 5 |" in lines[0] and lines[0].endswith("| True |")


@pytest.mark.parametrize("unroll", [False, True])
def test_timing_loop_runs_every_call(monkeypatch, unroll):
    """A part that counts through its threaded input: after `calls` calls the thread holds x0 + calls, while the
    non-threaded output (from the shifted inputs) equals the first call's (the shift is 0); unrolled, the program
    has no while loop (nothing per iteration to subtract)."""

    def count(spec, target, drafter, x):
        return {"thread": (x["thread"][0] + 1,), "twice": 2 * x["v"]}

    monkeypatch.setitem(bench_round.PART_FNS, "count", count)
    x0 = {"thread": (jnp.arange(3, dtype=jnp.int32),), "v": jnp.array([5.0, -1.5], jnp.float32)}
    lowered = bench_round.lower_amortised(None, "count", (None, None), (None, None), x0, 7, "highest", unroll)
    assert ("stablehlo.while" in lowered.as_text()) != unroll
    prog, _ = bench_round.amortised_program(None, "count", (None, None), (None, None), x0, 7, "highest", unroll)
    first, last = prog((None, None), x0)
    np.testing.assert_array_equal(first["thread"][0], [1, 2, 3])
    np.testing.assert_array_equal(last["thread"][0], [7, 8, 9])
    np.testing.assert_array_equal(last["twice"], [10.0, -3.0])


def test_max_diff_sees_every_kind_of_difference(rng):
    a = {"i": jnp.asarray(rng.integers(0, 50, (3, 4)), jnp.int32),
         "f": jnp.asarray(rng.standard_normal(5), jnp.float32), "b": jnp.asarray(rng.random(6) < 0.5)}
    assert bench_round.max_diff(a, a) == {"int_mismatch": 0, "float_max": 0.0}
    b = dict(a, i=a["i"].at[1, 2].add(1), b=~a["b"])
    assert bench_round.max_diff(a, b)["int_mismatch"] == 1 + 6
    c = dict(a, f=a["f"].at[3].add(0.25))
    assert bench_round.max_diff(c, a)["float_max"] == pytest.approx(0.25 / max(1.0, abs(float(a["f"][3]))))
    assert not bench_round._matches(bench_round.max_diff(a, c), 1e-5)
    with pytest.raises(ValueError, match="structure"):
        bench_round.max_diff(a, {"i": a["i"]})


def test_topk_prefix_is_the_smaller_topk(rng):
    """adapt_state cuts the widest prefill's top-K list: its first k entries must be top-k, ties included."""
    logits = jnp.asarray(rng.integers(-3, 3, (2, 5, 40)).astype(np.float32))  # many exact ties
    lp_wide, ids_wide = topk_logprobs(logits, 16)
    for k in (1, 4, 9):
        lp, ids = topk_logprobs(logits, k)
        np.testing.assert_array_equal(ids_wide[..., :k], ids)
        np.testing.assert_array_equal(lp_wide[..., :k], lp)


@pytest.mark.heavy
def test_adapted_prefill_equals_the_specs_own_prefill(smoke):
    """One prefill per batch (the widest spec) cut down to ar / chain equals prefill run with that spec."""
    args = bench_round.parse_args(SMOKE)
    engine = bench_round.Engine.load(args.checkpoint, args.drafter)
    prompts = bench_round.load_prompts(args.prompts, engine.tokenizer, 1, args.prompt_tokens)
    bench = bench_round.Bench(engine, prompts, args)
    wide = bench.spec("ddtree", 1, 4)
    for mode in ("ar", "chain"):
        spec = bench.spec(mode, 1, 0)
        cut = bench.prefilled_state(spec, wide)
        own = bench.start_state(spec)
        assert jax.tree.structure(cut) == jax.tree.structure(own), mode
        diff = bench_round.max_diff(cut, own)
        assert diff["int_mismatch"] == 0 and diff["float_max"] <= 1e-5, (mode, diff)
    with pytest.raises(ValueError, match="not contained"):
        bench_round.adapt_state(bench.prefilled[1][1], wide, bench.spec("ddtree", 1, 8))
