"""Request fields -> the constraint the output must match: OpenAI's `response_format`, vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `json_object`) and `tool_choice` ("required" or a named function: a Kimi tool-call
section whose arguments follow the tool's parameter schema). A `ValueError` says what is wrong; the caller names
the field.

The tool-call section is a regex over Kimi's special tokens and JSON: `<|tool_calls_section_begin|>`, then per call
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`, then
`<|tool_calls_section_end|>`. The markers are special tokens, so the regex names them as markers
(`ConstraintSpec.marker`): each matches its special token only, never ordinary text spelling the same characters.
"""
from __future__ import annotations

from typing import Any

from kdtree_jax.constrain.automaton import ConstraintSpec, spec_from_response_format
from kdtree_jax.server.reasoning import THINK_END
from kdtree_jax.server.tool_calls import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

TOOL_MARKERS = (SECTION_BEGIN, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, SECTION_END)  # marker i = TOOL_MARKERS[i]
CALL_INDEX = "[0-9]{1,3}"  # the call's index in its header (`functions.NAME:IDX`)
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "json_object")  # vLLM's structured_outputs fields served


def structured_outputs_spec(value: Any) -> ConstraintSpec | None:
    """vLLM's `structured_outputs` object: exactly one of json (a schema), regex, choice, json_object (true)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object with one of " + ", ".join(STRUCTURED_OUTPUT_KINDS))  # noqa: TRY004
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUT_KINDS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not supported by this server (only {', '.join(STRUCTURED_OUTPUT_KINDS)})")
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {sorted(given) or 'none'}")
    kind, v = next(iter(given.items()))
    try:
        if kind == "json":
            return ConstraintSpec.json_schema(v)
        if kind == "regex":
            return ConstraintSpec.regex(v)
        if kind == "choice":
            return ConstraintSpec.choice(v)
        return ConstraintSpec.json_object()
    except ValueError as e:
        raise ValueError(f"{kind}: {str(e).split(': ', 1)[-1]}") from None


def response_format_spec(value: Any) -> ConstraintSpec | None:
    """OpenAI's `response_format`; the error text starts with the sub-field (`json_schema.schema: ...`)."""
    try:
        return spec_from_response_format(value)
    except ValueError as e:
        raise ValueError(str(e).removeprefix("response_format.")) from None


def declared_tools(tools: list[dict]) -> dict[str, dict | None]:
    """name -> parameter schema (None: any JSON object) of each declared function."""
    return {t["function"]["name"]: t["function"].get("parameters") for t in tools}


def named_tool(tool_choice: Any) -> str | None:
    """The function a `tool_choice` object names ({"type": "function", "function": {"name"}}); None for a string."""
    if isinstance(tool_choice, str):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\"}}")
    return name


def tool_call_spec(tools: dict[str, dict | None], only: str | None, parallel: bool) -> ConstraintSpec:
    """A tool-call section calling `only` once (named tool_choice) or one or more of `tools` (`parallel`: several
    calls, else one, whose index is 0). A ValueError starting with `NAME:` names the tool whose parameter schema does not compile."""
    names = [only] if only is not None else list(tools)
    m = {name: ConstraintSpec.marker(i) for i, name in enumerate(TOOL_MARKERS)}
    calls = []
    for name in names:
        params = tools[name]
        try:
            args = (ConstraintSpec.json_object() if params is None else ConstraintSpec.json_schema(params)).to_regex()
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        index = CALL_INDEX if parallel and only is None else "0"  # one call: the first index
        calls.append(f"functions\\.{_escape(name)}:{index}{m[ARGUMENT_BEGIN]}(?:{args})")
    call = f"{m[CALL_BEGIN]}(?:{'|'.join(calls)}){m[CALL_END]}"
    repeat = "+" if parallel and only is None else ""
    return ConstraintSpec.regex(f"{m[SECTION_BEGIN]}(?:{call}){repeat}{m[SECTION_END]}", TOOL_MARKERS)


def after_reasoning(spec: ConstraintSpec, special_tokens: dict[str, int]) -> ConstraintSpec:
    """`spec` behind `</think>`, for a prompt that leaves the output inside reasoning: the reasoning closes at once
    and the constrained text is content (a tool-call section ends reasoning by itself)."""
    if spec.markers == TOOL_MARKERS:
        return spec
    markers = spec.markers
    if THINK_END in special_tokens:
        markers = (*markers, THINK_END)
        close = ConstraintSpec.marker(len(markers) - 1)
    else:
        close = _escape(THINK_END)
    return ConstraintSpec.regex(f"{close}(?:{spec.to_regex()})", markers)


def _escape(text: str) -> str:
    """`text` as a literal of outlines-core's regex syntax."""
    return ConstraintSpec.choice([text]).to_regex()
