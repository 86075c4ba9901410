"""JSON Schema -> the regex a token automaton enforces. Every keyword of a schema is enforced by the regex, or the
schema is refused with a `SchemaRefused` that names the keyword and its path: a schema's promise is never dropped
in silence. `KEYWORDS` is the table of what is enforced, refused, or an annotation (no effect on validity).

The regex matches a subset of the schema's instances (never a value the schema refuses): properties come in the
order declared and no undeclared property is generated, integers and bounded numbers carry no exponent, formats
take their common form (a date is a real calendar date, an IPv6 address its full or `::` form). Bounds are exact
(digit by digit, in `regex_pieces`). `check_schema` validates the schema against its metaschema (the `jsonschema`
package) first.
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

from kdtree_jax.constrain.regex_pieces import alt, integer_range, literal, number_range, trie

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
            return alt([self.value(s, (*path, "anyOf", i)) for i, s in enumerate(schema["anyOf"])])
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if types is None:  # the types its keywords speak of, else every type
            types = [t for t, keys in TYPE_KEYWORDS.items() if any(k in schema for k in keys)] or list(TYPES)
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
        return alt([self.typed(t, schema, path) for t in types])

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
        return alt([literal(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in keep])

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
            key = literal(json.dumps(name, ensure_ascii=False))
            members.append((f"{key}{ws}:{ws}{self.value(sub, (*path, 'properties', name))}", name in required))
        alts = []  # by the first member present: every member before it is optional and absent
        for i, (first, _) in enumerate(members):
            rest = "".join(f"{ws},{ws}{m}" if req else f"(?:{ws},{ws}{m})?" for m, req in members[i + 1:])
            alts.append(first + rest)
            if members[i][1]:
                break
        else:
            alts.append("")
        return rf"\{{{ws}{alt(alts)}{ws}\}}"

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
        return trie([str(k * step) for k in range(first, last + 1)])

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
