"""XLA options of the serving engine: process-wide ones it (and `generate`) sets before its first compile (the
persistent compilation cache, loop graphs on a GPU), and the compile options of its programs."""
from __future__ import annotations

import logging
import os
import re

import jax
from jax._src import xla_bridge

log = logging.getLogger(__name__)

CACHE_ENV = "KDTREE_COMPILATION_CACHE"  # directory of JAX's persistent compilation cache; "off" disables it
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
LOOP_GRAPHS_FLAG = f"{COMMAND_BUFFER_FLAG}=+WHILE,+CONDITIONAL"  # XLA's default command buffer types and these two


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Use JAX's persistent compilation cache so a restart loads the warm-up's programs instead of compiling them.

    Directory: `path`, else $KDTREE_COMPILATION_CACHE, else ~/.cache/kdtree-jax/xla; "off" disables. Every program
    is cached, however quickly it compiled. Call before the first compile."""
    path = path or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kdtree-jax", "xla")
    if path == "off":
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def enable_loop_graphs() -> bool:
    """Have XLA put while loops and conditionals into its CUDA graphs (command buffers) too, so that a step program's
    call returns once its rounds are queued instead of after the last one.

    By default XLA on a GPU copies every loop and branch predicate to the host and waits for it, so the call of a step
    program blocks for the whole step, and the host can only prepare the next step once the device is idle. Measured
    on one H200 with the shipped pair (ar, one request, 8 rounds per step): the call returned after 4.2 ms of its
    4.8 ms by default and after 1.4 ms with loop graphs, and the serving loop went from 0.72x to 1.00x the tokens/s
    of `Engine.generate` in the same process. A GPU-only setting; it must run before JAX creates its GPU client. An
    XLA_FLAGS that already chooses command buffers is left alone. Returns whether it set the flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    if COMMAND_BUFFER_FLAG in flags:
        return False
    if xla_bridge.backends_are_initialized():
        log.warning("loop graphs not enabled: JAX's backends are initialised already (call enable_loop_graphs first)")
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {LOOP_GRAPHS_FLAG}".strip()
    return True


DISABLE_PASSES_FLAG = "--xla_disable_hlo_passes"
REMAT_PASS = "rematerialization"  # XLA's HloRematerialization pass


def serving_compile_options() -> dict[str, str]:
    """The compile options of every serving program: XLA's rematerialization pass off.

    XLA's GPU compiler runs that pass against a memory limit of its own, derived from the device's memory, and counts
    a program's arguments as live throughout. A serving program's arguments include the page pool, which the memory
    planner sizes to fill the device, so no rematerialization can ever bring the program under that limit: on an H100
    every step program logged "Can't reduce memory use below 59.03GiB by rematerialization; only reduced to
    78.46GiB, down from 78.46GiB originally" (a 52.86 GiB pool; the programs' own peak was 0.05 GiB) after
    rematerializing what it could, recomputation that gains nothing. The programs' own memory is what the planner
    reads from each compiled program (`memory_plan`), with this option on too. Passes that XLA_FLAGS disables stay
    disabled."""
    given = re.findall(rf"{DISABLE_PASSES_FLAG}=(\S+)", os.environ.get("XLA_FLAGS", ""))
    passes = [p for flag in given for p in flag.split(",") if p]
    return {DISABLE_PASSES_FLAG.lstrip("-"): ",".join(dict.fromkeys([*passes, REMAT_PASS]))}
