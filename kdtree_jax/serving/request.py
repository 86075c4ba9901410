"""What a request is, from the server to the device: its parameters (`RequestParams`, defined in `decode.params`
because the batch engine and the device rows read them too), the limits a serving engine sets, the one check every
front runs before a request is sent, and what comes back (token deltas, the final record).

Every front checks with `check_request` against the engine's `RequestLimits`, so a bad request is refused where it
was submitted, in the server process too, and never reaches a slot.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kdtree_jax.constrain.automaton import ConstraintSpec
from kdtree_jax.decode.engine import ContextTooLongError
from kdtree_jax.decode.logprobs import TokenLogprob
from kdtree_jax.decode.params import ParamError, RequestParams

SEED_LIMIT = 1 << 32  # seeds are 32-bit: the request key is jax.random.key(seed)


class RequestError(ValueError):
    """A request refused before it reaches a slot; `field` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLongError(RequestError, ContextTooLongError):
    """Prompt plus max_new_tokens over the table's max_context."""


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests."""


class EngineClosedError(RuntimeError):
    """The serving engine was shut down."""


@dataclasses.dataclass(frozen=True)
class TokenDelta:
    request_id: int
    token_ids: list[int]
    time: float  # perf_counter when the host received them
    # where the request asked (`RequestParams.logprobs`): an entry per token, with its top `logprobs` alternatives
    logprobs: list[TokenLogprob] | None = None
    # on a request's first delta where it asked for `prompt_logprobs`: an entry per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class RequestRecord:
    """A finished request: its tokens, why it ended and its speculative statistics."""

    request_id: int
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error" | "nonfinite"
    prompt_tokens: int
    # tokens each round emitted (accepted drafts + 1, cut where the request ended: at a stop or max_new_tokens), so
    # that they add up to the tokens the rounds emitted (all but the first of each prefill)
    accept_lengths: list[int]
    num_draft_tokens: int  # tokens drafted and verified (B per DDTree round, L - 1 per chain round)
    error: str | None = None
    num_preemptions: int = 0  # times its pages were taken back and it was recomputed
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (usage's cached_tokens)
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens the target accepted (each round's bonus token is not a draft)."""
        return int(sum(a - 1 for a in self.accept_lengths))


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: fixed for a serving engine's life, and picklable (the engine process sends
    them to the server's)."""

    vocab_size: int
    max_context: int
    top_k_cap: int
    max_stop_ids: int
    stop_ids: tuple[int, ...]  # the model's own
    max_logprobs: int | None = None  # the top-k the programs keep; None: no log-probabilities


def _token_ids(values) -> bool:
    return all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in values)


def check_request(prompt: Sequence[int], params: RequestParams, limits: RequestLimits,
                  rng: np.random.Generator) -> tuple[list[int], tuple[int, ...], int]:
    """(prompt ids, stop ids, seed) of a valid request, the seed drawn from `rng` where it gives none; anything else
    raises RequestError naming the field."""
    vocab = limits.vocab_size
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise RequestError("prompt", f"must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise RequestError("prompt", "is empty")
    if not _token_ids(prompt):
        raise RequestError("prompt", "must hold integer token ids")
    bad = [int(t) for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError("prompt", f"has token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
    n = params.max_new_tokens
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise RequestError("max_new_tokens", f"must be an integer >= 1, got {n!r}")
    if len(prompt) + n > limits.max_context:
        raise PromptTooLongError(
            "prompt" if len(prompt) >= limits.max_context else "max_new_tokens",
            f"the prompt's {len(prompt)} tokens plus max_new_tokens {n} exceed max_context {limits.max_context}")
    try:
        params.check_sampling(limits.top_k_cap)
        params.check_logprobs(limits.max_logprobs)
    except ParamError as e:
        raise RequestError(e.field, e.detail) from None
    extra = tuple(params.stop_token_ids)
    if not _token_ids(extra):
        raise RequestError("stop_token_ids", f"must be integer token ids, got {extra!r}")
    out = [t for t in extra if not 0 <= t < vocab]
    if out:
        raise RequestError("stop_token_ids", f"ids outside the vocabulary (0..{vocab - 1}): {out[:5]}")
    stop = tuple(dict.fromkeys((() if params.ignore_eos else limits.stop_ids) + tuple(int(t) for t in extra)))
    if len(stop) > limits.max_stop_ids:
        raise RequestError("stop_token_ids", f"{len(stop)} stop ids (the model's included) exceed the table's "
                                             f"{limits.max_stop_ids}")
    if params.constraint is not None and not isinstance(params.constraint, ConstraintSpec):
        raise RequestError("constraint", f"must be a ConstraintSpec, got {type(params.constraint).__name__}")
    seed = params.seed
    if seed is None:
        seed = int(rng.integers(SEED_LIMIT))
    elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        raise RequestError("seed", f"must be an integer in [0, 2**32), got {seed!r}")
    return [int(t) for t in prompt], stop, int(seed)
