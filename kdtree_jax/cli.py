"""What the command-line programs (`kdtree_jax.generate`, `kdtree_jax.serve`) share: the shipped pair's paths,
one-line usage errors, help that states each default once, the --budget syntax, the default budget and how log
records read."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from kdtree_jax.decode import budget as budget_mod
from pallas_kernels.verify_attn import BACKENDS

ATTENTION_BACKENDS = ("auto", *BACKENDS)

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "kdtree-mini")
DEFAULT_TARGET = os.path.join(DEFAULT_DIR, "target")
DEFAULT_DRAFTER = os.path.join(DEFAULT_DIR, "drafter")
CACHE_HELP = ("compiled programs are kept in JAX's persistent compilation cache: $KDTREE_COMPILATION_CACHE, else "
              "~/.cache/kdtree-jax/xla; KDTREE_COMPILATION_CACHE=off disables it")
SERVER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # a long-running server: when, and from where


class UsageError(ValueError):
    """Bad input from the user: one line on stderr, exit code 2. A ValueError, so that the serving layer below passes
    it on as bad input without knowing the CLI."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already states its default or X is None / False
    (an unset option or an off switch: nothing to state)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


MODES = ("ddtree", "chain", "ar")


def add_model_flags(group, *, kernels=None, mesh_help: str = "") -> None:
    """The flags that pick the pair, its dtype, the device layout and the attention kernel (in `kernels` where the
    program groups its kernel flags apart)."""
    group.add_argument("--checkpoint", "--model", dest="checkpoint", default=DEFAULT_TARGET,
                       help="target: an HF safetensors directory (converted on the fly) or a converted checkpoint")
    group.add_argument("--drafter", "--speculative-model", dest="drafter", default=None,
                       help="DFlash drafter directory (z-lab HF layout); default: the shipped drafter when the "
                            "checkpoint is the shipped target")
    group.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter/compute dtype")
    group.add_argument("--mesh", default=None,
                       help=f"device layout as data x tensor x expert, e.g. 1x8x1 or 2x4{mesh_help}; default: one "
                            "device")
    kernels = group if kernels is None else kernels
    kernels.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                         help="verify_attn kernel: triton (any GPU, any shape), mosaic (Hopper wgmma; bf16/fp16 "
                              "cache, query rows padded to 64-row tiles) or auto = mosaic on an H100/H200 where the "
                              "tokens x heads of a request fill whole tiles (e.g. 64 heads)")


def add_mode_flags(group) -> None:
    """The decoding mode and the budget profile that --budget auto reads (each program's --budget differs)."""
    group.add_argument("--mode", "--speculative-algorithm", dest="mode", type=str.lower, choices=MODES,
                       default="ddtree", help="ddtree: draft tree; chain: DFlash block; ar: one token per target "
                                              "forward")
    group.add_argument("--budget-profile", default=None,
                       help="budget profile JSON for --budget auto and the default budget; default: "
                            "budget_profile.<device kind>.json in the checkpoint's parent directory")


def parse_budget(text: str) -> int | str:
    """--budget: an integer B or 'auto' (the measured best B for this device and batch size)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def parse_budget_table(text: str) -> dict[int, int | str]:
    """A budget per count of active slots (serving), e.g. '1:64,4:32,8:ar' -> {1: 64, 4: 32, 8: 'ar'}."""
    table = {}
    for item in text.split(","):
        slots, sep, budget = item.partition(":")
        try:
            if not sep:
                raise ValueError
            table[int(slots)] = "ar" if budget.strip().lower() == "ar" else int(budget)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'slots:budget' pairs such as 1:64,4:32,8:ar, got {text!r}") \
                from None
    return table


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. --step-widths 1,4,16."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, such as 1,4,16, got {text!r}") \
            from None
    if any(x < 1 for x in sizes):
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return sizes


def default_budget(engine, mode: str) -> int | str:
    """No --budget: "auto" where a budget profile measured on this device applies (the B the README's speedups were
    measured at), else the fixed budget. Unlike an explicit --budget auto, a missing, foreign or unreadable profile
    is no warning: a plain run on a device nobody profiled is not a mistake."""
    if mode != "ddtree":  # ar and chain take no budget
        return budget_mod.DEFAULT_BUDGET
    try:
        profile = budget_mod.profile_for(engine.budget_profile, engine.profile_key(), warn=False)
    except budget_mod.ProfileError:  # only an explicit --budget auto makes an unreadable profile an error
        return budget_mod.DEFAULT_BUDGET
    return budget_mod.DEFAULT_BUDGET if profile is None else "auto"


class TerminalFormatter(logging.Formatter):
    """Log records for a person at a terminal: progress as its bare text, a warning as 'warning: text', the way the
    one-line errors read ('error: text')."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def configure_logging(level: str = "info", *, server: bool = False) -> None:
    """How the programs' log records read, set once at startup. Importing orbax (through absl) has already installed
    logging's bare handler, which prints 'WARNING:kdtree_jax.decode.budget:...'; this replaces it. `server`: every
    logger at `level`, each record with its time, level and logger; else kdtree_jax's records at `level` in
    `TerminalFormatter`'s form, and other libraries' from warning up only. JAX stays at warning and above either way:
    it probes for backends at info."""
    numeric = logging.getLevelName(level.upper())
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(SERVER_LOG_FORMAT) if server else TerminalFormatter())
    logging.basicConfig(level=numeric if server else max(numeric, logging.WARNING), handlers=[handler], force=True)
    logging.getLogger("kdtree_jax").setLevel(numeric)
    logging.getLogger("jax").setLevel(max(logging.WARNING, numeric))


def close_progress_bars() -> None:
    """Close the progress bars an error left open (loading, compiling): they are leave=False bars, so closing erases
    them and the error that follows is the one line left on the terminal, not text glued to a half-drawn bar."""
    std = sys.modules.get("tqdm.std")  # not imported: no bar was ever drawn
    for bar in list(getattr(std.tqdm, "_instances", ()) if std is not None else ()):
        bar.close()


def run_main(run: Callable[[list[str] | None], int], argv: list[str] | None) -> None:
    """Run a program's `run(argv)` and exit with its code; bad input (flags, checkpoints, prompts) is one `error:`
    line on stderr and exit code 2 (KDTREE_DEBUG=1 shows the traceback)."""
    try:
        code = run(argv)
    except UsageError as e:
        close_progress_bars()
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except (ValueError, FileNotFoundError) as e:  # bad checkpoint, prompt too long, mismatched drafter, ...
        if os.environ.get("KDTREE_DEBUG"):
            raise
        close_progress_bars()
        print(f"error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
