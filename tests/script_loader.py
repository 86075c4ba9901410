"""Benchmarks and scripts are files, not packages: a test loads one as a fresh module, as `python path/to/it.py`
would see itself: its directory on sys.path (they import their neighbours) and itself in sys.modules under its name
(dataclasses look their module up there)."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relpath: str, name: str | None = None) -> ModuleType:
    """A fresh module of `relpath` (from the repository root, e.g. "benchmarks/serving_k26.py"), named `name`
    (default "_" + its stem) in sys.modules."""
    path = os.path.join(REPO, relpath)
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    name = name or "_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
