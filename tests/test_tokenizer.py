"""Kimi tokenizer: file format, pre-tokenizer, test vectors, specials, streaming decode, chat template, errors;
plus the corpus builder and the BPE -> tiktoken conversion used to make checkpoints/kdtree-mini/tokenizer."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sysconfig

import pytest
import regex
from script_loader import load_script

from kdtree_jax.checkpoint import tokenizer as tk
from kdtree_jax.checkpoint.tokenizer import KIMI_PAT_STR, KIMI_SPECIAL_OFFSETS, KimiTokenizer, TokenizerFileError

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOY_DIR = os.path.join(REPO, "tests", "data", "kimi_toy")
MINI_DIR = os.path.join(REPO, "checkpoints", "kdtree-mini", "tokenizer")
KIMI_BASE = 163584
MINI_BASE = 3840


def _load_script(name: str):
    return load_script(f"scripts/{name}.py", f"_script_{name}")


@pytest.fixture(scope="module")
def toy() -> KimiTokenizer:
    return KimiTokenizer.from_dir(TOY_DIR)


@pytest.fixture(scope="module")
def mini() -> KimiTokenizer:
    return KimiTokenizer.from_dir(MINI_DIR)


@pytest.fixture(params=["toy", "mini"])
def any_tok(request, toy, mini) -> KimiTokenizer:
    return {"toy": toy, "mini": mini}[request.param]


def _random_text(rng, n: int) -> str:
    """Mixed-script text: ASCII code, Latin-1, Greek, Han, kana, emoji (4-byte UTF-8), whitespace runs."""
    ranges = [(0x20, 0x7E), (0xC0, 0xFF), (0x391, 0x3C9), (0x4E00, 0x4FFF), (0x3041, 0x3096), (0x1F600, 0x1F64F)]
    out = []
    for _ in range(n):
        kind = rng.integers(0, len(ranges) + 1)
        if kind == len(ranges):
            out.append(rng.choice([" ", "\n", "\t", "    ", "\r\n"]))
        else:
            lo, hi = ranges[kind]
            out.append(chr(int(rng.integers(lo, hi + 1))))
    return "".join(out)


# ---- Kimi's format and test vectors ----

def test_kimi_test_vectors_from_kimi_format_vocab(toy):
    assert toy.encode("Hello world") == [19180, 2695]
    assert toy.encode("你好世界") == [33845, 2243]
    assert toy.decode([19180, 2695]) == "Hello world"
    assert toy.decode([33845, 2243]) == "你好世界"
    assert toy.vocab_size == 163840 and toy.special_base == KIMI_BASE


def test_special_ids_match_kimi_layout(toy, mini):
    for tok, base in ((toy, KIMI_BASE), (mini, MINI_BASE)):
        for name, off in KIMI_SPECIAL_OFFSETS.items():
            assert tok.special_tokens[name] == base + off
        assert tok.special_tokens[f"<|reserved_token_{base + 5}|>"] == base + 5
        assert len(tok.special_tokens) == tk.NUM_SPECIAL_SLOTS
        assert tok.bos_id == base and tok.eos_id == base + 1
    # Ids the format doc marks as verified for real Kimi.
    for name, kimi_id in {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "[PAD]": 163839,
                          "<|media_begin|>": 163602, "<|media_end|>": 163604, "<|media_pad|>": 163605,
                          "[UNK]": 163838, "<|im_middle|>": 163601, "<|im_system|>": 163594}.items():
        assert toy.special_tokens[name] == kimi_id


def test_stop_ids_include_im_end(toy, mini):
    assert toy.stop_token_ids == (163585, 163586)
    assert mini.stop_token_ids == (MINI_BASE + 1, MINI_BASE + 2)
    assert mini.special_id("<|im_end|>") in mini.stop_token_ids


def test_pattern_is_the_docs_eight_alternatives():
    """The Kimi K2 chat template as moonshotai/Kimi-K2.6 publishes it (tokenizer_config.json), independently of the module's spelling."""
    doc = [
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
    ]
    assert KIMI_PAT_STR == "|".join(doc)


@pytest.mark.parametrize("text, pieces", [
    ("Hello world你好世界abc", ["Hello", " world", "你好世界", "abc"]),
    ("x=1234567 and 89", ["x", "=", "123", "456", "7", " and", " ", "89"]),
    ("I'm sure they'll say DON'T", ["I'm", " sure", " they'll", " say", " DON'T"]),
    ("def f():\n    return 1\n\n", ["def", " f", "():\n", "   ", " return", " ", "1", "\n\n"]),
    ("日本語のテキスト HTTPServer", ["日本語", "のテキスト", " HTTPServer"]),
    ("中文English混合", ["中文", "English", "混合"]),
])
def test_pretokenizer_splits_like_kimi(text, pieces):
    """A vocab holding each expected piece as one token encodes to exactly those tokens only if tiktoken cut
    the text at the same places; `regex` (tiktoken's own dependency) cross-checks the expectation."""
    assert regex.findall(KIMI_PAT_STR, text, flags=regex.V1) == pieces
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces:
        ranks.setdefault(p.encode(), len(ranks) + 1000)
    tok = KimiTokenizer(ranks, {5000: "[BOS]"})
    assert tok.encode(text) == [ranks[p.encode()] for p in pieces]


# ---- round trips ----

ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "emoji 😀👩‍💻🇯🇵 mixed ✨",
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\r\n",
    "<|im_user|>user<|im_middle|>hi<|im_end|>[EOS]",
    "   leading and trailing spaces   \n\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_fixed_texts(any_tok, text):
    ids = any_tok.encode(text)
    assert any_tok.decode(ids) == text
    assert all(0 <= i < any_tok.vocab_size for i in ids)


def test_round_trip_random_text(any_tok, rng):
    for _ in range(20):
        text = _random_text(rng, int(rng.integers(1, 200)))
        assert any_tok.decode(any_tok.encode(text)) == text


def test_special_tokens_only_when_allowed(any_tok):
    base = any_tok.special_base
    text = "a<|im_end|>b"
    with_special = any_tok.encode(text, allow_special=True)
    assert base + 2 in with_special
    as_text = any_tok.encode(text, allow_special=False)
    assert all(i < base for i in as_text)
    assert any_tok.decode(as_text) == text == any_tok.decode(with_special)


def test_long_runs_are_chunked_like_kimi():
    """A run over 25k non-whitespace chars is cut after 25k chars before BPE. With "ab" ranked before "aa",
    the uncut run would merge its last "a" with "b"; cut, the "b" stands alone."""
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b"aa": 257}
    tok = KimiTokenizer(ranks, {300: "[BOS]"})
    n = tk.MAX_NO_WHITESPACES_CHARS
    assert tok.encode("a" * n + "b") == [257] * (n // 2) + [ord("b")]
    assert tok.encoding.encode("a" * n + "b") == [257] * (n // 2 - 1) + [ord("a"), 256]
    assert tok.encode("a" * 4 + " ab") == [257, 257, ord(" "), 256]


def test_max_encode_chars_chunking(monkeypatch):
    """Input is cut every TIKTOKEN_MAX_ENCODE_CHARS chars first (shrunk here to 3): "cd" straddles the cut."""
    ranks = {bytes([b]): b for b in range(256)} | {b"cd": 256}
    tok = KimiTokenizer(ranks, {300: "[BOS]"})
    assert tok.encode("abcdef") == [97, 98, 256, 101, 102]
    monkeypatch.setattr(tk, "TIKTOKEN_MAX_ENCODE_CHARS", 3)
    assert tok.encode("abcdef") == [97, 98, 99, 100, 101, 102]


def test_split_whitespace_runs(rng):
    for _ in range(50):
        s = "".join(rng.choice(["a", "b", " ", "\n", "汉"], size=int(rng.integers(0, 60))))
        max_len = int(rng.integers(1, 6))
        pieces = list(tk.split_whitespaces_or_nonwhitespaces(s, max_len))
        assert "".join(pieces) == s
        for p in pieces:
            runs = regex.findall(r"\s+|\S+", p)
            assert all(len(r) <= max_len for r in runs), (s, max_len, pieces)


# ---- streaming decode ----

def test_stream_decoder_emoji_split_over_tokens(toy):
    ids = toy.encode("ok😀")
    assert len(ids) == 6  # "o", "k" + four single-byte tokens of U+1F600 (toy vocab has no emoji merges)
    dec = toy.stream_decoder()
    outputs = [dec.push(i) for i in ids]
    assert outputs == ["o", "k", "", "", "", "😀"]
    assert dec.flush() == ""


def test_stream_decoder_random_text(any_tok, rng):
    for _ in range(10):
        text = _random_text(rng, 80)
        dec = any_tok.stream_decoder()
        ids = any_tok.encode(text)
        cut = int(rng.integers(0, len(ids) + 1))
        pieces = [dec.push(i) for i in ids[:cut]] + [dec.feed(ids[cut:])]
        assert "".join(pieces) + dec.flush() == text
        assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_flushes_incomplete_bytes(toy):
    dec = toy.stream_decoder()
    assert dec.feed(toy.encode("😀")[:2]) == ""
    assert dec.flush() == "\ufffd"


# ---- chat template ----

def test_default_chat_template_exact(mini):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "你好"}]
    expected = ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>2+2?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>4<|im_end|><|im_user|>user<|im_middle|>你好<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>")
    assert mini.apply_chat_template(msgs) == expected
    assert mini.apply_chat_template(msgs, add_generation_prompt=False) == expected.removesuffix(
        "<|im_assistant|>assistant<|im_middle|>")
    s = mini.special_tokens
    ids = mini.encode_chat(msgs[1:2])
    assert ids == ([s["<|im_user|>"]] + mini.encode("user", False) + [s["<|im_middle|>"]] + mini.encode("2+2?", False)
                   + [s["<|im_end|>"], s["<|im_assistant|>"]] + mini.encode("assistant", False) + [s["<|im_middle|>"]])


def test_builtin_template_when_checkpoint_has_none(tmp_path, toy):
    shutil.copy(os.path.join(TOY_DIR, "tiktoken.model"), tmp_path)
    shutil.copy(os.path.join(TOY_DIR, "tokenizer_config.json"), tmp_path)
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.chat_template == tk.DEFAULT_CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "Hello world"}]
    assert tok.apply_chat_template(msgs) == "<|im_user|>user<|im_middle|>Hello world<|im_end|>" \
                                            "<|im_assistant|>assistant<|im_middle|>"
    ids = tok.encode_chat(msgs)
    assert ids == [163587, *b"user", 163601, 19180, 2695, 163586, 163588, *b"assistant", 163601]
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_checkpoint_jinja_template_wins(toy):
    """tests/data/kimi_toy ships chat_template.jinja (K2-Instruct style: default system prompt injected)."""
    out = toy.apply_chat_template([{"role": "user", "content": "你好世界"}])
    assert out == ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
                   "<|im_user|>user<|im_middle|>你好世界<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = toy.encode_chat([{"role": "user", "content": "你好世界"}])
    assert ids[0] == 163594
    tail = [163587, *b"user", 163601, 33845, 2243, 163586, 163588, *b"assistant", 163601]
    assert ids[-len(tail):] == tail and 163586 in ids[:-len(tail)]


# ---- loading and errors ----

def test_bos_eos_fall_back_to_config_json(tmp_path):
    shutil.copy(os.path.join(TOY_DIR, "tiktoken.model"), tmp_path)
    with open(os.path.join(TOY_DIR, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    del cfg["bos_token"], cfg["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 163584,
                                                      "text_config": {"eos_token_id": 163586}}))
    tok = KimiTokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.stop_token_ids) == (163584, 163586, (163586,))


def test_from_checkpoint_dir_finds_tokenizer_subdir(mini):
    tok = KimiTokenizer.from_dir(os.path.dirname(MINI_DIR))
    assert tok.encode("import os\n") == mini.encode("import os\n")


def _toy_copy(tmp_path):
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOY_DIR, name), tmp_path)
    return tmp_path


@pytest.mark.parametrize("content, match", [
    ("SGVsbG8= 19180\nnot-base64!! 5\n", r"tiktoken\.model:2"),
    ("SGVsbG8=\n", r"tiktoken\.model:1"),
    ("SGVsbG8= abc\n", r"tiktoken\.model:1"),
    ("SGVsbG8= 1\nd29ybGQ= 1\n", r"tiktoken\.model:2.*duplicate"),
    ("SGVsbG8= 19180\n", r"tiktoken\.model: single-byte tokens missing"),
])
def test_malformed_tiktoken_model_names_file(tmp_path, content, match):
    _toy_copy(tmp_path)
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(TokenizerFileError, match=match):
        KimiTokenizer.from_dir(tmp_path)


def test_missing_files_name_the_file(tmp_path):
    _toy_copy(tmp_path)
    os.remove(tmp_path / "tokenizer_config.json")
    with pytest.raises(TokenizerFileError, match=r"tokenizer_config\.json: file not found"):
        KimiTokenizer.from_dir(tmp_path)
    os.remove(tmp_path / "tiktoken.model")
    with pytest.raises(TokenizerFileError, match=r"tiktoken\.model: tiktoken BPE file not found"):
        KimiTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("config_text, match", [
    ("{not json", "malformed JSON"),
    ('{"added_tokens_decoder": {"x": {"content": "[BOS]"}}}', "not an integer id"),
    ('{"added_tokens_decoder": {"163584": {"special": true}}}', "needs a string 'content'"),
    ('{"added_tokens_decoder": {"200": {"content": "[BOS]"}}}', "collides with BPE rank"),
    ('{"added_tokens_decoder": {"163584": {"content": "[BOS]"}}, "eos_token": "[NOPE]"}', "eos_token"),
])
def test_malformed_tokenizer_config_names_file(tmp_path, config_text, match):
    _toy_copy(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(config_text)
    with pytest.raises(TokenizerFileError, match=rf"tokenizer_config\.json.*{match}"):
        KimiTokenizer.from_dir(tmp_path)


def test_unknown_id_decode_error(toy):
    with pytest.raises(ValueError, match="not in the vocabulary"):
        toy.decode([5000])


def test_toy_files_match_generator(tmp_path):
    """tests/data/kimi_toy is exactly what tests/data/make_kimi_toy.py writes."""
    path = os.path.join(REPO, "tests", "data", "make_kimi_toy.py")
    spec = importlib.util.spec_from_file_location("_make_kimi_toy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.OUT = str(tmp_path)
    module.main()
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(TOY_DIR, name), "rb").read(), name


# ---- the shipped kdtree-mini vocabulary ----

def test_mini_vocab_layout():
    ranks = tk.read_tiktoken_ranks(os.path.join(MINI_DIR, "tiktoken.model"))
    assert sorted(ranks.values()) == list(range(MINI_BASE))
    assert all(ranks[bytes([b])] == b for b in range(256))
    by_rank = sorted(ranks, key=ranks.get)
    # Every merged token splits into two lower-ranked tokens (a valid BPE merge order).
    for rank in range(256, MINI_BASE):
        t = by_rank[rank]
        assert any(t[:k] in ranks and t[k:] in ranks and max(ranks[t[:k]], ranks[t[k:]]) < rank
                   for k in range(1, len(t))), t
    assert os.path.getsize(os.path.join(MINI_DIR, "tiktoken.model")) < 64 * 1024
    with open(os.path.join(MINI_DIR, "training_report.json")) as f:
        report = json.load(f)
    assert report["tiktoken_vs_hf"]["file_agreement"] == 1.0
    assert report["tiktoken_model_sha256"] == hashlib.sha256(
        open(os.path.join(MINI_DIR, "tiktoken.model"), "rb").read()).hexdigest()


def test_mini_compresses_stdlib_code(mini):
    """The vocab is trained on stdlib code: held-out module json/decoder.py compresses to > 3 chars/token,
    several times what single bytes give."""
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py"), encoding="utf-8") as f:
        text = f.read()
    ids = mini.encode(text)
    assert len(text) / len(ids) > 3.0
    assert mini.decode(ids) == text


# ---- corpus builder and BPE conversion ----

def _fake_stdlib(root) -> None:
    files = {
        "os.py": "import sys\n", "json/__init__.py": '"""JSON."""\n', "json/decoder.py": "x = 1\r\ny = 2\n",
        "csv.py": "import re\n", "test/test_os.py": "BAD\n", "idlelib/idle_test/t.py": "BAD\n",
        "lib2to3/tests/t.py": "BAD\n", "site-packages/pkg/m.py": "BAD\n", "email/__pycache__/x.py": "BAD\n",
        "email/parser.py": "# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n", "notes.txt": "BAD\n",
    }
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        encoding = "latin-1" if "latin-1" in text else "utf-8"
        with open(path, "w", encoding=encoding, newline="") as f:
            f.write(text)


def test_build_corpus_rules_and_determinism(tmp_path):
    bc = _load_script("build_corpus")
    _fake_stdlib(tmp_path / "lib")
    m1 = bc.build(str(tmp_path / "out1"), str(tmp_path / "lib"))
    m2 = bc.build(str(tmp_path / "out2"), str(tmp_path / "lib"))
    paths = [e["path"] for e in m1["files"]]
    assert paths == ["csv.py", "email/parser.py", "json/__init__.py", "json/decoder.py", "os.py"]
    assert {"csv.py", "json/__init__.py", "json/decoder.py"} <= set(m1["heldout_files"])
    for split in ("train", "heldout"):
        a = (tmp_path / "out1" / f"{split}.txt").read_bytes()
        assert a == (tmp_path / "out2" / f"{split}.txt").read_bytes()
        assert m1["outputs"][split]["sha256"] == hashlib.sha256(a).hexdigest()
    heldout = (tmp_path / "out1" / "heldout.txt").read_text(encoding="utf-8")
    assert "\n\n# ==== file: json/decoder.py ====\nx = 1\ny = 2\n" in heldout and "BAD" not in heldout
    train = (tmp_path / "out1" / "train.txt").read_text(encoding="utf-8")
    assert "s = 'café'" in train and "BAD" not in train
    assert m1["python_version"] == m2["python_version"] and m1["python_version"].count(".") == 2


def test_hf_bpe_converts_to_identical_tiktoken(rng):
    """Train a small HF byte-level BPE, convert it to tiktoken ranks and check both tokenize unseen text alike."""
    pytest.importorskip("tokenizers")
    tt = _load_script("train_tokenizer")
    words = ["return", "self", "import", "def", "class", "value", "数据", "处理", "naïve", "x", "42", "\n    "]
    texts = [" ".join(rng.choice(words, size=60)) for _ in range(40)]
    hf = tt.train_hf(texts, 300)
    ranks, hf_to_rank, duplicates = tt.hf_to_tiktoken_ranks(hf)
    assert len(ranks) == 300 and duplicates == 0
    kimi = KimiTokenizer(ranks, {300: "[BOS]", 301: "[EOS]"})
    unseen = [" ".join(rng.choice(words, size=30)) + " selfish returns 数据库" for _ in range(10)]
    report = tt.compare(hf, hf_to_rank, kimi, unseen)
    assert report["files_identical"] == len(unseen), report["examples"]
