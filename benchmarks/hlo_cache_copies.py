"""Count whole-cache copies in the compiled decode loop (one DDTree round per iteration).

    python benchmarks/hlo_cache_copies.py [--mode ddtree] [--no-pallas]
    python benchmarks/hlo_cache_copies.py --serving [--mode ddtree]

With --serving it compiles the serving engine's step program instead (the shipped pair, 4 slots over a page pool)
and lists every copy of an array shaped like either page pool (the latent's, the drafter's K/V).

Compiles the engine's decode loop for a small random pair on the current backend and lists every `copy` of an
array shaped like the latent cache [L, Bt, S, A], with the computation it sits in and the op that produced its
operand. A copy inside the loop body is a full read + write of the cache every round. On the GPU machine this
inspects the real (GPU) compile; on a CPU it shows the CPU compile, whose copy insertion differs, and with Pallas on
the interpreter's own loop copies its operands.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from engine_utils import drafter_config, random_drafter  # noqa: E402
from kdtree_jax import config, sampling  # noqa: E402
from kdtree_jax.engine import Engine, decode_loop, prefill  # noqa: E402
from kdtree_jax.speculative import RequestRows  # noqa: E402
from kdtree_jax.weights import init_random  # noqa: E402

CFG = config.tiny(eos_token_id=(), qk_rope_head_dim=16)  # latent 32 + 16: no padding copies in the kernel wrapper


def cache_copies(mode: str, use_pallas: bool, batch: int = 3) -> list[tuple[str, str]]:
    target, drafter = init_random(CFG, seed=0), random_drafter(drafter_config(CFG), 0)
    engine = Engine(target, drafter, use_pallas=use_pallas)
    spec = engine.spec_for(mode=mode, batch=batch, prompt_len=12, max_new_tokens=40, budget=16)
    rows = RequestRows.of([sampling.SamplingParams()] * batch, [40] * batch, [engine.stop_ids] * batch, 1)
    (tg, ts), (dg, ds) = nnx.split(target), nnx.split(drafter)
    d = None if mode == "ar" else dg

    def merged(ds):
        return None if d is None else nnx.merge(dg, ds)

    prompts = jnp.ones((batch, spec.prompt_cap), jnp.int32)
    lens, keys = jnp.full((batch,), 12, jnp.int32), jnp.zeros((batch, 2), jnp.uint32)
    state = jax.jit(lambda ts, ds: prefill(spec, nnx.merge(tg, ts), merged(ds), prompts, lens, keys, rows))(ts, ds)
    shape = "[" + ",".join(map(str, state.cache.latent.shape)) + "]"
    text = jax.jit(lambda ts, ds, s: decode_loop(spec, nnx.merge(tg, ts), merged(ds), s, jnp.int32(4)),
                   donate_argnums=(2,)).lower(ts, ds, state).compile().as_text()
    found, computation = [], ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
        if f"{shape}" in line and re.search(r"\bcopy\(", line):
            found.append((computation, line.strip()[:160]))
    return found


def pool_copies(text: str, shapes) -> list[tuple[str, str]]:
    """(computation, line) of every `copy` in compiled HLO `text` whose result has one of `shapes`."""
    found, computation = [], ""
    wanted = ["[" + ",".join(map(str, s)) + "]" for s in shapes]
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
        if any(w in line for w in wanted) and re.search(r"\bcopy\(", line):
            found.append((computation, line.strip()[:160]))
    return found


def serving_copies(mode: str) -> list[tuple[str, str]]:
    """Pool copies in the serving engine's compiled step program (4 slots, the shipped pair)."""
    from kdtree_jax.serving import ServeConfig, ServingEngine
    from kdtree_jax.serving.programs import StepKind

    ck = os.path.join(ROOT, "checkpoints", "kdtree-mini")
    pair = Engine.load(os.path.join(ck, "target"), os.path.join(ck, "drafter"))
    core = ServingEngine(pair, ServeConfig(max_slots=4, max_context=512, mode="ddtree", step_widths=(4,),
                                           budget=16 if mode == "ddtree" else "ar", rounds_per_step=2))
    kind = StepKind("ddtree", 16) if mode == "ddtree" else StepKind("ar")
    table = core.runner.table
    shapes = [table.cache.latent.shape, table.draft_cache.k.shape]
    return pool_copies(core.runner._program("step", (kind, 4)).as_text(), shapes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="ddtree", choices=("ar", "chain", "ddtree"))
    p.add_argument("--no-pallas", action="store_true")
    p.add_argument("--serving", action="store_true", help="the serving engine's step program over its page pools")
    args = p.parse_args(argv)
    if args.serving:
        found = serving_copies(args.mode)
        print(f"{len(found)} whole-pool copies in the serving step program ({jax.default_backend()}, {args.mode})")
    else:
        found = cache_copies(args.mode, not args.no_pallas)
        print(f"{len(found)} whole-cache copies in the compiled decode loop ({jax.default_backend()}, {args.mode}, "
              f"pallas={not args.no_pallas})")
    for computation, line in found:
        print(f"  in {computation}: {line}")
    return found


if __name__ == "__main__":
    main()
