"""Regenerate tests/data/kimi_toy: a tiny vocabulary in Kimi's exact file format and id layout.

    python tests/data/make_kimi_toy.py

tiktoken.model holds the 256 single bytes at ranks 0..255 (byte order) plus only the merges needed to build
Kimi's documented test vectors at their real ids: "Hello" 19180, " world" 2695, "你好" 33845, "世界" 2243
(every intermediate token at a lower rank, so BPE reaches them in the right order). Ranks are therefore sparse;
tiktoken only needs unique ranks, and sparse ranks let the specials sit at Kimi's real ids 163584..163839.
chat_template.jinja is a K2-Instruct-style template that injects a default system prompt, to test that a
checkpoint's own template wins over the built-in one.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kdtree_jax.checkpoint.tokenizer import KIMI_SPECIAL_OFFSETS, write_tiktoken_ranks  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kimi_toy")
KIMI_SPECIAL_BASE = 163584

# (token text or bytes, rank); each token is a concatenation of two tokens listed before it.
MERGES: list[tuple[str | bytes, int]] = [
    ("ll", 1000), ("He", 1001), ("llo", 1002), ("Hello", 19180),
    ("or", 1100), ("ld", 1101), (" w", 1102), ("orld", 1103), (" world", 2695),
    (b"\xe4\xbd", 1200), ("你", 1201), (b"\xe5\xa5", 1202), ("好", 1203),
    (b"\xe4\xb8", 1204), ("世", 1205), (b"\xe7\x95", 1206), ("界", 1207),
    ("世界", 2243), ("你好", 33845),
]

CHAT_TEMPLATE = """{%- if messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}<|im_system|>
{%- elif message['role'] == 'user' -%}<|im_user|>
{%- else -%}<|im_assistant|>
{%- endif -%}
{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    ranks = {bytes([b]): b for b in range(256)}
    for token, rank in MERGES:
        ranks[token.encode("utf-8") if isinstance(token, str) else token] = rank
    write_tiktoken_ranks(os.path.join(OUT, "tiktoken.model"), ranks)
    added = {str(KIMI_SPECIAL_BASE + off): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                                            "single_word": False, "special": True}
             for tok, off in sorted(KIMI_SPECIAL_OFFSETS.items(), key=lambda kv: kv[1])}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    with open(os.path.join(OUT, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)


if __name__ == "__main__":
    main()
