"""One request's parameters: the one type that carries a request from the HTTP server to the device.

In serving every field is runtime data, so no value of it compiles a program. Construction checks nothing, so that
each front refuses a bad request where it was submitted and names the field in its own error type (`check_sampling`
raises `ParamError`; the serving layer's `check_request` turns it into a `RequestError`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from kdtree_jax.constrain.automaton import ConstraintSpec


class ParamError(ValueError):
    """A decoding parameter out of range; `field` names it, `detail` says what is wrong with it."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's parameters as the user gives them; temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: drawn from the serving engine's own generator
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's stop ids
    ignore_eos: bool = False  # do not stop at the model's own stop ids
    constraint: ConstraintSpec | None = None  # the output must match it (structured output, forced tool calls)
    # None: none; k: each generated token's raw log-probability (the target's log_softmax, before temperature, top-k,
    # top-p and any constraint's mask) and the k most likely tokens at its position
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (serving engine only)

    def check_sampling(self, top_k_cap: int | None = None) -> None:
        """Raise ParamError naming the first sampling field out of range; `top_k_cap` (a compiled program's cap)
        also bounds top_k."""
        if not (_real(self.temperature) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ParamError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ParamError("top_k", f"must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not (_real(self.top_p) and 0.0 < self.top_p <= 1.0):  # also refuses NaN
            raise ParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if top_k_cap is not None and self.top_k > top_k_cap:
            raise ParamError("top_k", f"must be <= {top_k_cap} (the compiled cap), got {self.top_k}")


    def check_logprobs(self, max_logprobs: int | None) -> None:
        """Raise ParamError naming `logprobs` or `prompt_logprobs` where it is not None or an integer in
        [0, max_logprobs] (the top-k the programs were compiled for; None: programs without log-probabilities)."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is None:
                continue
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                raise ParamError(name, f"must be None or an integer >= 0, got {k!r}")
            if max_logprobs is None:
                raise ParamError(name, "needs an engine compiled with max_logprobs (serve --max-logprobs N)")
            if k > max_logprobs:
                raise ParamError(name, f"must be <= {max_logprobs} (max_logprobs), got {k}")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
