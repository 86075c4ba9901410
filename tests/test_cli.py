"""`python -m kdtree_jax.generate`: JSON output, streaming, `--help`, the default run, compile progress, log lines
and one-line errors with exit code 2. In-process through `main(argv)`, sharing loaded engines (and so their compiled
programs) between tests; one smoke test runs the real command with no arguments in a subprocess. Last, the test
suite's own timeout."""
from __future__ import annotations

import dataclasses
import glob
import io
import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest
from engine_utils import drafter_config, random_drafter

from kdtree_jax import generate
from kdtree_jax.checkpoint.drafter import save_drafter
from kdtree_jax.checkpoint.synthetic import write_synthetic_checkpoint
from kdtree_jax.decode import budget as budget_mod
from kdtree_jax.decode.engine import Engine
from kdtree_jax.model import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "kdtree-mini", "tokenizer")
DEFAULT_TARGET = os.path.join(REPO, "checkpoints", "kdtree-mini", "target")
TIMEOUT = 300
STATS = re.compile(r"^\[(ddtree|chain|ar)\] tokens=\d+ rounds=\d+ mean_acceptance_length=[\d.]+ tokens/s=[\d.]+ "
                   r"run_s=[\d.]+ compile_s=[\d.]+")
COMPILING = re.compile(r"^compiling (.+) \.\.\.$")  # a program's compile starts; then its seconds:
COMPILED = re.compile(r"^compiled (.+) in \d+\.\d s$")


@pytest.fixture(scope="module")
def synthetic_pair(tmp_path_factory):
    """A synthetic HF INT4 checkpoint (K2.6 wrapper layout) with our tokenizer, a random drafter for it, and two
    drafters that do not fit it: hidden size 32 (target: 64) and vocab 2048 (target: 4096)."""
    root = tmp_path_factory.mktemp("cli")
    cfg = config.tiny(vocab_size=4096, eos_token_id=(3841,), max_position_embeddings=256)
    target = str(root / "target")
    files = glob.glob(os.path.join(TOKENIZER, "*.json")) + [os.path.join(TOKENIZER, "tiktoken.model")]
    write_synthetic_checkpoint(target, cfg, fmt="int4", wrapped=True, seed=3,
                               extra_files={os.path.basename(f): pathlib.Path(f).read_bytes() for f in files})
    drafter = str(root / "drafter")
    dcfg = drafter_config(cfg, block_size=4)
    save_drafter(random_drafter(dcfg, 3), dcfg, drafter)
    bad = str(root / "bad_drafter")
    other = config.tiny(vocab_size=4096, hidden_size=32)
    bad_cfg = drafter_config(other, block_size=4)
    save_drafter(random_drafter(bad_cfg, 4), bad_cfg, bad)
    bad_vocab = str(root / "bad_vocab_drafter")  # same hidden size; a drafter has no vocab-sized weights of its own
    vocab_cfg = drafter_config(config.tiny(vocab_size=2048), block_size=4)
    save_drafter(random_drafter(vocab_cfg, 5), vocab_cfg, bad_vocab)
    return target, drafter, bad, bad_vocab


@pytest.fixture(scope="module")
def loaded_engines():
    """Engines loaded by this module's CLI runs, by Engine.load's arguments."""
    return {}


@pytest.fixture(autouse=True)
def share_engines(monkeypatch, loaded_engines):
    """Engine.load returns the engine an earlier run loaded with the same arguments, so the programs that run
    compiled serve this one. A load that raises is not kept."""
    real_load = Engine.load

    def load(target, drafter=None, **kw):
        key = (os.path.abspath(target), drafter and os.path.abspath(drafter), tuple(sorted(kw.items())))
        if key not in loaded_engines:
            loaded_engines[key] = real_load(target, drafter, **kw)
        return loaded_engines[key]

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps --help at the terminal width
    # this process keeps conftest's compilation cache settings (the subprocess test runs the CLI's own)
    monkeypatch.setattr(generate, "enable_compilation_cache", lambda: None)


@pytest.fixture(autouse=True)
def restore_logging():
    """A run configures the process's logging (the root logger's handler and levels); later tests get pytest's
    setup back."""
    root = logging.getLogger()
    handlers, levels = root.handlers[:], {name: logging.getLogger(name).level for name in ("", "kdtree_jax", "jax")}
    yield
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@dataclasses.dataclass
class Cli:
    returncode: int
    stdout: str
    stderr: str


def run_cli(capfd, *args, check=True) -> Cli:
    """`main(args)` in this process: its exit code and what reached file descriptors 1 and 2 (carriage returns
    kept: a progress bar's redraws must not read as lines that a terminal never shows)."""
    capfd.readouterr()  # drop what came before
    try:
        generate.main(list(args))
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    out, err = capfd.readouterr()
    if check:
        assert code == 0, err[-3000:]
    return Cli(code, out, err)


def cli_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # one device: the CLI is a single-process user program
    return env


def run_cli_process(*args, env: dict | None = None) -> Cli:
    """The real command in a subprocess, as a user runs it (with `env` added to the environment)."""
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", *args], capture_output=True,
                          check=False, timeout=TIMEOUT, cwd=REPO, env={**cli_env(), **(env or {})})
    cli = Cli(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))
    assert cli.returncode == 0, cli.stderr[-3000:]
    return cli


def screen_lines(raw: str) -> list[str]:
    """The non-blank lines a terminal shows for `raw`: a carriage return goes back to column 0 and what follows
    overwrites what was there (tqdm redraws a bar that way, and a closed leave=False bar blanks itself)."""
    rows = []
    for line in raw.split("\n"):
        row = ""
        for part in line.split("\r"):
            row = part + row[len(part):]
        if row.strip():
            rows.append(row.rstrip())
    return rows


def assert_one_line_error(proc, *needles):
    """Exit code 2, no traceback, and one line left on the user's terminal: the error, naming the problem."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = screen_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def parse_json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.heavy
def test_json_ddtree_equals_ar_on_synthetic_hf_dir(synthetic_pair, capfd):
    target, drafter, *_ = synthetic_pair
    common = ["--checkpoint", target, "--drafter", drafter, "--json", "--max-new-tokens", "12",
              "--prompt", "def add(a, b):", "--prompt", "import os", "--prompt-ids", "5,6,7,8"]
    ar = parse_json_lines(run_cli(capfd, *common, "--mode", "ar").stdout)
    tree = parse_json_lines(run_cli(capfd, *common, "--mode", "ddtree", "--budget", "8").stdout)
    assert len(ar) == len(tree) == 3
    for a, t in zip(ar, tree):
        assert a["token_ids"] == t["token_ids"] and len(a["token_ids"]) >= 1
        assert a["finish_reason"] in ("length", "stop")
        assert isinstance(t["text"], str)
        assert t["stats"]["rounds"] >= 1 and t["stats"]["mean_acceptance_length"] >= 1.0
        assert t["stats"]["tokens_per_s"] > 0


class _Pipe(io.TextIOBase):
    """A stream that appends what reaches its reader to `log` as (name, text): stdout on flush (a pipe is block
    buffered, so text printed without a flush would arrive only at exit), stderr on every write."""

    def __init__(self, name: str, log: list, buffered: bool):
        self.name, self.log, self.buffered, self.pending = name, log, buffered, []

    def write(self, text: str) -> int:
        self.pending.append(text)
        if not self.buffered:
            self.flush()
        return len(text)

    def flush(self) -> None:
        text, self.pending = "".join(self.pending), []
        if text:
            self.log.append((self.name, text))

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def test_text_streams_before_exit(synthetic_pair, monkeypatch):
    """Generated text reaches stdout round by round: after the engine hands over the tokens of one update and before
    it hands over the next, for two or more updates, and all before the stats line (printed after the last token).
    Evidence by order, not by timing: one log records each update the engine yields and each piece of text that
    reaches stdout or stderr. Printed once at the end, the text would follow the last update. The random drafter
    commits about one token per round, so 64 tokens are about 64 updates."""
    target, drafter, *_ = synthetic_pair
    log = []  # ("update", i) | ("out", text) | ("err", text), in order
    real_stream = Engine.generate_stream

    class LoggedStream:
        def __init__(self, stream):
            self.stream = stream

        def __iter__(self):
            for i, new in enumerate(self.stream):
                log.append(("update", i))
                yield new

        @property
        def result(self):
            return self.stream.result

    monkeypatch.setattr(Engine, "generate_stream", lambda self, *a, **kw: LoggedStream(real_stream(self, *a, **kw)))
    with monkeypatch.context() as streams:
        streams.setattr(sys, "stdout", _Pipe("out", log, buffered=True))
        streams.setattr(sys, "stderr", _Pipe("err", log, buffered=False))
        code = generate.run(["--checkpoint", target, "--drafter", drafter, "--prompt", "x", "--max-new-tokens", "64",
                             "--budget", "4", "--stream-every", "1"])
        sys.stdout.flush()  # what a buffered pipe would still deliver at exit
    err = "".join(text for kind, text in log if kind == "err")
    assert code == 0
    assert STATS.match(screen_lines(err)[-1]), err[-2000:]
    stats_at = next(i for i, (kind, text) in enumerate(log) if kind == "err" and "tokens/s=" in text)
    out = [(i, text) for i, (kind, text) in enumerate(log) if kind == "out"]
    assert out[0][1] == "x"  # the prompt echo, with the first update (after the compiles' lines)
    updates = [i for i, (kind, _) in enumerate(log) if kind == "update"]
    # for each piece of generated text, the update it followed
    after = {max((u for u in updates if u < i), default=-1) for i, text in out[1:] if text.strip()}
    assert len(after) >= 2, f"generated text followed {len(after)} update(s): {log[-8:]}"
    assert -1 not in after and max(updates) < stats_at and all(i < stats_at for i, _ in out), log[-8:]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--mode", "beam"], "invalid choice"),
        (["--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["--budget", "-1"], "--budget"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
    ],
)
def test_bad_flags_exit_2_one_line(args, needle, synthetic_pair, capfd):
    target, drafter, *_ = synthetic_pair
    assert_one_line_error(run_cli(capfd, "--checkpoint", target, "--drafter", drafter, *args, check=False), needle)


def test_attention_backend_that_cannot_serve_the_checkpoint_exits_2(synthetic_pair, capfd):
    target, drafter, *_ = synthetic_pair  # fp32 cache, latent widths the wgmma kernel does not take
    proc = run_cli(capfd, "--checkpoint", target, "--drafter", drafter, "--attention-backend", "mosaic",
                   "--prompt-ids", "1,2", check=False)
    assert proc.returncode == 2 and "attn_backend='mosaic' needs" in proc.stderr and "kv_lora_rank=" in proc.stderr
    assert "Traceback" not in proc.stderr and "compiling" not in proc.stderr  # refused before any compile


@pytest.mark.parametrize("case", ["drafter_hidden_size", "drafter_vocab", "prompt_too_long"])
def test_mismatched_drafter_and_long_prompt_exit_2(case, synthetic_pair, capfd):
    """Found after the target loaded: its progress bar has been drawn and must not be left around the message."""
    target, _, bad_hidden, bad_vocab = synthetic_pair
    args, needles = {
        "drafter_hidden_size": (["--drafter", bad_hidden, "--prompt-ids", "1,2"], ("hidden_size (32)", "(64)")),
        "drafter_vocab": (["--drafter", bad_vocab, "--prompt-ids", "1,2"], ("vocab_size (2048)", "(4096)")),
        "prompt_too_long": (["--mode", "ar", "--prompt-ids", ",".join(["7"] * 300)], ("300 tokens", "context")),
    }[case]
    assert_one_line_error(run_cli(capfd, "--checkpoint", target, *args, check=False), *needles)


def test_error_erases_a_progress_bar_left_open(monkeypatch, capfd):
    """An error raised while a bar is on screen (a tensor that fails mid-load, a failing compile) still leaves one
    line: main closes open bars before printing it. In-process: the raising frame keeps the bar alive."""
    from tqdm.auto import tqdm

    from kdtree_jax import generate

    def run_that_fails(argv):
        bar = tqdm(total=10, desc="loading tensors", unit="tensor", leave=False)
        bar.update(3)
        raise ValueError("INT4 scale shape (2, 3) does not match packed shape (4, 4)")

    monkeypatch.setattr(generate, "run", run_that_fails)
    with pytest.raises(SystemExit) as exit_info:
        generate.main([])
    assert exit_info.value.code == 2
    err = capfd.readouterr().err
    assert "loading tensors" in err  # the bar was drawn
    assert screen_lines(err) == ["error: INT4 scale shape (2, 3) does not match packed shape (4, 4)"]


def assert_compile_lines(lines: list[str]) -> None:
    """Each compile as a pair of lines: "compiling <what> ..." before it, "compiled <what> in <s> s" after."""
    assert lines and len(lines) % 2 == 0, lines
    for start, end in zip(lines[::2], lines[1::2]):
        what = COMPILING.match(start)
        assert what and COMPILED.match(end) and COMPILED.match(end).group(1) == what.group(1), (start, end)


def test_progress_and_warnings_read_as_plain_lines(synthetic_pair, capfd):
    """What the CLI logs on stderr: a warning as 'warning: ...' (not logging's bare 'WARNING:kdtree_jax.decode.budget:'
    that an import installs), and each compile it waits for as a line before and a line with its seconds after."""
    target, drafter, *_ = synthetic_pair  # no budget profile beside it: --budget auto warns and runs B = 32
    proc = run_cli(capfd, "--checkpoint", target, "--drafter", drafter, "--budget", "auto", "--json",
                   "--prompt-ids", "5,6,7", "--max-new-tokens", "4")
    lines = screen_lines(proc.stderr)
    assert lines[0].startswith("warning: budget='auto': no budget profile at "), lines
    assert_compile_lines(lines[1:-1])
    assert STATS.match(lines[-1]), lines
    assert "WARNING" not in proc.stderr and "kdtree_jax.decode.budget" not in proc.stderr


def help_sections(text: str) -> dict[str, str]:
    """argparse's help by group title ("options", "model", ...): each group's text."""
    parts = re.split(r"^(\w[\w ]*):$", text, flags=re.MULTILINE)
    return {title: body for title, body in zip(parts[1::2], parts[2::2])}


def test_help_groups_the_kernel_flags(capfd):
    sections = help_sections(run_cli(capfd, "--help").stdout)
    assert "--no-pallas" in sections["kernels"] and "--attention-backend" in sections["kernels"], sections.keys()
    assert "--no-pallas" not in sections["output"] and "--attention-backend" not in sections["output"]


def test_help_lists_every_flag_with_its_default(capfd):
    proc = run_cli(capfd, "--help")
    entries = {}  # flag -> its help text, whitespace collapsed (argparse wraps at the terminal width)
    for block in re.split(r"\n(?=  -)", proc.stdout.split("options:", 1)[1]):
        head = re.split(r"\s{2,}", block.strip())[0]  # "--mode {ddtree,chain,ar}, --speculative-algorithm ..."
        for flag in re.findall(r"(?:^|, )(--[a-z-]+)", head):
            entries[flag] = " ".join(block.split())
    switches = ("--chat", "--json")  # off unless given: no default to state
    for flag in ("--checkpoint", "--drafter", "--prompt", "--prompt-file", "--prompt-ids", "--chat",
                 "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--mode", "--budget",
                 "--batch-size", "--dtype", "--mesh", "--json"):
        assert flag in entries, flag
        if flag not in switches and flag not in ("--prompt-file", "--prompt-ids"):  # alternatives to --prompt
            assert entries[flag].count("default") == 1, entries[flag]
    assert "(default: None)" not in proc.stdout and "(default: False)" not in proc.stdout
    assert "(default: 128)" in entries["--max-new-tokens"] and "(default: ddtree)" in entries["--mode"]
    assert "default: auto where a budget profile" in entries["--budget"]
    assert "default: one device" in entries["--mesh"]


@pytest.mark.heavy
def test_default_budget_runs_the_profiles_choice(synthetic_pair, tmp_path, capfd):
    """No --budget: the B of a budget profile that applies (here one written for this CPU and this pair)."""
    target, drafter, *_ = synthetic_pair
    want = 4
    table = budget_mod.BatchProfile(ar_step_s=1.0, budgets={
        b: budget_mod.BudgetPoint(tau=2.0, round_s=0.1 if b == want else 0.2) for b in (2, want, 8)})
    profile = budget_mod.BudgetProfile(device_kind="cpu", dtype="float32", n_devices=1,
                                       target=budget_mod.checkpoint_name(target),
                                       drafter=budget_mod.checkpoint_name(drafter), batches={1: table})
    path = budget_mod.save_profile(profile, tmp_path / "profile.json")
    proc = run_cli(capfd, "--checkpoint", target, "--drafter", drafter, "--budget-profile", str(path), "--json",
                   "--prompt-ids", "5,6,7", "--max-new-tokens", "4")
    out = parse_json_lines(proc.stdout)
    assert len(out) == 1 and out[0]["stats"]["budget"] == want and out[0]["stats"]["budget_source"] == "auto"


@pytest.mark.skipif(not os.path.isdir(DEFAULT_TARGET), reason="no shipped default checkpoint")
def test_no_arguments_runs_the_default_checkpoint(tmp_path):
    """`python -m kdtree_jax.generate` and nothing else: the shipped pair, the default prompt, 128 new tokens. On
    this CPU no budget profile applies, so the default budget is the fixed 32, and that is no warning. Besides the
    stats, stderr shows each compile, and the compiled programs land in the persistent compilation cache (here the
    one $KDTREE_COMPILATION_CACHE names)."""
    cache = tmp_path / "xla"
    proc = run_cli_process(env={"KDTREE_COMPILATION_CACHE": str(cache)})
    assert proc.stdout.startswith("def fibonacci(n):\n") and proc.stdout[len("def fibonacci(n):\n"):].strip()
    lines = screen_lines(proc.stderr)
    assert_compile_lines(lines[:-1])
    assert STATS.match(lines[-1]) and lines[-1].startswith("[ddtree]"), lines
    assert "budget=32 (fixed)" in lines[-1]
    assert cache.is_dir() and any(cache.iterdir()), "no program reached the compilation cache"


@pytest.mark.heavy
@pytest.mark.skipif(not os.path.isdir(DEFAULT_TARGET), reason="no shipped default checkpoint")
def test_default_checkpoint_ddtree_equals_ar(capfd):
    proc = run_cli(capfd, "--max-new-tokens", "16", "--json", "--mode", "ddtree")
    out = parse_json_lines(proc.stdout)
    ar = parse_json_lines(run_cli(capfd, "--max-new-tokens", "16", "--json", "--mode", "ar").stdout)
    assert len(out) == 1 and out[0]["token_ids"] == ar[0]["token_ids"]
    assert out[0]["stats"]["mean_acceptance_length"] > 1.5  # the shipped drafter is trained


# ---- the test suite ----------------------------------------------------------------------------------------------
HANGING_TEST = """
import time


def test_hangs():
    time.sleep(600)
"""


def test_a_hanging_test_fails_at_the_suite_timeout(pytestconfig, tmp_path):
    """pyproject.toml gives every test a timeout (pytest-timeout), so a hang fails the run instead of stalling it.
    The hang here runs under this suite's settings with the time cut to 2 s."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout") or 0) >= 600  # a cold compile of the heavy tests' programs fits
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", os.path.join(REPO, "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=2", str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "Timeout" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
