#!/usr/bin/env bash
# Install (editable, with test extra) and run the CPU test suite, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
# Two workers (pytest-xdist), each test file whole on one of them so its module fixtures compile once: one XLA
# compile keeps about one core busy, and compiling is most of the suite's time. A test past its timeout ends its worker
# (pytest-timeout's thread method); no replacement is started, so the run stops there and names that test instead of
# waiting on a restarted worker. The 30 slowest tests close the report (--durations), so a run shows its worst case.
python -m pytest -q -m "not gpu and not slow" -n 2 --dist loadfile --max-worker-restart=0 --durations=30 "$@"
