"""serving_k26: its projection and crossover on hand-made rows, and a --tiny run on the CPU whose rows hold what the
GPU run reports (ar commits one token a round; the trees' tau comes from the profile file)."""
import json

import pytest
from script_loader import load_script

from kdtree_jax.decode import budget as budget_mod


def _load():
    return load_script("benchmarks/serving_k26.py")


def _row(config, budget, c, step_s):
    return dict(config=config, budget=budget, concurrency=c, step_s_median=step_s)


def test_projection_uses_the_profiles_tau_and_finds_the_crossover():
    mod = _load()
    profile = budget_mod.load_profile(mod.DEFAULT_TAU_PROFILE)
    rounds = 4
    # ar's step grows slowly with c, the tree's fast: the tree wins at c = 1, ar from c = 16
    rows = [_row("ar", None, 1, 0.010), _row("ddtree-16", 16, 1, 0.012),
            _row("ar", None, 16, 0.012), _row("ddtree-16", 16, 16, 0.200)]
    s = mod.project(rows, profile, rounds)
    for r in rows:
        if r["budget"] is None:
            assert r["tau"] == 1.0
        else:  # the profile's measured tau at the nearest batch (16 is one of its budgets)
            nearest = budget_mod.nearest_batch(profile, r["concurrency"])
            assert r["tau_batch"] == nearest and r["tau"] == profile.batches[nearest].budgets[16].tau
        assert r["projected_tokens_per_s"] == pytest.approx(r["concurrency"] * rounds * r["tau"] / r["step_s_median"])
    assert s["best"] == {1: "ddtree-16", 16: "ar"} and s["crossover_concurrency"] == 16
    assert s["ar_over_best_tree"][1] == pytest.approx(rows[0]["projected_tokens_per_s"]
                                                      / rows[1]["projected_tokens_per_s"])
    never = mod.project([_row("ar", None, 1, 0.010), _row("ddtree-16", 16, 1, 0.010)], profile, rounds)
    assert never["crossover_concurrency"] is None  # the tree is ahead at every c measured


@pytest.mark.parametrize("argv, needle", [
    (["--tiny", "--prompt-tokens", "48"], "power of two"),
    (["--tiny", "--page-size", "24"], "--page-size"),
    (["--tiny", "--concurrency", "0,2"], "integers >= 1"),
    (["--tiny", "--tau-profile", "missing.json"], "no such file"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit):
        _load().parse_args(argv)
    assert needle in capsys.readouterr().err


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_tiny_run_serves_every_concurrency_and_reports_the_projection(tmp_path):
    mod = _load()
    out = tmp_path / "serving_k26.json"
    status = mod.main(["--tiny", "--concurrency", "1,2", "--steps", "2", "--rounds-per-step", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert status == 0, result.get("error")
    rows = {(r["config"], r["concurrency"]): r for r in result["rows"]}
    assert sorted(rows) == [("ar", 1), ("ar", 2), ("ddtree-16", 1), ("ddtree-16", 2)]
    for (config, c), r in rows.items():
        assert len(r["step_s"]) == 2 and r["step_s_min"] <= r["step_s_median"] and r["prefill_steps"] >= c
        if config == "ar":  # one token a round and request, whatever the weights
            assert r["tokens"] == 2 * 2 * c and r["tokens_per_round_per_request"] == 1.0
        else:  # a tree round commits 1 to block tokens
            assert 1.0 <= r["tokens_per_round_per_request"] <= 8.0
    profile = budget_mod.load_profile(mod.DEFAULT_TAU_PROFILE)
    for r in result["rows"]:
        want = 1.0 if r["budget"] is None else budget_mod.interp_tau(
            profile.batches[budget_mod.nearest_batch(profile, r["concurrency"])], 16)
        assert r["tau"] == pytest.approx(want)
    s = result["summary"]
    assert set(s["best"]) == {"1", "2"} and set(result["compile_s"]) == {"ar", "ddtree-16"}
    for field in ("device", "layers", "draft_layers", "dtype", "weight_bytes", "max_context", "git_commit", "wall_s"):
        assert field in result, field
