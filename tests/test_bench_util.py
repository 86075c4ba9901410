"""The benchmark timing helper really runs the kernel once per argument set, and times something positive; a run
stopped by SIGTERM still writes what it finished."""
import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from script_loader import load_script

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_util.py")
bench_util = load_script("benchmarks/bench_util.py")


def test_back_to_back_runs_every_set(rng):
    sets = [(jnp.asarray(rng.standard_normal((3, 4)) + (3.0 if i == 4 else 0.0), jnp.float32),) for i in range(5)]

    def fn(x):
        return {"a": x * 2.0, "b": x.sum(axis=0)}

    got = float(bench_util._back_to_back(fn)(sets))
    terms = [2.0 * float(x[0, 0]) + float(np.asarray(x).sum(axis=0)[0]) for (x,) in sets]
    scale = sum(abs(t) for t in terms)  # the sum itself may cancel to near zero: compare against its terms' size
    assert got == pytest.approx(sum(terms), abs=1e-5 * scale)
    assert got != pytest.approx(sum(terms[:-1]), abs=1e-5 * scale)  # the last set (shifted: term ~15) really ran
    assert bench_util.per_call_s(fn, sets, min_reps=2, max_reps=2) > 0.0


@pytest.mark.parametrize("handler", [True, False])
def test_sigterm_still_writes_the_finished_rows(tmp_path, handler):
    """A benchmark stopped by SIGTERM (`timeout`, a device's time limit) runs its `finally` only under
    finish_on_sigterm; without it Python exits at once and the file is never written (the check can fail)."""
    out = tmp_path / "rows.json"
    code = "\n".join([
        "import importlib.util, os, signal, time",
        f"spec = importlib.util.spec_from_file_location('bu', {_PATH!r})",
        "bu = importlib.util.module_from_spec(spec); spec.loader.exec_module(bu)",
        "bu.finish_on_sigterm()" if handler else "",
        "try:",
        "    os.kill(os.getpid(), signal.SIGTERM)",
        "    time.sleep(30)",
        "finally:",
        f"    open({str(out)!r}, 'w').write('[1]')",
    ])
    rc = subprocess.run([sys.executable, "-c", code], timeout=60, check=False).returncode
    if handler:
        assert rc == 128 + signal.SIGTERM and out.read_text() == "[1]"
    else:
        assert rc == -signal.SIGTERM and not out.exists()


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def _repo(tmp_path):
    """A git repository with one commit; returns its path and HEAD."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("ignored/\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return repo, head


def test_git_state_labels_a_dirty_tree_by_its_difference(tmp_path):
    """A clean tree is labelled with HEAD; any edit, staged or not, or an untracked file makes it dirty with a hash
    of that difference: the same difference gives the same hash, another gives another, undoing it gives HEAD."""
    repo, head = _repo(tmp_path)

    clean = bench_util.git_state(str(repo))
    assert clean["git_commit"] == head and clean["git_dirty"] is False and clean["git_diff_sha256"] is None
    assert clean["git_label"] == head[:7]
    (repo / "ignored").mkdir()
    (repo / "ignored" / "out.json").write_text("{}")  # ignored outputs are not code
    assert bench_util.git_state(str(repo)) == clean

    (repo / "a.py").write_text("x = 2\n")
    edited = bench_util.git_state(str(repo))
    assert edited["git_commit"] == head and edited["git_dirty"] is True
    assert edited["git_label"] == f"{head[:7]}+dirty.{edited['git_diff_sha256']}"
    assert len(edited["git_diff_sha256"]) == bench_util.DIFF_HASH_CHARS
    assert any("a.py" in line for line in edited["git_dirty_files"])
    _git(repo, "add", "a.py")  # staged: still a difference from HEAD, the same one
    assert bench_util.git_state(str(repo))["git_diff_sha256"] == edited["git_diff_sha256"]
    (repo / "a.py").write_text("x = 3\n")
    assert bench_util.git_state(str(repo))["git_diff_sha256"] != edited["git_diff_sha256"]
    _git(repo, "checkout", "-q", "HEAD", "--", "a.py")
    assert bench_util.git_state(str(repo)) == clean

    (repo / "new.py").write_text("y = 1\n")  # untracked code ran too
    untracked = bench_util.git_state(str(repo))
    assert untracked["git_dirty"] is True and untracked["git_diff_sha256"] not in (None, edited["git_diff_sha256"])
    (repo / "new.py").write_text("y = 2\n")
    assert bench_util.git_state(str(repo))["git_diff_sha256"] != untracked["git_diff_sha256"]

    outside = bench_util.git_state(str(tmp_path / "nowhere"))
    assert outside == {"git_commit": None, "git_dirty": None, "git_diff_sha256": None, "git_label": "unknown",
                       "git_dirty_files": None}


def test_write_results_stamps_dicts_and_rows(tmp_path, monkeypatch):
    import json

    repo, head = _repo(tmp_path)
    (repo / "a.py").write_text("x = 2\n")
    monkeypatch.setattr(bench_util, "REPO", str(repo))
    want = bench_util.git_state()
    assert want["git_commit"] == head and want["git_dirty"] is True
    for result, rows_key in (({"device": "cpu", "rows": [1, 2]}, "rows"), ([{"a": 1}, {"a": 2}], "rows")):
        path = tmp_path / "r.json"  # outside the repository: the file itself changes no label
        written = bench_util.write_results(str(path), result)
        on_disk = json.loads(path.read_text())
        assert on_disk == written
        assert on_disk[rows_key] == (result if isinstance(result, list) else result["rows"])
        for field in ("git_commit", "git_dirty", "git_diff_sha256", "git_label"):
            assert on_disk[field] == want[field], field
        assert on_disk["date"] and on_disk["jax_version"] and "command" in on_disk
