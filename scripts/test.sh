#!/usr/bin/env bash
# Set up (see scripts/setup.sh --dev) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# the package's shape: transports behind one registry, the engine's connector seam, and the
# import layers (import-linter contracts in pyproject.toml)
.venv/bin/python scripts/check_shape.py
# progress as it happens, not in a buffer a killed run never prints
export PYTHONUNBUFFERED=1
if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest -q -ra "$@"; fi
# Three workers: much of the suite waits on processes starting and on servers. The tests that
# start a Ray form two groups, each run one test at a time in one worker (tests/conftest.py),
# queued first (hence no reordering by xdist); the third worker and whichever finishes its group
# take the other modules. Tests that need the cores to themselves run after them, alone.
.venv/bin/python -m pytest -q -ra --durations=25 -n 3 --dist loadgroup --no-loadscope-reorder \
  -m "not exclusive" tests
.venv/bin/python -m pytest -q -ra -m exclusive tests
# tests/multinode runs its own multi-node Ray cluster, and tests/chaos kills actors and
# redis-server under load in a Ray of its own: each a separate pytest process, the two at once
# (both mostly wait on processes starting and on timeouts). multinode's report follows chaos's.
multinode_log=$(mktemp)
trap 'rm -f "$multinode_log"' EXIT
.venv/bin/python -m pytest -q -ra tests/multinode > "$multinode_log" 2>&1 &
multinode=$!
chaos_rc=0
.venv/bin/python -m pytest -q -ra tests/chaos || chaos_rc=$?
multinode_rc=0
wait "$multinode" || multinode_rc=$?
echo "---- tests/multinode ----"
cat "$multinode_log"
[ "$chaos_rc" -eq 0 ] && [ "$multinode_rc" -eq 0 ]
