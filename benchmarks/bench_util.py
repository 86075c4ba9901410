"""Helpers shared by the benchmark scripts: synchronised medians, per-call device time with the host's dispatch
cost amortised, the two measured ceilings, the provenance every results file records (`write_results`), and a run
that writes its results file whatever happens (`recorded_run`)."""
from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIFF_HASH_CHARS = 12  # hex digits of the working tree's difference from HEAD kept in a results file


def finish_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that a run stopped by `timeout` or a machine's time limit still runs its
    `finally` and writes the rows it finished (Python's default for SIGTERM exits without unwinding)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def median_s(fn, min_reps: int = 5, max_reps: int = 30, min_total_s: float = 0.2) -> float:
    """Median wall time of fn() after two warm-up calls, each call synchronised with block_until_ready."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    while len(times) < min_reps or (sum(times) < min_total_s and len(times) < max_reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def _back_to_back(fn):
    """One jit that runs fn on every argument set in turn and keeps each output alive (a scalar from each)."""

    def many(arg_sets):
        acc = jnp.float32(0)
        for args in arg_sets:
            for leaf in jax.tree.leaves(fn(*args)):
                acc = acc + jnp.ravel(leaf)[0].astype(jnp.float32)
        return acc

    return jax.jit(many)


def per_call_s(fn, arg_sets, **median_kw) -> float:
    """Median seconds per call of fn(*args), the calls for all `arg_sets` issued back to back inside one jit.

    A single jitted call pays tens of µs of host dispatch, more than a small kernel runs; the engine issues its
    kernels from one compiled loop, so that cost is not the kernel's. The sets must differ (XLA merges identical
    calls); cycling through several large inputs also keeps a call from reading what the previous left in L2.
    Keep `fn` the same object across calls so one compile serves every set of the same shapes.
    """
    return median_s(lambda: _back_to_back(fn)(list(arg_sets)), **median_kw) / len(arg_sets)


def copy_ceiling(nbytes: int) -> float:
    """Bytes/s of a large device-to-device copy, read + write counted: the best of an XLA elementwise copy (x * s,
    runtime s = 1) and, where PyTorch sees a GPU, `torch.Tensor.copy_` (~4.3 TB/s that way on an H200, where an
    XLA copy once gave 2.7 TB/s: a ceiling must not be the slower of two copies)."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)  # never time on zeros
    f = jax.jit(lambda x, s: x * s)
    best = 2 * x.nbytes / median_s(lambda: f(x, jnp.asarray(1.0, jnp.bfloat16)))
    return max(best, _torch_copy(nbytes))


def _torch_copy(nbytes: int) -> float:
    """Read + write bytes/s of torch's device copy timed with CUDA events; 0 where torch or a GPU is missing."""
    try:
        import torch
    except ImportError:
        return 0.0
    if not torch.cuda.is_available():
        return 0.0
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(12):
        start.record()
        dst.copy_(src)
        stop.record()
        torch.cuda.synchronize()
        if i >= 2:  # warm-up
            times.append(start.elapsed_time(stop) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (nbytes // 2) * 2 / statistics.median(times)


def matmul_peak(n: int) -> float:
    """FLOP/s of an n^3 bf16 matmul through XLA."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / median_s(lambda: f(a))


def _git(repo: str, *args: str) -> bytes | None:
    try:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def git_state(repo: str | None = None) -> dict:
    """The code that ran: HEAD, whether the working tree differs from it, and a hash of that difference.

    A device runs a copy of a working tree, which is often dirty: HEAD alone would name code that did not run.
    The hash covers `git diff HEAD` (tracked files) and the path and bytes of every untracked, unignored file, so
    two runs with the same `git_label` ran the same sources (`git_dirty_files` lists what differs). `git_label` is "<short HEAD>" on a clean tree and
    "<short HEAD>+dirty.<hash>" otherwise; outside a git checkout every field is None and the label "unknown"."""
    repo = repo or REPO
    head = _git(repo, "rev-parse", "HEAD")
    if head is None:
        return {"git_commit": None, "git_dirty": None, "git_diff_sha256": None, "git_label": "unknown",
                "git_dirty_files": None}
    head = head.decode().strip()
    diff = _git(repo, "diff", "HEAD", "--binary") or b""
    untracked = (_git(repo, "ls-files", "--others", "--exclude-standard", "-z") or b"").split(b"\0")
    digest = hashlib.sha256(diff)
    for name in sorted(n for n in untracked if n):
        digest.update(b"\0untracked\0" + name + b"\0")
        try:
            with open(os.path.join(repo, os.fsdecode(name)), "rb") as f:
                digest.update(f.read())
        except OSError:  # vanished, or not a regular file: its name still counts
            pass
    dirty = bool(diff) or any(untracked)
    short = digest.hexdigest()[:DIFF_HASH_CHARS] if dirty else None
    changed = (_git(repo, "status", "--porcelain") or b"").decode(errors="replace").splitlines()
    return {"git_commit": head, "git_dirty": dirty, "git_diff_sha256": short,
            "git_label": f"{head[:7]}+dirty.{short}" if dirty else head[:7], "git_dirty_files": changed}


def provenance(repo: str | None = None) -> dict:
    """What a results file says about its run: the code (`git_state`), jax, XLA flags, the command and the date."""
    return {"jax_version": jax.__version__, **git_state(repo),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "command": " ".join(shlex.quote(a) for a in sys.argv)}


def write_results(path: str, result) -> dict:
    """Write a results file stamped with `provenance()` (one place for every writer): a dict gains the fields at
    its top level, a list of rows becomes {"rows": [...], ...}. Returns what was written."""
    stamped = {"rows": result} if isinstance(result, list) else dict(result)
    stamped.update(provenance())
    with open(path, "w") as f:
        json.dump(stamped, f, indent=1)
    return stamped


def short_error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def is_oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


@contextlib.contextmanager
def recorded_run(benchmark: str, result: dict, out: str | None, shrink: str):
    """The body of a benchmark's run, `run.stage` saying what it is doing: `result` gains its wall time and is
    written to `out` at the end whatever happens (SIGTERM included, with `finish_on_sigterm`); running out of device
    memory is recorded (error, stage, oom), reported with the flags that shrink the run (`shrink`) and sets
    `run.status` to 1; any other exception is recorded and raised."""
    run = types.SimpleNamespace(stage="starting", status=0, t0=time.perf_counter())
    try:
        yield run
    except Exception as e:
        result.update(error=short_error(e), error_stage=run.stage, oom=is_oom(e))
        if not is_oom(e):
            raise
        print(f"{benchmark}: out of device memory during {run.stage}: {short_error(e)}\n  lower {shrink}",
              file=sys.stderr)
        run.status = 1
    finally:
        result["wall_s"] = time.perf_counter() - run.t0
        if out:
            write_results(out, result)
