"""A request's text as its tokens arrive: incremental detokenization and stop strings, as vLLM applies them.

Stop strings are matched on the detokenized text, not on tokens: a stop string may span tokens, or be part of one.
The text is cut where the first stop string begins (the stop string is not part of the output) and the request
ends there. While streaming, the last len(longest stop) - 1 characters are held back, since they may still turn out
to begin a stop string.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class TextStream:
    """Feeds token ids through the tokenizer's stream decoder; hands out text that is final."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), hidden_ids: Iterable[int] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._hidden = frozenset(hidden_ids)  # token ids that add no text (special tokens, as vLLM skips them)
        self._pending = ""  # text not handed out yet: at most `_hold` characters between feeds
        self.token_ids: list[int] = []  # tokens taken in: up to the one that completed a stop string
        self.stop_string: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def feed(self, token_ids: Iterable[int]) -> str:
        """Take new tokens; returns the text that can no longer change. Tokens after a stop string are dropped."""
        out = []
        for t in token_ids:
            if self.stopped:
                break
            self.token_ids.append(t)
            if t not in self._hidden:
                out.append(self._add(self._decoder.push(t)))
        return "".join(out)

    def finish(self) -> str:
        """The request ended: the held-back text (and any incomplete character, as U+FFFD)."""
        out = "" if self.stopped else self._add(self._decoder.flush())
        out, self._pending = out + self._pending, ""
        return out

    def _add(self, piece: str) -> str:
        if not piece:
            return ""
        text = self._pending + piece  # holds every character a stop string ending in `piece` can start at
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stop_string = min((s for s in self._stop if text.find(s) == cut), key=len)
            self._pending = ""
            return text[:cut]
        keep = min(self._hold, len(text))
        self._pending = text[len(text) - keep:]
        return text[: len(text) - keep]
