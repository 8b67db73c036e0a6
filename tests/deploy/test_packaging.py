"""The package's layout: the repository's top-level folders install as `pdcluster.<folder>`
(pyproject's package-dir), and no code imports them under their bare folder names."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_an_init_is_a_listed_package_and_no_other():
    folders = set()
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            folders.add(".".join((name, *rel.parts)))
    assert set(SETUPTOOLS["packages"]) == folders | {"pdcluster"}
    assert (ROOT / "pdcluster" / "__init__.py").exists()


def test_no_code_imports_a_folder_by_its_bare_name():
    """`import engine` would load a second copy of every module (and, for `kernels`, shadow
    Hugging Face's package): every import goes through `pdcluster.`."""
    bare = "|".join(folder for folder in SETUPTOOLS["package-dir"].values())
    pattern = re.compile(rf"^\s*(from ({bare})(\.\w+)* import|import ({bare})\b)", re.M)
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    found = [f"{f}: {m.group(0).strip()}" for f in files if (ROOT / f).exists()
             for m in pattern.finditer((ROOT / f).read_text())]
    assert found == []


@pytest.mark.slow
def test_the_wheel_built_from_the_sdist_installs_pdcluster_alone(tmp_path):
    """`python -m build` (the sdist, then the wheel from it) on the tracked files; the wheel in a
    fresh venv, its dependencies borrowed from this one: one top-level name, the package data
    inside it, `pdcluster serve --help` runs, and the folders' bare names do not import."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    dist = tmp_path / "dist"
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("pdcluster-*.whl")
    (sdist,) = dist.glob("pdcluster-*.tar.gz")
    with tarfile.open(sdist) as tar:
        in_sdist = {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 1}
    assert set(SETUPTOOLS["package-dir"].values()) | {"pdcluster", "pyproject.toml"} <= in_sdist
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pdcluster", wheel.name.split("-py3")[0] + ".dist-info"}
    for data in ("pdcluster/engine/models/stories260K/model.safetensors",
                 "pdcluster/kvstore/proto/kvstore.proto", "pdcluster/kernels/cpu_extension.cpp",
                 "pdcluster/kvstore/transport/mooncake/te_bind.c"):
        assert data in names

    venv = tmp_path / "venv"
    venv_python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, timeout=300)
    site = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies: this venv's site-packages, after the new venv's own (a plain path entry:
    # the editable install's import hook in it is not loaded)
    ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "borrowed.pth").write_text(ours + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    check = subprocess.run(
        [str(venv_python), "-c",
         "import importlib.util, json, sys, pdcluster, pdcluster.deploy.cli; "
         "print(json.dumps([pdcluster.__file__, "
         f"[n for n in {sorted(SETUPTOOLS['package-dir'].values())!r} "
         "if (spec := importlib.util.find_spec(n)) and spec.origin.startswith(sys.prefix)]]))"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert check.returncode == 0, check.stderr[-3000:]
    where, ours_bare = json.loads(check.stdout)  # (Hugging Face's `kernels` may be borrowed)
    assert Path(where).is_relative_to(venv) and ours_bare == []
    help_text = subprocess.run([str(venv / "bin" / "pdcluster"), "serve", "--help"],
                               capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert help_text.returncode == 0 and "--kv-transfer" in help_text.stdout, help_text.stderr[-3000:]


def test_a_checkout_on_pythonpath_imports_its_own_folders(tmp_path):
    """Another checkout run with this venv (benchmarks/startup.py --baseline) imports its own
    modules, not the installed checkout's."""
    other = tmp_path / "other"
    for folder in ("pdcluster", "engine"):
        shutil.copytree(ROOT / folder, other / folder, ignore=shutil.ignore_patterns("models"))
    shutil.copy2(ROOT / "pyproject.toml", other / "pyproject.toml")
    env = dict(os.environ, PYTHONPATH=str(other))
    out = subprocess.run([sys.executable, "-c", "import pdcluster.engine.config as c; print(c.__file__)"],
                         capture_output=True, text=True, check=True, cwd=tmp_path, env=env)
    assert Path(out.stdout.strip()).is_relative_to(other)
