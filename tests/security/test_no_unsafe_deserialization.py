"""No code-executing deserialization in pdcluster's network-facing packages (peers' KV
channels unpickled network bytes: vLLM CVE-2025-29783/32444/47277, SGLang CVE-2026-3059).

Parses every module's AST: an import of pickle/cloudpickle/dill (or marshal/shelve), a call of
their load functions, or a torch.load without weights_only=True fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["router", "kvstore", "prefill_worker", "decode_worker", "engine"]
UNSAFE_MODULES = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "_pickle"}


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "_pb2" not in p.name)


def unsafe_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] in UNSAFE_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else None
            if name in UNSAFE_MODULES and node.func.attr in ("load", "loads", "Unpickler"):
                found.append(f"{name}.{node.func.attr}()")
            if name == "torch" and node.func.attr == "load" and not any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                    and k.value.value is True for k in node.keywords):
                found.append("torch.load() without weights_only=True")
    return found


def test_the_checker_catches_each_pattern():
    bad = ("import pickle\nfrom dill import loads\nimport cloudpickle as cp\n"
           "torch.load(f)\ntorch.load(f, weights_only=False)\nmarshal.loads(b)\n")
    assert len(unsafe_uses(bad)) == 6
    assert unsafe_uses("torch.load(f, weights_only=True)\nimport json\n") == []


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_has_no_unsafe_deserialization(path):
    assert unsafe_uses(path.read_text()) == [], path
