#!/usr/bin/env bash
# The import-linter contracts of pyproject.toml. import-linter's graph builder (grimp) walks
# one folder per root package, and pdcluster's subpackages are the repository's top-level
# folders (setuptools' package-dir), so this lays them out as the installed package does, as
# links in a scratch folder, and lints that.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
layout="$(mktemp -d)"
trap 'rm -rf "$layout"' EXIT
mkdir "$layout/pdcluster"
ln -s "$repo/pdcluster/__init__.py" "$layout/pdcluster/__init__.py"
# pyproject's package-dir: "pdcluster.engine" = "engine", ...
"$repo/.venv/bin/python" - "$repo" "$layout" <<'PY'
import os, sys, tomllib
repo, layout = sys.argv[1:]
with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
    package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
for name, folder in package_dir.items():
    os.symlink(os.path.join(repo, folder), os.path.join(layout, *name.split(".")))
PY
cd "$layout"
PYTHONPATH="$layout" "$repo/.venv/bin/lint-imports" --config "$repo/pyproject.toml" --no-cache "$@"
