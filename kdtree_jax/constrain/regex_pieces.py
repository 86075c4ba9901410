"""Regex text from words and numeric bounds: alternation, literals, a trie of words, exact integer and number ranges.

Apart from `schema_regex` because none of it knows JSON Schema: pure functions whose output the tests compare with
the bounds exactly. An integer range becomes digit-by-digit alternatives (`[0, 99]` -> `0|[1-9][0-9]?`), a bounded
number the integer part's range and, where the integer part meets a bound, the fraction's digits against the
bound's. Literals are in outlines-core's (Rust) regex syntax.
"""
from __future__ import annotations

import decimal
import re

REGEX_META = set(r"\.+*?()|[]{}^$#&-~")  # characters escaped in literals of outlines-core's (Rust) regex syntax


def alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def literal(text: str) -> str:
    """`text` as a regex that matches exactly it."""
    out = []
    for ch in text:
        if ch in REGEX_META:
            out.append("\\" + ch)
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(f"\\x{{{ord(ch):X}}}")
    return "".join(out)


def trie(words: list[str]) -> str:
    """Words as one regex that shares their prefixes (a compact alternation)."""
    if words == [""]:
        return ""
    heads: dict[str, list[str]] = {}
    for w in words:
        heads.setdefault(w[:1], []).append(w[1:])
    parts = [literal(h) + (group(trie(rest)) if rest != [""] else "") for h, rest in heads.items() if h]
    body = alt(parts)
    return f"(?:{body})?" if "" in heads else body


def group(r: str) -> str:
    return r if not r or re.fullmatch(r"[^|()]*", r) else f"(?:{r})"


def _cls(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"


def _same_length(lo: str, hi: str) -> str:
    """Numerals of len(lo) digits from lo to hi (same length, lo <= hi), digit by digit."""
    if lo == hi:
        return lo
    if lo[0] == hi[0]:
        return lo[0] + group(_same_length(lo[1:], hi[1:]))
    n = len(lo) - 1
    tail = f"[0-9]{{{n}}}" if n > 1 else ("[0-9]" if n else "")
    alts, start, end = [], int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:
        alts.append(lo[0] + group(_same_length(lo[1:], "9" * n)))
        start += 1
    last = None
    if hi[1:] != "9" * n:
        last = hi[0] + group(_same_length("0" * n, hi[1:]))
        end -= 1
    if start <= end:
        alts.append(_cls(start, end) + tail)
    if last:
        alts.append(last)
    return alt(alts)


def natural_range(lo: int, hi: int | None) -> str | None:
    """Numerals without leading zeros from lo >= 0 to hi (None: no end); None where the range is empty."""
    if hi is not None and lo > hi:
        return None
    alts = []
    if lo == 0:
        alts.append("0")
        lo = 1
        if hi == 0:
            return "0"
    top = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top + 1):
        a = str(lo) if n == len(str(lo)) else "1" + "0" * (n - 1)
        b = str(hi) if hi is not None and n == top else "9" * n
        alts.append(_same_length(a, b))
    if hi is None:
        alts.append(f"[1-9][0-9]{{{top},}}")
    return alt(alts)


def integer_range(lo: int | None, hi: int | None) -> str:
    """JSON integers from lo to hi (None: unbounded on that side), exactly."""
    alts = []
    if hi is None or hi >= 0:
        alts.append(natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag = natural_range(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)
        if mag is not None:
            alts.append("-" + group(mag))
    return alt([a for a in alts if a is not None])


def _digits(v: decimal.Decimal) -> tuple[int, str]:
    """v >= 0 -> (integer part, fraction digits without trailing zeros)."""
    whole = int(v)
    frac = format(v - whole, "f").partition(".")[2].rstrip("0")
    return whole, frac


def _tail(lo: str, hi: str | None, lo_inc: bool, hi_inc: bool) -> str | None:
    """Non-empty digit strings T with lo <= .T <= hi as fractions (exclusive where *_inc is false); hi None: no
    upper bound below 1; lo and hi carry no trailing zeros ("" is 0). None where no T qualifies."""
    if hi == "":
        return "0+" if lo == "" and lo_inc and hi_inc else None
    if hi is None and lo == "":
        return "[0-9]+" if lo_inc else "[0-9]*[1-9][0-9]*"
    l0, h0 = (int(lo[0]) if lo else 0), (int(hi[0]) if hi else 10)
    alts = []
    if l0 == h0:
        rest = _rest(lo[1:], hi[1:], lo_inc, hi_inc)
        return None if rest is None else str(l0) + group(rest)
    low = _rest(lo[1:], None, lo_inc, True)
    if low is not None:
        alts.append(str(l0) + group(low))
    if l0 + 1 <= h0 - 1:
        alts.append(_cls(l0 + 1, h0 - 1) + "[0-9]*")
    if h0 <= 9:
        high = _rest("", hi[1:], True, hi_inc)
        if high is not None:
            alts.append(str(h0) + group(high))
    return alt(alts) if alts else None


def _rest(lo: str, hi: str | None, lo_inc: bool, hi_inc: bool) -> str | None:
    """Like `_tail`, but T may be empty (it follows digits already matched)."""
    empty = lo == "" and lo_inc and (hi is None or hi != "" or hi_inc)
    more = _tail(lo, hi, lo_inc, hi_inc)
    if more is None:
        return "" if empty else None
    return f"(?:{more})?" if empty else more


def _fraction(lo: str, hi: str | None, lo_inc: bool, hi_inc: bool) -> str | None:
    """The optional `.digits` of a number whose integer part is fixed, the fraction bounded as in `_tail`."""
    empty = lo == "" and lo_inc and (hi is None or hi != "" or hi_inc)
    more = _tail(lo, hi, lo_inc, hi_inc)
    if more is None:
        return "" if empty else None
    return rf"(?:\.{group(more)})?" if empty else rf"\.{group(more)}"


def _magnitudes(lo, hi) -> str | None:
    """Decimal numerals y >= 0 (no exponent) with lo <= y <= hi; lo, hi: (Decimal >= 0, inclusive), hi may be
    None (no end)."""
    a, alpha = _digits(lo[0])
    alts = []
    if hi is not None:
        b, beta = _digits(hi[0])
        if a == b:
            f = _fraction(alpha, beta, lo[1], hi[1])
            return None if f is None else f"{a}{f}"
        high = _fraction("", beta, True, hi[1])
        if high is not None:
            alts.append(f"{b}{high}")
    low = _fraction(alpha, None, lo[1], True)
    if low is not None:
        alts.insert(0, f"{a}{low}")
    middle = natural_range(a + 1, None if hi is None else b - 1)
    if middle is not None:
        alts.insert(1 if low is not None else 0, group(middle) + r"(?:\.[0-9]+)?")
    return alt(alts) if alts else None


def number_range(lo, hi) -> str | None:
    """JSON numbers (no exponent) within the bounds ((Decimal, inclusive) or None each); None where none lies
    between them."""
    zero = decimal.Decimal(0)
    if lo is not None and hi is not None and (lo[0] > hi[0] or (lo[0] == hi[0] and not (lo[1] and hi[1]))):
        return None
    alts = []
    if hi is None or hi[0] > 0 or (hi[0] == 0 and hi[1]):
        floor = lo if lo is not None and lo[0] >= 0 else (zero, True)
        pos = _magnitudes(floor, hi)
        if pos is not None:
            alts.append(pos)
    if lo is None or lo[0] < 0:
        top = None if lo is None else (-lo[0], lo[1])
        bottom = (-hi[0], hi[1]) if hi is not None and hi[0] < 0 else (zero, False)  # -0 is 0: not below zero
        if top is None or bottom[0] < top[0] or (bottom[0] == top[0] and bottom[1] and top[1]):
            neg = _magnitudes(bottom, top)
            if neg is not None:
                alts.append("-" + group(neg))
    return alt(alts) if alts else None
