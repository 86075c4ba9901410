"""The benchmark timing helper really runs the kernel once per argument set, and times something positive; a run
stopped by SIGTERM still writes what it finished."""
import importlib.util
import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_util.py")
_spec = importlib.util.spec_from_file_location("_bench_util", _PATH)
bench_util = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_util)


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
