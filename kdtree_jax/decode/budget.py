"""Automatic DDTree budget: the tree budget B that maximises measured decode throughput on this device.

Expected tokens per second at budget B are tau(B) / cost(B): tau = mean tokens committed per round (the engine's
acceptance length) and cost = seconds per round of the whole batch. A bigger tree raises tau with diminishing
returns while cost grows with the 1 + B verified tokens, so the best B depends on the device, the batch size and the
drafter; `scripts/profile_budget.py` measures both and stores them as a JSON `BudgetProfile`, by default next to the
checkpoint as `<target dir>/../budget_profile.<device kind slug>.json`.

A profile applies to an engine only when device kind, dtype, device count and the target / drafter names all match:
each of them changes tau or cost.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from fractions import Fraction

import numpy as np

from kdtree_jax.checkpoint.atomic import write_text_atomic

PROFILE_VERSION = 1
DEFAULT_BUDGET = 32  # the fixed budget used when no profile applies (and the engine's default)
AUTO_AR = "auto-ar"  # budget source when the profile measured AR faster than every budget: the engine runs AR
PROFILE_PREFIX = "budget_profile"

log = logging.getLogger(__name__)


class ProfileError(ValueError):
    """A budget profile file that cannot be used as it is (bad JSON, missing or ill-typed field)."""


@dataclasses.dataclass(frozen=True)
class BudgetPoint:
    tau: float  # mean tokens committed per round per request (>= 1)
    round_s: float  # seconds per round of the whole batch (> 0)

    @property
    def tokens_per_s(self) -> float:
        """Per request; multiply by the batch size for the batch's throughput (the argmax is the same)."""
        return self.tau / self.round_s


@dataclasses.dataclass(frozen=True)
class BatchProfile:
    ar_step_s: float  # seconds per autoregressive step at this batch size (the baseline)
    budgets: dict[int, BudgetPoint]  # measured B -> (tau, round_s)


@dataclasses.dataclass(frozen=True)
class ProfileKey:
    """What an engine is: a profile measured for anything else does not apply to it. None = not known/compared."""

    device_kind: str
    dtype: str
    n_devices: int
    target: str | None = None
    drafter: str | None = None


@dataclasses.dataclass(frozen=True)
class BudgetProfile:
    device_kind: str  # jax.Device.device_kind, e.g. "NVIDIA H200"
    dtype: str  # parameter / compute dtype of the engine, e.g. "float32"
    n_devices: int
    target: str  # checkpoint_name() of the target, e.g. "kdtree-mini/target"
    drafter: str
    batches: dict[int, BatchProfile]
    settings: dict = dataclasses.field(default_factory=dict)  # how it was measured (informational)

    def mismatch(self, key: ProfileKey) -> str | None:
        """Why this profile does not apply to an engine described by `key`, or None when it does."""
        for field in ("device_kind", "dtype", "n_devices", "target", "drafter"):
            want = getattr(key, field)
            if want is not None and want != getattr(self, field):
                return f"profile {field} is {getattr(self, field)!r}, the engine's is {want!r}"
        return None

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION, "device_kind": self.device_kind, "dtype": self.dtype,
            "n_devices": self.n_devices, "target": self.target, "drafter": self.drafter, "settings": self.settings,
            "batches": {str(b): {"ar_step_s": t.ar_step_s,
                                 "budgets": {str(k): {"tau": p.tau, "round_s": p.round_s}
                                             for k, p in sorted(t.budgets.items())}}
                        for b, t in sorted(self.batches.items())},
        }

    @classmethod
    def from_json(cls, obj, source: str = "<profile>") -> "BudgetProfile":
        """Parse and validate; errors name `source` and the offending field, e.g. `batches.8.budgets.16.tau`."""
        obj = _field(obj, None, dict, source, "")
        version = _field(obj, "version", int, source, "")
        if version != PROFILE_VERSION:
            raise ProfileError(f"{source}: field 'version' is {version}, this code reads version {PROFILE_VERSION}")
        batches = {}
        raw_batches = _field(obj, "batches", dict, source, "")
        if not raw_batches:
            raise ProfileError(f"{source}: field 'batches' is empty")
        for bkey, braw in raw_batches.items():
            where = f"batches.{bkey}"
            batch = _int_key(bkey, source, where, 1)
            braw = _field(braw, None, dict, source, where)
            raw_budgets = _field(braw, "budgets", dict, source, where)
            if not raw_budgets:
                raise ProfileError(f"{source}: field '{where}.budgets' is empty")
            points = {}
            for kkey, praw in raw_budgets.items():
                pwhere = f"{where}.budgets.{kkey}"
                budget = _int_key(kkey, source, pwhere, 0)
                praw = _field(praw, None, dict, source, pwhere)
                points[budget] = BudgetPoint(tau=_number(praw, "tau", source, pwhere, low=1.0),
                                             round_s=_number(praw, "round_s", source, pwhere, positive=True))
            batches[batch] = BatchProfile(ar_step_s=_number(braw, "ar_step_s", source, where, positive=True),
                                          budgets=points)
        n_devices = _field(obj, "n_devices", int, source, "")
        if n_devices < 1:
            raise ProfileError(f"{source}: field 'n_devices' must be >= 1, got {n_devices}")
        return cls(device_kind=_field(obj, "device_kind", str, source, ""), dtype=_field(obj, "dtype", str, source, ""),
                   n_devices=n_devices, target=_field(obj, "target", str, source, ""),
                   drafter=_field(obj, "drafter", str, source, ""), batches=batches,
                   settings=_field(obj, "settings", dict, source, "") if "settings" in obj else {})


def _field(obj, key, kind, source, where):
    """obj[key] (or obj itself when key is None), checked to be of `kind`."""
    name = ".".join(p for p in (where, key) if p) or "<top level>"
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise ProfileError(f"{source}: missing field '{name}'")
        obj = obj[key]
    if not isinstance(obj, kind) or (kind is int and isinstance(obj, bool)):
        raise ProfileError(f"{source}: field '{name}' must be {kind.__name__}, got {type(obj).__name__} {obj!r:.40}")
    return obj


def _int_key(text: str, source: str, where: str, minimum: int) -> int:
    if not re.fullmatch(r"\d+", text) or int(text) < minimum:
        raise ProfileError(f"{source}: key '{where}' must be an integer >= {minimum}")
    return int(text)


def _number(obj, key, source, where, *, low: float | None = None, positive: bool = False) -> float:
    name = f"{where}.{key}"
    if key not in obj:
        raise ProfileError(f"{source}: missing field '{name}'")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{source}: field '{name}' must be a finite number, got {v!r:.40}")
    if positive and v <= 0:
        raise ProfileError(f"{source}: field '{name}' must be > 0, got {v}")
    if low is not None and v < low:
        raise ProfileError(f"{source}: field '{name}' must be >= {low}, got {v}")
    return float(v)


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------
def device_slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the device part of a profile's file name."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")
    if not slug:
        raise ValueError(f"device kind {device_kind!r} has no letters or digits to name a profile file after")
    return slug


def default_profile_path(target_dir: str | os.PathLike, device_kind: str) -> str:
    """`<target dir>/../budget_profile.<slug>.json`: one profile per device kind, shared by a pair's directory."""
    parent = os.path.dirname(os.path.abspath(os.fspath(target_dir)))
    return os.path.join(parent, f"{PROFILE_PREFIX}.{device_slug(device_kind)}.json")


def checkpoint_name(path: str | os.PathLike) -> str:
    """The last two path components ('kdtree-mini/target'): names a checkpoint without tying it to one machine."""
    parts = os.path.abspath(os.fspath(path)).rstrip(os.sep).split(os.sep)
    return "/".join(p for p in parts[-2:] if p)


def merge_profiles(old: BudgetProfile, new: BudgetProfile) -> BudgetProfile:
    """`new` plus the batch sizes of `old` that `new` did not measure, for the same engine and device: a profile
    re-measured one batch size at a time (each run within a time limit) keeps the others. Settings are
    kept per batch size (`settings["by_batch"]`), so each table says when and how it was measured."""
    key = ProfileKey(new.device_kind, new.dtype, new.n_devices, new.target, new.drafter)
    why = old.mismatch(key)
    if why is not None:
        raise ProfileError(f"cannot merge budget profiles of different engines: {why}")
    by_batch = {**_settings_by_batch(old), **_settings_by_batch(new)}
    return dataclasses.replace(new, batches={**old.batches, **new.batches},
                               settings={"by_batch": {k: by_batch[k] for k in sorted(by_batch, key=int)}})


def _settings_by_batch(profile: BudgetProfile) -> dict:
    """{batch: settings}; a profile written before settings were kept per batch has one flat dict with
    `tokens_per_s` keyed by batch (the first shipped profiles): its fields apply to every batch."""
    if "by_batch" in profile.settings:
        return dict(profile.settings["by_batch"])
    flat = {k: v for k, v in profile.settings.items() if k != "tokens_per_s"}
    rates = profile.settings.get("tokens_per_s", {})
    return {str(b): {**flat, **({"tokens_per_s": rates[str(b)]} if str(b) in rates else {})}
            for b in profile.batches}


def save_profile(profile: BudgetProfile, path: str | os.PathLike) -> str:
    """Written atomically: a reader never sees half a profile."""
    return write_text_atomic(path, json.dumps(profile.to_json(), indent=2) + "\n")


def load_profile(path: str | os.PathLike) -> BudgetProfile:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return BudgetProfile.from_json(obj, source=path)


def profile_for(source: str | os.PathLike | BudgetProfile | None, key: ProfileKey, *,
                warn: bool = True) -> BudgetProfile | None:
    """The profile at `source` if it applies to `key`; else None after a one-line warning naming the file (with
    `warn`: an explicit budget='auto' that finds no profile is worth a word, a default that falls back is not)."""
    say = log.warning if warn else log.debug
    if source is None:
        say("budget='auto': no budget profile given; using the fixed budget %d", DEFAULT_BUDGET)
        return None
    if isinstance(source, BudgetProfile):
        profile, name = source, "the given profile"
    else:
        name = os.fspath(source)
        if not os.path.isfile(name):
            say("budget='auto': no budget profile at %s (run scripts/profile_budget.py); using the fixed "
                "budget %d", name, DEFAULT_BUDGET)
            return None
        profile = load_profile(name)
    why = profile.mismatch(key)
    if why is not None:
        say("budget='auto': %s does not apply (%s); using the fixed budget %d", name, why, DEFAULT_BUDGET)
        return None
    return profile


# ---------------------------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------------------------
def nearest_batch(profile: BudgetProfile, batch: int) -> int:
    """The measured batch size closest to `batch` on a log scale; ties go to the larger one.

    Why not interpolate: tau is per request (nearly batch independent) but cost(B) at a batch depends on where the
    batch * (1 + B) verified tokens sit relative to the device's memory-bound / compute-bound knee, and a table
    interpolated across that knee is wrong on both sides; the nearest measured regime is the honest guess. Log
    scale because batch costs scale multiplicatively (4 is as far from 2 as from 8). Ties go to the larger batch,
    whose cost grows faster with B, so the guess leans to the smaller tree, which wastes less when it is wrong.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    # log distance compared exactly: max/min as a fraction (floats could break genuine ties, e.g. 6 vs 3 and 12)
    return min(profile.batches, key=lambda m: (Fraction(max(m, batch), min(m, batch)), -m))


@dataclasses.dataclass(frozen=True)
class CostFit:
    """cost(B) ~ a + b * (1 + B): a = fixed per-round work (drafter, tree build, weights read once), b = per
    verified token. rel_err[B] = (fit - measured) / measured at each measured budget."""

    a: float
    b: float
    rel_err: dict[int, float]

    def predict(self, budget: int | float) -> float:
        return self.a + self.b * (1 + budget)

    @property
    def max_abs_rel_err(self) -> float:
        return max(abs(e) for e in self.rel_err.values())


def fit_cost(table: BatchProfile) -> CostFit:
    """Least squares of round_s on (1 + B) over the measured budgets (needs two distinct budgets)."""
    budgets = sorted(table.budgets)
    if len(budgets) < 2:
        raise ValueError(f"fitting cost(B) needs >= 2 measured budgets, got {budgets}")
    x = np.array([1.0 + k for k in budgets])  # [P]
    y = np.array([table.budgets[k].round_s for k in budgets])  # [P]
    design = np.stack([np.ones_like(x), x], axis=1)  # [P, 2]
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    fit = a + b * x
    return CostFit(a=float(a), b=float(b), rel_err={k: float((f - m) / m) for k, f, m in zip(budgets, fit, y)})


def interp_tau(table: BatchProfile, budget: float) -> float:
    """tau between measured budgets, linear in log(1 + B) (acceptance grows about logarithmically with tree size);
    no extrapolation."""
    budgets = sorted(table.budgets)
    if not budgets[0] <= budget <= budgets[-1]:
        raise ValueError(f"budget {budget} is outside the measured range {budgets[0]}..{budgets[-1]}")
    xs = np.log1p(np.array(budgets, np.float64))
    return float(np.interp(math.log1p(budget), xs, [table.budgets[k].tau for k in budgets]))


def expected_tokens_per_s(profile: BudgetProfile, batch: int, *, fitted: bool = False,
                          candidates=None) -> dict[int, float]:
    """Per-request tau / cost for each candidate B at the nearest measured batch: measured points, or (fitted)
    interpolated tau over the fitted cost at any B inside the measured range."""
    table = profile.batches[nearest_batch(profile, batch)]
    if not fitted:
        return {k: p.tokens_per_s for k, p in table.budgets.items()}
    fit = fit_cost(table)
    out = {}
    for k in candidates if candidates is not None else range(min(table.budgets), max(table.budgets) + 1):
        cost = fit.predict(k)
        if cost <= 0:
            raise ValueError(f"the fitted cost at budget {k} is {cost:.3g} s (not positive); the linear law does not "
                             f"hold for this table (max relative error {fit.max_abs_rel_err:.2f})")
        out[int(k)] = interp_tau(table, k) / cost
    return out


def speculation_pays(profile: BudgetProfile, batch: int) -> bool:
    """Whether the best measured budget beats autoregressive decoding (one token per `ar_step_s`) at the nearest
    measured batch size. Where it does not (a target whose tree verify costs more than its acceptance gains, e.g. an
    MoE reading many more experts for a tree, docs/scale_up.md), "auto" runs AR: same tokens, faster. Ties go to AR."""
    table = profile.batches[nearest_batch(profile, batch)]
    return max(p.tokens_per_s for p in table.budgets.values()) > 1.0 / table.ar_step_s


def choose_budget(profile: BudgetProfile, batch: int, *, fitted: bool = False, candidates=None) -> int:
    """argmax_B tau(B) / cost(B) at the nearest measured batch size; ties go to the smaller B (less memory, same
    speed). By default only measured budgets compete; `fitted=True` also scores unmeasured B (all integers in the
    measured range, or `candidates`) with interpolated tau and the fitted cost model."""
    scores = expected_tokens_per_s(profile, batch, fitted=fitted, candidates=candidates)
    return min(scores, key=lambda k: (-scores[k], k))


@dataclasses.dataclass(frozen=True, order=True)
class StepKind:
    """Which round a serving step runs: "ar", "chain" or "ddtree" with its budget B."""

    mode: str
    budget: int = 0

    @property
    def name(self) -> str:
        return f"ddtree-{self.budget}" if self.mode == "ddtree" else self.mode


def step_kinds(mode: str, budget: int | str | Mapping, max_slots: int,
               profile: Callable[[], BudgetProfile | None]) -> dict[int, StepKind]:
    """The step program for each count of active slots 1..max_slots. A ddtree `budget` is a fixed B, "auto" (from
    the device's profile, read only then: the best B per load, or AR where speculation does not pay, DEFAULT_BUDGET
    without a profile), or a table {active slots: B or "ar"} whose missing counts take the nearest smaller entry."""
    counts = range(1, max_slots + 1)
    if mode != "ddtree":
        return {a: StepKind(mode) for a in counts}
    if isinstance(budget, str):
        if budget != "auto":
            raise ValueError(f"budget must be an integer, 'auto' or a table, got {budget!r}")
        measured = profile()
        if measured is None:
            return {a: StepKind("ddtree", DEFAULT_BUDGET) for a in counts}
        return {a: (StepKind("ddtree", choose_budget(measured, a)) if speculation_pays(measured, a)
                    else StepKind("ar")) for a in counts}
    if isinstance(budget, Mapping):
        table = {int(a): b for a, b in budget.items()}
        if not table or min(table) > 1:
            raise ValueError(f"a budget table needs an entry for 1 active slot, got {sorted(table)}")
        entry = {a: table[max(k for k in table if k <= a)] for a in counts}
        return {a: StepKind("ar") if b == "ar" else StepKind("ddtree", _budget_int(b)) for a, b in entry.items()}
    return {a: StepKind("ddtree", _budget_int(budget)) for a in counts}


def _budget_int(b) -> int:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
        raise ValueError(f"a DDTree budget must be an integer >= 1 or 'ar', got {b!r}")
    return int(b)
