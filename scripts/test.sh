#!/usr/bin/env bash
# Set up (see scripts/setup.sh --dev) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
exec .venv/bin/python -m pytest -q -ra "$@"
