"""`python -m kdtree_jax.generate` in a subprocess: JSON output, streaming, and one-line errors with exit code 2."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest
from engine_utils import drafter_config, random_drafter

from kdtree_jax import config
from kdtree_jax.drafter import save_drafter
from kdtree_jax.synthetic import write_synthetic_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "kdtree-mini", "tokenizer")
DEFAULT_TARGET = os.path.join(REPO, "checkpoints", "kdtree-mini", "target")
TIMEOUT = 300


@pytest.fixture(scope="module")
def synthetic_pair(tmp_path_factory):
    """A synthetic HF INT4 checkpoint (K2.6 wrapper layout) with our tokenizer, and a random drafter for it."""
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
    return target, drafter, bad


def run_cli(*args, check=True):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # one device: the CLI is a single-process user program
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=REPO, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def parse_json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_json_ddtree_equals_ar_on_synthetic_hf_dir(synthetic_pair):
    target, drafter, _ = synthetic_pair
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
    target, drafter, _ = synthetic_pair
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdtree_jax.generate", "--checkpoint", target, "--drafter", drafter,
         "--prompt", "x", "--max-new-tokens", "200", "--budget", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
    try:
        seen = b""
        deadline = time.time() + TIMEOUT
        while len(seen) < 8 and time.time() < deadline:  # the prompt echo plus streamed text
            seen += os.read(proc.stdout.fileno(), 64)
        still_running = proc.poll() is None
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert still_running, "no output arrived before the process ended"
    assert "tokens/s=" in err.decode() and "compile_s=" in err.decode()


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
    target, drafter, _ = synthetic_pair
    full = ["--checkpoint", target, "--drafter", drafter] + args
    proc = run_cli(*full, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_attention_backend_that_cannot_serve_the_checkpoint_exits_2(synthetic_pair):
    target, drafter, _ = synthetic_pair  # fp32 cache, latent widths the wgmma kernel does not take
    proc = run_cli("--checkpoint", target, "--drafter", drafter, "--attention-backend", "mosaic", "--prompt-ids", "1,2",
                   check=False)
    assert proc.returncode == 2 and "attn_backend='mosaic' needs" in proc.stderr and "kv_lora_rank=" in proc.stderr
    assert "Traceback" not in proc.stderr and "compiling" not in proc.stderr  # refused before any compile


def test_mismatched_drafter_and_long_prompt_exit_2(synthetic_pair):
    target, _, bad = synthetic_pair
    proc = run_cli("--checkpoint", target, "--drafter", bad, "--prompt-ids", "1,2", check=False)
    assert proc.returncode == 2 and "hidden_size" in proc.stderr and "Traceback" not in proc.stderr
    ids = ",".join(["7"] * 300)
    proc = run_cli("--checkpoint", target, "--mode", "ar", "--prompt-ids", ids, check=False)
    assert proc.returncode == 2 and "context" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not os.path.isdir(DEFAULT_TARGET), reason="no shipped default checkpoint")
def test_default_checkpoint_runs_with_no_arguments():
    proc = run_cli("--max-new-tokens", "16", "--json", "--mode", "ddtree")
    out = parse_json_lines(proc.stdout)
    ar = parse_json_lines(run_cli("--max-new-tokens", "16", "--json", "--mode", "ar").stdout)
    assert len(out) == 1 and out[0]["token_ids"] == ar[0]["token_ids"]
    assert out[0]["stats"]["mean_acceptance_length"] > 1.5  # the shipped drafter is trained
