"""`python -m kdtree_jax.generate`: run the engine on prompts and stream text to the terminal.

With no arguments it runs on the shipped default pair in `checkpoints/kdtree-mini/`. Flags follow the
vLLM / SGLang conventions where they have one (`--model`, `--speculative-model`, ...). Compiled programs are kept in
JAX's persistent compilation cache, as the server keeps them ($KDTREE_COMPILATION_CACHE), so a second run loads them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from kdtree_jax.cli import (  # noqa: F401 (UsageError, ATTENTION_BACKENDS: part of this module's interface)
    ATTENTION_BACKENDS,
    CACHE_HELP,
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    HelpFormatter,
    Parser,
    UsageError,
    add_mode_flags,
    add_model_flags,
    configure_logging,
    default_budget,
    parse_budget,
    run_main,
)
from kdtree_jax.decode.engine import Engine
from kdtree_jax.parallel.sharding import parse_mesh
from kdtree_jax.serving import enable_compilation_cache

log = logging.getLogger("kdtree_jax.generate")

DEFAULT_PROMPT = "def fibonacci(n):\n"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m kdtree_jax.generate",
        description="Generate with DDTree speculative decoding (or the chain / autoregressive baselines).",
        formatter_class=HelpFormatter,
        epilog=CACHE_HELP,
    )
    io = p.add_argument_group("model")
    pr = p.add_argument_group("prompts")
    pr.add_argument("--prompt", action="append", default=None,
                    help=f"prompt text (repeatable); default without any prompt flag: {DEFAULT_PROMPT!r}")
    pr.add_argument("--prompt-file", default=None, help="file with one prompt per line")
    pr.add_argument("--prompt-ids", action="append", default=None,
                    help="comma-separated token ids (repeatable)")
    pr.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    sm = p.add_argument_group("decoding")
    add_mode_flags(sm)
    sm.add_argument("--budget", "--speculative-num-draft-tokens", dest="budget", type=parse_budget, default=None,
                    help="DDTree node budget B (tree tokens verified per round = 1 + B), or 'auto': the B with the "
                         "most measured tokens/s for this device and batch size, or plain ar where the profile "
                         "measured ar faster than every tree (scripts/profile_budget.py); default: auto where a "
                         "budget profile measured on this device applies (the shipped pair has one for the H200), "
                         "else 32")
    sm.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=128,
                    help="most tokens generated per prompt")
    sm.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sm.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    sm.add_argument("--top-k", type=int, default=0, help="0 = off")
    sm.add_argument("--seed", type=int, default=0, help="sampling seed; prompt i uses seed + i")
    sm.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object per prompt per line, in prompt order")
    out.add_argument("--stream-every", type=int, default=1, help="rounds between streamed updates")
    kn = p.add_argument_group("kernels")
    add_model_flags(io, kernels=kn)
    kn.add_argument("--no-pallas", action="store_true", help="jnp attention instead of the verify_attn kernel")
    return p


def _prompts(args) -> list:
    prompts: list = []
    for text in args.prompt or []:
        prompts.append(text)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise UsageError(f"--prompt-file {args.prompt_file}: no such file")
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip())
    for spec in args.prompt_ids or []:
        try:
            ids = [int(t) for t in spec.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids {spec!r}: expected comma-separated integers") from None
        if not ids:
            raise UsageError("--prompt-ids: empty list")
        prompts.append(ids)
    return prompts or [DEFAULT_PROMPT]


def _check_args(args) -> None:
    if isinstance(args.budget, int) and args.budget < 0:
        raise UsageError(f"--budget must be >= 0, got {args.budget}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.stream_every < 1:
        raise UsageError(f"--stream-every must be >= 1, got {args.stream_every}")
    if not os.path.exists(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint}: no such directory")
    if args.drafter is None and args.mode != "ar" and os.path.abspath(args.checkpoint) == DEFAULT_TARGET:
        args.drafter = DEFAULT_DRAFTER
    if args.mode != "ar":
        if args.drafter is None:
            raise UsageError(f"--mode {args.mode} needs --drafter (or use --mode ar)")
        if not os.path.exists(args.drafter):
            raise UsageError(f"--drafter {args.drafter}: no such directory")


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    prompts = _prompts(args)
    configure_logging()
    enable_compilation_cache()

    mesh = parse_mesh(args.mesh) if args.mesh else None
    engine = Engine.load(args.checkpoint, args.drafter if args.mode != "ar" else None, mesh=mesh, dtype=args.dtype,
                         use_pallas=not args.no_pallas, progress=True, budget_profile=args.budget_profile,
                         attn_backend=None if args.attention_backend == "auto" else args.attention_backend)
    _report_compiles(engine)
    if any(isinstance(p, str) for p in prompts) and engine.tokenizer is None:
        raise UsageError(f"--checkpoint {args.checkpoint} has no tokenizer files; pass --prompt-ids instead")
    budget = args.budget if args.budget is not None else default_budget(engine, args.mode)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              mode=args.mode, budget=budget, chat=args.chat)
    totals = {"tokens": 0, "rounds": 0, "wall": 0.0, "compile": 0.0, "acc": [], "budgets": set()}
    for lo in range(0, len(prompts), args.batch_size):
        batch = prompts[lo : lo + args.batch_size]
        seeds = [args.seed + lo + i for i in range(len(batch))]
        result = _run_batch(engine, batch, seeds, args, kw)
        for out in result.outputs:
            if args.json:
                print(json.dumps({
                    "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                    "stats": {"rounds": out.rounds, "mean_acceptance_length": out.mean_acceptance_length,
                              "tokens_per_s": result.stats.tokens_per_s, "accept_lengths": out.accept_lengths,
                              "mode": result.stats.mode, "budget": result.stats.budget,
                              "budget_source": result.stats.budget_source},
                }, ensure_ascii=False), flush=True)
            totals["acc"].extend(out.accept_lengths)
        totals["tokens"] += result.stats.generated_tokens
        totals["rounds"] += result.stats.rounds
        totals["wall"] += result.stats.wall_s
        totals["compile"] += result.stats.compile_s
        if result.stats.budget_source is not None:
            totals["budgets"].add((result.stats.budget, result.stats.budget_source))
    mean_acc = sum(totals["acc"]) / len(totals["acc"]) if totals["acc"] else 0.0
    tps = totals["tokens"] / totals["wall"] if totals["wall"] > 0 else float("nan")
    print(f"[{args.mode}] tokens={totals['tokens']} rounds={totals['rounds']} mean_acceptance_length={mean_acc:.2f} "
          f"tokens/s={tps:.1f} run_s={totals['wall']:.2f} compile_s={totals['compile']:.2f}{_budget_note(totals)}",
          file=sys.stderr)
    return 0


def _report_compiles(engine: Engine) -> None:
    """Report each program the engine compiles as a line on stderr before it starts ("compiling prefill (ddtree,
    batch 1) ...") and a line with its seconds once done: a cold compile takes seconds (about 10 s for the shipped
    pair on a 2-core CPU), too long to pass in silence, and the engine's own progress bars erase themselves. The
    engine calls its `compile` for every program, compiled already or not; only the first call of a key compiles,
    so only that one is reported. An engine set up by an earlier run keeps the reporter it has."""
    if getattr(engine.compile, "reports_compiles", False):
        return
    compiled = set()

    def compile(fn, args, key, *, desc, **kw):
        if key in compiled:
            return type(engine).compile(engine, fn, args, key, desc=desc, **kw)
        log.info("compiling %s ...", desc)
        program, seconds = type(engine).compile(engine, fn, args, key, desc=desc, **kw)
        compiled.add(key)
        log.info("compiled %s in %.1f s", desc, seconds)
        return program, seconds

    compile.reports_compiles = True
    engine.progress = False  # these lines instead of the bars
    engine.compile = compile


def _budget_note(totals) -> str:
    """' budget=16 (auto)' for ddtree: the B each batch ran with (batches of different sizes may differ); ' budget=ar
    (auto-ar)' where the budget profile measured AR faster than any tree for that batch size."""
    if not totals["budgets"]:
        return ""
    return " budget=" + ",".join(f"{'ar' if b is None else b} ({src})"
                                 for b, src in sorted(totals["budgets"], key=lambda x: (x[0] is None, x[0] or 0, x[1])))


def _run_batch(engine, batch, seeds, args, kw):
    """Stream text for a single interactive prompt; otherwise decode the batch in one computation."""
    if args.json or len(batch) > 1:
        result = engine.generate(batch, seed=seeds, **kw)
        if not args.json:
            for i, out in enumerate(result.outputs):
                print(f"--- prompt {i} ({out.finish_reason}) ---")
                print(out.text if out.text is not None else out.token_ids, flush=True)
        return result
    stream = engine.generate_stream(batch, seed=seeds, stream_every=args.stream_every, **kw)
    decoder = engine.tokenizer.stream_decoder() if engine.tokenizer is not None else None
    echo = batch[0] if decoder is not None and isinstance(batch[0], str) and not args.chat else ""
    for new in stream:
        if echo:  # the prompt, with the first tokens: after the compiles' lines, which would split the text
            print(echo, end="", flush=True)
            echo = ""
        if decoder is None:
            if new[0]:
                print(" ".join(map(str, new[0])), end=" ", flush=True)
        else:
            print(decoder.feed(new[0]), end="", flush=True)
    if decoder is not None:
        print(decoder.flush(), end="")
    print(flush=True)
    return stream.result


def main(argv: list[str] | None = None) -> None:
    run_main(run, argv)


if __name__ == "__main__":
    main()
