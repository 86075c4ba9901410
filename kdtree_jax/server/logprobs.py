"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content[]` and the legacy completions `logprobs` object.

The values are the engine's raw ones (the target's log_softmax before temperature, top-k, top-p and any output
constraint's mask: `kdtree_jax/decode/logprobs.py`). A token's text is its bytes decoded as UTF-8, a partial character
as U+FFFD; JSON has no -inf, so a log-probability below -9999 is sent as -9999.0, as vLLM sends it.
"""
from __future__ import annotations

from collections.abc import Sequence

from kdtree_jax.decode.logprobs import TokenLogprob

FLOOR = -9999.0  # the lowest log-probability sent (an impossible token's -inf included)


def _value(x: float) -> float:
    return x if x >= FLOOR else FLOOR  # NaN and -inf become FLOOR


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached: a response names the same tokens over and over."""

    def __init__(self, tokenizer):
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        out = self._cache.get(token)
        if out is None:
            raw = self._tokenizer.token_bytes(token)
            out = self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return out


def chat_content(texts: TokenTexts, entries: Sequence[TokenLogprob], top_logprobs: int) -> list[dict]:
    """Chat's `logprobs.content`: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    out = []
    for e in entries:
        text, raw = texts(e.token)
        top = [{"token": t, "logprob": _value(lp), "bytes": b}
               for (t, b), lp in ((texts(i), lp) for i, lp in e.top[:top_logprobs])]
        out.append({"token": text, "logprob": _value(e.logprob), "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(texts: TokenTexts, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], k: int,
                        offset: int = 0) -> dict:
    """The legacy completions `logprobs`: {tokens, token_logprobs, top_logprobs (a dict per token), text_offset};
    None where a token has no entry (the prompt's first). `offset`: the text offset of the first token."""
    strings, values, tops, offsets = [], [], [], []
    for token, e in zip(tokens, entries, strict=True):
        text, _ = texts(token)
        strings.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if e is None else _value(e.logprob))
        tops.append(None if e is None else {texts(i)[0]: _value(lp) for i, lp in e.top[:k]})
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
