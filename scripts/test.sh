#!/usr/bin/env bash
# Set up (see scripts/setup.sh --dev) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# package layers (which may import which): import-linter contracts in pyproject.toml
.venv/bin/lint-imports
# progress as it happens, not in a buffer a killed run never prints
export PYTHONUNBUFFERED=1
if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest -q -ra "$@"; fi
# Two workers: much of the suite waits on processes starting and on servers, so the tests that
# start a Ray (one worker, one at a time: tests/conftest.py) share the 2 cores with the rest.
# Tests that need the cores to themselves run after them, alone.
.venv/bin/python -m pytest -q -ra --durations=25 -n 2 --dist loadgroup -m "not exclusive" tests
.venv/bin/python -m pytest -q -ra -m exclusive tests
# tests/multinode runs its own multi-node Ray cluster: a separate pytest process
.venv/bin/python -m pytest -q -ra tests/multinode
# tests/chaos kills actors and redis-server under load in a Ray of its own: a separate process too
.venv/bin/python -m pytest -q -ra tests/chaos
