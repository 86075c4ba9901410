"""Training data: the stdlib corpus tokenized once (cached next to the text, keyed by text and tokenizer), packed
into shuffled fixed-length windows; held-out windows and the unigram baseline."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from kdtree_jax.checkpoint.hf import TOKENIZER_FILES
from kdtree_jax.checkpoint.io import file_sha256

TOKEN_CACHE_SUFFIX = ".tokens.npy"
FINGERPRINT_CHARS = 16


def corpus_info(corpus_dir: str) -> dict[str, Any]:
    """Manifest hash + Python version of the corpus (the GPU host's stdlib may differ slightly)."""
    manifest = os.path.join(corpus_dir, "manifest.json")
    if not os.path.isfile(manifest):
        raise FileNotFoundError(f"{manifest}: corpus manifest missing; run `python scripts/build_corpus.py "
                                f"--out {corpus_dir}` first")
    with open(manifest) as f:
        m = json.load(f)
    return {"manifest_sha256": file_sha256(manifest), "python_version": m.get("python_version"),
            "outputs": m.get("outputs")}


def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = os.path.join(tokenizer_dir, name)
        if os.path.isfile(p):
            h.update(name.encode() + b"\0" + open(p, "rb").read())
    return h.hexdigest()


def load_tokens(text_path: str, tokenizer, tokenizer_dir: str, *, use_cache: bool = True) -> np.ndarray:
    """Token ids [N] int32 of a corpus text file; cached as <file>.<text+tokenizer hash>.tokens.npy."""
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"{text_path}: corpus text missing; run scripts/build_corpus.py")
    key = hashlib.sha256((file_sha256(text_path) + tokenizer_fingerprint(tokenizer_dir)).encode()).hexdigest()
    cache = f"{text_path}.{key[:FINGERPRINT_CHARS]}{TOKEN_CACHE_SUFFIX}"
    if use_cache and os.path.isfile(cache):
        return np.load(cache)
    with open(text_path, encoding="utf-8") as f:
        ids = np.asarray(tokenizer.encode(f.read(), allow_special=False), np.int32)
    if use_cache:
        tmp = f"{cache}.tmp{os.getpid()}.npy"
        np.save(tmp, ids)
        os.replace(tmp, cache)
    return ids


class PackedBatches:
    """Endless [B, T] windows of a token stream: each epoch cuts it at a random offset into non-overlapping
    windows and shuffles them (seeded numpy, so a run is reproducible)."""

    def __init__(self, tokens: np.ndarray, window: int, batch: int, seed: int):
        if len(tokens) < window * batch:
            raise ValueError(f"token stream of {len(tokens)} tokens is too short for batch {batch} x window {window}")
        self.tokens, self.window, self.batch = tokens, window, batch
        self.rng = np.random.default_rng(seed)
        self.epoch, self._order, self._pos, self._offset = -1, np.zeros(0, np.int64), 0, 0

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._offset = int(self.rng.integers(self.window))
        n = (len(self.tokens) - self._offset) // self.window
        self._order, self._pos = self.rng.permutation(n), 0

    @property
    def epochs_seen(self) -> float:
        return max(self.epoch, 0) + self._pos / max(len(self._order), 1)

    def next(self) -> np.ndarray:
        if self._pos + self.batch > len(self._order):
            self._new_epoch()
        idx = self._order[self._pos: self._pos + self.batch]
        self._pos += self.batch
        starts = self._offset + idx * self.window
        return self.tokens[starts[:, None] + np.arange(self.window)].astype(np.int32)  # [B, T]


def eval_windows(tokens: np.ndarray, window: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows [N, window] from the start of `tokens`, evenly thinned to at most max_windows."""
    n = len(tokens) // window
    if n == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window ({window})")
    keep = np.unique(np.linspace(0, n - 1, min(n, max_windows)).round().astype(np.int64))
    return tokens[keep[:, None] * window + np.arange(window)].astype(np.int32)


def unigram_log_probs(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Add-one smoothed unigram log-probabilities [V] (float64) from training counts."""
    counts = np.bincount(tokens, minlength=vocab).astype(np.float64)
    return np.log((counts + 1.0) / (counts.sum() + vocab))


def unigram_nll(log_probs: np.ndarray, windows: np.ndarray) -> float:
    """Mean unigram NLL over the same predicted tokens as the model's eval (columns 1..T-1)."""
    return float(-log_probs[windows[:, 1:]].mean())
