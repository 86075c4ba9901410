"""`python -m kdtree_jax.generate` in a subprocess: JSON output, streaming, `--help`, the default run, and one-line
errors with exit code 2."""
from __future__ import annotations

import glob
import json
import os
import re
import selectors
import subprocess
import sys

import pytest
from engine_utils import drafter_config, random_drafter

from kdtree_jax import budget as budget_mod
from kdtree_jax import config
from kdtree_jax.drafter import save_drafter
from kdtree_jax.synthetic import write_synthetic_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "kdtree-mini", "tokenizer")
DEFAULT_TARGET = os.path.join(REPO, "checkpoints", "kdtree-mini", "target")
TIMEOUT = 300
STATS = re.compile(r"^\[(ddtree|chain|ar)\] tokens=\d+ rounds=\d+ mean_acceptance_length=[\d.]+ tokens/s=[\d.]+ "
                   r"run_s=[\d.]+ compile_s=[\d.]+")


@pytest.fixture(scope="module")
def synthetic_pair(tmp_path_factory):
    """A synthetic HF INT4 checkpoint (K2.6 wrapper layout) with our tokenizer, a random drafter for it, and two
    drafters that do not fit it: hidden size 32 (target: 64) and vocab 2048 (target: 4096)."""
    root = tmp_path_factory.mktemp("cli")
    cfg = config.tiny(vocab_size=4096, eos_token_id=(3841,), max_position_embeddings=256)
    target = str(root / "target")
    files = glob.glob(os.path.join(TOKENIZER, "*.json")) + [os.path.join(TOKENIZER, "tiktoken.model")]
    write_synthetic_checkpoint(target, cfg, fmt="int4", wrapped=True, seed=3,
                               extra_files={os.path.basename(f): open(f, "rb").read() for f in files})
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


def cli_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # one device: the CLI is a single-process user program
    return env


def run_cli(*args, check=True):
    """Exit code and output, decoded with carriage returns kept: text=True would turn each into a newline, and a
    progress bar's redraws would read as lines that a terminal never shows."""
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", *args], capture_output=True,
                          timeout=TIMEOUT, cwd=REPO, env=cli_env())
    proc.stdout, proc.stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


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


def test_json_ddtree_equals_ar_on_synthetic_hf_dir(synthetic_pair):
    target, drafter, *_ = synthetic_pair
    common = ["--checkpoint", target, "--drafter", drafter, "--json", "--max-new-tokens", "12",
              "--prompt", "def add(a, b):", "--prompt", "import os", "--prompt-ids", "5,6,7,8"]
    ar = parse_json_lines(run_cli(*common, "--mode", "ar").stdout)
    tree = parse_json_lines(run_cli(*common, "--mode", "ddtree", "--budget", "8").stdout)
    assert len(ar) == len(tree) == 3
    for a, t in zip(ar, tree):
        assert a["token_ids"] == t["token_ids"] and len(a["token_ids"]) >= 1
        assert a["finish_reason"] in ("length", "stop")
        assert isinstance(t["text"], str)
        assert t["stats"]["rounds"] >= 1 and t["stats"]["mean_acceptance_length"] >= 1.0
        assert t["stats"]["tokens_per_s"] > 0


def test_text_streams_before_exit(synthetic_pair):
    """Generated text reaches stdout round by round: in two or more separate reads, all before the read that brings
    the stats line (printed after the last token). Evidence by order, not by timing. Printed once at the end, the
    text (one write under PIPE_BUF, so atomic) would come in a single read just before the stats line. The random
    drafter commits about one token per round, so 200 tokens are about 200 streamed updates."""
    target, drafter, *_ = synthetic_pair
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdtree_jax.generate", "--checkpoint", target, "--drafter", drafter,
         "--prompt", "x", "--max-new-tokens", "200", "--budget", "4", "--stream-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=cli_env())
    reads = []  # ("out" | "err", bytes), in the order the reads returned them
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            while sel.get_map():
                ready = sel.select(timeout=TIMEOUT)
                assert ready, f"no output for {TIMEOUT} s"
                for key, _ in ready:
                    data = os.read(key.fileobj.fileno(), 1 << 16)
                    if data:
                        reads.append((key.data, data))
                    else:
                        sel.unregister(key.fileobj)
        proc.wait(timeout=TIMEOUT)
    finally:
        proc.kill()
    err = b"".join(data for kind, data in reads if kind == "err").decode(errors="replace")
    assert proc.returncode == 0, err[-2000:]
    assert STATS.match(screen_lines(err)[-1]), err[-2000:]
    stats_at = next(i for i, (kind, data) in enumerate(reads) if kind == "err" and b"tokens/s=" in data)
    echo, seen, text_reads = len(b"x"), 0, 0  # stdout is the prompt echo, then the generated text
    for kind, data in reads[:stats_at]:
        if kind == "out":
            text_reads += bool(data[max(0, echo - seen):].strip())
            seen += len(data)
    assert text_reads >= 2, f"generated text came in {text_reads} read(s) before the stats line: {reads[-8:]}"


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
def test_bad_flags_exit_2_one_line(args, needle, synthetic_pair):
    target, drafter, *_ = synthetic_pair
    assert_one_line_error(run_cli("--checkpoint", target, "--drafter", drafter, *args, check=False), needle)


def test_attention_backend_that_cannot_serve_the_checkpoint_exits_2(synthetic_pair):
    target, drafter, *_ = synthetic_pair  # fp32 cache, latent widths the wgmma kernel does not take
    proc = run_cli("--checkpoint", target, "--drafter", drafter, "--attention-backend", "mosaic", "--prompt-ids", "1,2",
                   check=False)
    assert proc.returncode == 2 and "attn_backend='mosaic' needs" in proc.stderr and "kv_lora_rank=" in proc.stderr
    assert "Traceback" not in proc.stderr and "compiling" not in proc.stderr  # refused before any compile


@pytest.mark.parametrize("case", ["drafter_hidden_size", "drafter_vocab", "prompt_too_long"])
def test_mismatched_drafter_and_long_prompt_exit_2(case, synthetic_pair):
    """Found after the target loaded: its progress bar has been drawn and must not be left around the message."""
    target, _, bad_hidden, bad_vocab = synthetic_pair
    args, needles = {
        "drafter_hidden_size": (["--drafter", bad_hidden, "--prompt-ids", "1,2"], ("hidden_size (32)", "(64)")),
        "drafter_vocab": (["--drafter", bad_vocab, "--prompt-ids", "1,2"], ("vocab_size (2048)", "(4096)")),
        "prompt_too_long": (["--mode", "ar", "--prompt-ids", ",".join(["7"] * 300)], ("300 tokens", "context")),
    }[case]
    assert_one_line_error(run_cli("--checkpoint", target, *args, check=False), *needles)


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


def test_help_lists_every_flag_with_its_default():
    proc = run_cli("--help")
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


def test_default_budget_runs_the_profiles_choice(synthetic_pair, tmp_path):
    """No --budget: the B of a budget profile that applies (here one written for this CPU and this pair)."""
    target, drafter, *_ = synthetic_pair
    want = 4
    table = budget_mod.BatchProfile(ar_step_s=1.0, budgets={
        b: budget_mod.BudgetPoint(tau=2.0, round_s=0.1 if b == want else 0.2) for b in (2, want, 8)})
    profile = budget_mod.BudgetProfile(device_kind="cpu", dtype="float32", n_devices=1,
                                       target=budget_mod.checkpoint_name(target),
                                       drafter=budget_mod.checkpoint_name(drafter), batches={1: table})
    path = budget_mod.save_profile(profile, tmp_path / "profile.json")
    proc = run_cli("--checkpoint", target, "--drafter", drafter, "--budget-profile", str(path), "--json",
                   "--prompt-ids", "5,6,7", "--max-new-tokens", "4")
    out = parse_json_lines(proc.stdout)
    assert len(out) == 1 and out[0]["stats"]["budget"] == want and out[0]["stats"]["budget_source"] == "auto"


@pytest.mark.skipif(not os.path.isdir(DEFAULT_TARGET), reason="no shipped default checkpoint")
def test_no_arguments_runs_the_default_checkpoint():
    """`python -m kdtree_jax.generate` and nothing else: the shipped pair, the default prompt, 128 new tokens. On
    this CPU no budget profile applies, so the default budget is the fixed 32, and that is no warning."""
    proc = run_cli()
    assert proc.stdout.startswith("def fibonacci(n):\n") and proc.stdout[len("def fibonacci(n):\n"):].strip()
    lines = screen_lines(proc.stderr)
    assert len(lines) == 1 and STATS.match(lines[0]) and lines[0].startswith("[ddtree]"), lines
    assert "budget=32 (fixed)" in lines[0]


@pytest.mark.skipif(not os.path.isdir(DEFAULT_TARGET), reason="no shipped default checkpoint")
def test_default_checkpoint_ddtree_equals_ar():
    proc = run_cli("--max-new-tokens", "16", "--json", "--mode", "ddtree")
    out = parse_json_lines(proc.stdout)
    ar = parse_json_lines(run_cli("--max-new-tokens", "16", "--json", "--mode", "ar").stdout)
    assert len(out) == 1 and out[0]["token_ids"] == ar[0]["token_ids"]
    assert out[0]["stats"]["mean_acceptance_length"] > 1.5  # the shipped drafter is trained
