"""JSON Schema -> the regex a token automaton enforces. Every keyword of a schema is enforced by the regex, or the
schema is refused with a `SchemaRefused` that names the keyword and its path: a schema's promise is never dropped
in silence. `KEYWORDS` is the table of what is enforced, refused, or an annotation (no effect on validity).

The regex matches a subset of the schema's instances (never a value the schema refuses): properties come in the
order declared and no undeclared property is generated, integers and bounded numbers carry no exponent, formats
take their common form (a date is a real calendar date, an IPv6 address its full or `::` form). Bounds are exact:
an integer range becomes digit-by-digit alternatives (`[0, 99]` -> `0|[1-9][0-9]?`), a bounded number the
integer part's range and, where the integer part meets a bound, the fraction's digits against the bound's.
`check_schema` validates the schema against its metaschema (the `jsonschema` package) first.
"""
from __future__ import annotations

import decimal
import json
import math
import re
import re._constants as sre_c
import re._parser as sre_parse
from typing import Any

import jsonschema
from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, STRING_INNER

ENFORCED, REFUSED, ANNOTATION = "enforced", "refused", "annotation"
KEYWORDS = {  # keyword -> how the generated regex treats it; a keyword missing here is refused as unknown
    "type": ENFORCED, "enum": ENFORCED, "const": ENFORCED, "anyOf": ENFORCED, "$ref": ENFORCED, "$defs": ENFORCED,
    "definitions": ENFORCED, "properties": ENFORCED, "required": ENFORCED, "additionalProperties": ENFORCED,
    "items": ENFORCED, "minItems": ENFORCED, "maxItems": ENFORCED, "pattern": ENFORCED, "format": ENFORCED,
    "minLength": ENFORCED, "maxLength": ENFORCED, "minimum": ENFORCED, "maximum": ENFORCED,
    "exclusiveMinimum": ENFORCED, "exclusiveMaximum": ENFORCED, "multipleOf": ENFORCED,
    "uniqueItems": REFUSED, "not": REFUSED, "if": REFUSED, "then": REFUSED, "else": REFUSED, "allOf": REFUSED,
    "oneOf": REFUSED, "patternProperties": REFUSED, "propertyNames": REFUSED, "dependentRequired": REFUSED,
    "dependentSchemas": REFUSED, "dependencies": REFUSED, "minProperties": REFUSED, "maxProperties": REFUSED,
    "unevaluatedProperties": REFUSED, "unevaluatedItems": REFUSED, "prefixItems": REFUSED,
    "additionalItems": REFUSED, "contains": REFUSED, "minContains": REFUSED, "maxContains": REFUSED,
    "$dynamicRef": REFUSED, "$dynamicAnchor": REFUSED, "$recursiveRef": REFUSED, "$recursiveAnchor": REFUSED,
    "$anchor": REFUSED, "$id": REFUSED, "$vocabulary": REFUSED, "contentSchema": REFUSED,
    "$schema": ANNOTATION, "$comment": ANNOTATION, "title": ANNOTATION, "description": ANNOTATION,
    "default": ANNOTATION, "examples": ANNOTATION, "deprecated": ANNOTATION, "readOnly": ANNOTATION,
    "writeOnly": ANNOTATION, "contentMediaType": ANNOTATION, "contentEncoding": ANNOTATION,
}
WHY_REFUSED = {  # the reason a refusal gives, where the keyword has one of its own
    "uniqueItems": "a regex cannot compare one array item with another",
    "not": "a regex cannot take the complement of a schema", "allOf": "a regex cannot intersect schemas",
    "oneOf": "a regex cannot require exactly one branch to match (use anyOf)",
    "if": "conditional schemas are not supported", "then": "conditional schemas are not supported",
    "else": "conditional schemas are not supported",
}
# the keywords of one instance type: they constrain values of that type only (JSON Schema's semantics)
TYPE_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "minItems", "maxItems"),
    "string": ("pattern", "format", "minLength", "maxLength"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
ANY_VALUE_DEPTH = 2  # `{}`, `true` and an object or array with no item schema: values nest this deep in all
MAX_BOUND_DIGITS = 18  # a number bound's integer digits and fraction digits, each (past it: refused)
MAX_MULTIPLES = 256  # multipleOf between finite bounds: the multiples spelled out, at most this many (~0.7 states each)
STRING_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x9F))  # never raw inside a JSON string
REGEX_META = set(r"\.+*?()|[]{}^$#&-~")  # characters escaped in literals of outlines-core's (Rust) regex syntax

DATE = (r"[1-9][0-9]{3}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
        r"|(?:0[13578]|1[02])-31)")  # every month's days, February to the 28th: each is a real date
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[a-z][a-z0-9]{0,7}"  # a short DNS label: few states (each bounded count is a state)
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX4 = r"[0-9a-f]{1,4}"
_DUR_TIME = r"T(?:[0-9]{1,4}H(?:[0-9]{1,4}M)?(?:[0-9]{1,4}S)?|[0-9]{1,4}M(?:[0-9]{1,4}S)?|[0-9]{1,4}S)"
FORMATS = {  # format -> the regex of the string's characters (between the quotes)
    "date-time": f"{DATE}T{TIME}", "date": DATE, "time": TIME,
    "duration": (r"P(?:[0-9]{1,4}W|(?:[0-9]{1,4}Y(?:[0-9]{1,4}M)?(?:[0-9]{1,4}D)?|[0-9]{1,4}M(?:[0-9]{1,4}D)?"
                 rf"|[0-9]{{1,4}}D)(?:{_DUR_TIME})?|{_DUR_TIME})"),
    "email": rf"[a-z0-9][a-z0-9._+-]{{0,15}}@{_LABEL}(?:\.{_LABEL}){{1,2}}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,2}}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": rf"{_HEX4}(?::{_HEX4}){{7}}|(?:{_HEX4}(?::{_HEX4}){{0,5}})?::(?:{_HEX4})?",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}


class SchemaRefused(ValueError):
    """The schema breaks its metaschema, or holds a keyword (or value) no regex here enforces."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


def pointer(parts) -> str:
    """A location in the schema as a JSON pointer fragment (`#/properties/n/minimum`)."""
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def check_schema(schema: Any) -> None:
    """Validate against the schema's metaschema ($schema, else draft 2020-12); SchemaRefused names the path."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        raise SchemaRefused(pointer(error.absolute_path), f"invalid schema ({error.message})")


def schema_to_regex(schema: Any, whitespace: str) -> str:
    """The regex of `schema`'s JSON text (checked against its metaschema first); SchemaRefused names the keyword."""
    check_schema(schema)
    return _Translator(schema, whitespace).value(schema, ())


class _Translator:
    def __init__(self, root: Any, ws: str):
        self.root, self.ws = root, ws
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        self.validator = cls(root if isinstance(root, dict) else {}, format_checker=cls.FORMAT_CHECKER)
        self.refs: list[str] = []  # the $refs being expanded (a repeat is recursion)

    def refuse(self, path, message: str):
        raise SchemaRefused(pointer(path), message)

    # ---- any schema ----------------------------------------------------------------------------------------
    def value(self, schema: Any, path: tuple) -> str:
        if schema is True:
            return self.any_value(ANY_VALUE_DEPTH)
        if schema is False:
            self.refuse(path, "false: no value matches this schema")
        for k in schema:
            kind = KEYWORDS.get(k)
            if kind is None:
                self.refuse((*path, k), f"{k}: not a JSON Schema keyword this server enforces; remove it")
            if kind == REFUSED and not _is_noop(k, schema[k]):
                why = WHY_REFUSED.get(k, "not supported by this server's structured output")
                self.refuse((*path, k), f"{k}: {why}")
        if "$ref" in schema:
            return self.ref(schema, path)
        if "enum" in schema or "const" in schema:
            return self.literals(schema, path)
        if "anyOf" in schema:
            siblings = sorted(k for k in schema if KEYWORDS[k] == ENFORCED and k not in ("anyOf", "$defs",
                                                                                         "definitions"))
            if siblings:
                self.refuse((*path, siblings[0]), f"{siblings[0]} beside anyOf: move it into each branch")
            return _alt([self.value(s, (*path, "anyOf", i)) for i, s in enumerate(schema["anyOf"])])
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if types is None:  # the types its keywords speak of, else every type
            types = [t for t, keys in TYPE_KEYWORDS.items() if any(k in schema for k in keys)] or list(TYPES)
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
        return _alt([self.typed(t, schema, path) for t in types])

    def typed(self, t: str, schema: dict, path: tuple) -> str:
        if t == "boolean":
            return BOOLEAN
        if t == "null":
            return NULL
        return {"object": self.object, "array": self.array, "string": self.string, "number": self.number,
                "integer": self.integer}[t](schema, path)

    def ref(self, schema: dict, path: tuple) -> str:
        extra = sorted(k for k in schema if KEYWORDS[k] == ENFORCED and k not in ("$ref", "$defs", "definitions"))
        if extra:
            self.refuse((*path, extra[0]), f"{extra[0]} beside $ref: move it into the schema referred to")
        ref = schema["$ref"]
        if not ref.startswith("#"):
            self.refuse((*path, "$ref"), f"$ref {ref!r}: only references inside the schema (#/...) are supported")
        if ref in self.refs:
            self.refuse((*path, "$ref"), f"$ref {ref!r} is recursive: a regex cannot nest without a bound")
        target, parts = self.root, [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]
        for p in parts:
            try:
                target = target[int(p)] if isinstance(target, list) else target[p]
            except (KeyError, IndexError, ValueError, TypeError):
                self.refuse((*path, "$ref"), f"$ref {ref!r} names nothing in the schema")
        self.refs.append(ref)
        try:
            return self.value(target, tuple(parts))
        finally:
            self.refs.pop()

    def literals(self, schema: dict, path: tuple) -> str:
        """enum / const: the values that also satisfy the rest of the schema, as compact JSON."""
        key = "const" if "const" in schema else "enum"
        values = [schema["const"]] if key == "const" else schema["enum"]
        check = self.validator.evolve(schema=schema)
        keep = [v for v in values if check.is_valid(v)]
        if not keep:
            self.refuse((*path, key), f"{key}: no value satisfies the rest of the schema")
        return _alt([_literal(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in keep])

    def any_value(self, depth: int) -> str:
        """Any JSON value with objects and arrays nested `depth` levels in all."""
        ws, scalar = self.ws, f"(?:{STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
        value = scalar
        for _ in range(depth):
            member = f"{STRING}{ws}:{ws}{value}"
            obj = rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"
            arr = rf"\[{ws}(?:{value}(?:{ws},{ws}{value})*)?{ws}\]"
            value = f"(?:{scalar}|{obj}|{arr})"
        return value

    # ---- objects and arrays --------------------------------------------------------------------------------
    def object(self, schema: dict, path: tuple) -> str:
        ws = self.ws
        props, required = schema.get("properties", {}), schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        missing = [r for r in required if props.get(r, False) is False]
        if missing and (props or extra is False):
            self.refuse((*path, "required"), f"required: {missing[0]!r} has no schema under properties")
        if not props:
            if required:
                self.refuse((*path, "required"), "required: give the properties' schemas under properties")
            if extra is False:
                return rf"\{{{ws}\}}"
            value = (self.any_value(ANY_VALUE_DEPTH - 1) if extra is True
                     else self.value(extra, (*path, "additionalProperties")))
            member = f"{STRING}{ws}:{ws}{value}"
            return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"
        members = []  # (regex, required) in the order declared; a false schema is a property left out
        for name, sub in props.items():
            if sub is False:
                continue
            key = _literal(json.dumps(name, ensure_ascii=False))
            members.append((f"{key}{ws}:{ws}{self.value(sub, (*path, 'properties', name))}", name in required))
        alts = []  # by the first member present: every member before it is optional and absent
        for i, (first, _) in enumerate(members):
            rest = "".join(f"{ws},{ws}{m}" if req else f"(?:{ws},{ws}{m})?" for m, req in members[i + 1:])
            alts.append(first + rest)
            if members[i][1]:
                break
        else:
            alts.append("")
        return rf"\{{{ws}{_alt(alts)}{ws}\}}"

    def array(self, schema: dict, path: tuple) -> str:
        ws = self.ws
        items = schema.get("items", True)
        if isinstance(items, list):
            self.refuse((*path, "items"), "items as a list (tuple validation) is not supported")
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        hi = None if hi is None else int(hi)
        if hi is not None and lo > hi:
            self.refuse((*path, "minItems"), f"minItems {lo} is above maxItems {hi}")
        if hi == 0 or items is False:
            if lo > 0:
                self.refuse((*path, "items"), "items: false leaves no array of minItems")
            return rf"\[{ws}\]"
        value = self.any_value(ANY_VALUE_DEPTH - 1) if items is True else self.value(items, (*path, "items"))
        more = f"{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        body = f"{value}(?:{ws},{ws}{value}){more}"
        return rf"\[{ws}{body if lo else f'(?:{body})?'}{ws}\]"

    # ---- strings -------------------------------------------------------------------------------------------
    def string(self, schema: dict, path: tuple) -> str:
        given = [k for k in TYPE_KEYWORDS["string"] if k in schema]
        if "pattern" in given or "format" in given:
            if len(given) > 1:
                self.refuse((*path, given[1]), f"{given[1]} beside {given[0]}: a regex cannot intersect them")
            if "pattern" in given:
                return f'"{pattern_regex(schema["pattern"], pointer((*path, "pattern")))}"'
            fmt = schema["format"]
            if fmt not in FORMATS:
                self.refuse((*path, "format"), f"format {fmt!r}: not supported (supported: {', '.join(FORMATS)})")
            return f'"(?:{FORMATS[fmt]})"'
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        if hi is None:
            return STRING if lo == 0 else f'"(?:{STRING_INNER}){{{lo},}}"'
        if lo > int(hi):
            self.refuse((*path, "minLength"), f"minLength {lo} is above maxLength {hi}")
        return f'"(?:{STRING_INNER}){{{lo},{int(hi)}}}"'

    # ---- numbers -------------------------------------------------------------------------------------------
    def integer(self, schema: dict, path: tuple) -> str:
        lo, hi = self.bounds(schema, path)
        lo = None if lo is None else math.ceil(lo[0]) + (1 if not lo[1] and lo[0] == int(lo[0]) else 0)
        hi = None if hi is None else math.floor(hi[0]) - (1 if not hi[1] and hi[0] == int(hi[0]) else 0)
        if lo is not None and hi is not None and lo > hi:
            self.refuse((*path, "minimum"), "no integer lies between the bounds")
        step = schema.get("multipleOf")
        if step is None or step == 1:
            return integer_range(lo, hi)
        return self.multiples(step, lo, hi, path)

    def multiples(self, step, lo: int | None, hi: int | None, path: tuple) -> str:
        """multipleOf between finite bounds: the multiples spelled out (a trie of their digits)."""
        at = (*path, "multipleOf")
        if step != int(step):
            self.refuse(at, f"multipleOf {step}: only an integer step is supported")
        step = int(step)
        if lo is None or hi is None:
            self.refuse(at, "multipleOf needs a finite minimum and maximum beside it")
        first, last = -(-lo // step), hi // step
        if last - first + 1 > MAX_MULTIPLES:
            self.refuse(at, f"multipleOf {step}: {last - first + 1} multiples lie between the bounds, over the cap "
                            f"of {MAX_MULTIPLES}; narrow the bounds")
        if last < first:
            self.refuse(at, f"multipleOf {step}: no multiple lies between the bounds")
        return _trie([str(k * step) for k in range(first, last + 1)])

    def number(self, schema: dict, path: tuple) -> str:
        step = schema.get("multipleOf")
        if step is not None:
            if step != int(step):
                self.refuse((*path, "multipleOf"), f"multipleOf {step}: only an integer step is supported")
            return self.integer(schema, path)  # a multiple of an integer step is an integer
        lo, hi = self.bounds(schema, path)
        if lo is None and hi is None:
            return NUMBER
        return number_range(lo, hi) or self.refuse((*path, "minimum"), "no number lies between the bounds")

    def bounds(self, schema: dict, path: tuple):
        """((lower, inclusive) | None, (upper, inclusive) | None) as Decimals, the tighter where both forms are
        given; a bound with more digits than MAX_BOUND_DIGITS on either side of the point is refused."""
        lo = hi = None
        for key, upper, inclusive in (("minimum", False, True), ("exclusiveMinimum", False, False),
                                      ("maximum", True, True), ("exclusiveMaximum", True, False)):
            if key not in schema:
                continue
            v = decimal.Decimal(repr(schema[key]) if isinstance(schema[key], float) else schema[key])
            sign, digits, exp = v.normalize().as_tuple()
            if len(digits) + exp > MAX_BOUND_DIGITS or -exp > MAX_BOUND_DIGITS:
                self.refuse((*path, key), f"{key} {schema[key]}: more than {MAX_BOUND_DIGITS} digits on a side of "
                                          f"the point; the bound cannot be spelled digit by digit")
            cur = hi if upper else lo
            tighter = cur is None or (v < cur[0] if upper else v > cur[0]) or (v == cur[0] and not inclusive)
            if tighter:
                if upper:
                    hi = (v, inclusive)
                else:
                    lo = (v, inclusive)
        return lo, hi


def _is_noop(keyword: str, value) -> bool:
    """A refused keyword at the value that constrains nothing (uniqueItems false, minProperties 0)."""
    return (keyword == "uniqueItems" and value is False) or (keyword == "minProperties" and value == 0)


# ---- regex pieces --------------------------------------------------------------------------------------------
def _alt(parts: list[str]) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _literal(text: str) -> str:
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


def _trie(words: list[str]) -> str:
    """Words as one regex that shares their prefixes (a compact alternation)."""
    if words == [""]:
        return ""
    heads: dict[str, list[str]] = {}
    for w in words:
        heads.setdefault(w[:1], []).append(w[1:])
    parts = [_literal(h) + (_group(_trie(rest)) if rest != [""] else "") for h, rest in heads.items() if h]
    body = _alt(parts)
    return f"(?:{body})?" if "" in heads else body


def _group(r: str) -> str:
    return r if not r or re.fullmatch(r"[^|()]*", r) else f"(?:{r})"


def _cls(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"


def _same_length(lo: str, hi: str) -> str:
    """Numerals of len(lo) digits from lo to hi (same length, lo <= hi), digit by digit."""
    if lo == hi:
        return lo
    if lo[0] == hi[0]:
        return lo[0] + _group(_same_length(lo[1:], hi[1:]))
    n = len(lo) - 1
    tail = f"[0-9]{{{n}}}" if n > 1 else ("[0-9]" if n else "")
    alts, start, end = [], int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:
        alts.append(lo[0] + _group(_same_length(lo[1:], "9" * n)))
        start += 1
    last = None
    if hi[1:] != "9" * n:
        last = hi[0] + _group(_same_length("0" * n, hi[1:]))
        end -= 1
    if start <= end:
        alts.append(_cls(start, end) + tail)
    if last:
        alts.append(last)
    return _alt(alts)


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
    return _alt(alts)


def integer_range(lo: int | None, hi: int | None) -> str:
    """JSON integers from lo to hi (None: unbounded on that side), exactly."""
    alts = []
    if hi is None or hi >= 0:
        alts.append(natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag = natural_range(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)
        if mag is not None:
            alts.append("-" + _group(mag))
    return _alt([a for a in alts if a is not None])


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
        return None if rest is None else str(l0) + _group(rest)
    low = _rest(lo[1:], None, lo_inc, True)
    if low is not None:
        alts.append(str(l0) + _group(low))
    if l0 + 1 <= h0 - 1:
        alts.append(_cls(l0 + 1, h0 - 1) + "[0-9]*")
    if h0 <= 9:
        high = _rest("", hi[1:], True, hi_inc)
        if high is not None:
            alts.append(str(h0) + _group(high))
    return _alt(alts) if alts else None


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
    return rf"(?:\.{_group(more)})?" if empty else rf"\.{_group(more)}"


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
        alts.insert(1 if low is not None else 0, _group(middle) + r"(?:\.[0-9]+)?")
    return _alt(alts) if alts else None


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
                alts.append("-" + _group(neg))
    return _alt(alts) if alts else None


# ---- pattern -----------------------------------------------------------------------------------------------
def pattern_regex(pattern: str, where: str) -> str:
    """A `pattern` as the regex of a JSON string's characters: what it matches, less the characters a JSON string
    cannot hold raw (quote, backslash, controls); leading ^ and trailing $ dropped (a whole match is a search
    match). SchemaRefused for a construct a token automaton cannot follow (lookaround, backreferences, flags)."""
    try:
        tree = sre_parse.parse(pattern)
    except re.error as e:
        raise SchemaRefused(where, f"pattern {pattern!r} is not a valid regex ({e})") from None
    if tree.state.flags & ~(sre_c.SRE_FLAG_UNICODE):
        raise SchemaRefused(where, f"pattern {pattern!r}: inline flags are not supported")
    items = list(tree)
    if items and items[0] == (sre_c.AT, sre_c.AT_BEGINNING):
        items = items[1:]
    if items and items[-1] == (sre_c.AT, sre_c.AT_END):
        items = items[:-1]
    return _emit(items, pattern, where)


def _emit(items, pattern: str, where: str) -> str:
    out = []
    for op, av in items:
        if op is sre_c.LITERAL:
            out.append(_char_class([(av, av)]))
        elif op is sre_c.NOT_LITERAL:
            out.append(_char_class(_complement([(av, av)])))
        elif op is sre_c.ANY:
            out.append(_char_class(_complement([(0x0A, 0x0A)])))
        elif op is sre_c.IN:
            out.append(_char_class(_set_ranges(av, pattern, where)))
        elif op is sre_c.BRANCH:
            out.append("(?:" + "|".join(_emit(list(b), pattern, where) for b in av[1]) + ")")
        elif op is sre_c.SUBPATTERN:
            if av[1] or av[2]:
                raise SchemaRefused(where, f"pattern {pattern!r}: inline flags are not supported")
            out.append("(?:" + _emit(list(av[3]), pattern, where) + ")")
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            count = f"{{{lo},}}" if hi is sre_c.MAXREPEAT else f"{{{lo},{hi}}}"
            out.append(f"(?:{_emit(list(sub), pattern, where)}){count}")
        else:
            raise SchemaRefused(where, f"pattern {pattern!r}: {str(op).lower()} is not supported in a pattern")
    return "".join(out)


CATEGORIES = {  # the ASCII part of each class (Python's \d, \w also match other scripts: a subset is sound)
    sre_c.CATEGORY_DIGIT: [(0x30, 0x39)], sre_c.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F),
                                                                 (0x61, 0x7A)],
    sre_c.CATEGORY_SPACE: [(0x20, 0x20)],
}


def _set_ranges(items, pattern: str, where: str) -> list[tuple[int, int]]:
    ranges, negate = [], False
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            ranges.append((av, av))
        elif op is sre_c.RANGE:
            ranges.append(av)
        elif op is sre_c.CATEGORY and av in CATEGORIES and not negate:
            ranges += CATEGORIES[av]
        else:
            raise SchemaRefused(where, f"pattern {pattern!r}: the class item {str(av).lower()} is not supported")
    if negate and any(op is sre_c.CATEGORY for op, _ in items):
        raise SchemaRefused(where, f"pattern {pattern!r}: a category in a negated class is not supported")
    return _complement(ranges) if negate else ranges


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a - 1))
        at = max(at, b + 1)
    return [*out, (at, 0x10FFFF)] if at <= 0x10FFFF else out


def _char_class(ranges: list[tuple[int, int]]) -> str:
    """A character class of `ranges` less the characters a JSON string cannot hold raw; a quote or backslash the
    pattern asks for comes as its escape."""
    safe = [r for r in ranges]
    for ua, ub in STRING_UNSAFE:
        safe = [piece for a, b in safe for piece in ((a, min(b, ua - 1)), (max(a, ub + 1), b)) if piece[0] <= piece[1]]
    escapes = [e for c, e in ((0x22, r'\\"'), (0x5C, r"\\\\")) if any(a <= c <= b for a, b in ranges)]
    body = "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in safe)
    controls = [rf"\\u{c:04x}" for a, b in ranges for c in range(a, min(b, 0x1F) + 1)] if not body else []
    parts = ([f"[{body}]"] if body else []) + escapes + controls  # controls only where nothing else is asked for
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _class_char(c: int) -> str:
    ch = chr(c)
    if ch.isalnum() and ch.isascii():
        return ch
    return f"\\x{{{c:X}}}"
