"""The serving engine at Kimi K2.6 width, ar against ddtree, at concurrency 1 to 64 on one GPU.

    python benchmarks/serving_k26.py [--layers 3] [--draft-layers 1] [--concurrency 1,2,4,8,16,32,64]
                                     [--budgets 16] [--prompt-tokens 1024] [--steps 6] [--rounds-per-step 4]
                                     [--tau-profile checkpoints/kdtree-mini/budget_profile.nvidia-h200.json]
                                     [--out serving_k26.json] [--tiny]

The target is `kimi_k2_6()` cut to --layers decoder layers (layer 0 dense, the rest MoE with 384 INT4 experts,
tile-major as the engine stores them), the drafter z-lab's Kimi-K2.5/K2.6-DFlash shape cut to --draft-layers
(`profile_round.drafter_config`), random bf16 weights made on the device. One `ServingEngine` per config (ar, then
ddtree at each --budgets B) serves with max_slots = the largest concurrency and a step program for each concurrency
(step_widths), stepped directly: no HTTP, no front. Per concurrency c: c requests of --prompt-tokens random ids
(greedy, ignore_eos) are submitted and prefilled; once all c run, --steps steps are timed one by one (each runs
--rounds-per-step rounds over width c); then they are cancelled. Reported per (config, c): the step's median and
min seconds, the rounds' tokens per request as served, and tokens/s.

Random weights accept about one token per round, so what a tree gains has to come from elsewhere: the projected
tokens/s multiplies each round by tau(B), the mean tokens per round the shipped trained pair measured at the nearest
batch on an H200 (--tau-profile; interpolated in log(1 + B) between its budgets), a stand-in for K2.6's own drafter,
whose acceptance no one has measured here. ar commits one token a round whatever the weights, so its projection is
what it served. The crossover is the smallest c at which ar's projected tokens/s is at least the best tree's. What
the step time does not see: real routing (sibling tree tokens route alike, so uniform random routing overstates the
experts a tree reads) and K2.6's other 61 - --layers layers (which make the drafter's share of a round smaller).

--tiny: `config.tiny()` shapes (prompt 32, concurrency 1,2,4, f32, XLA attention) on any backend: on a CPU it checks
the script, not the speed. Without --tiny a CPU backend is refused (3 layers' weights alone are 25 GB).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kimi_layer import ENGINE_LAYOUT, build_model, random_module, weight_bytes  # noqa: E402
from bench_util import finish_on_sigterm, recorded_run  # noqa: E402
from flax import nnx  # noqa: E402
from profile_round import drafter_config  # noqa: E402

from kdtree_jax.decode import budget as budget_mod  # noqa: E402
from kdtree_jax.decode.engine import Engine  # noqa: E402
from kdtree_jax.decode.speculative import aligned_rows  # noqa: E402
from kdtree_jax.model.config import kimi_k2_6, tiny  # noqa: E402
from kdtree_jax.model.drafter import DFlashDrafter  # noqa: E402
from kdtree_jax.serving import RequestParams, ServeConfig, ServingEngine  # noqa: E402
from kdtree_jax.serving.xla_options import CACHE_ENV, enable_compilation_cache  # noqa: E402
from pallas_kernels.verify_attn import PAGE_SIZES  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
DEFAULT_TAU_PROFILE = os.path.join(ROOT, "checkpoints", "kdtree-mini", "budget_profile.nvidia-h200.json")
POOL_SCRATCH_ROWS = 64  # rows of the pool beyond max_context per request: a round's scratch and the step's reserve


@dataclasses.dataclass(frozen=True)
class Shape:
    """Defaults of one model width: K2.6 on a GPU, or the tiny config anywhere."""

    concurrency: tuple[int, ...]
    prompt_tokens: int
    page_size: int
    dtype: str


K26 = Shape(concurrency=(1, 2, 4, 8, 16, 32, 64), prompt_tokens=1024, page_size=64, dtype="bfloat16")
TINY = Shape(concurrency=(1, 2, 4), prompt_tokens=32, page_size=16, dtype="float32")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return sizes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=3, help="target decoder layers (layer 0 dense, the rest MoE)")
    p.add_argument("--draft-layers", type=int, default=1, help="drafter layers (z-lab's shape has 6)")
    p.add_argument("--concurrency", type=_sizes, help="requests decoding at once (default 1,2,4,...,64; --tiny 1,2,4)")
    p.add_argument("--budgets", type=_sizes, default=(16,), help="the ddtree configs' tree budgets B")
    p.add_argument("--prompt-tokens", type=int, help="each request's prompt (default 1024; --tiny 32)")
    p.add_argument("--steps", type=int, default=6, help="steps timed per concurrency, all c requests running")
    p.add_argument("--rounds-per-step", type=int, default=4)
    p.add_argument("--page-size", type=int, help="cache rows per page (default 64; --tiny 16)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="weights and cache (default bfloat16; --tiny float32)")
    p.add_argument("--tau-profile", default=DEFAULT_TAU_PROFILE,
                   help="a budget profile whose tau(B) projects the trees' tokens/s (the shipped pair's, H200)")
    p.add_argument("--seed", type=int, default=0, help="token ids and weights")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no further concurrency once this many seconds have passed (rows so far are kept)")
    p.add_argument("--tiny", action="store_true", help="config.tiny() shapes: a check of the script, on any backend")
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    shape = TINY if args.tiny else K26
    for name in ("concurrency", "prompt_tokens", "page_size", "dtype"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(shape, name))
    for flag in ("layers", "draft_layers", "prompt_tokens", "steps", "rounds_per_step"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.page_size not in PAGE_SIZES:
        p.error(f"--page-size must be one of {PAGE_SIZES}, got {args.page_size}")
    if args.prompt_tokens & (args.prompt_tokens - 1):
        p.error(f"--prompt-tokens must be a power of two (one prefill program), got {args.prompt_tokens}")
    if not os.path.isfile(args.tau_profile):
        p.error(f"--tau-profile: no such file: {args.tau_profile}")
    return args


def configs(args) -> list[tuple[str, int | None]]:
    return [("ar", None)] + [("ddtree", b) for b in args.budgets]


def config_name(mode: str, budget: int | None) -> str:
    return mode if budget is None else f"{mode}-{budget}"


def new_tokens_cap(args, block: int) -> int:
    """Enough tokens for every step a request may run: a step per prefill (one prompt a step), the step before
    timing, the timed ones and one spare; each round commits at most a block."""
    steps = max(args.concurrency) + args.steps + 2
    return steps * args.rounds_per_step * block


def serve_config(args, mode: str, budget: int | None, max_context: int) -> ServeConfig:
    """One prefill program (a whole prompt, one request), a step program per concurrency, a pool of exactly the
    largest concurrency's requests."""
    slots = max(args.concurrency)
    pages = -(-aligned_rows(max_context + POOL_SCRATCH_ROWS) // args.page_size)
    extra = {} if budget is None else {"budget": budget}
    return ServeConfig(max_slots=slots, max_context=max_context, mode=mode, rounds_per_step=args.rounds_per_step,
                       step_widths=args.concurrency, page_size=args.page_size, num_pages=slots * pages,
                       prefill_batch=1, min_prompt_bucket=args.prompt_tokens,
                       max_num_batched_tokens=args.prompt_tokens, max_queue=slots, enable_prefix_caching=False,
                       **extra)


def tau_at(profile: budget_mod.BudgetProfile, batch: int, budget: int) -> tuple[float, int]:
    """(tau(B), the profile's batch it came from)."""
    nearest = budget_mod.nearest_batch(profile, batch)
    return budget_mod.interp_tau(profile.batches[nearest], budget), nearest


def run_concurrency(core: ServingEngine, rng: np.random.Generator, args, vocab: int, c: int) -> dict:
    """c requests prefilled, then --steps steps timed with all of them running; the requests are then cancelled."""
    params = RequestParams(max_new_tokens=core.config.max_context - args.prompt_tokens, ignore_eos=True)
    rids = [core.submit(rng.integers(0, vocab - 2, args.prompt_tokens).tolist(), params) for _ in range(c)]
    settle = 0
    while core.n_running < c:  # prefills, one request a step
        core.step()
        settle += 1
        if settle > 4 * c + 8:
            raise RuntimeError(f"only {core.n_running} of {c} requests running after {settle} steps")
    core.step()  # the first step with every request: its tokens come back in the next one (overlap)
    times, tokens = [], 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        report = core.step()
        times.append(time.perf_counter() - t0)
        if report.active != c or report.width != c:
            raise RuntimeError(f"a timed step ran {report.active} requests over width {report.width}, not {c}")
        tokens += sum(len(e.token_ids) for e in report.deltas)
    for rid in rids:
        core.cancel(rid)
    while core.has_work:
        core.step()
    step_s = statistics.median(times)
    rounds = args.steps * args.rounds_per_step
    return dict(concurrency=c, step_s_median=step_s, step_s_min=min(times), step_s=times, prefill_steps=settle,
                tokens=tokens, tokens_per_round_per_request=tokens / (rounds * c),
                served_tokens_per_s=tokens / sum(times))


def project(rows: list[dict], profile: budget_mod.BudgetProfile, rounds_per_step: int) -> dict:
    """Projected tokens/s per row (ar as served; trees with the profile's tau); the best config per c and the
    crossover."""
    for r in rows:
        if r["budget"] is None:
            r["tau"], r["tau_batch"] = 1.0, None
        else:
            r["tau"], r["tau_batch"] = tau_at(profile, r["concurrency"], r["budget"])
        r["projected_tokens_per_s"] = r["concurrency"] * rounds_per_step * r["tau"] / r["step_s_median"]
    by_c: dict[int, dict[str, float]] = {}
    for r in rows:
        by_c.setdefault(r["concurrency"], {})[r["config"]] = r["projected_tokens_per_s"]
    best = {c: max(v, key=v.get) for c, v in sorted(by_c.items())}
    trees = {c: max((t for k, t in v.items() if k != "ar"), default=None) for c, v in by_c.items()}
    crossover = next((c for c, v in sorted(by_c.items()) if "ar" in v and trees[c] is not None and v["ar"] >= trees[c]),
                     None)
    return dict(best=best, crossover_concurrency=crossover,
                ar_over_best_tree={c: v["ar"] / trees[c] for c, v in by_c.items() if "ar" in v and trees[c]})


def markdown(result: dict) -> str:
    title = (f"serving at {result['model']} width, {result['layers']} target layers + {result['draft_layers']} "
             f"drafter layers, {result['dtype']}, {result['device']}: prompt {result['prompt_tokens']}, "
             f"{result['rounds_per_step']} rounds a step; tau from {os.path.basename(result['tau_profile'])}")
    lines = [title, "", "| config | c | step ms (median) | tokens/round/request served | tau | "
                        "projected tokens/s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['config']} | {r['concurrency']} | {1e3 * r['step_s_median']:.2f} | "
                     f"{r['tokens_per_round_per_request']:.2f} | {r['tau']:.2f} | "
                     f"{r['projected_tokens_per_s']:.0f} |")
    s = result.get("summary")
    if s:
        lines += ["", f"best config per c: {s['best']}; ar at least the best tree from c = "
                      f"{s['crossover_concurrency']}"]
    return "\n".join(lines)


def build_engine(args, cfg, dtype, on_cpu: bool) -> tuple[Engine, dict]:
    graphdef, state = build_model(cfg, dtype)
    dcfg = drafter_config(cfg, args.draft_layers)
    d_graph, d_state = random_module(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0), param_dtype=dtype,
                                                           compute_dtype=dtype), 1, seed=args.seed + 1)
    engine = Engine(nnx.merge(graphdef, state), nnx.merge(d_graph, d_state), None, use_pallas=not on_cpu)
    return engine, dict(target=weight_bytes(state), drafter_bytes=sum(x.nbytes for x in jax.tree.leaves(d_state)))


def main(argv=None) -> int:
    args = parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and not args.tiny:
        print("serving_k26: K2.6 width needs a GPU (25 GB of weights at 3 layers); pass --tiny on a CPU",
              file=sys.stderr)
        return 2
    if os.environ.get(CACHE_ENV):
        enable_compilation_cache()
    finish_on_sigterm()
    base = tiny() if args.tiny else kimi_k2_6()
    cfg, dtype = dataclasses.replace(base, num_hidden_layers=args.layers), DTYPES[args.dtype]
    profile = budget_mod.load_profile(args.tau_profile)
    device = jax.devices()[0].device_kind
    result = dict(benchmark="serving_k26", model="tiny" if args.tiny else "kimi_k2_6", device=device,
                  backend=jax.default_backend(), layers=args.layers, draft_layers=args.draft_layers, dtype=args.dtype,
                  expert_format="int4", expert_layout=ENGINE_LAYOUT, prompt_tokens=args.prompt_tokens,
                  rounds_per_step=args.rounds_per_step, steps=args.steps, concurrency=list(args.concurrency),
                  tau_profile=args.tau_profile, tau_profile_device=profile.device_kind, rows=[], compile_s={})
    shrink = (f"--layers ({args.layers}), the largest --concurrency ({max(args.concurrency)}) or "
              f"--prompt-tokens ({args.prompt_tokens})")
    with recorded_run("serving_k26", result, args.out, shrink) as run:
        run.stage = "building the models"
        engine, result["weight_bytes"] = build_engine(args, cfg, dtype, on_cpu)
        block = engine.drafter.cfg.block_size
        max_context = args.prompt_tokens + new_tokens_cap(args, block)
        result["max_context"] = max_context
        print(f"{device}: built in {time.perf_counter() - run.t0:.0f} s; max_context {max_context}", flush=True)
        rng = np.random.default_rng(args.seed)
        for mode, budget in configs(args):
            name = config_name(mode, budget)
            run.stage = f"{name}: compiling"
            core = ServingEngine(engine, serve_config(args, mode, budget, max_context))
            try:
                result["compile_s"][name] = core.warm_up()
                print(f"{name}: {core.capacity_summary()}; compiled in "
                      f"{sum(result['compile_s'][name].values()):.0f} s", flush=True)
                for c in args.concurrency:
                    if time.perf_counter() - run.t0 > args.budget_s:
                        result.setdefault("skipped", []).append(f"{name} c={c}: --budget-s {args.budget_s} reached")
                        continue
                    run.stage = f"{name} at concurrency {c}"
                    row = dict(config=name, mode=mode, budget=budget, **run_concurrency(core, rng, args,
                                                                                        cfg.vocab_size, c))
                    result["rows"].append(row)
                    print(f"{name} c={c}: step {1e3 * row['step_s_median']:.2f} ms, "
                          f"{row['tokens_per_round_per_request']:.2f} tokens/round/request", flush=True)
            finally:
                core.shutdown()
        result["summary"] = project(result["rows"], profile, args.rounds_per_step)
        print(markdown(result), flush=True)
    return run.status


if __name__ == "__main__":
    sys.exit(main())
