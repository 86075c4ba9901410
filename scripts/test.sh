#!/usr/bin/env bash
# Install (editable, with test extra) and run the CPU test suite, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
python -m pytest -q -m "not gpu and not slow" "$@"
