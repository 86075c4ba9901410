"""One serving step part by part on a GPU: device time by part, host time by part, and the idle gaps between.

    python benchmarks/profile_serving.py --mode ddtree --budget 16 --concurrency 16 [--out FILE]

It profiles whichever `kdtree_jax` is first on the path, so the same file profiles another commit's tree
(`run_gpu.sh serving-profile` runs it over $BASE, the slot table's tree, and over this one). Settings are BENCHMARKS
§5b's: the shipped pair, 16 slots, context 192, widths 1/4/8/16, 8 rounds a step, 64-token prompts, 128 new tokens,
greedy, a closed loop of `--concurrency` clients.

Three passes over the same warm engine, each a closed loop of `--requests` requests:
  - wall: steps and tokens/s, nothing attached;
  - host: cProfile over `ServingEngine.step` and what it calls, per step (the profiler slows Python, so these are
    upper bounds; their shares are what to read);
  - device: a jax.profiler trace; each GPU kernel goes to the part whose `jax.named_scope` its HLO instruction was
    traced under (round/verify, round/draft, round/tree, round/sample, round/accept, round/cache_update), Pallas
    kernels by name, the rest of a step program to "step bookkeeping" and prefill programs to "prefill". The idle gap
    (gpu_idle_ms) is the step's wall time less the time some kernel ran.

XLA command buffers are off in this process (attribution needs each kernel's HLO instruction, which a command buffer
hides), so a step's call blocks until its rounds end: the gaps are those of a loop without CUDA graphs. The wall
pass of `serving-vs-base` measures with them on.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import fcntl
import glob
import json
import os
import pstats
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from trace_parts import busy_time, command_buffers_off, gpu_kernels, hlo_scopes  # (no jax inside)

HLO_DIR = tempfile.mkdtemp(prefix="kdtree-hlo-")
if __name__ == "__main__":  # before jax reads XLA_FLAGS
    command_buffers_off()
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={HLO_DIR} --xla_dump_hlo_as_text"

import jax  # noqa: E402

CKPT = os.path.join(os.path.dirname(HERE), "checkpoints", "kdtree-mini")
ROUND_PARTS = ("verify", "draft", "tree", "sample", "accept", "cache_update")
PALLAS_PARTS = {"verify_attn": "verify attention (kernel)", "tree_build": "tree build", "tree_accept": "accept",
                "topk": "drafter"}  # pallas_call name= prefixes
HOST_SHARE = 0.02  # host functions under this share of step() are left out of the listing
DEVICE_WAITS = ("device_get", "block_until_ready", "_value")  # JAX calls that wait for the device


def part_of(op_name: str) -> str | None:
    """A named-scope path -> its part of the round; None outside the round."""
    m = re.search(r"round/(\w+)", op_name)
    if m and m.group(1) in ROUND_PARTS:
        part = m.group(1)
        if part == "verify" and re.search(r"gather|page", op_name):
            return "verify: page-table gathers"
        return {"verify": "verify (target, not attention)", "draft": "drafter", "tree": "tree build",
                "sample": "sampling", "accept": "accept", "cache_update": "cache and page writes"}[part]
    if "topk" in op_name:
        return "drafter"
    return None


def load_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    with open(os.path.join(CKPT, "heldout_prompts.jsonl"), encoding="utf-8") as f:
        ids = [tokenizer.encode(json.loads(line)["text"]) for line in f if line.strip()]
    return [p[:length] for p in ids if len(p) >= length][:n]


def load_engine(args):
    try:
        from kdtree_jax.decode.engine import Engine
    except ImportError:  # the slot table's tree keeps the engine at the package's top
        from kdtree_jax.engine import Engine
    from kdtree_jax.serving import ServeConfig, ServingEngine

    engine = Engine.load(os.path.join(CKPT, "target"), os.path.join(CKPT, "drafter"), dtype="float32")
    cfg = ServeConfig(max_slots=16, max_context=192, mode=args.mode, rounds_per_step=8, min_prompt_bucket=64,
                      step_widths=(1, 4, 8, 16), **({} if args.mode == "ar" else {"budget": args.budget}))
    return engine, ServingEngine(engine, cfg)


def records(report) -> list:
    own = getattr(report, "records", None)
    return list(own) if own is not None else [e for e in report.events if hasattr(e, "finish_reason")]


def closed_loop(core, prompts, n: int, c: int, on_step=None) -> tuple[int, int, float]:
    """n requests, c at a time; returns (steps, output tokens, seconds)."""
    from kdtree_jax.serving import RequestParams

    sent = done = steps = tokens = 0
    t0 = time.perf_counter()
    while sent < min(c, n):
        core.submit(prompts[sent % len(prompts)], RequestParams(max_new_tokens=128, temperature=0.0, seed=sent))
        sent += 1
    while done < n:
        report = core.step() if on_step is None else on_step()
        steps += 1
        for rec in records(report):
            done += 1
            tokens += len(rec.token_ids)
            if sent < n:
                core.submit(prompts[sent % len(prompts)], RequestParams(max_new_tokens=128, seed=sent))
                sent += 1
    return steps, tokens, time.perf_counter() - t0


def host_parts(stats: pstats.Stats, steps: int) -> dict:
    """ms per step: step() in all, each function it calls directly, and every engine function (or JAX's wait for
    the device) whose cumulative time is at least HOST_SHARE of step(); nested functions count in their callers."""
    step_key = max((k for k in stats.stats if k[2] == "step" and "serving" in k[0]), key=lambda k: stats.stats[k][1])
    total = stats.stats[step_key][3]

    def name(key) -> str:
        return f"{os.path.basename(key[0])}:{key[2]}"

    callees = {name(k): v[4][step_key][3] for k, v in stats.stats.items() if step_key in v[4]}
    functions = {name(k): v[3] for k, v in stats.stats.items()
                 if v[3] >= HOST_SHARE * total and ("kdtree_jax" in k[0] or k[2] in DEVICE_WAITS)}

    def ms(d: dict) -> dict:
        return {k: round(1e3 * v / steps, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {"step_ms": round(1e3 * total / steps, 4), "callees": ms(callees), "functions": ms(functions)}


def device_parts(trace_dir: str, steps: int) -> dict:
    """ms per step by device part, from the trace and the HLO modules XLA dumped. A module with no round scope in
    it is a prefill, release or move program."""
    by_id, by_name = {}, collections.defaultdict(dict)
    for path in glob.glob(os.path.join(HLO_DIR, "*after_optimizations.txt")):
        m = re.match(r"module_(\d+)\.([^.]*)", os.path.basename(path))
        with open(path) as f:
            text = f.read()
        scopes = hlo_scopes(text, part_of)
        is_step = "round/" in text
        by_id[int(m.group(1))] = (scopes, is_step)
        by_name[m.group(2)].update({k: (v, is_step) for k, v in scopes.items()})
    kernels = gpu_kernels(trace_dir)
    acc = collections.defaultdict(float)
    for e in kernels:
        a = e.get("args", {})
        op_key = re.sub(r"[^0-9A-Za-z]", "_", a.get("hlo_op", ""))
        pid = str(a.get("program_id", "")).strip()
        if pid.isdigit() and int(pid) in by_id:
            scopes, is_step = by_id[int(pid)]
            op = scopes.get(op_key)
        else:
            op, is_step = by_name.get(a.get("hlo_module", ""), {}).get(op_key, (None, False))
        part = next((name for prefix, name in PALLAS_PARTS.items() if e["name"].startswith(prefix)), None)
        if part is None:
            if op is not None and part_of(op):
                part = part_of(op)
            elif op is not None or a.get("hlo_op"):
                part = "step bookkeeping" if is_step else "prefill, release, move"
            else:
                part = "unattributed"
        acc[part] += e["dur"]
    busy = busy_time(kernels, steps)
    return {"parts_ms": {k: round(v / steps / 1e3, 4) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])},
            "kernels_per_step": busy["kernels"], "busy_ms": busy["busy_us"] / 1e3}


def profile(core, prompts, c: int, n: int) -> dict:
    """The three passes at concurrency c."""
    closed_loop(core, prompts, 2 * c, c)  # first calls, allocator, caches
    steps, tokens, wall = closed_loop(core, prompts, n, c)
    prof = cProfile.Profile()
    prof.enable()
    h_steps, _, _ = closed_loop(core, prompts, n, c)
    prof.disable()
    trace_dir = tempfile.mkdtemp(prefix="kdtree-trace-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        d_steps, _, d_wall = closed_loop(core, prompts, n, c)
    dev = device_parts(trace_dir, d_steps)
    step_ms = 1e3 * d_wall / d_steps
    return {"concurrency": c, "steps": steps, "tokens_per_s": round(tokens / wall, 1),
            "step_ms": round(1e3 * wall / steps, 4), "host_ms_per_step": host_parts(pstats.Stats(prof), h_steps),
            "device_ms_per_step": dev["parts_ms"], "traced_step_ms": round(step_ms, 4),
            "kernels_per_step": dev["kernels_per_step"], "gpu_busy_ms": round(dev["busy_ms"], 4),
            "gpu_idle_ms": round(step_ms - dev["busy_ms"], 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="ddtree", choices=("ar", "ddtree"))
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=None, help="per pass; default max(4c, 16)")
    p.add_argument("--lock", default=None,
                   help="a file to hold an exclusive lock on while measuring: processes that compile side by side "
                        "measure one at a time")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine, core = load_engine(args)
    prompts = load_prompts(engine.tokenizer, 16, 64)
    t0 = time.perf_counter()
    core.warm_up()
    result = {"label": args.label, "mode": args.mode, "budget": args.budget, "device": jax.devices()[0].device_kind,
              "compile_s": round(time.perf_counter() - t0, 1), "rows": []}
    with open(args.lock or os.devnull, "a") as lock:
        if args.lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        for c in (int(x) for x in args.concurrency.split(",")):
            result["rows"].append(profile(core, prompts, c, args.requests or max(4 * c, 16)))
            print(json.dumps(result["rows"][-1], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
