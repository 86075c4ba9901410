"""Evaluate the kdtree-mini target + DFlash drafter pair on held-out stdlib text.

    python scripts/eval_pair.py                                   # after train_target.py and train_drafter.py
    python scripts/eval_pair.py --no-engine                       # model metrics only
    python scripts/eval_pair.py --model-card checkpoints/kdtree-mini/MODEL_CARD.md   # also fill the card

Measures (1) target held-out loss / perplexity vs an add-one unigram baseline from train counts; (2) drafter
per-position top-1 agreement with the target's greedy continuation of held-out prompts, and the chain acceptance
length it implies: the mean over every anchor, and per round as a chain decode walks those continuations (what the
engine reports: a stretch of long acceptances is crossed in few rounds); (3) unless --no-engine: mean acceptance
length of chain and ddtree at each budget, ar/chain/ddtree decode tokens/s at each batch size, and whether greedy
outputs are identical across modes.
Writes eval.json, eval.md and eval_plot.png to --out-dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_engine's timing, shared

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kdtree_jax import train as T  # noqa: E402
from kdtree_jax.checkpoint.drafter import load_drafter  # noqa: E402
from kdtree_jax.checkpoint.hf import HFCheckpoint  # noqa: E402
from kdtree_jax.checkpoint.tokenizer import KimiTokenizer  # noqa: E402
from kdtree_jax.checkpoint.weights import load_model  # noqa: E402

CARD_BEGIN, CARD_END = "<!-- METRICS:BEGIN -->", "<!-- METRICS:END -->"
PALLAS = {"auto": None, "on": True, "off": False}


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    target: str = "checkpoints/kdtree-mini/target"
    drafter: str = "checkpoints/kdtree-mini/drafter"
    corpus: str = "data/corpus"
    out_dir: str = "out/eval_pair"
    model_card: str = dataclasses.field(default="", metadata={"help": "markdown file whose metrics block to fill"})
    seed: int = 0
    # target loss
    loss_window: int = 512
    loss_windows: int = 256
    loss_batch: int = 32
    # drafter agreement on greedy continuations
    prompt_len: int = 64
    continuation_len: int = 192
    agreement_prompts: int = 128
    agreement_stride: int = 1
    agreement_batch: int = 16
    # engine
    engine: bool = True
    budgets: str = "16,64,256"
    batch_sizes: str = "1,8"
    engine_prompts: int = 8
    max_new_tokens: int = 128
    repeats: int = dataclasses.field(default=2, metadata={"help": "timed passes per setting (the median is kept)"})
    use_pallas: str = dataclasses.field(default="auto", metadata={"choices": tuple(PALLAS)})


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def held_prompts(tokens: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - length, size=n)
    return tokens[starts[:, None] + np.arange(length)].astype(np.int32)


def engine_eval(c: EvalConfig, target, drafter, tokenizer, prompts: np.ndarray) -> dict:
    """AR / chain / ddtree(B) over all the prompts at each batch size (batch 1: one prompt at a time), timed and
    compared with AR the way bench_engine.py does it: acceptance length, decode tok/s, greedy identity vs AR."""
    from bench_engine import agreement, run_mode

    from kdtree_jax.decode.engine import Engine

    engine = Engine(target, drafter, tokenizer, use_pallas=PALLAS[c.use_pallas])
    prompts = [p.tolist() for p in prompts]
    settings = [("chain", 0)] + [("ddtree", b) for b in _ints(c.budgets)]
    runs = []
    for bs in _ints(c.batch_sizes):
        ar, ar_ids = run_mode(engine, prompts, bs, "ar", 0, c.max_new_tokens, c.repeats)
        ar.update(identical_to_ar=True, speedup_vs_ar=1.0)
        runs.append(ar)
        for mode, budget in settings:
            run, ids = run_mode(engine, prompts, bs, mode, budget, c.max_new_tokens, c.repeats)
            run.update(agreement(ids, ar_ids), identical_to_ar=ids == ar_ids,
                       speedup_vs_ar=run["tokens_per_s"] / ar["tokens_per_s"])
            runs.append(run)
        for run in runs[-len(settings) - 1:]:
            print(f"batch {bs} {run['mode']:6s} B={run['budget'] or 0:3d}: tau {run['mean_acceptance_length']:.2f}  "
                  f"{run['tokens_per_s']:,.0f} tok/s  identical to ar: {run['identical_to_ar']}", flush=True)
    return {"runs": runs, "all_identical": all(r["identical_to_ar"] for r in runs)}


def markdown(res: dict) -> str:
    t, a = res["target"], res["drafter"]
    lines = ["| metric | value |", "| --- | --- |",
             f"| target held-out loss (nats/token) | {t['heldout_loss']:.4f} |",
             f"| target held-out perplexity | {t['heldout_ppl']:.2f} |",
             f"| unigram (add-one) loss / perplexity | {t['unigram_loss']:.4f} / {t['unigram_ppl']:.1f} |",
             f"| drafter chain acceptance, mean over every anchor | {a['chain_tau_mean']:.3f} |",
             *([f"| drafter chain acceptance per round (a chain decode's walk over the same continuations) | "
                f"{a['chain_tau_per_round']:.3f} |"] if "chain_tau_per_round" in a else []),
             "", "Drafter top-1 agreement with the target's greedy continuation, by block position k:", "",
             "| k | " + " | ".join(str(k + 1) for k in range(len(a["acc_per_pos"]))) + " |",
             "| --- |" + " --- |" * len(a["acc_per_pos"]),
             "| acc | " + " | ".join(f"{x:.3f}" for x in a["acc_per_pos"]) + " |"]
    eng = res.get("engine")
    if eng:
        lines += ["", "| batch | mode | budget | accept len | tok/s | speedup vs ar | identical to ar |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in eng["runs"]:
            budget = r["budget"] if r["mode"] == "ddtree" else "-"
            lines.append(f"| {r['batch']} | {r['mode']} | {budget} | {r['mean_acceptance_length']:.2f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_ar']:.2f}x | {r['identical_to_ar']} |")
    lines += ["", f"Device: {res['device']['device']} ({res['device']['backend']}); corpus manifest "
              f"{res['corpus']['manifest_sha256'][:16]} (Python {res['corpus']['python_version']})."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> str | None:
    eng = res.get("engine")
    if not eng:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return None
    runs = eng["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for bs in sorted({r["batch"] for r in runs}):
        tree = sorted((r for r in runs if r["batch"] == bs and r["mode"] == "ddtree"), key=lambda r: r["budget"])
        chain = next(r for r in runs if r["batch"] == bs and r["mode"] == "chain")
        xs = [r["budget"] for r in tree]
        line = ax1.plot(xs, [r["mean_acceptance_length"] for r in tree], "o-", label=f"ddtree, batch {bs}")[0]
        ax1.axhline(chain["mean_acceptance_length"], ls="--", color=line.get_color(), label=f"chain, batch {bs}")
        line = ax2.plot(xs, [r["speedup_vs_ar"] for r in tree], "o-", label=f"ddtree, batch {bs}")[0]
        ax2.axhline(chain["speedup_vs_ar"], ls="--", color=line.get_color(), label=f"chain, batch {bs}")
    for ax, title in ((ax1, "mean acceptance length"), (ax2, "decode speedup vs AR")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget B")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax2.axhline(1.0, color="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fill_model_card(path: str, table: str) -> None:
    text = open(path).read()
    if CARD_BEGIN not in text or CARD_END not in text:
        raise ValueError(f"{path}: no {CARD_BEGIN} ... {CARD_END} block to fill")
    head, rest = text.split(CARD_BEGIN, 1)
    _, tail = rest.split(CARD_END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{CARD_BEGIN}\n{table}{CARD_END}{tail}")


def run(c: EvalConfig) -> dict:
    t0 = time.perf_counter()
    tokenizer = KimiTokenizer.from_dir(c.target)
    with HFCheckpoint.open(c.target) as ckpt:
        target = load_model(ckpt, param_dtype=jnp.float32, dtype=jnp.float32)
    drafter = load_drafter(c.drafter, jnp.float32)
    drafter.cfg.check_compatible(target.cfg)
    train_tokens = T.load_tokens(os.path.join(c.corpus, "train.txt"), tokenizer, c.target)
    held_tokens = T.load_tokens(os.path.join(c.corpus, "heldout.txt"), tokenizer, c.target)

    windows = T.eval_windows(held_tokens, c.loss_window, c.loss_windows)
    held = T.heldout_nll(target, windows, c.loss_batch)
    uni = T.unigram_nll(T.unigram_log_probs(train_tokens, target.cfg.vocab_size), windows)
    target_res = {"heldout_loss": held, "heldout_ppl": T.perplexity(held), "unigram_loss": uni,
                  "unigram_ppl": T.perplexity(uni), "tokens_scored": int(windows.shape[0] * (windows.shape[1] - 1))}
    print(f"target: held-out loss {held:.4f} (ppl {target_res['heldout_ppl']:.1f}) vs unigram {uni:.4f} "
          f"(ppl {target_res['unigram_ppl']:.1f})", flush=True)

    prompts = held_prompts(held_tokens, c.agreement_prompts, c.prompt_len, c.seed)
    seqs = T.greedy_continue(target, prompts, c.continuation_len, c.agreement_batch)
    walk_from = c.prompt_len if c.agreement_stride == 1 else None
    agree = T.drafter_agreement(target, drafter, seqs, c.prompt_len - 1, c.agreement_stride, c.agreement_batch,
                                walk_from=walk_from)
    print(f"drafter: acc@1 {agree['acc_per_pos'][0]:.3f} ... acc@{len(agree['acc_per_pos'])} "
          f"{agree['acc_per_pos'][-1]:.3f}; chain tau {agree['chain_tau_mean']:.3f} per anchor, "
          f"{agree.get('chain_tau_per_round', float('nan')):.3f} per round", flush=True)

    res = {"config": dataclasses.asdict(c), "target": target_res, "drafter": agree,
           "corpus": T.corpus_info(c.corpus), "device": T.device_summary()}
    if c.engine:
        res["engine"] = engine_eval(c, target, drafter, tokenizer,
                                    held_prompts(held_tokens, c.engine_prompts, c.prompt_len, c.seed + 1))
    res["wall_s"] = time.perf_counter() - t0
    os.makedirs(c.out_dir, exist_ok=True)
    table = markdown(res)
    with open(os.path.join(c.out_dir, "eval.md"), "w") as f:
        f.write(table)
    res["plot"] = plot(res, os.path.join(c.out_dir, "eval_plot.png"))
    T.write_json(os.path.join(c.out_dir, "eval.json"), res)
    if c.model_card:
        fill_model_card(c.model_card, table)
    print(table)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    T.add_config_args(ap, EvalConfig)
    run(T.config_from_args(EvalConfig, ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
