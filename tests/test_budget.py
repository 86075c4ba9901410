"""Automatic DDTree budget: the choice is the argmax of measured tau / cost, the cost fit, profile files, and the
engine / CLI running with budget="auto"."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from script_loader import load_script

from kdtree_jax.decode import budget as budget_mod
from kdtree_jax.decode.budget import BatchProfile, BudgetPoint, BudgetProfile, ProfileError, ProfileKey
from kdtree_jax.decode.engine import Engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
BUDGET_POOL = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 100, 128, 256)
N_RANDOM_PROFILES = 60


def random_profile(rng, *, key: ProfileKey | None = None, batches=None, budgets=None, ties: bool = True):
    """Random tables; with `ties`, some budgets copy another's (tau, round_s) so that exact ties occur."""
    key = key or ProfileKey(device_kind="NVIDIA H200", dtype="bfloat16", n_devices=int(rng.integers(1, 9)),
                            target="pair/target", drafter="pair/drafter")
    if batches is None:
        batches = rng.choice(BATCH_SIZES, size=int(rng.integers(1, 5)), replace=False).tolist()
    tables = {}
    for b in batches:
        chosen = budgets if budgets is not None else \
            sorted(rng.choice(BUDGET_POOL, size=int(rng.integers(2, 7)), replace=False).tolist())
        points = {int(k): BudgetPoint(tau=float(rng.uniform(1.0, 8.0)), round_s=float(rng.lognormal(-5, 1)))
                  for k in chosen}
        if ties and rng.random() < 0.5:
            src, dst = rng.choice(sorted(points), size=2, replace=False)
            points[int(dst)] = points[int(src)]
        tables[int(b)] = BatchProfile(ar_step_s=float(rng.lognormal(-6, 1)), budgets=points)
    return BudgetProfile(device_kind=key.device_kind, dtype=key.dtype, n_devices=key.n_devices, target=key.target,
                         drafter=key.drafter, batches=tables, settings={"note": "random"})


def brute_nearest(measured, batch: int) -> int:
    """Closest on a log scale by exact cross-multiplication; ties -> the larger batch."""
    best = None
    for m in sorted(measured, reverse=True):
        if best is None or max(m, batch) * min(best, batch) < max(best, batch) * min(m, batch):
            best = m
    return best


def brute_argmax(scores: dict[int, float]) -> int:
    top = max(scores.values())
    return min(k for k, v in scores.items() if v == top)


# ---------------------------------------------------------------------------------------------------------------
# The choice and the cost model
# ---------------------------------------------------------------------------------------------------------------
def test_choose_budget_is_brute_force_argmax(rng):
    saw_tie = saw_unmeasured_batch = 0
    for _ in range(N_RANDOM_PROFILES):
        profile = random_profile(rng)
        for batch in (*profile.batches, int(rng.integers(1, 100))):
            table = profile.batches[brute_nearest(profile.batches, batch)]
            scores = {k: p.tau / p.round_s for k, p in table.budgets.items()}
            want = brute_argmax(scores)
            saw_tie += sum(v == scores[want] for v in scores.values()) > 1
            saw_unmeasured_batch += batch not in profile.batches
            assert budget_mod.nearest_batch(profile, batch) == brute_nearest(profile.batches, batch)
            assert budget_mod.choose_budget(profile, batch) == want, (batch, scores)
    assert saw_tie and saw_unmeasured_batch  # both rules were exercised


def test_speculation_pays_is_best_tokens_per_s_against_ar(rng):
    saw = set()
    for _ in range(N_RANDOM_PROFILES):
        profile = random_profile(rng)
        for batch in (*profile.batches, int(rng.integers(1, 100))):
            table = profile.batches[brute_nearest(profile.batches, batch)]
            best = max(p.tau / p.round_s for p in table.budgets.values())
            want = best > 1 / table.ar_step_s
            saw.add(want)
            assert budget_mod.speculation_pays(profile, batch) == want
    assert saw == {True, False}  # random tables exercise both answers


def test_nearest_batch_ties_go_to_the_larger_batch():
    def measured(*batches):
        return BudgetProfile("cpu", "float32", 1, "t", "d", {
            b: BatchProfile(1e-3, {4: BudgetPoint(2.0, 1e-3), 8: BudgetPoint(2.5, 1e-3)}) for b in batches})

    assert budget_mod.nearest_batch(measured(2, 8), 4) == 8  # 4/2 == 8/4
    assert budget_mod.nearest_batch(measured(3, 12), 6) == 12  # 6/3 == 12/6
    assert budget_mod.nearest_batch(measured(3, 8), 5) == 8  # 8/5 < 5/3
    assert budget_mod.nearest_batch(measured(1, 8), 2) == 1  # 2/1 < 8/2
    assert budget_mod.nearest_batch(measured(1, 8), 3) == 8  # 8/3 < 3/1
    with pytest.raises(ValueError, match="batch must be >= 1"):
        budget_mod.nearest_batch(measured(1), 0)


def test_cost_fit_recovers_linear_law_and_reports_errors(rng):
    a, b = float(rng.uniform(1e-3, 1e-2)), float(rng.uniform(1e-6, 1e-4))
    budgets = sorted(rng.choice(BUDGET_POOL, size=5, replace=False).tolist())
    exact = BatchProfile(1e-3, {k: BudgetPoint(2.0, a + b * (1 + k)) for k in budgets})
    fit = budget_mod.fit_cost(exact)
    np.testing.assert_allclose([fit.a, fit.b], [a, b], rtol=1e-9)
    assert fit.max_abs_rel_err < 1e-9 and set(fit.rel_err) == set(budgets)
    mid = (budgets[0] + budgets[-1]) // 2 + 0.5  # not a measured budget
    np.testing.assert_allclose(fit.predict(mid), a + b * (1 + mid), rtol=1e-9)

    noisy = BatchProfile(1e-3, {k: BudgetPoint(2.0, (a + b * (1 + k)) * float(rng.uniform(0.8, 1.2)))
                                for k in budgets})
    fit = budget_mod.fit_cost(noisy)
    x = np.array([1.0 + k for k in budgets], np.float64)
    y = np.array([noisy.budgets[k].round_s for k in budgets], np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    np.testing.assert_allclose([fit.a, fit.b], [intercept, slope], rtol=1e-7)
    want_err = (intercept + slope * x - y) / y
    np.testing.assert_allclose([fit.rel_err[k] for k in budgets], want_err, rtol=1e-6, atol=1e-12)
    assert fit.max_abs_rel_err == pytest.approx(np.abs(want_err).max()) and fit.max_abs_rel_err > 0
    with pytest.raises(ValueError, match=">= 2 measured budgets"):
        budget_mod.fit_cost(BatchProfile(1e-3, {8: BudgetPoint(2.0, 1e-3)}))


def test_fitted_choice_scores_unmeasured_budgets(rng):
    """fitted=True: interpolated tau (linear in log(1 + B)) over the fitted cost, argmax over every B in range."""
    budgets = [2, 8, 32, 128]
    a, b = float(rng.uniform(1e-3, 1e-2)), float(rng.uniform(1e-6, 1e-4))
    taus = np.sort(rng.uniform(1.0, 6.0, size=len(budgets)))
    profile = BudgetProfile("cpu", "float32", 1, "t", "d", {
        4: BatchProfile(1e-3, {k: BudgetPoint(float(t), a + b * (1 + k)) for k, t in zip(budgets, taus)})})
    ks = np.arange(budgets[0], budgets[-1] + 1)
    scores = np.interp(np.log1p(ks), np.log1p(budgets), taus) / (a + b * (1 + ks))
    got = budget_mod.expected_tokens_per_s(profile, 4, fitted=True)
    np.testing.assert_allclose([got[int(k)] for k in ks], scores, rtol=1e-7)
    assert budget_mod.choose_budget(profile, 4, fitted=True) == int(ks[np.argmax(scores)])
    assert budget_mod.choose_budget(profile, 4) in budgets  # measured budgets only unless asked
    with pytest.raises(ValueError, match="outside the measured range"):
        budget_mod.choose_budget(profile, 4, fitted=True, candidates=[1, 8])


# ---------------------------------------------------------------------------------------------------------------
# Profile files
# ---------------------------------------------------------------------------------------------------------------
def test_profile_json_round_trip_is_exact_and_atomic(rng, tmp_path):
    profile = random_profile(rng)
    path = tmp_path / "budget_profile.nvidia-h200.json"
    assert budget_mod.save_profile(profile, path) == str(path)
    assert budget_mod.load_profile(path) == profile
    profile2 = random_profile(rng)
    budget_mod.save_profile(profile2, path)  # replaces; no temp files are left behind
    assert budget_mod.load_profile(path) == profile2
    assert os.listdir(tmp_path) == [path.name]
    assert budget_mod.default_profile_path("/x/kdtree-mini/target", "NVIDIA H200") == \
        "/x/kdtree-mini/budget_profile.nvidia-h200.json"
    assert budget_mod.checkpoint_name("/x/kdtree-mini/target/") == "kdtree-mini/target"


def test_merge_keeps_the_batches_a_run_did_not_measure(rng, tmp_path):
    """A profile re-measured one batch size per run: the new tables replace theirs, the other batch sizes stay, and
    each batch keeps its own settings, including those of a profile written with flat settings (the first profile format)."""
    key = ProfileKey(device_kind="NVIDIA H200", dtype="float32", n_devices=1, target="a/target", drafter="a/drafter")
    old = dataclasses.replace(random_profile(rng, key=key, batches=[1, 8, 64]),
                              settings={"repeats": 3, "tokens_per_s": {"1": {"ar": 1.0}, "8": {"ar": 2.0}}})
    new = dataclasses.replace(random_profile(rng, key=key, batches=[8, 2]),
                              settings={"by_batch": {"8": {"measured_at": "now"}, "2": {"measured_at": "now"}}})
    merged = budget_mod.merge_profiles(old, new)
    assert merged.batches == {1: old.batches[1], 8: new.batches[8], 64: old.batches[64], 2: new.batches[2]}
    assert merged.settings["by_batch"] == {"1": {"repeats": 3, "tokens_per_s": {"ar": 1.0}},
                                           "2": {"measured_at": "now"}, "8": {"measured_at": "now"},
                                           "64": {"repeats": 3}}
    budget_mod.save_profile(merged, tmp_path / "p.json")
    assert budget_mod.load_profile(tmp_path / "p.json") == merged
    with pytest.raises(ProfileError, match="dtype"):
        budget_mod.merge_profiles(dataclasses.replace(old, dtype="bfloat16"), new)


def _valid_json(rng) -> dict:
    return random_profile(rng, batches=[1], budgets=[4, 16], ties=False).to_json()


def _set(path_keys, value):
    def edit(obj):
        *head, last = path_keys
        for k in head:
            obj = obj[k]
        if value is KeyError:
            del obj[last]
        else:
            obj[last] = value
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_set(["device_kind"], KeyError), "missing field 'device_kind'"),
    (_set(["n_devices"], "one"), "field 'n_devices' must be int"),
    (_set(["version"], 99), "field 'version' is 99"),
    (_set(["batches", "1", "budgets", "4", "tau"], "fast"), "field 'batches.1.budgets.4.tau' must be a finite number"),
    (_set(["batches", "1", "budgets", "16", "tau"], 0.5), "field 'batches.1.budgets.16.tau' must be >= 1"),
    (_set(["batches", "1", "budgets", "4", "round_s"], 0), "field 'batches.1.budgets.4.round_s' must be > 0"),
    (_set(["batches", "1", "ar_step_s"], KeyError), "missing field 'batches.1.ar_step_s'"),
    (_set(["batches", "1", "budgets"], {}), "field 'batches.1.budgets' is empty"),
    (_set(["batches", "1", "budgets", "x4"], {"tau": 2.0, "round_s": 1.0}), "key 'batches.1.budgets.x4' must be"),
    (_set(["batches", "0"], {"ar_step_s": 1.0, "budgets": {"4": {"tau": 2.0, "round_s": 1.0}}}),
     "key 'batches.0' must be an integer >= 1"),
])
def test_malformed_profile_error_names_file_and_field(edit, needle, rng, tmp_path):
    obj = _valid_json(rng)
    edit(obj)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ProfileError) as err:
        budget_mod.load_profile(path)
    assert str(path) in str(err.value) and needle in str(err.value), str(err.value)


def test_unparseable_profile_names_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"version": 1, "batches": ')
    with pytest.raises(ProfileError, match="not valid JSON") as err:
        budget_mod.load_profile(path)
    assert str(path) in str(err.value)
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="'<top level>' must be dict"):
        budget_mod.load_profile(path)


# ---------------------------------------------------------------------------------------------------------------
# Engine and CLI
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    """The shipped pair and four short held-out prompts."""
    eng = Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f][:2]
    return eng, [eng.tokenizer.encode(t)[:n] for t, n in zip(texts, (21, 14))]


def dictating_profile(rng, key: ProfileKey, batches, budgets, want: int) -> BudgetProfile:
    """Random tables in which `want` has the best tau / cost at every batch size."""
    profile = random_profile(rng, key=key, batches=batches, budgets=budgets, ties=False)
    for b, t in profile.batches.items():
        best = max(p.tokens_per_s for p in t.budgets.values())
        t.budgets[want] = BudgetPoint(tau=t.budgets[want].tau, round_s=t.budgets[want].tau / (2 * best))
        profile.batches[b] = dataclasses.replace(t, ar_step_s=max(t.ar_step_s, 1 / best))  # AR slower than `want`
    return profile


# A plausible device: a round costs a fixed part (weights read once, launches) plus a part per verified token of
# the batch, batch x (1 + B); acceptance grows about logarithmically with the tree. At low load the fixed part
# dominates and a tree pays; at high load every tree node is paid for by every request and AR wins.
LOAD_FIXED_S = 1e-3  # seconds per round whatever the batch
LOAD_PER_TOKEN_S = 2e-5  # seconds per verified token (batch x (1 + B))
LOAD_TAU_SLOPE = 0.3  # tau(B) = 1 + slope * ln(1 + B)
LOAD_BUDGETS = (4, 16, 64)
LOAD_BATCHES = (1, 2, 4, 8, 16)


def load_profile_where_ar_wins_at_high_load(key: ProfileKey) -> BudgetProfile:
    def cost(batch, budget):
        return LOAD_FIXED_S + LOAD_PER_TOKEN_S * batch * (1 + budget)

    tables = {b: BatchProfile(ar_step_s=cost(b, 0), budgets={
        k: BudgetPoint(tau=1.0 + LOAD_TAU_SLOPE * float(np.log1p(k)), round_s=cost(b, k)) for k in LOAD_BUDGETS})
        for b in LOAD_BATCHES}
    return BudgetProfile(device_kind=key.device_kind, dtype=key.dtype, n_devices=key.n_devices, target=key.target,
                         drafter=key.drafter, batches=tables, settings={"note": "synthetic: cost ~ batch x width"})


def test_auto_plan_runs_ddtree_at_low_load_and_ar_at_high_load():
    """Per batch: the best measured tokens/s (ar or a budget), computed here by hand, is what auto picks; the
    profile makes a tree best at batch 1-4 (16, then 4) and ar best at 8-16, so every answer is exercised."""
    profile = load_profile_where_ar_wins_at_high_load(ProfileKey("cpu", "float32", 1, "t", "d"))
    want = {}
    for batch, table in profile.batches.items():
        per_request = {"ar": 1.0 / table.ar_step_s, **{k: p.tau / p.round_s for k, p in table.budgets.items()}}
        want[batch] = max(per_request, key=per_request.get)
    assert want == {1: 16, 2: 4, 4: 4, 8: "ar", 16: "ar"}  # the synthetic device behaves as described
    for batch in range(1, 2 * max(LOAD_BATCHES) + 1):
        nearest = budget_mod.nearest_batch(profile, batch)
        pays = budget_mod.speculation_pays(profile, batch)
        assert pays == (want[nearest] != "ar"), batch
        if pays:
            assert budget_mod.choose_budget(profile, batch) == want[nearest], batch


def test_serving_engine_plan_follows_the_load(shipped):
    """ServingEngine's plan under budget="auto" with that profile: a tree at 1-5 running requests, ar above."""
    from kdtree_jax.serving import ServeConfig, ServingEngine
    from kdtree_jax.decode.budget import StepKind

    eng0, _ = shipped
    eng = Engine(eng0.target, eng0.drafter, eng0.tokenizer,
                 budget_profile=load_profile_where_ar_wins_at_high_load(eng0.profile_key()))
    eng.checkpoint_names = eng0.checkpoint_names
    core = ServingEngine(eng, ServeConfig(max_slots=64, max_context=64, budget="auto", step_widths=(1, 64)))
    try:
        assert core.scheduler.kinds[1] == StepKind("ddtree", 16)
        assert {core.scheduler.kinds[a] for a in range(2, 6)} == {StepKind("ddtree", 4)}  # nearest measured: 2 and 4
        assert {core.scheduler.kinds[a] for a in range(6, 65)} == {StepKind("ar")}  # 6/4 > 8/6: nearest is 8
    finally:
        core.shutdown()


@pytest.mark.heavy
def test_serving_engine_steps_ar_at_high_load(shipped):
    """The step report's kind: one running request runs the tree, 6 or more run ar (8 measured: ar wins)."""
    from kdtree_jax.serving import RequestParams, ServeConfig, ServingEngine

    eng0, prompts = shipped
    eng = Engine(eng0.target, eng0.drafter, eng0.tokenizer,
                 budget_profile=load_profile_where_ar_wins_at_high_load(eng0.profile_key()))
    eng.checkpoint_names = eng0.checkpoint_names
    high, context = 8, 256  # every request still decoding when the last one joins: prefill 256 tokens a step
    core = ServingEngine(eng, ServeConfig(max_slots=high, max_context=context, budget="auto", step_widths=(1, high),
                                          prefill_batch=high, max_num_batched_tokens=context, overlap=False))
    params = RequestParams(max_new_tokens=context - max(map(len, prompts)) - 8)
    try:
        def step_until(active: int):
            for _ in range(4 * high):
                report = core.step()
                if report.active >= active:
                    return report
            raise AssertionError(f"never {active} requests running")

        core.submit(prompts[0], params)
        low = step_until(1)
        assert (low.active, low.kind.name) == (1, "ddtree-16")
        for i in range(1, high):
            core.submit(prompts[i % len(prompts)], params)
        busy = step_until(high)
        assert busy.active == high and busy.kind.name == "ar", (busy.active, busy.kind)
    finally:
        core.shutdown()


@pytest.mark.heavy
def test_engine_auto_budget_runs_the_profiles_choice(shipped, rng, tmp_path):
    eng0, prompts = shipped
    budgets = [2, 4, 8]
    want = int(rng.choice(budgets))
    path = tmp_path / "profile.json"
    budget_mod.save_profile(dictating_profile(rng, eng0.profile_key(), [2, 16], budgets, want), path)
    eng = Engine(eng0.target, eng0.drafter, eng0.tokenizer, budget_profile=str(path))
    eng.checkpoint_names = eng0.checkpoint_names
    ar = eng.generate(prompts, 8, mode="ar")
    auto = eng.generate(prompts, 8, mode="ddtree", budget="auto")
    assert auto.stats.budget == want and auto.stats.budget_source == "auto"
    assert [s.budget for s, kind in eng._compiled if s.mode == "ddtree"] == [want]  # the compiled tree size
    assert auto.token_ids == ar.token_ids
    fixed = eng.generate(prompts, 8, mode="ddtree", budget=want)  # integers as before; same compiled program
    assert fixed.stats.budget == want and fixed.stats.budget_source == "fixed"
    assert fixed.token_ids == ar.token_ids and len(eng._compiled) == 2
    assert ar.stats.budget is None and ar.stats.budget_source is None
    assert (ar.stats.mode, auto.stats.mode) == ("ar", "ddtree")


@pytest.mark.heavy
def test_engine_auto_runs_ar_where_the_profile_measured_ar_faster(shipped, rng, tmp_path):
    eng0, prompts = shipped
    budgets = [2, 4, 8]
    profile = random_profile(rng, key=eng0.profile_key(), batches=[2, 16], budgets=budgets, ties=False)
    for b, t in profile.batches.items():  # AR at twice the best tree's tokens/s
        best = max(p.tokens_per_s for p in t.budgets.values())
        profile.batches[b] = dataclasses.replace(t, ar_step_s=1 / (2 * best))
    path = tmp_path / "profile.json"
    budget_mod.save_profile(profile, path)
    eng = Engine(eng0.target, eng0.drafter, eng0.tokenizer, budget_profile=str(path))
    eng.checkpoint_names = eng0.checkpoint_names
    assert eng.resolve_budget("auto", "ddtree", len(prompts)) == (budget_mod.DEFAULT_BUDGET, budget_mod.AUTO_AR)
    ar = eng.generate(prompts, 8, mode="ar")
    auto = eng.generate(prompts, 8, mode="ddtree", budget="auto")
    assert auto.stats.mode == "ar" and auto.stats.budget is None and auto.stats.budget_source == budget_mod.AUTO_AR
    assert {s.mode for s, kind in eng._compiled} == {"ar"}  # no tree program was built
    assert auto.token_ids == ar.token_ids
    assert auto.stats.mean_acceptance_length == 1.0
    fixed = eng.generate(prompts, 8, mode="ddtree", budget=4)  # an explicit budget is never overridden
    assert fixed.stats.mode == "ddtree" and fixed.stats.budget == 4 and fixed.token_ids == ar.token_ids


def test_engine_auto_without_matching_profile_falls_back_with_one_warning(shipped, rng, tmp_path, caplog):
    eng0, _ = shipped
    assert eng0.checkpoint_names == ("kdtree-mini/target", "kdtree-mini/drafter")
    slug = budget_mod.device_slug(jax.devices()[0].device_kind)
    assert eng0.budget_profile == os.path.join(SHIPPED, f"budget_profile.{slug}.json")  # found by the naming rule
    missing = str(tmp_path / "nope.json")
    eng = Engine(eng0.target, eng0.drafter, eng0.tokenizer, budget_profile=missing)
    with caplog.at_level(logging.WARNING, logger="kdtree_jax.decode.budget"):
        assert eng.resolve_budget("auto", "ddtree", 2) == (budget_mod.DEFAULT_BUDGET, "auto-default")
        assert eng.resolve_budget("auto", "ddtree", 8) == (budget_mod.DEFAULT_BUDGET, "auto-default")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and missing in msgs[0] and "\n" not in msgs[0]

    key = eng0.profile_key()
    for field, value in (("device_kind", "NVIDIA H200"), ("dtype", "bfloat16"), ("drafter", "other/drafter")):
        other = dataclasses.replace(key, **{field: value})
        path = tmp_path / f"{field}.json"
        budget_mod.save_profile(dictating_profile(rng, other, [2], [2, 4], 4), path)
        eng = Engine(eng0.target, eng0.drafter, eng0.tokenizer, budget_profile=str(path))
        eng.checkpoint_names = eng0.checkpoint_names
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kdtree_jax.decode.budget"):
            assert eng.resolve_budget("auto", "ddtree", 2) == (budget_mod.DEFAULT_BUDGET, "auto-default")
        assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()
        assert field in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="budget must be an integer >= 0 or 'auto', got 'big'"):
        eng.generate([[1, 2, 3]], 4, budget="big")
    assert eng.resolve_budget(7, "ddtree", 2) == (7, "fixed")


def test_cli_budget_flag_parses_auto_and_integers():
    from kdtree_jax.generate import UsageError, build_parser

    assert build_parser().parse_args(["--budget", "auto"]).budget == "auto"
    assert build_parser().parse_args(["--budget", "48"]).budget == 48
    with pytest.raises(UsageError, match="--budget"):
        build_parser().parse_args(["--budget", "lots"])


def _subprocess_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # one device: a single-process user program
    return env


@pytest.mark.slow
def test_cli_budget_auto_reports_the_chosen_budget(shipped, rng, tmp_path):
    """--json (Engine.generate) and the streamed text path (Engine.generate_stream) both run the profile's B."""
    eng0, _ = shipped
    budgets = [2, 4, 8]
    want = int(rng.choice(budgets))
    path = tmp_path / "profile.json"
    budget_mod.save_profile(dictating_profile(rng, eng0.profile_key(), [1], budgets, want), path)
    for extra in (["--json"], []):
        proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", "--budget", "auto", "--budget-profile",
                               str(path), "--max-new-tokens", "8", *extra], capture_output=True, text=True, cwd=REPO,
                              env=_subprocess_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"budget={want} (auto)" in proc.stderr.splitlines()[-1]
        if extra:
            out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            assert len(out) == 1 and out[0]["stats"]["budget"] == want and out[0]["stats"]["budget_source"] == "auto"


@pytest.mark.slow
def test_profile_script_smoke_run_writes_a_loadable_profile(tmp_path):
    """Batch 1, then batch 2 in a second run to the same file: the second keeps the first's table."""
    out = tmp_path / "profile.json"

    def run(batch):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "profile_budget.py"), "--n-prompts",
                               "2", "--max-new-tokens", "16", "--budgets", "4", "16", "--batches", str(batch),
                               "--repeats", "1", "--out", str(out)], capture_output=True, text=True, cwd=REPO,
                              env=_subprocess_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    first = run(1)
    batch_1 = budget_mod.load_profile(out).batches[1]
    proc = run(2)
    profile = budget_mod.load_profile(out)
    assert profile.batches[1] == batch_1 and sorted(profile.settings["by_batch"]) == ["1", "2"]
    assert profile.device_kind == jax.devices()[0].device_kind and profile.dtype == "float32"
    assert (profile.target, profile.drafter) == ("kdtree-mini/target", "kdtree-mini/drafter")
    assert sorted(profile.batches) == [1, 2]
    for t in profile.batches.values():
        assert sorted(t.budgets) == [4, 16] and t.ar_step_s > 0
        assert all(p.tau > 1.0 and p.round_s > 0 for p in t.budgets.values())  # the shipped drafter is trained
    for batch, batch_run in ((1, first), (2, proc)):
        rows = [line for line in batch_run.stdout.splitlines() if line.startswith(f"| {batch} | ")]
        auto = [line for line in rows if "(auto)" in line]
        if budget_mod.speculation_pays(profile, batch):
            want = f"| {batch} | ddtree | **{budget_mod.choose_budget(profile, batch)}** (auto) |"
        else:  # e.g. on a 2-core CPU, where verifying a tree costs more than its acceptance gains
            want = f"| {batch} | ar (auto) |"
        assert len(auto) == 1 and auto[0].startswith(want), auto
    assert f"wrote {out}" in proc.stdout


def _profile_script():
    return load_script("scripts/profile_budget.py")


def test_scoring_a_profile_records_its_source_and_scores_fresh_timings(rng, tmp_path):
    """Out-of-sample: the earlier profile's choice, scored against the best of this run's rows; the results name
    the profile file (sha256) and the commit and date that measured each of its tables."""
    script = _profile_script()
    profile = load_profile_where_ar_wins_at_high_load(ProfileKey("cpu", "float32", 1, "t", "d"))
    path = tmp_path / "earlier.json"
    budget_mod.save_profile(profile, path)
    with pytest.raises(SystemExit, match="--profile-commit"):  # nothing says which run measured it
        script.profile_source(str(path), profile, None)
    source = script.profile_source(str(path), profile, "eaf7c42")
    import hashlib

    assert source["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert {b["git_commit"] for b in source["batches"].values()} == {"eaf7c42"}
    recorded = dataclasses.replace(profile, settings={"by_batch": {
        str(b): {"measured_at": f"2026-01-0{i + 1}", "git_commit": f"c{b}", "git_label": f"c{b}+dirty.ab"}
        for i, b in enumerate(profile.batches)}})
    budget_mod.save_profile(recorded, path)
    source = script.profile_source(str(path), recorded, "ignored")
    assert source["batches"]["16"] == {"measured_at": "2026-01-05", "git_commit": "c16", "git_label": "c16+dirty.ab"}
    partly = dataclasses.replace(recorded, settings={"by_batch": {"1": recorded.settings["by_batch"]["1"]}})
    assert list(script.profile_source(str(path), partly, None, [1])["batches"]) == ["1"]  # only the tables it reads
    with pytest.raises(SystemExit, match="batch 16 records no commit"):
        script.profile_source(str(path), partly, None, [1, 50])

    fresh = {b: {"ar": {"tokens_per_s": float(rng.uniform(100, 200))},
                 **{k: {"tokens_per_s": float(rng.uniform(100, 200))} for k in LOAD_BUDGETS}} for b in (1, 32)}
    scores = {s["batch"]: s for s in script.score(recorded, fresh)}
    for batch, want in ((1, 16), (32, "ar")):
        s, rates = scores[batch], {k: r["tokens_per_s"] for k, r in fresh[batch].items()}
        best = max(rates, key=rates.get)
        assert (s["auto"], s["best_fixed"]) == (want, best)
        assert s["auto_over_best"] == pytest.approx(rates[want] / rates[best])
        assert s["met"] == (rates[want] / rates[best] >= script.AUTO_GOAL)
    with pytest.raises(SystemExit, match="chooses budget 16"):
        script.score(recorded, {1: {"ar": {"tokens_per_s": 1.0}, 4: {"tokens_per_s": 2.0}}})


@pytest.mark.parametrize("argv, needle", [
    (["--score-profile", "PROFILE"], "--score-profile needs --results"),
    (["--score-profile", "PROFILE", "--results", "r.json", "--out", "p.json"], "--out"),
    (["--score-profile", "missing.json", "--results", "r.json"], "no such file"),
    (["--profile-commit", "abc"], "--profile-commit applies only with --score-profile"),
])
def test_profile_script_flags_for_scoring(argv, needle, tmp_path, capsys):
    script = _profile_script()
    path = tmp_path / "p.json"
    budget_mod.save_profile(load_profile_where_ar_wins_at_high_load(ProfileKey("cpu", "float32", 1, "t", "d")), path)
    with pytest.raises(SystemExit):
        script.parse_args([str(path) if a == "PROFILE" else a for a in argv])
    assert needle in capsys.readouterr().err


@pytest.mark.slow
def test_profile_script_scores_an_earlier_profile_on_a_fresh_run(tmp_path):
    """A --score-profile run measures again, writes no profile, and its results carry the scores and both runs'
    provenance."""
    eng_key = ProfileKey(jax.devices()[0].device_kind, "float32", 1, "kdtree-mini/target", "kdtree-mini/drafter")
    earlier = dataclasses.replace(load_profile_where_ar_wins_at_high_load(eng_key), settings={"by_batch": {
        str(b): {"measured_at": "2026-01-01 00:00:00", "git_commit": "0" * 40, "git_label": "0000000"}
        for b in LOAD_BATCHES}})
    path, results = tmp_path / "earlier.json", tmp_path / "score.json"
    budget_mod.save_profile(earlier, path)
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "profile_budget.py"), "--n-prompts", "2",
                           "--max-new-tokens", "16", "--budgets", "4", "16", "--batches", "1", "--repeats", "1",
                           "--score-profile", str(path), "--results", str(results)], capture_output=True, text=True,
                          cwd=REPO, env=_subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert path.read_bytes() == before and "auto scored out-of-sample" in proc.stdout
    out = json.loads(results.read_text())
    assert out["scored_on"].endswith("out-of-sample") and out["git_commit"] and "git_diff_sha256" in out
    assert out["profile_source"]["batches"]["1"]["git_commit"] == "0" * 40
    (score,) = out["scores"]
    rates = {k: r["tokens_per_s"] for k, r in out["rows"]["1"].items()}
    assert score["auto"] == 16 and score["auto_tokens_per_s"] == rates["16"]
    assert score["auto_over_best"] == pytest.approx(rates["16"] / max(rates.values()))
