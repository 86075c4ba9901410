"""What a serving engine is compiled for: slots, context, mode and budget, rounds per step, prefill batching, pages
and the constraint tables. Fixed for the engine's life; everything a request asks for is runtime data instead."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kdtree_jax.constrain import device as cd
from kdtree_jax.decode import sampling
from kdtree_jax.decode.logprobs import MAX_LOGPROBS
from kdtree_jax.decode.speculative import MODES
from pallas_kernels.verify_attn import PAGE_SIZES


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the serving engine is compiled for; fixed for its life."""

    max_slots: int = 4  # the most requests decoding at once (vLLM's max_num_seqs)
    max_context: int = 1024  # prompt + generated tokens of one request
    mode: str = "ddtree"  # "ar" | "chain" | "ddtree"
    # ddtree: B, "auto" (per step, from the budget profile and the number of active slots), or a table
    # {active slots: B or "ar"} (missing counts take the nearest smaller entry)
    budget: int | str | Mapping[int, int | str] = "auto"
    rounds_per_step: int = 8  # k: rounds per step; tokens come back to the host once per step
    # prefill chunks of one bucket run together in one program of up to this many rows per data group (a program
    # per power of two up to it): one launch instead of one per request when many join at once
    prefill_batch: int = 4
    top_k_cap: int = sampling.TOP_K_CAP  # the largest per-request top_k
    max_stop_ids: int = 8  # stop-id table width per slot (the model's own stop ids included)
    min_prompt_bucket: int = 16  # prefill chunks pad to powers of two from here
    max_queue: int = 1024  # waiting requests beyond this are refused
    # step programs run over the first w slots, for each w here (None: powers of two, then max_slots; on a mesh
    # that splits data over G devices, G times those of max_slots / G, and every w a multiple of G: the first w / G
    # slots of each data group); a step takes the narrowest that holds the running requests
    step_widths: tuple[int, ...] | None = None
    # run each step on a device thread and read the last step's tokens meanwhile, so the device waits only for
    # admission and dispatch; tokens, finishes and faults reach the host one step later (a finished row rides
    # that step at no cost)
    overlap: bool = True
    page_size: int = 64  # cache rows per page (vLLM's block size)
    # pages in the pool; None: from gpu_memory_utilization on a device that reports its memory, else max_slots
    # requests of max_context (the bytes a slot table would take)
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9  # the share of device memory weights, activations and pages may use
    # prompt tokens prefilled per step (one chunk program); None: the engine's prefill chunk
    max_num_batched_tokens: int | None = None
    # full pages of committed rows are indexed by their tokens and shared by later requests with the same prefix
    # (`serving/prefix_cache.py`); off: every request computes its whole context
    enable_prefix_caching: bool = True
    # the budget of the device's constraint tables, shared by every constrained request running at once: global
    # automaton states (the free state included; V / 8 bytes each: 160 MiB at V = 163,840 for the default 8192, the
    # most the int32 exception keys allow there being 13,107) and transition exceptions (8 bytes each). The tables
    # take the first bucket (1024 states, 2^18 exceptions) doubled as the live automata need, compiling the prefill
    # and step programs once per bucket; a constraint past the budget is a 400 naming it
    constraint_states: int = cd.STATES_CAP
    constraint_exceptions: int = cd.EXCEPTIONS_CAP
    # the most top log-probabilities a request may ask for (vLLM's max_logprobs); None: the programs compute none and
    # a request asking for them is refused. Set, every program keeps each token's raw log-probability and this many
    # alternatives, for every request (the host hands them only to the requests that asked)
    max_logprobs: int | None = None

    @property
    def constraint_caps(self) -> cd.TableCaps:
        return cd.TableCaps(self.constraint_states, self.constraint_exceptions)

    def __post_init__(self):
        for name in ("max_slots", "max_context", "rounds_per_step", "max_stop_ids", "min_prompt_bucket",
                     "prefill_batch", "page_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("num_pages", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page_size must be one of {PAGE_SIZES} (what the verify kernels read), "
                             f"got {self.page_size!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.step_widths is not None:
            w = self.step_widths
            if not w or not all(isinstance(x, int) and 1 <= x <= self.max_slots for x in w) \
                    or self.max_slots not in w:
                raise ValueError(f"step_widths must be integers in [1, max_slots] including max_slots "
                                 f"{self.max_slots}, got {w!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_logprobs is not None and (isinstance(self.max_logprobs, bool) or not isinstance(
                self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"max_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
                             f"{self.max_logprobs!r}")
        if self.top_k_cap < 0 or self.max_queue < 0:
            raise ValueError(f"top_k_cap and max_queue must be >= 0, got {self.top_k_cap}, {self.max_queue}")
        self.constraint_caps  # noqa: B018  (TableCaps checks the caps)
