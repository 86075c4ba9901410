"""Measure tau(B) and seconds per round of DDTree budgets on this device and write the budget profile that
`budget="auto"` reads (kdtree_jax/decode/budget.py).

For each batch size: ar (the baseline step time), then ddtree at each budget, timed like scripts/bench_engine.py
(compile excluded, median of repeats). tau = the engine's mean acceptance length, seconds per round = wall / rounds.
The table ends with the check that matters: measured tokens/s of the automatic choice against every fixed budget.

    python scripts/profile_budget.py                 # shipped pair, batches 1 8, budgets 8 .. 256
    python scripts/profile_budget.py --n-prompts 2 --max-new-tokens 16 --budgets 4 16 --batches 1 2 --repeats 1

The profile is written after each batch size. A profile already at --out for the same engine and device keeps the
batch sizes this run does not measure, so one batch size per run (e.g. under a time limit per run) rebuilds it.
Each batch's settings record the code that measured it (`bench_util.git_state`).

The check in a profiling run scores the choice on the timings it was made from (in-sample). `--score-profile` scores
a profile measured earlier on fresh timings instead (out-of-sample): it measures ar and every budget again, writes no
profile, and writes `--results` with the profile's source (file, sha256, commit, date) beside the scores:

    python scripts/profile_budget.py --score-profile checkpoints/kdtree-mini/budget_profile.nvidia-h200.json \
        --batches 1 --results score_batch1.json
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_engine import add_workload_args, load_prompts, run_mode  # noqa: E402

from benchmarks.bench_util import git_state, write_results  # noqa: E402
from kdtree_jax.decode import budget as budget_mod  # noqa: E402
from kdtree_jax.decode.engine import Engine  # noqa: E402

AUTO_GOAL = 0.95  # auto's tokens/s over the best fixed budget's (ar included) that counts as "within 5%"
CODE_FIELDS = ("git_commit", "git_dirty", "git_diff_sha256", "git_label")  # a profile's batch settings keep these


class _StatsRecorder:
    """The engine, recording each generation's stats: run_mode reports wall time, the rounds come from here."""

    def __init__(self, engine):
        self.engine = engine
        self.stats = []

    def generate(self, *args, **kwargs):
        result = self.engine.generate(*args, **kwargs)
        self.stats.append(result.stats)
        return result


def measure(engine, prompts, batch: int, mode: str, budget: int, max_new: int, repeats: int):
    """bench_engine.run_mode plus rounds and seconds per round (rounds of the first timed pass; greedy decoding
    makes every pass identical)."""
    rec = _StatsRecorder(engine)
    row, ids = run_mode(rec, prompts, batch, mode, budget, max_new, repeats)
    n_calls = len(prompts) // batch
    rounds = sum(s.rounds for s in rec.stats[1 : 1 + n_calls])  # [0] is the compile + warm-up call
    if rounds < 1:
        raise SystemExit(f"batch {batch} {mode} B={budget}: no decode rounds ran (every request stopped at prefill)")
    row["rounds"] = rounds
    row["round_s"] = row["wall_s"] / rounds
    return row, ids


def build_profile(engine, args, rows: dict, measured_at: dict, device_kind: str) -> budget_mod.BudgetProfile:
    batches = {}
    for batch, by_budget in rows.items():
        points = {b: budget_mod.BudgetPoint(tau=r["mean_acceptance_length"], round_s=r["round_s"])
                  for b, r in by_budget.items() if b != "ar"}
        batches[batch] = budget_mod.BatchProfile(ar_step_s=by_budget["ar"]["round_s"], budgets=points)
    key = engine.profile_key()
    run = {"n_prompts": args.n_prompts, "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "prompts": os.path.basename(args.prompts)}
    code = {k: v for k, v in git_state().items() if k in CODE_FIELDS}
    settings = {"by_batch": {str(bt): {**run, "measured_at": measured_at[bt], **code,
                                       "tokens_per_s": {str(b): r["tokens_per_s"] for b, r in by.items()}}
                             for bt, by in rows.items()}}
    return budget_mod.BudgetProfile(device_kind=device_kind, dtype=key.dtype, n_devices=key.n_devices,
                                    target=key.target, drafter=key.drafter, batches=batches, settings=settings)


def existing_profile(path: str, key: budget_mod.ProfileKey) -> budget_mod.BudgetProfile | None:
    """The profile already at `path` when it was measured for the same engine and device (its other batch sizes
    are kept); None when there is none, or it is for another engine (it is replaced, with a line saying so). Read
    before any measuring, so that a file that does not parse stops the run before it costs anything."""
    if not os.path.isfile(path):
        return None
    old = budget_mod.load_profile(path)
    why = old.mismatch(key)
    if why is not None:
        print(f"replacing {path}: {why}", flush=True)
        return None
    return old


def report(profile: budget_mod.BudgetProfile, rows: dict, args) -> str:
    lines = [f"### budget profile: {profile.device_kind}, {profile.dtype}, {args.n_prompts} prompts x "
             f"{args.prompt_tokens} tokens, {args.max_new_tokens} new tokens, greedy, median of {args.repeats}", "",
             "| batch | mode | B | tau | ms / round | tau/cost tok/s | measured tok/s | speedup vs ar | auto / this |"
             " cost fit err | identical to ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = ["", "| batch | auto | cost fit a (ms) | b (ms / token) | max fit err | best fixed | "
               "auto / best (in-sample: the same run) |", "|---|---|---|---|---|---|---|"]
    for batch, by_budget in rows.items():
        table = profile.batches[batch]
        chosen = auto_choice(profile, batch)
        auto_tps = by_budget[chosen]["tokens_per_s"]
        fit = budget_mod.fit_cost(table) if len(table.budgets) >= 2 else None
        ar = by_budget["ar"]
        ar_name = "ar (auto)" if chosen == "ar" else "ar"
        lines.append(f"| {batch} | {ar_name} | - | 1.00 | {1e3 * ar['round_s']:.3f} | {batch / ar['round_s']:.1f} | "
                     f"{ar['tokens_per_s']:.1f} | 1.00 | {auto_tps / ar['tokens_per_s']:.2f} | - | True |")
        for b in sorted(table.budgets):
            r, p = by_budget[b], table.budgets[b]
            name = f"**{b}** (auto)" if b == chosen else str(b)
            err = f"{100 * fit.rel_err[b]:+.1f}%" if fit else "-"
            lines.append(f"| {batch} | ddtree | {name} | {p.tau:.2f} | {1e3 * p.round_s:.3f} | "
                         f"{batch * p.tokens_per_s:.1f} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f} | {auto_tps / r['tokens_per_s']:.2f} | {err} | "
                         f"{r['identical_to_ar']} |")
        best = max(["ar", *table.budgets], key=lambda b: by_budget[b]["tokens_per_s"])
        fit_cols = (f"{1e3 * fit.a:.3f} | {1e3 * fit.b:.4f} | {100 * fit.max_abs_rel_err:.1f}%" if fit
                    else "- | - | -")
        summary.append(f"| {batch} | {chosen} | {fit_cols} | {best} | "
                       f"{auto_tps / by_budget[best]['tokens_per_s']:.2f} |")
    return "\n".join(lines + summary)


def auto_choice(profile: budget_mod.BudgetProfile, batch: int) -> int | str:
    """What budget="auto" runs at this batch size: the profile's best budget, or "ar" where AR measured faster."""
    return budget_mod.choose_budget(profile, batch) if budget_mod.speculation_pays(profile, batch) else "ar"


def profile_source(path: str, profile: budget_mod.BudgetProfile, commit: str | None, batches=None) -> dict:
    """The run that measured `profile`: its file, the file's sha256, and for each of its tables that `batches`
    (run batch sizes) read, its date and code. The code comes from the profile (recorded since profiles keep
    `git_state`) or else from `commit` (--profile-commit); a table with neither cannot be scored: its figure could
    not say which run it was judged against."""
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    by_batch = budget_mod._settings_by_batch(profile)
    used = profile.batches if batches is None else {budget_mod.nearest_batch(profile, b) for b in batches}
    out = {}
    for b in sorted(used):
        s = by_batch.get(str(b), {})
        code = {k: s[k] for k in CODE_FIELDS if k in s}
        if not code.get("git_commit"):
            if not commit:
                raise SystemExit(f"--score-profile {path}: batch {b} records no commit; pass --profile-commit with the "
                                 f"commit that measured it")
            code = {"git_commit": commit, "git_label": f"{commit} (--profile-commit)"}
        out[str(b)] = {"measured_at": s.get("measured_at"), **code}
    return {"file": os.path.abspath(path), "sha256": sha, "device_kind": profile.device_kind, "batches": out}


def score(profile: budget_mod.BudgetProfile, rows: dict) -> list[dict]:
    """Per batch size: what auto runs under `profile` against the best of this run's timings (ar and every budget).
    With a profile from another run this is out-of-sample; the run must have measured the profile's choice."""
    out = []
    for batch, by_budget in rows.items():
        chosen = auto_choice(profile, batch)
        if chosen not in by_budget:
            measured = sorted(b for b in by_budget if b != "ar")
            raise SystemExit(f"batch {batch}: the profile chooses budget {chosen}, which --budgets {measured} did not "
                             f"measure")
        best = max(by_budget, key=lambda b: (by_budget[b]["tokens_per_s"], str(b)))
        ratio = by_budget[chosen]["tokens_per_s"] / by_budget[best]["tokens_per_s"]
        out.append({"batch": batch, "profile_batch": budget_mod.nearest_batch(profile, batch), "auto": chosen,
                    "auto_tokens_per_s": by_budget[chosen]["tokens_per_s"], "best_fixed": best,
                    "best_tokens_per_s": by_budget[best]["tokens_per_s"], "auto_over_best": ratio,
                    "met": ratio >= AUTO_GOAL})
    return out


def score_report(scores: list[dict], source: dict) -> str:
    lines = [f"### auto scored out-of-sample: profile {source['file']} (sha256 {source['sha256'][:12]}) on this run's "
             f"timings", "", "| batch | profile measured (batch: date, code) | auto | auto tok/s | best fixed | "
             "best tok/s | auto / best | met |", "|---|---|---|---|---|---|---|---|"]
    for r in scores:
        src = source["batches"][str(r["profile_batch"])]
        lines.append(f"| {r['batch']} | {r['profile_batch']}: {src['measured_at']}, {src['git_label']} | {r['auto']} | "
                     f"{r['auto_tokens_per_s']:.1f} | {r['best_fixed']} | {r['best_tokens_per_s']:.1f} | "
                     f"{r['auto_over_best']:.3f} | {'yes' if r['met'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--out", default=None,
                   help="profile JSON; default <checkpoint>/../budget_profile.<device kind>.json (where auto looks)")
    p.add_argument("--score-profile", default=None, metavar="PROFILE",
                   help="score this profile (measured in an earlier run) on this run's timings; writes no profile")
    p.add_argument("--profile-commit", default=None,
                   help="with --score-profile: the commit that measured the profile's tables this run scores, where "
                        "the profile does not record it")
    p.add_argument("--results", default=None,
                   help="results JSON: every row, the scores, the provenance of this run (and of a scored profile)")
    args = p.parse_args(argv)
    if args.score_profile is not None:
        if not os.path.isfile(args.score_profile):
            p.error(f"--score-profile {args.score_profile}: no such file")
        if args.out is not None:
            p.error("--out: a --score-profile run writes no profile (it scores one measured earlier)")
        if args.results is None:
            p.error("--score-profile needs --results: the out-of-sample score is a results file")
    elif args.profile_commit is not None:
        p.error("--profile-commit applies only with --score-profile")
    for b in args.batches:
        if b < 1 or args.n_prompts % b:
            p.error(f"--batches {b}: must be >= 1 and divide --n-prompts {args.n_prompts} (every timed batch has "
                    f"exactly that many requests)")
    if any(b < 0 for b in args.budgets):
        p.error(f"--budgets must be >= 0, got {args.budgets}")
    if args.repeats < 1 or args.max_new_tokens < 2:
        p.error("--repeats must be >= 1 and --max-new-tokens >= 2 (prefill emits the first token; rounds do the rest)")
    args.budgets = sorted(set(args.budgets))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    device_kind = jax.devices()[0].device_kind
    scored = source = None
    if args.score_profile:  # read and checked before anything is measured
        scored = budget_mod.load_profile(args.score_profile)
        source = profile_source(args.score_profile, scored, args.profile_commit, args.batches)
    engine = Engine.load(args.checkpoint, args.drafter, dtype=args.dtype)
    if scored is not None:
        why = scored.mismatch(engine.profile_key())
        if why is not None:
            raise SystemExit(f"--score-profile {args.score_profile} does not apply to this engine: {why}")
    prompts = load_prompts(args.prompts, engine.tokenizer, args.n_prompts, args.prompt_tokens)
    out = None if scored else args.out or budget_mod.default_profile_path(args.checkpoint, device_kind)
    old = existing_profile(out, engine.profile_key()) if out else None
    rows: dict = {}
    measured_at: dict = {}
    for batch in args.batches:
        ar_row, ar_ids = measure(engine, prompts, batch, "ar", 0, args.max_new_tokens, args.repeats)
        rows[batch] = {"ar": ar_row}
        print(f"batch {batch} ar        {1e3 * ar_row['round_s']:.3f} ms/step", flush=True)
        for budget in args.budgets:
            row, ids = measure(engine, prompts, batch, "ddtree", budget, args.max_new_tokens, args.repeats)
            row["identical_to_ar"] = ids == ar_ids
            rows[batch][budget] = row
            print(f"batch {batch} ddtree B={budget:<4d} tau {row['mean_acceptance_length']:.2f} "
                  f"{1e3 * row['round_s']:.3f} ms/round {row['tokens_per_s']:.1f} tok/s same={row['identical_to_ar']}",
                  flush=True)
        measured_at[batch] = time.strftime("%Y-%m-%d %H:%M:%S")
        profile = build_profile(engine, args, rows, measured_at, device_kind)
        if out:
            budget_mod.save_profile(budget_mod.merge_profiles(old, profile) if old else profile, out)
            print(f"wrote batch {batch} to {out}", flush=True)  # each batch as it completes: a time limit loses one
    print("\n" + report(profile, rows, args))
    result = {"device": device_kind, "args": vars(args), "measured_at": measured_at,
              "rows": {str(bt): {str(b): r for b, r in by.items()} for bt, by in rows.items()}}
    if scored is not None:
        scores = score(scored, rows)
        print("\n" + score_report(scores, source))
        result.update(scored_on="a fresh run: out-of-sample", profile_source=source, scores=scores)
    else:
        result.update(scored_on="the run that measured the profile: in-sample", profile=out,
                      scores=score(profile, rows))
        print(f"\nwrote {out}")
    if args.results:
        write_results(args.results, result)
        print(f"wrote {args.results}")
    if not all(r["identical_to_ar"] for by in rows.values() for k, r in by.items() if k != "ar"):
        raise SystemExit("ddtree output differs from ar: the profile was written, but the engine is not lossless here")


if __name__ == "__main__":
    main()
