"""Training-run plumbing shared by scripts/train_target.py, train_drafter.py and eval_pair.py: one CLI flag per
field of a config dataclass, atomic JSON, loss curves (JSON + PNG), the device summary, small metrics."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per dataclass field (type from the default value), so every default lives in the dataclass."""
    for f in dataclasses.fields(cls):
        default = f.default
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, dest=f.name, type=type(default), default=None, choices=choices,
                                help=f"{help_text} (default {default!r})")


def config_from_args(cls: type, args: argparse.Namespace, base: Any | None = None) -> Any:
    """`base` (or cls()) with every flag the user actually passed applied on top."""
    base = cls() if base is None else base
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **given)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomic JSON write (temp file + rename)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


class CurveLog:
    """Collects per-step records; writes <name>_curve.json and (matplotlib permitting) <name>_curve.png."""

    def __init__(self, log_dir: str, name: str):
        self.log_dir, self.name = log_dir, name
        self.records: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        os.makedirs(log_dir, exist_ok=True)

    def add(self, step: int, **values: Any) -> dict[str, Any]:
        rec = {"step": step, "time_s": round(time.perf_counter() - self.t0, 3)}
        rec.update({k: (float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()) for k, v in values.items()})
        self.records.append(rec)
        return rec

    def save(self, plot_keys: Sequence[str] = ("loss",)) -> dict[str, str | None]:
        json_path = os.path.join(self.log_dir, f"{self.name}_curve.json")
        write_json(json_path, {"name": self.name, "records": self.records})
        return {"curve_json": json_path, "curve_png": self._plot(plot_keys)}

    def _plot(self, keys: Sequence[str]) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: skipping the PNG curve")
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in keys:
            pts = [(r["step"], r[k]) for r in self.records if isinstance(r.get(k), float)]
            if pts:
                ax.plot(*zip(*pts), label=k)
        ax.set_xlabel("step")
        ax.set_ylabel("nats / token")
        ax.set_title(self.name)
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(self.log_dir, f"{self.name}_curve.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def device_summary() -> dict[str, Any]:
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": getattr(d, "device_kind", str(d)), "count": jax.device_count(),
            "jax": jax.__version__}


def perplexity(nll: float) -> float:
    return float(math.exp(min(nll, 700.0)))


def global_norm(tree) -> jax.Array:
    """L2 norm over all leaves (optax renamed its helper across versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
