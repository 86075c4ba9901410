"""The rope keys of an HF `config.json`, in either spelling transformers has used, read one way for every model.

transformers >= 5 (src/transformers/modeling_rope_utils.py, RotaryEmbeddingConfigMixin) writes `rope_parameters` =
{rope_type, rope_theta, factor, ...}; DeepSeek / Kimi / z-lab drafter configs and transformers < 5 write `rope_theta`
at the top level and the scaling fields under `rope_scaling` (with "type" or "rope_type"). transformers 5 lets a
legacy rope_scaling win over rope_parameters and transformers 4 never reads rope_parameters, so where both spell a
value they must agree. The target and the drafter read one rope object differently (DeepSeek's YaRN vs Qwen3's) and
pass that reader in; the spelling rules live only here.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from kdtree_jax.model.config import ConfigError

ROPE_OBJECTS = ("rope_parameters", "rope_scaling")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")
ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor") + YARN_KEYS


def read_number(d: dict, name: str, prefix: str) -> float:
    """d[name] as a float; `prefix` is the path the field's name is appended to in the error."""
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{prefix}{name} must be a number, got {value!r}")
    return float(value)


def read_rope[T](table: dict, where: str, parse: Callable[[dict, str], T], describe: Callable[[T], str], plain: T, *,
                 legacy: str) -> tuple[float, T]:
    """(rope_theta, scaling) of the architecture dict `table`, from `rope_parameters` and/or the legacy keys.

    `where` starts every field path in an error ("ckpt/config.json: text_config."). `parse(obj, label)` reads one
    rope object (`label` is its path); `describe` words a parsed one for the disagreement error; `plain` is the
    scaling when no object is given. `legacy` completes "(and so ...)" in the error for a config with no base.
    """
    objects: dict[str, dict] = {}
    for name in ROPE_OBJECTS:
        value = table.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}{name} must be an object or null")
        unknown = sorted(set(value) - set(ROPE_KEYS))
        if unknown:
            raise ConfigError(f"{where}{name} has fields {unknown} that are not supported (known: {list(ROPE_KEYS)}); "
                              "per-layer-type rope parameters are not supported either")
        objects[name] = value
    thetas = []  # (field path, value as written) of every rope_theta spelled
    for path, d in [(f"{name}.", d) for name, d in objects.items()] + [("", table)]:
        if d.get("rope_theta") is not None:
            read_number(d, "rope_theta", f"{where}{path}")
            thetas.append((f"{path}rope_theta", d["rope_theta"]))
    if not thetas:
        # transformers falls back to 10000, but every config it writes carries rope_theta (inside rope_parameters
        # since 5.0) and real bases differ (Kimi 50000, Qwen3 1e6): a config without one has an unknown base
        raise ConfigError(f"{where}rope_parameters is missing (and so {legacy}): the rotary base rope_theta is unknown")
    prefix = where.split(": ", 1)[1] if ": " in where else ""  # the field path within the file, for a second field
    (field, theta), *others = thetas
    for other, value in others:
        if value != theta:
            raise ConfigError(f"{where}{field} ({theta}) and {prefix}{other} ({value}) disagree; remove one of them")
    theta = float(theta)
    if theta <= 1.0:
        raise ConfigError(f"{where}{field} must be > 1, got {theta}")
    scalings = [(name, parse(d, f"{where}{name}")) for name, d in objects.items()]
    if len(scalings) == 2 and scalings[0][1] != scalings[1][1]:
        (a, ra), (b, rb) = scalings
        raise ConfigError(f"{where}{a} ({describe(ra)}) and {prefix}{b} ({describe(rb)}) disagree; remove one of "
                          "them")
    return theta, scalings[0][1] if scalings else plain
