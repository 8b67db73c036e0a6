#!/usr/bin/env bash
# Install pdcluster and its pinned runtime into a virtualenv. The one install path of both
# images (deploy/docker/Dockerfile.cpu, Dockerfile.cuda) and of CI, which runs it in a fresh
# virtualenv (tests/deploy/test_docker.py), so the images' install steps are tested.
#
#   deploy/docker/install.sh [--venv DIR] [--torch cpu|cuda] [--src DIR]
#
#   --venv DIR   virtualenv to create if missing, then install into (default /opt/pdcluster)
#   --torch K    cpu (default) or cuda: which torch build to install (see TORCH_INDEX_URL)
#   --src DIR    pdcluster source tree to install (default: two levels above this script)
#   PYTHON           interpreter that creates the virtualenv (default python3)
#   TORCH_INDEX_URL  package index torch alone comes from, e.g.
#                    https://download.pytorch.org/whl/cpu or .../whl/cu128; unset: pip's
#                    configured indexes (on PyPI that is the CUDA build on Linux)
#
# Versions: deploy/docker/constraints.txt pins ray and torch for every node of a cluster;
# ray comes with its [default] extra (dashboard agent: KubeRay's health probes need it).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
venv=/opt/pdcluster
torch_kind=cpu
src="$(cd "$here/../.." && pwd)"
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --torch) torch_kind="$2"; shift 2 ;;
    --src) src="$2"; shift 2 ;;
    *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$torch_kind" in cpu|cuda) ;; *) echo "install.sh: --torch cpu|cuda" >&2; exit 2 ;; esac

constraints="$here/constraints.txt"
pin() { sed -n "s/^$1==//p" "$constraints"; }
ray_version="$(pin ray)"
torch_version="$(pin torch)"

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)

# torch first, alone, from its own index: with it in place the rest pulls no other build
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${pip[@]}" --index-url "$TORCH_INDEX_URL" "torch==$torch_version"
else
  "${pip[@]}" "torch==$torch_version"
fi
"${pip[@]}" --constraint "$constraints" "ray[default]==$ray_version" "$src"

# fail the build, not the cluster: the versions every node must agree on, and the CLI
"$venv/bin/python" - "$ray_version" "$torch_version" "$torch_kind" <<'PY'
import sys

import ray
import torch

import pdcluster.deploy.cli  # noqa: F401  (the entry point imports)

ray_want, torch_want, kind = sys.argv[1:]
assert ray.__version__ == ray_want, f"ray {ray.__version__} != pinned {ray_want}"
assert torch.__version__.split("+")[0] == torch_want, f"torch {torch.__version__} != {torch_want}"
if kind == "cpu":
    assert torch.version.cuda is None, f"a CUDA build of torch ({torch.version.cuda}) on cpu"
else:
    assert torch.version.cuda is not None, "a CPU-only build of torch for cuda"
print(f"pdcluster installed: ray {ray.__version__}, torch {torch.__version__}")
PY
"$venv/bin/pdcluster" --help >/dev/null
