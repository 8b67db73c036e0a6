#!/usr/bin/env bash
# Set up pdcluster in ./.venv on a fresh machine.
#   bash scripts/setup.sh          # to serve
#   bash scripts/setup.sh --dev    # + test tools and redis-server (from the OS packages)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The CPU build of torch first: with it installed, pyproject's torch range pulls no CUDA wheels.
.venv/bin/python -m pip install -q torch==2.13.0
# Triton without dependencies (it would not pull CUDA torch, but keep the tested version exact).
[ "$(uname -s)" = Linux ] && .venv/bin/python -m pip install -q --no-deps triton==3.9.0
if [ "${1:-}" = "--dev" ]; then
  # the tests of --kv-transfer mooncake need Mooncake's Transfer Engine (its CPU build, which
  # loads libibverbs even over TCP)
  .venv/bin/python -m pip install -q -e ".[dev,mooncake]"
  NEED=""
  command -v redis-server >/dev/null 2>&1 || NEED="redis-server"
  ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || NEED="$NEED libibverbs1"
  if [ -n "$NEED" ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $NEED >/dev/null
  fi
else
  .venv/bin/python -m pip install -q -e .
fi
# The workers' allocator (deploy/preload.py): tcmalloc from the OS packages, where it can be
# installed. Optional: without it the workers run on glibc malloc.
if [ "$(uname -s)" = Linux ]; then
  if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    if command -v apt-get >/dev/null 2>&1 && $SUDO true 2>/dev/null; then
      { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } \
        || echo "note: libtcmalloc-minimal4 not installed; workers use glibc malloc"
    else
      echo "note: install libtcmalloc-minimal4 for the workers' allocator (needs root)"
    fi
  fi
fi
