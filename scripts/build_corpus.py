"""Build the training corpus: the running interpreter's Python standard library source (with docstrings).

    python scripts/build_corpus.py [--out data/corpus]

Writes train.txt, heldout.txt (files joined by FILE_SEPARATOR) and manifest.json (Python version, stdlib path,
per-file sha256, held-out module list, output sizes and hashes). The held-out set is a fixed list of modules
plus every file whose path hash falls in HASH_HELDOUT_PERCENT buckets, so it never depends on the file
system's listing order or on which other files exist. Output depends only on the interpreter's stdlib.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import tokenize

FILE_SEPARATOR = "\n\n# ==== file: {path} ====\n"
# Directories (relative to the stdlib root, posix form) that are test suites or third-party code.
EXCLUDED_DIRS = ("test", "idlelib/idle_test", "idlelib/tests", "lib2to3/tests", "site-packages", "dist-packages")
EXCLUDED_DIR_NAMES = ("__pycache__", "tests", "test")  # at any depth
# Always held out (module files or packages): common, self-contained modules that make a readable eval set.
HELDOUT_MODULES = ("json", "csv", "argparse", "textwrap", "heapq", "statistics", "fractions", "difflib")
HASH_HELDOUT_PERCENT = 3  # plus files whose sha256(path) % 100 < this; together about 5% of the files


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _excluded(rel_dir: str) -> bool:
    parts = rel_dir.split("/") if rel_dir not in ("", ".") else []
    if any(p in EXCLUDED_DIR_NAMES for p in parts) or any(p.startswith("config-") for p in parts[:1]):
        return True
    return any(rel_dir == d or rel_dir.startswith(d + "/") for d in EXCLUDED_DIRS)


def list_sources(root: str) -> list[str]:
    """Sorted stdlib-relative posix paths of the *.py files that go into the corpus."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if _excluded(rel_dir):
            dirnames[:] = []
            continue
        for name in filenames:
            if name.endswith(".py"):
                found.append(name if rel_dir == "." else f"{rel_dir}/{name}")
    return sorted(found)


def is_heldout(rel_path: str) -> bool:
    top = rel_path.split("/")[0].removesuffix(".py")
    if top in HELDOUT_MODULES:
        return True
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % 100 < HASH_HELDOUT_PERCENT


def read_source(path: str) -> str:
    """Decode with the file's PEP 263 encoding; normalize newlines so the corpus is platform-independent."""
    with open(path, "rb") as f:
        encoding, _ = tokenize.detect_encoding(f.readline)
    with open(path, encoding=encoding, newline="") as f:
        text = f.read()
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def build(out_dir: str, root: str | None = None) -> dict:
    root = root or stdlib_root()
    files = list_sources(root)
    if not files:
        raise SystemExit(f"no *.py files found under stdlib root {root}")
    parts: dict[str, list[str]] = {"train": [], "heldout": []}
    entries = []
    for rel in files:
        text = read_source(os.path.join(root, rel))
        split = "heldout" if is_heldout(rel) else "train"
        parts[split].append(FILE_SEPARATOR.format(path=rel) + text)
        entries.append({"path": rel, "split": split, "chars": len(text),
                        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
    os.makedirs(out_dir, exist_ok=True)
    outputs = {}
    for split, chunks in parts.items():
        data = "".join(chunks).encode("utf-8")
        with open(os.path.join(out_dir, f"{split}.txt"), "wb") as f:
            f.write(data)
        outputs[split] = {"file": f"{split}.txt", "files": len(chunks), "bytes": len(data),
                          "chars": len(data.decode("utf-8")), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "sys_version": sys.version,
        "stdlib_root": root,
        "file_separator": FILE_SEPARATOR,
        "heldout_rule": {"modules": list(HELDOUT_MODULES), "hash_percent": HASH_HELDOUT_PERCENT},
        "heldout_files": [e["path"] for e in entries if e["split"] == "heldout"],
        "outputs": outputs,
        "files": entries,
    }
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/corpus", help="output directory (git-ignored)")
    parser.add_argument("--stdlib", default=None, help="stdlib root (default: the running interpreter's)")
    args = parser.parse_args(argv)
    m = build(args.out, args.stdlib)
    print(f"Python {m['python_version']} stdlib at {m['stdlib_root']}")
    for split, o in m["outputs"].items():
        print(f"{split:8s}: {o['files']:4d} files  {o['chars']:>10,d} chars  {o['bytes']:>10,d} bytes  "
              f"sha256 {o['sha256'][:16]}")
    n_held, n_all = len(m["heldout_files"]), len(m["files"])
    print(f"held out {n_held}/{n_all} files ({100 * n_held / n_all:.1f}%); manifest: {args.out}/manifest.json")


if __name__ == "__main__":
    main()
