"""The OpenAI request bodies the server accepts (pydantic, strict types) and OpenAI's error shape.

Types are strict, as OpenAI's own API is: "max_tokens": "16" or "temperature": true is a 400, not a silent
conversion. Fields this server does not know are ignored, as vLLM ignores them (clients send vendor extras); known
OpenAI fields it does not implement (best_of, penalties, ...) are accepted only at their "off" value, so a
request is never answered as if they had been applied (README.md, "Request fields", lists every field). Tools, tool
choice, response formats and vLLM's `structured_outputs` are checked in depth by the app (`server/constraints.py`),
which names the field at fault.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16  # stop strings per request; each one is searched for in every new piece of text
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat defaults to the rest of the context
MAX_N = 16  # choices per prompt (`n`)


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def param_path(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ('body', 'messages', 0, 'role') -> messages[0].role."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Refusing(_Strict):
    """A request whose UNSUPPORTED fields (name -> the values that mean "off") are a 400 at any other value."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @field_validator("*")
    @classmethod
    def _off_unless_supported(cls, v, info):
        off = cls.UNSUPPORTED.get(info.field_name)
        if off is not None and not any(_same(v, o) for o in off):
            raise ValueError(f"not supported by this server (only {off[-1]!r})")
        return v


class _SamplingRequest(_Refusing):
    """The fields completions and chat completions share."""

    # field -> the values that mean "off"; anything else is refused as not supported
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
        "logit_bias": (None, {}),
    }

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # vLLM's convention: 0 or -1 = off
    seed: int | None = None
    stop: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = None  # vLLM extra: more token ids that end the request
    ignore_eos: bool = False  # vLLM extra: do not stop at the model's own stop tokens
    return_token_ids: bool = False  # vLLM extra: the prompt's and the completion's token ids in the choice
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)  # choices per prompt, each its own request
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None  # vLLM extra
    logit_bias: Any = None
    response_format: Any = None  # OpenAI: {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: Any = None  # vLLM: {"json" | "regex" | "choice" | "json_object": ...}

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, v):
        if isinstance(v, str):
            return [v]
        if v is not None and not isinstance(v, list):
            raise ValueError("must be a string or a list of strings")
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v):
        if v is not None and any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v


    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def token_limit(self) -> tuple[int | None, str]:
        """(max tokens asked for, the field that asked)."""
        return self.max_tokens, "max_tokens"


def _same(value, off) -> bool:
    """`value` is the off value `off` (True is not 1, False is not 0)."""
    return value is off or (value == off and isinstance(value, bool) == isinstance(off, bool))


class CompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.UNSUPPORTED, "best_of": (None, 1), "suffix": (None, ""),
    }

    prompt: Any = None  # text or token ids, or a list of either; read by `prompt_list`
    max_tokens: int | None = Field(None, ge=0)  # 0: no completion (with echo: the prompt's log-probabilities alone)
    best_of: Any = None
    echo: bool | None = None  # the prompt's text (with logprobs, its tokens' log-probabilities) before the completion
    logprobs: int | None = Field(None, ge=0)  # each token's log-probability and this many alternatives
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, v):
        return prompt_list(v)


def prompt_list(v) -> list[str | list[int]]:
    """OpenAI's prompt forms -> the prompts: a string or token ids (one prompt), or a non-empty list of strings or
    of token-id lists (a prompt each). None (no prompt) is one empty string, as OpenAI reads it."""
    if v is None:
        return [""]
    if isinstance(v, str) or (isinstance(v, list) and v and all(_token_id(t) for t in v)):
        return [v]
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return v
    if isinstance(v, list) and v and all(isinstance(p, list) and all(_token_id(t) for t in p) for p in v):
        return v
    raise ValueError("must be a string, a list of integer token ids, or a non-empty list of either")


def _token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = Field(None, validate_default=True)  # None: only an assistant turn (tool calls)
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (OpenAI's shape; the template checks them)
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, where the template keeps it

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, v, info):
        if v is None:
            if info.data.get("role") != "assistant":
                raise ValueError("Field required (only an assistant message may leave it out)")
            return v
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of text parts")  # noqa: TRY004 (pydantic wants ValueError)
        return v

    def as_template_message(self) -> dict:
        """The message as the chat template reads it (a developer turn is a system turn)."""
        msg = {"role": "system" if self.role == "developer" else self.role,
               "content": "".join(p.text for p in self.content or ())}
        for field in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, field) is not None:
                msg[field] = getattr(self, field)
        return msg


class ChatCompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.UNSUPPORTED,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each output token's log-probability
    top_logprobs: int | None = Field(None, ge=0)  # with logprobs: this many alternatives per token
    tools: list[Any] | None = None  # [{type: "function", function: {name, description?, parameters?}}]
    tool_choice: Any = None  # "none" | "auto" | "required" | {type: "function", function: {name}}; default auto
    parallel_tool_calls: bool = True  # a forced tool choice may make several calls
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: more template variables (e.g. thinking)

    @property
    def token_limit(self) -> tuple[int | None, str]:
        """(max tokens asked for, the field that asked)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class ResponsesRequest(_Refusing):
    """POST /v1/responses: OpenAI's Responses API over the chat path (serving_responses.py reads `input`, `tools`,
    `tool_choice` and `text` into a chat request and names the field at fault)."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "previous_response_id": (None,), "conversation": (None,), "background": (None, False), "prompt": (None,),
        "reasoning": (None,), "include": (None, []), "top_logprobs": (None, 0), "max_tool_calls": (None,),
        "truncation": (None, "disabled"), "stream_options": (None,),
    }

    model: str | None = None
    input: Any = None  # a string, or a list of messages and items (message, function_call, function_call_output)
    instructions: str | None = None  # a system message before the input
    tools: list[Any] | None = None  # function tools, flattened: {type: "function", name, description?, parameters?}
    tool_choice: Any = None  # "none" | "auto" | "required" | {type: "function", name}
    parallel_tool_calls: bool = True
    text: Any = None  # {format: {type: "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored (previous_response_id is refused)
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None
    stream_options: Any = None

