"""Train kdtree-mini's byte-level BPE on the stdlib corpus and write it in Kimi's tokenizer format.

    python scripts/build_corpus.py && python scripts/train_tokenizer.py [--corpus data/corpus]

Vocabulary: 3840 BPE ranks (256 single bytes at ranks 0..255 in byte order, then one rank per merge in merge
order) + 256 special slots at 3840..4095 with Kimi's offsets (`[BOS]` +0, `[EOS]` +1, `<|im_end|>` +2, ...,
`[UNK]` +254, `[PAD]` +255). Training uses HF `tokenizers` (training-only dependency) with Kimi's pre-tokenizer
pattern; the merges are converted to tiktoken ranks and the script checks that tiktoken reproduces the HF
tokenization of held-out text. Writes tiktoken.model, tokenizer_config.json and training_report.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdtree_jax.checkpoint.tokenizer import (  # noqa: E402
    CONFIG_FILE,
    DEFAULT_CHAT_TEMPLATE,
    KIMI_PAT_STR,
    KIMI_SPECIAL_OFFSETS,
    NUM_SPECIAL_SLOTS,
    TIKTOKEN_FILE,
    KimiTokenizer,
    write_tiktoken_ranks,
)

NUM_BPE_RANKS = 3840  # total vocab 4096 = 3840 BPE ranks + 256 special slots
MIN_PAIR_FREQUENCY = 2
FILE_MARKER = "\n\n# ==== file: "  # build_corpus.FILE_SEPARATOR's fixed prefix


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map, which HF ByteLevel uses to store byte tokens as text."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def split_files(text: str) -> list[str]:
    """One training sequence per source file, so whitespace / newline pre-tokens see the real file layout
    (HF's file reader would cut the text at every line)."""
    return [FILE_MARKER + part if i else part for i, part in enumerate(text.split(FILE_MARKER)) if part]


def train_hf(train_texts: list[str], num_ranks: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, min_frequency=MIN_PAIR_FREQUENCY, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    return tok


def hf_to_tiktoken_ranks(hf_tok) -> tuple[dict[bytes, int], dict[int, int], int]:
    """Bytes 0..255 -> ranks 0..255, then merge i -> rank 256 + i (merge priority = rank order, as tiktoken
    needs). Returns (ranks, hf id -> rank, number of duplicate merges that tiktoken cannot represent)."""
    state = json.loads(hf_tok.model.__getstate__())
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def raw(s: str) -> bytes:
        return bytes(byte_of[c] for c in s)

    ranks = {bytes([b]): b for b in range(256)}
    duplicates = 0
    for a, b in merges:
        token = raw(a) + raw(b)
        if token in ranks:
            duplicates += 1
            continue
        ranks[token] = len(ranks)
    hf_to_rank = {i: ranks[raw(s)] for s, i in vocab.items()}
    if len(hf_to_rank) != len(vocab) or sorted(ranks.values()) != list(range(len(ranks))):
        raise RuntimeError("HF vocab and merges do not map one-to-one onto tiktoken ranks")
    return ranks, hf_to_rank, duplicates


def tokenizer_config(base: int) -> dict:
    """Named specials only: the loader names the other slots `<|reserved_token_{id}|>`, as Kimi's does."""
    named = sorted((base + off, tok) for tok, off in KIMI_SPECIAL_OFFSETS.items())
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, tok in named}
    return {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
            "unk_token": "[UNK]", "chat_template": DEFAULT_CHAT_TEMPLATE, "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False, "tokenizer_class": "TikTokenTokenizer"}


def dump_config(cfg: dict) -> str:
    """JSON with one added token per line: readable diffs, a third of the indented size."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in cfg.items()
             if k != "added_tokens_decoder"]
    tokens = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in cfg["added_tokens_decoder"].items())
    return "{\n" + ' "added_tokens_decoder": {\n' + tokens + "\n },\n" + ",\n".join(lines) + "\n}\n"


def _show(kimi: KimiTokenizer, ids: list[int]) -> list[str]:
    return [kimi.token_bytes(t).decode("utf-8", "replace") for t in ids]


def compare(hf_tok, hf_to_rank: dict[int, int], kimi: KimiTokenizer, texts: list[str]) -> dict:
    """Token-for-token agreement of tiktoken (our runtime) with the trained HF BPE, per file and per token."""
    same_files, tokens, mismatched_tokens, examples = 0, 0, 0, []
    for text in texts:
        ref = [hf_to_rank[i] for i in hf_tok.encode(text).ids]
        got = kimi.encode(text, allow_special=False)
        tokens += len(ref)
        if ref == got:
            same_files += 1
            continue
        first = next((k for k, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))
        mismatched_tokens += max(len(ref), len(got)) - first
        if len(examples) < 5:
            examples.append({"hf": _show(kimi, ref[first:first + 6]), "tiktoken": _show(kimi, got[first:first + 6])})
    return {"files": len(texts), "files_identical": same_files, "file_agreement": same_files / len(texts),
            "hf_tokens": tokens, "tokens_after_first_mismatch": mismatched_tokens, "examples": examples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="data/corpus", help="build_corpus.py output dir")
    parser.add_argument("--out", default="checkpoints/kdtree-mini/tokenizer")
    args = parser.parse_args(argv)

    with open(os.path.join(args.corpus, "train.txt"), encoding="utf-8") as f:
        train_text = f.read()
    with open(os.path.join(args.corpus, "heldout.txt"), encoding="utf-8") as f:
        heldout_text = f.read()
    with open(os.path.join(args.corpus, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)

    t0 = time.time()
    hf_tok = train_hf(split_files(train_text), NUM_BPE_RANKS)
    ranks, hf_to_rank, duplicates = hf_to_tiktoken_ranks(hf_tok)
    print(f"trained {len(ranks)} BPE ranks in {time.time() - t0:.1f}s ({duplicates} duplicate merges skipped)")
    if len(ranks) != NUM_BPE_RANKS:
        raise SystemExit(f"expected {NUM_BPE_RANKS} BPE ranks, got {len(ranks)} (corpus too small?)")

    os.makedirs(args.out, exist_ok=True)
    write_tiktoken_ranks(os.path.join(args.out, TIKTOKEN_FILE), ranks)
    with open(os.path.join(args.out, CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(dump_config(tokenizer_config(NUM_BPE_RANKS)))

    kimi = KimiTokenizer.from_dir(args.out)
    heldout_files = split_files(heldout_text)
    agreement = compare(hf_tok, hf_to_rank, kimi, heldout_files)
    n_tokens = len(kimi.encode(heldout_text))
    compression = len(heldout_text) / n_tokens
    print(f"tiktoken vs HF on {agreement['files']} held-out files: {agreement['files_identical']} identical "
          f"({100 * agreement['file_agreement']:.1f}%), {agreement['tokens_after_first_mismatch']} of "
          f"{agreement['hf_tokens']} tokens after a first mismatch")
    for ex in agreement["examples"]:
        print(f"  mismatch: hf {ex['hf']} vs tiktoken {ex['tiktoken']}")
    print(f"held-out compression: {len(heldout_text):,d} chars / {n_tokens:,d} tokens = {compression:.3f} chars/token")

    with open(os.path.join(args.out, TIKTOKEN_FILE), "rb") as f:
        model_sha = hashlib.sha256(f.read()).hexdigest()
    report = {
        "corpus": {"python_version": manifest["python_version"],
                   "train_sha256": manifest["outputs"]["train"]["sha256"],
                   "heldout_sha256": manifest["outputs"]["heldout"]["sha256"]},
        "num_bpe_ranks": len(ranks), "num_special_slots": NUM_SPECIAL_SLOTS, "vocab_size": kimi.vocab_size,
        "min_pair_frequency": MIN_PAIR_FREQUENCY, "duplicate_merges_skipped": duplicates,
        "tiktoken_model_sha256": model_sha, "heldout_chars_per_token": round(compression, 4),
        "tiktoken_vs_hf": {k: v for k, v in agreement.items() if k != "examples"},
    }
    with open(os.path.join(args.out, "training_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}/{{{TIKTOKEN_FILE},{CONFIG_FILE},training_report.json}}")


if __name__ == "__main__":
    main()
