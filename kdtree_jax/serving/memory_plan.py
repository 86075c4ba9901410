"""How many pages the pool gets on a device: what is left of its memory once the weights and the programs have theirs.

The programs' own memory (temporaries and outputs they do not write in place) does not grow with the pool, since
every program updates the pools in place (tests/test_serving_memory.py). So it can be read once, from
`compiled.memory_analysis()` of the widest step and the largest prefill chunk, and the pool sized after it (vLLM
sizes its KV cache after a profiling run in the same way).

A program's shapes include the pool's, so the probe compiles over the pool that a reserve of `PROGRAMS_RESERVE`
bytes for the programs leaves: where their peak fits that reserve (the shipped pair's is 0.05 GiB on an H100), the
probe's programs are the engine's own and nothing compiles twice; otherwise the pool is planned again after the
measured peak, and the engine compiles its programs over that pool.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np

from kdtree_jax.serving.config import ServeConfig

GIB = 2**30
# beside the weights and the programs' peak: the constraint tables a request may add, a step's packed output in
# flight while the host reads the one before, the runtime's own buffers
MARGIN_BYTES = 512 * 2**20
# what the pool leaves the programs at first: a peak above it costs one more compile of the probe's two programs
PROGRAMS_RESERVE = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's figures, from `compiled.memory_analysis()`."""

    temp: int
    argument: int
    output: int
    alias: int

    @classmethod
    def of(cls, compiled) -> "ProgramMemory":
        m = compiled.memory_analysis()
        return cls(temp=int(m.temp_size_in_bytes), argument=int(m.argument_size_in_bytes),
                   output=int(m.output_size_in_bytes), alias=int(m.alias_size_in_bytes))

    @property
    def peak(self) -> int:
        """What it needs beyond its arguments: temporaries and the outputs it does not write in place."""
        return self.temp + max(self.output - self.alias, 0)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    pages: int
    weights: int  # bytes on each device before the pool (weights and whatever else is in use)
    programs_peak: int
    margin: int
    page_bytes: int
    reserve: int = 0  # bytes the pool leaves the programs (>= programs_peak); 0: programs_peak exactly

    @property
    def pool_bytes(self) -> int:
        return self.pages * self.page_bytes

    def summary(self, requests: int, max_context: int) -> str:
        reserved = f" ({self.reserve / GIB:.2f} GiB reserved)" if self.reserve > self.programs_peak else ""
        return (f"memory: weights {self.weights / GIB:.2f} GiB / programs' peak {self.programs_peak / GIB:.2f} GiB"
                f"{reserved} / pool {self.pool_bytes / GIB:.2f} GiB / {requests} requests of max_context {max_context}")


def plan_pool(*, bytes_limit: int, bytes_in_use: int, utilization: float, programs_peak: int, page_bytes: int,
              groups: int, pages_per_request: int, margin: int = MARGIN_BYTES) -> PoolPlan:
    """The pool for one device's share `utilization` of `bytes_limit`, less what is in use (the weights), the
    programs' peak and `margin`; each of `groups` data shards holds its own pages (page_bytes each). Raises when a
    data group's pages cannot hold one request of max_context (pages_per_request)."""
    free = int(bytes_limit * utilization) - bytes_in_use - programs_peak - margin
    pages = groups * (max(free, 0) // page_bytes)
    if pages // groups < pages_per_request:
        raise ValueError(
            f"the device leaves no room for one request of max_context: {utilization:.2f} x {bytes_limit / GIB:.2f} "
            f"GiB less {bytes_in_use / GIB:.2f} GiB in use (weights), {programs_peak / GIB:.2f} GiB for the programs "
            f"and a {margin / GIB:.2f} GiB margin leaves {max(free, 0) / GIB:.2f} GiB, {pages // groups} pages of the "
            f"{pages_per_request} one request needs: raise --gpu-memory-utilization, set --num-pages, or lower "
            f"--max-context")
    return PoolPlan(pages=pages, weights=bytes_in_use, programs_peak=programs_peak, margin=margin,
                    page_bytes=page_bytes)


def page_bytes(target, drafter, page_size: int) -> int:
    """Bytes of one page: the target's latent rows and, with a drafter (None: none runs), its context rows, every
    layer."""
    cfg = target.cfg
    latent = cfg.num_hidden_layers * page_size * cfg.latent_dim * np.dtype(target.cache_dtype).itemsize
    if drafter is None:
        return latent
    d = drafter.cfg
    k = d.num_hidden_layers * d.num_key_value_heads * page_size * d.head_dim
    return latent + 2 * k * np.dtype(drafter.compute_dtype).itemsize


def memory_stats() -> dict | None:
    """The first device's memory limit and use, where it reports them (GPUs do; a CPU does not)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (a backend without memory figures)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats


def pool_pages(config: ServeConfig, *, groups: int, pages_per_request: int, row_slack: int, page_bytes: int,
               programs_peak: Callable[[int], int]) -> tuple[int, PoolPlan | None]:
    """The pool's pages, and the plan behind them where the device reports its memory: `config.num_pages`, else
    what `gpu_memory_utilization` of the device leaves after what is in use (weights), the programs' peak and a
    margin on each data shard (`plan_pool`), else (no memory figures, e.g. a CPU) max_slots requests of max_context.
    A pool whose data group cannot hold one request of max_context is refused.

    `programs_peak(n_pages)` compiles the probe's programs over a pool of n pages and returns their peak; it is
    called once, and only where the device reports its memory: over the pool that a `PROGRAMS_RESERVE` for the
    programs leaves (where that leaves no room for one request, over one request per data group). Where the peak
    fits the reserve that pool is the plan's, and the caller keeps the probe's programs."""
    c, n, plan = config, config.num_pages, None
    if n is None:
        stats = memory_stats()
        if stats is not None:  # each data shard holds its group's pages, every head's rows of them
            plan_for = functools.partial(plan_pool, bytes_limit=int(stats["bytes_limit"]),
                                         bytes_in_use=int(stats["bytes_in_use"]), utilization=c.gpu_memory_utilization,
                                         page_bytes=page_bytes, groups=groups, pages_per_request=pages_per_request)
            try:
                guess = plan_for(programs_peak=PROGRAMS_RESERVE)
            except ValueError:  # no room for the reserve: plan after the peak itself
                guess = None
            peak = programs_peak(guess.pages if guess is not None else groups * pages_per_request)
            if guess is not None and peak <= PROGRAMS_RESERVE:
                plan = dataclasses.replace(guess, programs_peak=peak, reserve=PROGRAMS_RESERVE)
            else:
                plan = plan_for(programs_peak=peak)
            n = plan.pages
        else:
            n = c.max_slots * pages_per_request
    elif n % groups:
        raise ValueError(f"num_pages (--num-pages) {n} must be a multiple of the mesh's data size {groups}: each data "
                         f"group owns an equal range of pages")
    if n // groups < pages_per_request:
        raise ValueError(
            f"the page pool holds {n} pages of {c.page_size} tokens ({n // groups} per data group), fewer than the "
            f"{pages_per_request} one request of max_context {c.max_context} needs (with {row_slack} rows of "
            f"scratch): raise --num-pages or --gpu-memory-utilization, or lower --max-context")
    return int(n), plan
