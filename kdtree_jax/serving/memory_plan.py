"""How many pages the pool gets on a device: what is left of its memory once the weights and the programs have theirs.

The programs' own memory (temporaries and outputs they do not write in place) does not grow with the pool, since
every program updates the pools in place (tests/test_serving_memory.py). So it can be read once, from
`compiled.memory_analysis()` of the widest step and the largest prefill chunk compiled against a small probe pool,
and the pool sized after it (vLLM sizes its KV cache after a profiling run in the same way).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from kdtree_jax.serving.config import ServeConfig

GIB = 2**30
# beside the weights and the programs' peak: the constraint tables a request may add, a step's packed output in
# flight while the host reads the one before, the runtime's own buffers
MARGIN_BYTES = 512 * 2**20


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

    @property
    def pool_bytes(self) -> int:
        return self.pages * self.page_bytes

    def summary(self, requests: int, max_context: int) -> str:
        return (f"memory: weights {self.weights / GIB:.2f} GiB / programs' peak {self.programs_peak / GIB:.2f} GiB / "
                f"pool {self.pool_bytes / GIB:.2f} GiB / {requests} requests of max_context {max_context}")


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
               programs_peak: Callable[[], int]) -> tuple[int, PoolPlan | None]:
    """The pool's pages, and the plan behind them where the device reports its memory: `config.num_pages`, else
    what `gpu_memory_utilization` of the device leaves after what is in use (weights), the programs' peak (read only
    then) and a margin on each data shard (`plan_pool`), else (no memory figures, e.g. a CPU) max_slots requests of
    max_context. A pool whose data group cannot hold one request of max_context is refused."""
    c, n, plan = config, config.num_pages, None
    if n is None:
        stats = memory_stats()
        if stats is not None:  # each data shard holds its group's pages, every head's rows of them
            plan = plan_pool(bytes_limit=int(stats["bytes_limit"]), bytes_in_use=int(stats["bytes_in_use"]),
                             utilization=c.gpu_memory_utilization, programs_peak=programs_peak(),
                             page_bytes=page_bytes, groups=groups, pages_per_request=pages_per_request)
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
