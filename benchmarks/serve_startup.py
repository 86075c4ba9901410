"""Seconds from `python -m kdtree_jax.serve` to its first /health answer: the server loads the pair and compiles
every serving program before it opens the port, so this is the start-up a user waits for.

Two starts share one empty compilation cache directory ($KDTREE_COMPILATION_CACHE): cold (every program compiles),
then warm (the programs load from the cache). Each server is stopped with SIGTERM once it answers.

    python benchmarks/serve_startup.py --out benchmarks/results/serve_startup/cpu.json [-- SERVE FLAGS]
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_util import REPO, write_results  # noqa: E402

POLL_S = 0.25  # between /health probes
STOP_TIMEOUT_S = 60.0  # for a server to exit after SIGTERM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_start(serve_args: list[str], cache: str, timeout_s: float) -> dict:
    """One server process: seconds until /health answers 200, then SIGTERM and its exit code."""
    port = free_port()
    cmd = [sys.executable, "-m", "kdtree_jax.serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    env = {**os.environ, "KDTREE_COMPILATION_CACHE": cache}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}) before answering:\n{proc.stdout.read()[-4000:]}")
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"the server did not answer /health within --timeout {timeout_s} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=POLL_S) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(POLL_S)
        ready_s = time.perf_counter() - t0
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=STOP_TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"ready_s": ready_s, "exit_code": proc.returncode, "command": cmd, "log_tail": log.splitlines()[-20:]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take")
    p.add_argument("serve_args", nargs="*", help="flags for kdtree_jax.serve (after --)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdtree-xla-") as cache:
        for run in ("cold", "warm"):
            load = os.getloadavg()
            row = {"run": run, "loadavg_before": load, **time_start(args.serve_args, cache, args.timeout)}
            rows.append(row)
            print(f"{run}: /health after {row['ready_s']:.1f} s (load average before {load[0]:.2f}), "
                  f"exit {row['exit_code']}", flush=True)
    result = {"device": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        result = write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
