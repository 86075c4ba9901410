"""Where one speculative round's time goes: drafter / tree build / verify / select / accept / commit.

Method ("timed variants"): prefill real held-out prompts of the shipped pair, run a few warm rounds to get a
mid-generation `DecodeState`, then jit each part of the round as its own function of that state, together with the
whole round (`speculative.speculative_round`). Parts, in round order:

    tree      tree build from the stored draft (ddtree: `tree_build` + ancestor mask; chain / ar: trivial)
    verify    the target forward over the N tree slots (`forward_verify`, cache rows written)
    select    the target's token per slot (`sampling.choose`) + the non-finite logits check
    accept    the verified-tree walk (`tree_accept`)
    commit    latent compaction (`compact_latents`) + emitted tokens + per-request commit / stop rules
    drafter   gather the accepted path's target features + the drafter pass (`draft`, logits)
    topk      top-K draft log-probs for the next tree (full-vocab logsumexp + `top_k`)

Timing: each program runs its part `--calls` times back to back inside one jit (a `fori_loop`), so the ~tens of µs
of host dispatch per jitted call is paid once per `--calls` parts, as in the engine's compiled decode loop. Call
i + 1 depends on call i: the caches a part updates in place (target latents, drafter K/V) are threaded through the
loop (rewriting the same rows: idempotent), and every other input is shifted by a runtime 0 that XLA cannot prove
is 0 (a flag computed from call i's outputs), so nothing is hoisted or merged. The loop's own per-iteration cost is
measured with an empty part ("loop") and subtracted from every part and from the round ("net" times). That cost was
16.5 µs in one H200 run and 33 µs in another, as large as the small parts (BENCHMARKS.md 4c): `--unroll` unrolls the
loop instead (no while loop, so no per-iteration loop cost to subtract; `--calls` copies of each part per program,
so use a small `--calls`).

The table's "tree build" is tree + topk (the top-K closes round r, the heap opens round r + 1); "tree+accept+commit"
is tree + topk + accept + commit over the round, the bookkeeping that should stay under 5 % of a round.

Checks (reported, and asserted by tests/test_bench_round.py): the parts chained on the same state (each fed the
outputs of the previous part's timed program) rebuild exactly the state the timed whole-round program returns, and
the last of the `--calls` calls returns what the first did (commit: its token / length outputs; it compacts its
threaded cache again on every call, which costs the same).

Compile count: one prefill per batch size (the widest spec of the plan, cut down to each configuration:
`adapt_state`), one loop program per batch size, and per configuration the round plus its 5 (ar) or 7 parts. All
programs of a batch size are lowered from shapes alone and compiled together, `--compile-workers` at a time.

    python benchmarks/bench_round.py --out bench_round.json [--batches 1 8] [--budgets 16 64 256] [--time-limit 210]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))  # bench_engine's prompts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_engine import load_prompts  # noqa: E402
from bench_util import median_s, write_results  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax.decode import sampling  # noqa: E402
from kdtree_jax.decode.engine import Engine  # noqa: E402
from kdtree_jax.decode.params import RequestParams  # noqa: E402
from kdtree_jax.decode.programs import prefill  # noqa: E402
from kdtree_jax.decode.speculative import (  # noqa: E402
    DecodeSpec,
    DecodeState,
    RequestRows,
    commit,
    make_tree,
    nonfinite_slots,
    speculative_round,
)
from kdtree_jax.model import cache_update  # noqa: E402
from kdtree_jax.model.drafter import DrafterCache, draft  # noqa: E402
from kdtree_jax.model.target import LatentCache, forward_verify  # noqa: E402
from pallas_kernels.tree_accept import tree_accept  # noqa: E402
from pallas_kernels.tree_build import topk_logprobs  # noqa: E402

DEFAULT_DIR = os.path.join(REPO, "checkpoints", "kdtree-mini")
TARGET_PARTS = ("tree", "verify", "select", "accept", "commit")  # every mode
DRAFT_PARTS = ("drafter", "topk")  # chain / ddtree
BOOKKEEPING = ("tree", "topk", "accept", "commit")  # "tree build + accept + compaction": the < 5 % target
_SENTINEL = -3.0e38  # a probe sum no real output reaches: the loop's runtime-0 shift is (probe == _SENTINEL)
_FLOAT_TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # parts vs fused round (relative): same ops, other fusions


# ---------------------------------------------------------------------------------------------------------------
# The round, cut into parts. Each part is f(spec, target, drafter, x) -> y over dicts; the caches a part updates in
# place travel under the key "thread" (a tuple of arrays) in both x and y, so the timing loop can thread them.
# ---------------------------------------------------------------------------------------------------------------
def split_state(state: DecodeState) -> tuple[tuple, dict]:
    """(caches, rest): the target latents and drafter K/V apart from the small per-request fields."""
    rest = state.replace(cache=None, draft_cache=None)
    if state.draft_cache is None:
        return (state.cache.latent,), {"state": rest}
    dc = state.draft_cache
    return (state.cache.latent, dc.k, dc.v), {"state": rest, "draft_length": dc.length}


def join_state(thread: tuple, rest: dict) -> DecodeState:
    state = rest["state"].replace(cache=LatentCache(latent=thread[0]))
    if len(thread) == 1:
        return state
    return state.replace(draft_cache=DrafterCache(k=thread[1], v=thread[2], length=rest["draft_length"]))


def adapt_state(state: DecodeState, wide: DecodeSpec, spec: DecodeSpec) -> DecodeState:
    """The state `prefill(spec, ...)` returns, cut from the one prefilled with the wider spec `wide`.

    Prefill writes only prompt rows, so fewer cache rows lose nothing; the top-K list is sorted (ties: lower id
    first), so its first K entries are the top-K; ar has no drafter state.
    """
    same = ("batch", "prompt_cap", "max_new_tokens", "prefill_chunk", "top_k_cap")
    bad = [f for f in same if getattr(wide, f) != getattr(spec, f)]
    if bad or spec.capacity > wide.capacity or spec.top_k > wide.top_k or (spec.mode != "ar" and wide.mode == "ar"):
        raise ValueError(f"adapt_state: spec {spec} is not contained in the prefilled spec {wide} (fields {bad})")
    cap, k = spec.capacity, spec.top_k
    state = state.replace(tokens=state.tokens[:, :cap], cache=LatentCache(latent=tuple(x[:, :cap] for x in state.cache.latent)))
    if spec.mode == "ar":
        shape = (spec.batch, max(spec.depth, 1), k)
        return state.replace(draft_cache=None, draft_lp=jnp.zeros(shape, jnp.float32),
                             draft_ids=jnp.zeros(shape, jnp.int32))
    dc = state.draft_cache
    return state.replace(draft_cache=DrafterCache(k=tuple(x[:, :, :cap] for x in dc.k), v=tuple(x[:, :, :cap] for x in dc.v),
                                                         length=dc.length),
                         draft_lp=state.draft_lp[:, :, :k], draft_ids=state.draft_ids[:, :, :k])


def widest_config(plan: list[tuple[str, int]]) -> tuple[str, int]:
    """The (mode, budget) whose prefilled state contains every other one's: most cache rows, largest top-K."""
    rank = {"ar": 0, "chain": 1, "ddtree": 2}
    return max(plan, key=lambda mb: (rank[mb[0]], mb[1]))


def part_round(spec, target, drafter, x):
    new = speculative_round(spec, target, drafter, join_state(x["thread"], x))
    thread, rest = split_state(new)
    return {"thread": thread, **rest}


def part_tree(spec, target, drafter, x):
    return {"tree": make_tree(spec, x["state"])[0]}


def part_verify(spec, target, drafter, x):
    tree, length = x["tree"], x["length"]
    out = forward_verify(target, tree.tokens, length[:, None] + tree.depths, length, tree.vis,
                         LatentCache(latent=x["thread"][0]), taps=spec.taps, use_pallas=spec.use_pallas)
    return {"thread": (out.cache.latent,), "logits": out.logits, "hidden": out.hidden}


def part_select(spec, target, drafter, x):
    keys = sampling.position_keys(jax.random.wrap_key_data(x["keys"]), x["positions"])
    choice = sampling.choose(x["logits"], x["rules"], keys, spec.top_k_cap)
    return {"choice": choice, "nonfinite": nonfinite_slots(x["logits"], x["tree"])}


def part_accept(spec, target, drafter, x):
    tree = x["tree"]
    return {"acc": tree_accept(x["choice"], tree.tokens, tree.parents, tree.n_nodes, max_depth=spec.depth)}


def part_commit(spec, target, drafter, x):
    state, tree, acc = x["state"], x["tree"], x["acc"]
    latent = cache_update.compact_latents(x["thread"][0], state.length, acc.src_slot)
    emitted = cache_update.emitted_tokens(tree.tokens, acc.path, acc.n_accepted, acc.bonus)
    return {"thread": (latent,), "state": commit(state, emitted, acc.n_accepted, x["nonfinite"])}


def part_drafter(spec, target, drafter, x):
    ctx = cache_update.gather_slots(x["hidden"], x["path"])
    n_ctx = jnp.where(x["done"], 0, x["n_accepted"])
    cache = DrafterCache(k=x["thread"][0], v=x["thread"][1], length=x["draft_length"])
    logits, cache = draft(drafter, cache, ctx, n_ctx, x["bonus"], target.embed_table(), target.lm_head_table(),
                          mask_token_id=spec.mask_token_id)
    return {"thread": (cache.k, cache.v), "draft_length": cache.length, "logits": logits}


def part_topk(spec, target, drafter, x):
    lp, ids = topk_logprobs(x["logits"], spec.top_k)
    return {"lp": lp, "ids": ids}


def part_loop(spec, target, drafter, x):
    """Empty part: what one iteration of the timing loop costs by itself."""
    return {"v": x["v"] + 1}


PART_FNS = {"round": part_round, "tree": part_tree, "verify": part_verify, "select": part_select,
            "accept": part_accept, "commit": part_commit, "drafter": part_drafter, "topk": part_topk,
            "loop": part_loop}


# ---------------------------------------------------------------------------------------------------------------
# Amortised timing loop
# ---------------------------------------------------------------------------------------------------------------
def _probe(y) -> jax.Array:
    """A scalar that depends on every non-empty output leaf (one element each), as float32."""
    return sum(jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in jax.tree.leaves(y) if leaf.size)


def _shift(x, c: jax.Array):
    """Every leaf moved by the runtime 0 / 1 value c (always 0 in practice, but XLA cannot know)."""

    def one(a):
        if a.dtype == jnp.bool_:
            return a ^ (c > 0)
        return a + c.astype(a.dtype)

    return jax.tree.map(one, x)


def lower_amortised(spec: DecodeSpec, part: str, graphs, weights, x0, calls: int, precision: str,
                    unroll: bool = False):
    """Lower x0 -> (y of call 1, y of call `calls`) running the part `calls` times back to back (x0 may be abstract),
    in a while loop or, with `unroll`, as `calls` straight-line copies."""
    fn = PART_FNS[part]
    tg, dg = graphs

    def run(weights, x0):
        target = None if weights[0] is None else nnx.merge(tg, weights[0])
        drafter = None if weights[1] is None else nnx.merge(dg, weights[1])

        def f(x):
            return fn(spec, target, drafter, x)

        y0 = f(x0)
        if calls == 1:
            return y0, y0
        rest = {k: v for k, v in y0.items() if k != "thread"}

        def body(_, carry):
            thread, c, _ = carry
            x = _shift(x0, c)
            if "thread" in x0:
                x["thread"] = thread
            y = f(x)
            flag = (_probe(y) == _SENTINEL).astype(jnp.int32)
            return y.get("thread", ()), flag, {k: v for k, v in y.items() if k != "thread"}

        flag0 = (_probe(y0) == _SENTINEL).astype(jnp.int32)
        thread, _, last = jax.lax.fori_loop(1, calls, body, (y0.get("thread", ()), flag0, rest), unroll=unroll)
        return y0, ({**last, "thread": thread} if "thread" in y0 else last)

    with jax.default_matmul_precision(precision):
        return jax.jit(run).lower(weights, x0)


def amortised_program(spec: DecodeSpec, part: str, graphs, weights, x0, calls: int, precision: str,
                      unroll: bool = False):
    """`lower_amortised`, compiled; returns (program, compile seconds)."""
    t0 = time.perf_counter()
    compiled = lower_amortised(spec, part, graphs, weights, x0, calls, precision, unroll).compile()
    return compiled, time.perf_counter() - t0


def compile_all(lowered: dict, workers: int) -> tuple[dict, dict]:
    """Compile every lowered program, `workers` at a time (XLA compiles without holding the GIL); + seconds each."""

    def one(item):
        t0 = time.perf_counter()
        return item[0], item[1].compile(), time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        done = list(pool.map(one, lowered.items()))
    return {k: prog for k, prog, _ in done}, {k: sec for k, _, sec in done}


def chain_parts(spec: DecodeSpec, base: DecodeState, call: Callable):
    """The round cut into its parts: each part gets the base state and the outputs of the parts before it, as in
    `speculative_round`. call(part, x) -> y. Returns ({part: x}, {part: y}, the state the parts rebuild)."""
    xs, ys = {}, {}

    def step(part, x):
        xs[part] = x
        ys[part] = call(part, x)
        return ys[part]

    thread, rest = split_state(base)
    step("round", {"thread": thread, **rest})
    small = base.replace(cache=None, draft_cache=None)
    tree = step("tree", {"state": small})["tree"]
    ver = step("verify", {"thread": (base.cache.latent,), "tree": tree, "length": base.length})
    sel = step("select", {"logits": ver["logits"], "tree": tree, "keys": base.keys,
                          "positions": base.length[:, None] + tree.depths, "rules": base.params.sampling})
    acc = step("accept", {"choice": sel["choice"], "tree": tree})["acc"]
    com = step("commit", {"thread": ver["thread"], "state": small, "tree": tree, "acc": acc,
                          "nonfinite": sel["nonfinite"]})
    composed = com["state"].replace(cache=LatentCache(latent=com["thread"][0]))
    if spec.mode == "ar":
        return xs, ys, composed
    dc = base.draft_cache
    dra = step("drafter", {"thread": (dc.k, dc.v), "draft_length": dc.length, "hidden": ver["hidden"],
                           "path": acc.path, "n_accepted": acc.n_accepted, "done": base.done,
                           "bonus": com["state"].bonus})
    top = step("topk", {"logits": dra["logits"]})
    composed = composed.replace(draft_cache=DrafterCache(k=dra["thread"][0], v=dra["thread"][1],
                                                         length=dra["draft_length"]),
                                draft_lp=top["lp"], draft_ids=top["ids"])
    return xs, ys, composed


# ---------------------------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------------------------
def max_diff(a, b) -> dict:
    """{'int_mismatch': differing integer / bool elements, 'float_max': largest |a - b| / max(1, |b|) over floats}."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise ValueError(f"compared trees differ in structure: {jax.tree.structure(a)} vs {jax.tree.structure(b)}")
    mismatch, fmax = 0, 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
            x, y = x.astype(np.float64), y.astype(np.float64)
            same_nan = np.isnan(x) & np.isnan(y)
            d = np.where(same_nan | (x == y), 0.0, np.abs(x - y) / np.maximum(1.0, np.abs(y)))  # equal infs: 0
            fmax = max(fmax, float(np.max(d, initial=0.0)))
        else:
            mismatch += int(np.sum(x != y))
    return {"int_mismatch": mismatch, "float_max": fmax}


def _matches(diff: dict, tol: float) -> bool:
    return diff["int_mismatch"] == 0 and diff["float_max"] <= tol


# ---------------------------------------------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------------------------------------------
class Bench:
    """The engine's weights, prompts and timing settings shared by all configurations."""

    def __init__(self, engine: Engine, prompts: list[list[int]], args):
        self.engine = engine
        self.prompts = prompts
        self.args = args
        self.graphs = (nnx.graphdef(engine.target), None if engine.drafter is None else nnx.graphdef(engine.drafter))
        self.weights = {False: (nnx.state(engine.target), None)}
        if engine.drafter is not None:
            self.weights[True] = (nnx.state(engine.target), nnx.state(engine.drafter))
        self.compile_s: dict[str, float] = {}  # program -> compile seconds, summed over configurations
        self.compile_wall_s = 0.0  # wall time of the (parallel) compile phases
        self.prefilled: dict[int, tuple[DecodeSpec, DecodeState]] = {}

    def spec(self, mode: str, batch: int, budget: int) -> DecodeSpec:
        return self.engine.spec_for(mode=mode, batch=batch, prompt_len=self.args.prompt_tokens,
                                    max_new_tokens=self.args.max_new_tokens, budget=budget)

    def rows(self, batch: int) -> RequestRows:
        """Every request's decoding rule, token limit and stop ids, as the engine passes them to prefill."""
        rule = RequestParams(max_new_tokens=self.args.max_new_tokens, temperature=self.args.temperature,
                             top_p=self.args.top_p)
        stop = self.engine.stop_ids
        return RequestRows.of([rule] * batch, [stop] * batch, len(stop))

    def _prefill_lowered(self, spec: DecodeSpec):
        """The engine's prefill on the first `batch` held-out prompts: (lowered program, its arguments)."""
        bt = spec.batch
        arr = np.zeros((bt, spec.prompt_cap), np.int32)
        for i, p in enumerate(self.prompts[:bt]):
            arr[i, : len(p)] = p
        lens = np.array([len(p) for p in self.prompts[:bt]], np.int32)
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(self.args.seed), i)))
                         for i in range(bt)])
        tg, dg = self.graphs
        uses_drafter = spec.mode != "ar"

        def fn(weights, prompts, prompt_len, keys, rows):
            drafter = nnx.merge(dg, weights[1]) if uses_drafter else None
            return prefill(spec, nnx.merge(tg, weights[0]), drafter, prompts, prompt_len, keys, rows)

        args = (self.weights[uses_drafter], arr, lens, keys, self.rows(bt))
        with jax.default_matmul_precision(self.engine.matmul_precision):
            return jax.jit(fn).lower(*args), args

    def start_state(self, spec: DecodeSpec) -> DecodeState:
        lowered, args = self._prefill_lowered(spec)
        return lowered.compile()(*args)

    def prefilled_state(self, spec: DecodeSpec, widest: DecodeSpec) -> DecodeState:
        """One prefill per batch size, with the widest spec of the plan, cut down to `spec` (saves compiles)."""
        if spec.batch not in self.prefilled:
            self.prefilled[spec.batch] = (widest, self.start_state(widest))
        wide, state = self.prefilled[spec.batch]
        return adapt_state(state, wide, spec)

    def _abstract_inputs(self, spec: DecodeSpec, base) -> dict:
        """Shapes of every part's inputs on a state shaped like `base`, without running anything."""
        tg, dg = self.graphs

        def inputs(weights, state):
            target = nnx.merge(tg, weights[0])
            drafter = None if weights[1] is None else nnx.merge(dg, weights[1])
            return chain_parts(spec, state, lambda part, x: PART_FNS[part](spec, target, drafter, x))[0]

        return jax.eval_shape(inputs, self.weights[spec.mode != "ar"], base)

    def compile_batch(self, batch: int, plan: list[tuple[str, int]], widest: tuple[str, int]) -> dict:
        """Every program of one batch size (prefill, loop, each config's round and parts), compiled in parallel."""
        wide = self.spec(widest[0], batch, widest[1])
        lowered = {}
        lowered["prefill"], prefill_args = self._prefill_lowered(wide)
        state = lowered["prefill"].out_info  # the prefilled state's shapes
        precision = self.engine.matmul_precision
        loop_x = {"v": jnp.arange(batch, dtype=jnp.int32)}
        lowered["loop"] = lower_amortised(wide, "loop", self.graphs, self.weights[False], loop_x, self.args.calls,
                                          precision, self.args.unroll)
        for mode, budget in plan:
            spec = self.spec(mode, batch, budget)
            base = jax.eval_shape(lambda s: adapt_state(s, wide, spec), state)
            for part, x in self._abstract_inputs(spec, base).items():
                lowered[(mode, budget, part)] = lower_amortised(spec, part, self.graphs, self.weights[mode != "ar"],
                                                                x, self.args.calls, precision, self.args.unroll)
        t0 = time.perf_counter()
        progs, seconds = compile_all(lowered, self.args.compile_workers)
        self.compile_wall_s += time.perf_counter() - t0
        for key, sec in seconds.items():
            name = key if isinstance(key, str) else key[2]
            self.compile_s[name] = self.compile_s.get(name, 0.0) + sec
        self.prefilled[batch] = (wide, progs["prefill"](*prefill_args))
        return {"loop_ms": self.time_ms(progs["loop"], self.weights[False], loop_x), "progs": progs, "wide": wide}

    def time_ms(self, prog, weights, x0) -> float:
        reps = self.args.reps
        return 1e3 * median_s(lambda: prog(weights, x0), min_reps=reps, max_reps=reps) / self.args.calls

    def run(self, mode: str, budget: int, compiled: dict) -> dict:
        """Warm rounds from the shared prefill, then every part timed and chained on the resulting state."""
        wide, progs = compiled["wide"], compiled["progs"]
        spec = self.spec(mode, wide.batch, budget)
        weights = self.weights[mode != "ar"]
        state = self.prefilled_state(spec, wide)
        round_prog = progs[(mode, budget, "round")]
        thread, rest = split_state(state)
        for _ in range(self.args.warm_rounds):  # the first call's output is one real round
            y0, _ = round_prog(weights, {"thread": thread, **rest})
            thread, rest = y0["thread"], {k: v for k, v in y0.items() if k != "thread"}
        base = join_state(thread, rest)
        if self.args.trace_dir:
            name = f"b{spec.batch}_{mode}{budget if mode == 'ddtree' else ''}"
            with jax.profiler.trace(os.path.join(self.args.trace_dir, name)):
                jax.block_until_ready(round_prog(weights, {"thread": thread, **rest}))

        ms, steady = {}, {}

        def timed(part, x):
            prog = progs[(mode, budget, part)]
            first, last = prog(weights, x)
            # commit compacts its threaded cache again on every call; its other outputs repeat
            steady[part] = max_diff(first["state"], last["state"]) if part == "commit" else max_diff(first, last)
            ms[part] = self.time_ms(prog, weights, x)
            return first

        _, ys, composed = chain_parts(spec, base, timed)
        tol = _FLOAT_TOL.get(self.args.dtype, 1e-5)
        parts_vs_round = max_diff(composed, join_state(ys["round"]["thread"], ys["round"]))
        return self._row(spec, ms, compiled["loop_ms"], base, ys["accept"]["acc"], parts_vs_round, steady, tol)

    def _row(self, spec, ms, loop_ms, base, acc, parts_vs_round, steady, tol) -> dict:
        net = {k: max(v - loop_ms, 0.0) for k, v in ms.items()}
        parts = [p for p in TARGET_PARTS + DRAFT_PARTS if p in ms]
        round_net = net["round"]
        running = ~np.asarray(base.done)
        n_acc = np.asarray(acc.n_accepted)[running]
        return {
            "batch": spec.batch, "mode": spec.mode, "budget": spec.budget if spec.mode == "ddtree" else None,
            "n_slots": spec.n_slots, "calls": self.args.calls, "cache_rows": int(np.max(np.asarray(base.length))),
            "acceptance_length": float(n_acc.mean()) if n_acc.size else 0.0,
            "loop_ms": loop_ms, "ms": ms, "net_ms": net,
            "share": {p: (net[p] / round_net if round_net > 0 else float("nan")) for p in parts},
            "sum_parts_net_ms": sum(net[p] for p in parts),
            "sum_parts_over_round": sum(net[p] for p in parts) / round_net if round_net > 0 else float("nan"),
            "bookkeeping_share": sum(net[p] for p in BOOKKEEPING if p in net) / round_net if round_net > 0
            else float("nan"),
            "parts_vs_round": parts_vs_round, "parts_match_round": _matches(parts_vs_round, tol),
            "steady": steady, "steady_ok": all(_matches(d, tol) for d in steady.values()),
        }


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def markdown(rows: list[dict], header: str) -> str:
    """One line per configuration; part cells are net ms (share of the net round)."""
    cols = ("drafter", "tree build", "verify", "select", "accept", "commit")
    lines = [header, "",
             "| batch | mode | B | N | round ms | " + " | ".join(cols) + " | Σ parts / round | tree+accept+commit | "
             "loop ms | parts = round |",
             "|" + "---|" * (10 + len(cols) - 1)]
    for r in rows:
        net, share = r["net_ms"], r["share"]

        def cell(*names):
            if not all(n in net for n in names):
                return "-"
            return f"{sum(net[n] for n in names):.3f} ({100 * sum(share[n] for n in names):.1f}%)"

        lines.append(
            f"| {r['batch']} | {r['mode']} | {r['budget'] if r['budget'] is not None else '-'} | {r['n_slots']} | "
            f"{net['round']:.3f} | {cell('drafter')} | {cell('tree', 'topk')} | {cell('verify')} | {cell('select')} | "
            f"{cell('accept')} | {cell('commit')} | {100 * r['sum_parts_over_round']:.0f}% | "
            f"{100 * r['bookkeeping_share']:.1f}% | {r['loop_ms']:.4f} | {r['parts_match_round'] and r['steady_ok']} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=os.path.join(DEFAULT_DIR, "target"))
    p.add_argument("--drafter", default=os.path.join(DEFAULT_DIR, "drafter"))
    p.add_argument("--prompts", default=os.path.join(DEFAULT_DIR, "heldout_prompts.jsonl"))
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128, help="sets the cache capacity, as in a generation")
    p.add_argument("--warm-rounds", type=int, default=8, help="rounds run after prefill before the state is timed")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256], help="ddtree budgets B")
    p.add_argument("--modes", nargs="+", default=["ddtree", "chain", "ar"], choices=("ar", "chain", "ddtree"),
                   help="in the order run (ddtree first: a --time-limit cuts the references)")
    p.add_argument("--calls", type=int, default=32, help="calls of a part back to back inside one timed jit")
    p.add_argument("--unroll", action="store_true",
                   help="unroll the calls (no while loop, no loop cost to subtract; use a small --calls)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each jit (median)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-pallas", action="store_true", help="verify attention in jnp instead of the kernel")
    p.add_argument("--out", default=None, help="write all rows as JSON")
    p.add_argument("--compile-workers", type=int, default=os.cpu_count() or 1,
                   help="programs compiled at once (each batch size's programs are compiled together up front)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds (0 = none): start a batch size only if one more like the last still fits; "
                   "the rest are listed as skipped")
    p.add_argument("--trace-dir", default=None, help="jax.profiler trace of one whole-round program per config")
    args = p.parse_args(argv)
    for name in ("calls", "reps", "prompt_tokens", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warm_rounds < 0 or args.warm_rounds >= args.max_new_tokens:
        raise SystemExit(f"--warm-rounds must be in 0..max_new_tokens-1, got {args.warm_rounds}")
    if any(b < 1 for b in args.batches) or any(b < 0 for b in args.budgets):
        raise SystemExit(f"--batches must be >= 1 and --budgets >= 0, got {args.batches} / {args.budgets}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    engine = Engine.load(args.checkpoint, args.drafter if {"chain", "ddtree"} & set(args.modes) else None,
                         dtype=args.dtype, use_pallas=not args.no_pallas)
    prompts = load_prompts(args.prompts, engine.tokenizer, max(args.batches), args.prompt_tokens)
    bench = Bench(engine, prompts, args)
    plan = [(m, b) for m in args.modes for b in (args.budgets if m == "ddtree" else [0])]
    widest = widest_config(plan)
    device = jax.devices()[0].device_kind
    result = {"device": device, "args": vars(args), "rows": [], "skipped": []}
    last_batch_s = 0.0  # a batch size is started only if one more like the last still fits in --time-limit
    for batch in args.batches:
        t_batch = time.perf_counter()
        if args.time_limit and t_batch - t_start + last_batch_s > args.time_limit:
            result["skipped"] += [{"batch": batch, "mode": m, "budget": b} for m, b in plan]
            continue
        compiled = bench.compile_batch(batch, plan, widest)
        print(f"batch {batch}: compiled {len(compiled['progs'])} programs "
              f"({time.perf_counter() - t_start:.0f} s)", flush=True)
        for mode, budget in plan:  # once compiled, a batch size is measured in full (seconds, not minutes)
            row = bench.run(mode, budget, compiled)
            result["rows"].append(row)
            print(f"batch {batch} {mode:6s} B={budget:<4d} round {row['net_ms']['round']:.3f} ms  parts "
                  f"{100 * row['sum_parts_over_round']:.0f}%  bookkeeping {100 * row['bookkeeping_share']:.1f}%  "
                  f"match={row['parts_match_round']} steady={row['steady_ok']}  "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
            result.update(compile_s=bench.compile_s, compile_wall_s=bench.compile_wall_s,
                          total_s=time.perf_counter() - t_start)
            _write(args.out, result)  # after every configuration: a run cut short keeps what it measured
        del compiled
        last_batch_s = time.perf_counter() - t_batch
    header = (f"### One round, {device}, {args.dtype}, {args.prompt_tokens}-token prompts + {args.warm_rounds} warm "
              f"rounds, {'greedy' if args.temperature == 0 else f'T={args.temperature}'}; net ms per call "
              f"({args.calls} calls per jit, loop cost subtracted) and share of the round")
    print("\n" + markdown(result["rows"], header))
    result.update(compile_s=bench.compile_s, compile_wall_s=bench.compile_wall_s,
                  total_s=time.perf_counter() - t_start)
    compiles = ", ".join(f"{k} {v:.1f}" for k, v in bench.compile_s.items())
    print(f"\ncompile s per program kind (summed): {compiles}; compile wall {bench.compile_wall_s:.1f} s; "
          f"total {result['total_s']:.1f} s")
    if result["skipped"]:
        print(f"skipped (--time-limit {args.time_limit} s): {result['skipped']}")
    _write(args.out, result)
    return result


def _write(path, result) -> None:
    if path:
        write_results(path, result)


if __name__ == "__main__":
    main()
