"""Kimi K2-family tokenizer: tiktoken BPE ranks + Kimi's pre-tokenizer pattern + 256 special slots + chat template.

Reads a checkpoint's `tiktoken.model` ("<base64 token> <rank>" per line) and `tokenizer_config.json`
(`added_tokens_decoder`, `bos_token` / `eos_token`, `chat_template`) exactly as Moonshot's `tokenization_kimi.py`
does, so real Kimi checkpoints and our own small vocabularies (`checkpoints/kdtree-mini/tokenizer`) load the same way.
Every missing or malformed input is a `TokenizerFileError` that names the file.
"""
from __future__ import annotations

import base64
import binascii
import codecs
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import tiktoken
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Kimi's pre-tokenizer (o200k-like, Han runs split out first). `&&` is set intersection in tiktoken's regex engine.
KIMI_PAT_PARTS: tuple[str, ...] = (
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
KIMI_PAT_STR = "|".join(KIMI_PAT_PARTS)

NUM_SPECIAL_SLOTS = 256  # special ids occupy [special_base, special_base + 256); Kimi: 163584..163839
TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # tiktoken panics on longer inputs
MAX_NO_WHITESPACES_CHARS = 25_000  # tiktoken is quadratic on long runs of (non-)whitespace (github.com/openai/tiktoken/issues/195)

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIG_FILE = "config.json"
IM_END = "<|im_end|>"

# Kimi's special-slot layout, as offsets from the special base (163584 in Kimi K2). Tokens not listed here are
# `<|reserved_token_{id}|>`. `[UNK]` doubles as the DFlash drafter's mask token.
KIMI_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": 254,
    "[PAD]": 255,
}

# Kimi's turn format (K2): `<|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>`. Used when a checkpoint ships
# no template, and written into our own tokenizer_config.json. Tools follow Kimi K2.6's template: declared first as a
# `tool_declare` system turn (compact JSON, or the caller's `tools_ts_str`); an assistant turn's calls follow its
# content as `<|tool_calls_section_begin|>` + `<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}
# <|tool_call_end|>` per call + `<|tool_calls_section_end|>`; a tool result is a system-channel turn named after the
# function (or "tool") whose content opens with `## Return of {tool_call_id}`. Thinking marks appear only when the
# caller passes `thinking`: the generation prompt then ends with `<think>` (True) or `<think></think>` (False), and
# assistant turns carry `<think>{reasoning_content}</think>`, the reasoning kept only after the last answer that
# called no tool, as K2.6 does. Without tools, tool turns or `thinking`, the output is the plain turn format.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{%- if tools_ts_str is defined and tools_ts_str -%}{{ tools_ts_str }}"
    "{%- else -%}{{ tools | tojson(separators=(',', ':')) }}{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_answer=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}"
    "{%- set ns.last_answer = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' or message['role'] == 'tool' -%}<|im_system|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}{{ raise_exception('unknown chat role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ message.get('name') or message['role'] }}<|im_middle|>"
    "{%- if message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}\n{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' and (thinking is defined or message.get('tool_calls')) -%}"
    "{%- if thinking is defined -%}<think>"
    "{%- if thinking and loop.index0 > ns.last_answer -%}{{ message.get('reasoning_content') or '' }}{%- endif -%}"
    "</think>{%- endif -%}"
    "{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "{%- else -%}{{ message['content'] }}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined -%}{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}{%- endif -%}"
    "{%- endif -%}"
)


class TokenizerFileError(ValueError):
    """A tokenizer file that is missing or malformed; the message names the file (and line / field)."""


class ChatInputError(ValueError, TemplateError):
    """Chat messages or tools the template cannot render; the message names the field. A TemplateError too, so a
    caller that reports template refusals (the server's 400) reports these the same way."""


def reserved_token_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken.model file into {token bytes: rank}; ranks and tokens must each be unique."""
    if not os.path.isfile(path):
        raise TokenizerFileError(f"{path}: tiktoken BPE file not found")
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            fields = line.split()
            if len(fields) != 2:
                raise TokenizerFileError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}")
            try:
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
            except (binascii.Error, ValueError) as e:
                raise TokenizerFileError(f"{path}:{lineno}: malformed entry {line[:80]!r} ({e})") from e
            if rank < 0 or rank in seen_ranks or token in ranks or not token:
                raise TokenizerFileError(f"{path}:{lineno}: empty/duplicate token or negative/duplicate rank {rank}")
            ranks[token] = rank
            seen_ranks.add(rank)
    if not ranks:
        raise TokenizerFileError(f"{path}: no BPE ranks")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken falls back to single bytes, so every byte needs a rank
        raise TokenizerFileError(f"{path}: single-byte tokens missing for bytes {missing[:8]}...")
    return ranks


def write_tiktoken_ranks(path: str, ranks: dict[bytes, int]) -> None:
    """Write {token bytes: rank} in Kimi's format, sorted by rank."""
    with open(path, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def split_whitespaces_or_nonwhitespaces(s: str, max_len: int) -> Iterator[str]:
    """Cut `s` so no piece holds more than `max_len` consecutive whitespace or non-whitespace chars (Kimi's rule)."""
    run_len = 0
    run_is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_len, run_is_space = 1, is_space
        else:
            run_len += 1
            if run_len > max_len:
                yield s[start:i]
                start, run_len = i, 1
    yield s[start:]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise TokenizerFileError(f"{path}: file not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerFileError(f"{path}: malformed JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: str, field: str) -> str | None:
    """bos_token / eos_token come as a plain string or as an AddedToken dict {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerFileError(f"{path}: field {field!r} must be a string or {{'content': str}}, got {value!r}")


def _parse_added_tokens(cfg: dict[str, Any], path: str) -> dict[int, str]:
    decoder = cfg.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerFileError(f"{path}: 'added_tokens_decoder' must be an object id -> {{content, special}}")
    added: dict[int, str] = {}
    for key, entry in decoder.items():
        try:
            token_id = int(key)
        except ValueError as e:
            raise TokenizerFileError(f"{path}: added_tokens_decoder key {key!r} is not an integer id") from e
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerFileError(f"{path}: added_tokens_decoder[{key}] needs a string 'content'")
        added[token_id] = entry["content"]
    return added


class StreamDecoder:
    """Incremental detokenizer: emits text only once its bytes form complete UTF-8, so a multi-byte character
    split across tokens (emoji, CJK with a small vocab) prints whole instead of as replacement characters."""

    def __init__(self, tokenizer: KimiTokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one token id; returns the newly completed text (possibly "")."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def feed(self, token_ids: Iterable[int]) -> str:
        """Feed several token ids (e.g. one streamed chunk); returns the newly completed text."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: any dangling incomplete bytes become U+FFFD."""
        return self._utf8.decode(b"", final=True)


class KimiTokenizer:
    """tiktoken encoding with Kimi's pattern, special-token slots, stop ids and chat template."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        added_tokens: dict[int, str],
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        name: str = "kimi",
        source: str = "<memory>",
    ):
        max_rank = max(mergeable_ranks.values())
        # Kimi puts the 256 special slots right after the BPE ranks; with a contiguous vocab that is
        # len(ranks). A toy vocab with sparse ranks places them by its added_tokens_decoder ids instead.
        self.special_base = min(added_tokens) if added_tokens else max_rank + 1
        if self.special_base <= max_rank:
            raise TokenizerFileError(f"{source}: special token id {self.special_base} collides with BPE rank range "
                                     f"0..{max_rank}")
        end = self.special_base + NUM_SPECIAL_SLOTS
        outside = [i for i in added_tokens if i >= end]
        if outside:
            raise TokenizerFileError(f"{source}: added token ids {outside[:4]} lie outside the special slots "
                                     f"[{self.special_base}, {end})")
        names = {i: added_tokens.get(i, reserved_token_name(i)) for i in range(self.special_base, end)}
        self.special_tokens: dict[str, int] = {tok: i for i, tok in names.items()}
        if len(self.special_tokens) != NUM_SPECIAL_SLOTS:
            raise TokenizerFileError(f"{source}: duplicate special token contents in added_tokens_decoder")
        self._id_to_special = names
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=KIMI_PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens
        )
        self.num_base_tokens = len(mergeable_ranks)
        self.vocab_size = end
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        for field, tok in (("bos_token", bos_token), ("eos_token", eos_token)):
            if tok is not None and tok not in self.special_tokens:
                raise TokenizerFileError(f"{source}: {field} {tok!r} is not a special token")
        self.bos_id = self.special_tokens[bos_token] if bos_token else None
        self.eos_id = self.special_tokens[eos_token] if eos_token else None
        self._template = None  # compiled lazily: jinja2 is only needed for chat

    # ---- loading ----
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> KimiTokenizer:
        """Load from a dir holding tiktoken.model + tokenizer_config.json (or from a checkpoint dir whose
        `tokenizer/` subdir does). bos/eos fall back to config.json's bos_token_id / eos_token_id."""
        path = os.fspath(path)
        if not os.path.isfile(os.path.join(path, TIKTOKEN_FILE)) and os.path.isdir(os.path.join(path, "tokenizer")):
            path = os.path.join(path, "tokenizer")
        ranks = read_tiktoken_ranks(os.path.join(path, TIKTOKEN_FILE))
        cfg_path = os.path.join(path, CONFIG_FILE)
        cfg = _read_json(cfg_path)
        added = _parse_added_tokens(cfg, cfg_path)
        template = cfg.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerFileError(f"{cfg_path}: 'chat_template' must be a string")
        template_path = os.path.join(path, TEMPLATE_FILE)
        if template is None and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        bos = _token_content(cfg.get("bos_token"), cfg_path, "bos_token")
        eos = _token_content(cfg.get("eos_token"), cfg_path, "eos_token")
        tok = cls(ranks, added, bos_token=bos, eos_token=eos, chat_template=template,
                  name=os.path.basename(os.path.abspath(path)), source=cfg_path)
        tok._fill_ids_from_model_config(os.path.join(path, MODEL_CONFIG_FILE))
        return tok

    def _fill_ids_from_model_config(self, path: str) -> None:
        if (self.bos_id is not None and self.eos_id is not None) or not os.path.isfile(path):
            return
        cfg = _read_json(path)
        cfg = {**cfg, **cfg.get("text_config", {})} if isinstance(cfg.get("text_config"), dict) else cfg
        for attr, field in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id")):
            value = cfg.get(field)
            if getattr(self, attr) is None and value is not None:
                if not isinstance(value, int) or value not in self._id_to_special:
                    raise TokenizerFileError(f"{path}: {field}={value!r} is not a special token id")
                setattr(self, attr, value)

    # ---- encode / decode ----
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids. allow_special=True turns special-token text (e.g. "<|im_end|>") into its id, as Kimi's
        chat path does; False encodes it as ordinary text."""
        kwargs: dict[str, Any] = {"allowed_special": "all"} if allow_special else {"disallowed_special": ()}
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in split_whitespaces_or_nonwhitespaces(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS],
                                                              MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.encoding.encode(piece, **kwargs))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.token_bytes_many(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        if token_id in self._id_to_special:
            return self._id_to_special[token_id].encode("utf-8")
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except KeyError as e:
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {self.vocab_size})") from e

    def token_bytes_many(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(t) for t in ids)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Generation stops on eos and on `<|im_end|>` (end of a chat turn); sorted, unique."""
        ids = {self.special_tokens[IM_END]} if IM_END in self.special_tokens else set()
        if self.eos_id is not None:
            ids.add(self.eos_id)
        return tuple(sorted(ids))

    def special_id(self, token: str) -> int:
        if token not in self.special_tokens:
            raise KeyError(f"{token!r} is not a special token of this tokenizer")
        return self.special_tokens[token]

    # ---- chat ----
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages ([{role, content, name?, tool_calls?, tool_call_id?, reasoning_content?}]) with the
        checkpoint's Jinja template (HF conventions: sandboxed, trim_blocks / lstrip_blocks, `raise_exception`,
        `tojson`); extra kwargs (tools, thinking, ...) reach the template. Tool calls, tool results and tool
        declarations are checked first (OpenAI's shapes): a ValueError names the field that is wrong."""
        check_chat_tool_fields(messages, kwargs.get("tools"))
        if "thinking" in kwargs and not isinstance(kwargs["thinking"], bool):
            raise ChatInputError(f"thinking must be true or false, got {kwargs['thinking']!r}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), allow_special=True)


def _check_function_call(call: Any, where: str) -> None:
    if not isinstance(call, dict):
        raise ChatInputError(f"{where}: a tool call must be an object {{id, type, function: {{name, arguments}}}}")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ChatInputError(f"{where}.id: a tool call needs a non-empty string id")
    function = call.get("function")
    if not isinstance(function, dict):
        raise ChatInputError(f"{where}.function: must be an object {{name, arguments}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ChatInputError(f"{where}.function.name: a tool call needs the function's name")
    if not isinstance(function.get("arguments"), (str, dict)):
        raise ChatInputError(f"{where}.function.arguments: must be a JSON string or an object")


def check_chat_tool_fields(messages: Sequence[dict[str, Any]], tools: Any = None) -> None:
    """OpenAI's shapes for `tools`, an assistant turn's `tool_calls` and a tool turn's `tool_call_id`; a
    `ChatInputError` (a ValueError) names the first field that is missing or of the wrong type."""
    if tools is not None:
        if not isinstance(tools, (list, tuple)):
            raise ChatInputError("tools: must be a list of {type: 'function', function: {name, parameters?}}")
        for k, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise ChatInputError(f"tools[{k}].function.name: a tool needs a function with a name")
            if not isinstance(function.get("parameters", {}), dict):
                raise ChatInputError(f"tools[{k}].function.parameters: must be a JSON schema object")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatInputError(f"messages[{i}]: must be an object with a role")
        if message.get("role") == "tool" and (not isinstance(message.get("tool_call_id"), str)
                                              or not message["tool_call_id"]):
            raise ChatInputError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if message.get("role") != "assistant":
            raise ChatInputError(f"messages[{i}].tool_calls: only an assistant message makes tool calls")
        if not isinstance(calls, (list, tuple)):
            raise ChatInputError(f"messages[{i}].tool_calls: must be a list")
        for j, call in enumerate(calls):
            _check_function_call(call, f"messages[{i}].tool_calls[{j}]")


def _compile_template(source: str):
    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        """HF transformers' `tojson` (its signature and defaults): templates pass `separators=(',', ':')`."""
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
