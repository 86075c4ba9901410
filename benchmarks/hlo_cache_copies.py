"""Count whole-cache copies in the compiled decode loop (one DDTree round per iteration).

    python benchmarks/hlo_cache_copies.py [--mode ddtree] [--no-pallas]
    python benchmarks/hlo_cache_copies.py --serving [--mode ddtree] [--budget 16] [--steps-only] [--pools 1024,4096]
        [--dump DIR]

With --serving it compiles every serving program (the shipped pair, 4 slots) at two pool sizes instead and lists
every `copy` whose size scales with the number of pages (present at the larger pool, absent at the smaller), with
each program's temp bytes at both sizes: a program that keeps a pool-sized copy grows with the pool.

Without it, compiles the engine's decode loop for a small random pair on the current backend and lists every
`copy` of an array shaped like one layer of the latent cache [Bt, S, A], with the computation it sits in and the op that produced its
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
from engine_utils import drafter_config, random_drafter  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax.checkpoint.weights import init_random  # noqa: E402
from kdtree_jax.decode.engine import Engine  # noqa: E402
from kdtree_jax.decode.params import RequestParams  # noqa: E402
from kdtree_jax.decode.programs import decode_loop, prefill  # noqa: E402
from kdtree_jax.decode.speculative import RequestRows  # noqa: E402
from kdtree_jax.model import config  # noqa: E402
from kdtree_jax.serving.memory_plan import ProgramMemory  # noqa: E402

CFG = config.tiny(eos_token_id=(), qk_rope_head_dim=16)  # latent 32 + 16: no padding copies in the kernel wrapper


def cache_copies(mode: str, use_pallas: bool, batch: int = 3) -> list[tuple[str, str]]:
    target, drafter = init_random(CFG, seed=0), random_drafter(drafter_config(CFG), 0)
    engine = Engine(target, drafter, use_pallas=use_pallas)
    spec = engine.spec_for(mode=mode, batch=batch, prompt_len=12, max_new_tokens=40, budget=16)
    rows = RequestRows.of([RequestParams(max_new_tokens=40)] * batch, [engine.stop_ids] * batch, 1)
    (tg, ts), (dg, ds) = nnx.split(target), nnx.split(drafter)
    d = None if mode == "ar" else dg

    def merged(ds):
        return None if d is None else nnx.merge(dg, ds)

    prompts = jnp.ones((batch, spec.prompt_cap), jnp.int32)
    lens, keys = jnp.full((batch,), 12, jnp.int32), jnp.zeros((batch, 2), jnp.uint32)
    state = jax.jit(lambda ts, ds: prefill(spec, nnx.merge(tg, ts), merged(ds), prompts, lens, keys, rows))(ts, ds)
    shape = "[" + ",".join(map(str, state.cache.latent[0].shape)) + "]"
    text = jax.jit(lambda ts, ds, s: decode_loop(spec, nnx.merge(tg, ts), merged(ds), s, jnp.int32(4)),
                   donate_argnums=(2,)).lower(ts, ds, state).compile().as_text()
    found, computation = [], ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
        if f"{shape}" in line and re.search(r"\bcopy\(", line):
            found.append((computation, line.strip()[:160]))
    return found


_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")


def copies(text: str) -> list[tuple[int, str]]:
    """(bytes, line) of every `copy` instruction in compiled HLO `text`."""
    out = []
    for line in text.splitlines():
        m = _COPY.search(line)
        if m and m.group(1) in _DTYPE_BYTES:
            dims = [int(d) for d in m.group(2).split(",") if d]
            n = _DTYPE_BYTES[m.group(1)]
            for d in dims:
                n *= d
            out.append((n, line.strip()[:160]))
    return out


def scaling_copies(small: str, large: str) -> list[tuple[int, str]]:
    """The copies of HLO `large` (the larger pool) whose size the HLO `small` (same program, smaller pool) has no
    copy of: those whose size follows the number of pages."""
    sizes: dict[int, int] = {}
    for n, _ in copies(small):
        sizes[n] = sizes.get(n, 0) + 1
    found = []
    for n, line in copies(large):
        if sizes.get(n, 0):
            sizes[n] -= 1
        else:
            found.append((n, line))
    return found


def serving_programs(mode: str, n_pages: int, budget: int = 16, steps_only: bool = False) -> dict:
    """Every compiled serving program (4 slots, the shipped pair) over a pool of n_pages pages of 64 rows (only the
    steps with `steps_only`)."""
    from kdtree_jax.serving import ServeConfig, ServingEngine

    ck = os.path.join(ROOT, "checkpoints", "kdtree-mini")
    pair = Engine.load(os.path.join(ck, "target"), os.path.join(ck, "drafter"))
    engine = pair if mode != "ar" else Engine(pair.target, None, pair.tokenizer)
    core = ServingEngine(engine, ServeConfig(max_slots=4, max_context=512, mode=mode, step_widths=(4,), budget=budget,
                                             rounds_per_step=2, num_pages=n_pages, page_size=64))
    if steps_only:
        for key in core.runner.step_specs:
            core.runner.step_program(key)
    else:
        core.warm_up()
    return dict(core.runner._programs)


def serving_copies(mode: str, pools=(1024, 4096), budget: int = 16, dump: str | None = None,
                   steps_only: bool = False) -> list[tuple[str, str]]:
    """(program, line) of each copy that scales with the pool, over every serving program; prints temp bytes and
    writes each program's compiled HLO at the larger pool under `dump`."""
    small, large = (serving_programs(mode, n, budget, steps_only) for n in pools)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for key, program in large.items():
            name = re.sub(r"[^\w.-]+", "_", str(key))
            with open(os.path.join(dump, f"{mode}_{name}.hlo.txt"), "w") as f:
                f.write(program.as_text())
    found = []
    for key in small:
        mem = [ProgramMemory.of(p[key]) for p in (small, large)]
        print(f"  {key}: temp {mem[0].temp / 2**20:.1f} MiB at {pools[0]} pages, {mem[1].temp / 2**20:.1f} MiB at "
              f"{pools[1]}; outputs not aliased {(mem[0].peak - mem[0].temp) / 2**20:.1f} / "
              f"{(mem[1].peak - mem[1].temp) / 2**20:.1f} MiB")
        found += [(str(key), line) for _, line in scaling_copies(small[key].as_text(), large[key].as_text())]
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="ddtree", choices=("ar", "chain", "ddtree"))
    p.add_argument("--no-pallas", action="store_true")
    p.add_argument("--serving", action="store_true", help="every serving program, at two pool sizes")
    p.add_argument("--budget", type=int, default=16, help="--serving: the ddtree steps' tree budget")
    p.add_argument("--steps-only", action="store_true", help="--serving: compile only the step programs")
    p.add_argument("--pools", default="1024,4096", help="--serving: the two pool sizes, in pages")
    p.add_argument("--dump", help="--serving: write each program's compiled HLO (larger pool) in this folder")
    args = p.parse_args(argv)
    if args.serving:
        found = serving_copies(args.mode, pools=tuple(int(n) for n in args.pools.split(",")), budget=args.budget,
                               dump=args.dump, steps_only=args.steps_only)
        print(f"{len(found)} copies that scale with the pool in the serving programs ({jax.default_backend()}, "
              f"{args.mode})")
    else:
        found = cache_copies(args.mode, not args.no_pallas)
        print(f"{len(found)} whole-cache copies in the compiled decode loop ({jax.default_backend()}, {args.mode}, "
              f"pallas={not args.no_pallas})")
    for computation, line in found:
        print(f"  in {computation}: {line}")
    return found


if __name__ == "__main__":
    main()
