"""End-to-end decoding benchmark: ar vs chain vs ddtree (budget sweep), measured side by side in one run.

Every mode runs the same prompts in the same compile mode (one jitted generation each); compile time is
excluded (each spec is compiled and run once before it is timed). Greedy outputs must be identical across modes.

    python scripts/bench_engine.py --out bench_engine.json --plot bench_engine.png

`--json-schema` decodes every mode under a JSON schema (structured output; the speedup column is then constrained
ddtree over constrained ar). `--logprobs K` has every mode keep each token's log-probability and its top K (what
that costs: run with and without).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_util import write_results  # noqa: E402
from kdtree_jax.decode.engine import Engine  # noqa: E402

DEFAULT_DIR = os.path.join(REPO, "checkpoints", "kdtree-mini")


def load_prompts(path: str, tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """Held-out prompts cut to exactly `prompt_tokens` tokens, so every batch shares one compiled shape."""
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    out = []
    for t in texts:
        ids = tokenizer.encode(t)
        if len(ids) >= prompt_tokens:
            out.append(ids[:prompt_tokens])
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"{path}: only {len(out)} prompts have >= {prompt_tokens} tokens (need {n})")
    return out


def run_mode(engine, prompts, batch, mode, budget, max_new, repeats, constraint=None, logprobs=None):
    """Compile + warm once, then time `repeats` passes over all prompts; returns stats and token ids."""
    batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    engine.generate(batches[0], max_new, mode=mode, budget=budget, constraint=constraint,
                    logprobs=logprobs)  # compile + warm-up
    walls, tokens, accept, ids = [], 0, [], []
    for rep in range(repeats):
        wall = 0.0
        for b in batches:
            t0 = time.perf_counter()
            res = engine.generate(b, max_new, mode=mode, budget=budget, constraint=constraint, logprobs=logprobs)
            wall += time.perf_counter() - t0
            if rep == 0:
                tokens += res.stats.generated_tokens
                ids.extend(res.token_ids)
                for o in res.outputs:
                    accept.extend(o.accept_lengths)
        walls.append(wall)
    wall = float(np.median(walls))
    return {
        "mode": mode, "budget": budget if mode == "ddtree" else None, "batch": batch,
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "mean_acceptance_length": float(np.mean(accept)) if accept else 1.0,
        "accept_histogram": np.bincount(accept, minlength=2)[1:].tolist(),  # rounds that accepted 1, 2, ... tokens
    }, ids


def agreement(ids: list[list[int]], ar_ids: list[list[int]]) -> dict:
    """Per prompt, against ar: how many prompts got ar's tokens exactly, and where the others first differ (in
    bfloat16 the verify pass and the one-token step round differently, so a near-tie can flip one token and with
    it the rest of that prompt)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ids, ar_ids) if a != b]
    return {"prompts_identical": len(ids) - len(firsts), "first_difference_at": firsts}


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """The pair and the held-out prompts (dtype_agreement.py too)."""
    p.add_argument("--checkpoint", default=os.path.join(DEFAULT_DIR, "target"))
    p.add_argument("--drafter", default=os.path.join(DEFAULT_DIR, "drafter"))
    p.add_argument("--prompts", default=os.path.join(DEFAULT_DIR, "heldout_prompts.jsonl"))
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The pair, prompts and generation length every engine benchmark shares (profile_budget.py too)."""
    add_pair_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budgets", default="16,32,64,128,256")
    p.add_argument("--out", default=None, help="write all rows as JSON")
    p.add_argument("--plot", default=None, help="PNG: acceptance length and speedup vs budget")
    p.add_argument("--json-schema", default=None,
                   help="constrain every mode to this JSON schema (its text, or a path to a .json file)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="keep each token's log-probability and its top K (0..20) in every mode")
    args = p.parse_args()
    constraint = None
    if args.json_schema is not None:
        from kdtree_jax.constrain.automaton import ConstraintSpec

        text = args.json_schema
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            constraint = ConstraintSpec.json_schema(text)
        except ValueError as e:
            p.error(f"--json-schema: {e}")

    import jax

    engine = Engine.load(args.checkpoint, args.drafter, dtype=args.dtype)
    prompts = load_prompts(args.prompts, engine.tokenizer, args.n_prompts, args.prompt_tokens)
    device = jax.devices()[0].device_kind
    rows = []
    for batch in map(int, args.batches.split(",")):
        ar_row, ar_ids = run_mode(engine, prompts, batch, "ar", 0, args.max_new_tokens, args.repeats, constraint,
                                  args.logprobs)
        rows.append(ar_row)
        plan = [("chain", 0)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
        for mode, budget in plan:
            row, ids = run_mode(engine, prompts, batch, mode, budget, args.max_new_tokens, args.repeats, constraint,
                                args.logprobs)
            row["identical_to_ar"] = ids == ar_ids
            row.update(agreement(ids, ar_ids))
            row["speedup_vs_ar"] = row["tokens_per_s"] / ar_row["tokens_per_s"]
            rows.append(row)
            print(f"batch {batch} {mode:6s} B={budget:<4d} tok/s {row['tokens_per_s']:9.1f} "
                  f"tau {row['mean_acceptance_length']:.2f} x{row['speedup_vs_ar']:.2f} same={row['identical_to_ar']} "
                  f"({row['prompts_identical']}/{len(prompts)} prompts; others differ from token "
                  f"{row['first_difference_at']})", flush=True)
    print(f"\n### {device}, {args.dtype}, {args.n_prompts} prompts x {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new tokens, greedy{', JSON schema' if constraint else ''}"
          f"{'' if args.logprobs is None else f', logprobs {args.logprobs}'}\n")
    print("| batch | mode | B | tokens/s | mean acceptance | speedup vs ar | identical to ar | prompts identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['budget'] or '-'} | {r['tokens_per_s']:.1f} | "
              f"{r['mean_acceptance_length']:.2f} | {r.get('speedup_vs_ar', 1.0):.2f} | "
              f"{r.get('identical_to_ar', True)} | {r.get('prompts_identical', len(prompts))}/{len(prompts)} |")
    if args.out:
        write_results(args.out, {"device": device, "args": vars(args), "rows": rows})
    if args.plot:
        plot(rows, args.plot, device)


def plot(rows, path, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for batch in sorted({r["batch"] for r in rows}):
        tree = [r for r in rows if r["batch"] == batch and r["mode"] == "ddtree"]
        chain = next(r for r in rows if r["batch"] == batch and r["mode"] == "chain")
        b = [r["budget"] for r in tree]
        a1.plot(b, [r["mean_acceptance_length"] for r in tree], "o-", label=f"ddtree, batch {batch}")
        a1.axhline(chain["mean_acceptance_length"], ls="--", color=a1.lines[-1].get_color(), label=f"chain, batch {batch}")
        a2.plot(b, [r["speedup_vs_ar"] for r in tree], "o-", label=f"ddtree, batch {batch}")
        a2.axhline(chain["speedup_vs_ar"], ls="--", color=a2.lines[-1].get_color(), label=f"chain, batch {batch}")
    for ax, name in ((a1, "mean acceptance length"), (a2, "speedup vs ar")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget B")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"kdtree-mini on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
