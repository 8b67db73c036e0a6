"""The worker side's shape, checked: one engine, a typed connector seam, transports behind the
registry. Prints each check and exits 1 if any fails.

    .venv/bin/python scripts/check_shape.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: modules allowed to branch on a transfer backend's name: the registries that map names to
#: connectors and backends
REGISTRIES = {"kvstore/connector/__init__.py", "kvstore/transfer/registry.py"}
#: a comparison with a transfer backend's name (--kv-transfer: grpc, torch, mooncake)
BACKEND_NAME = re.compile(r"\bbackend(\.name)?\s*(==|!=|\bin\b)\s*\(?[\"'](grpc|torch|mooncake)[\"']")
TRANSPORT_WORDS = re.compile(r"\b(pair_address|pair_tag|kv_region|layer_stream|mooncake|grpc|"
                             r"nccl|torch\.distributed)\b", re.IGNORECASE)


def product_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return [ROOT / n for n in names
            if not re.match(r"(tests|benchmarks|scripts|docs)/", n) and "_pb2" not in n]


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of code, docstrings and comments left out."""
    out, in_doc = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc:
            in_doc = quotes % 2 == 0
            continue
        if stripped.startswith('"""'):
            in_doc = quotes == 1
            continue
        out.append((number, line.split("#", 1)[0]))
    return out


def main() -> int:
    files = product_files()
    rel = {p: str(p.relative_to(ROOT)) for p in files}
    checks: list[tuple[str, list[str]]] = []
    engines = [f"{rel[p]}:{n}" for p in files for n, line in code_lines(p)
               if re.match(r"\s*class (PrefillEngine|DecodeEngine)\b", line)]
    checks.append(("PrefillEngine and DecodeEngine are gone", engines))
    branches = [f"{rel[p]}:{n}: {line.strip()}" for p in files if rel[p] not in REGISTRIES
                and not rel[p].startswith("kernels/") for n, line in code_lines(p)
                if BACKEND_NAME.search(line)]
    checks.append(("no module outside the registries compares a transfer backend's name",
                   branches))
    protocol = ROOT / "engine" / "protocol.py"
    words = [f"engine/protocol.py:{n}: {line.strip()}" for n, line in code_lines(protocol)
             if TRANSPORT_WORDS.search(line)]
    checks.append(("engine/protocol.py names no transport", words))
    base = ROOT / "engine" / "core" / "kv_connector.py"
    anys = [f"engine/core/kv_connector.py:{n}" for n, line in code_lines(base)
            if re.search(r"\bAny\b", line)]
    checks.append(("the connector base has no Any", anys))
    from pdcluster.engine.core.kv_connector import KVConnector
    core = ROOT / "engine" / "core" / "engine_core.py"
    called = {m for _, line in code_lines(core)
              for m in re.findall(r"\bconnector\.(\w+)", line)}
    checks.append(("the engine calls only the connector base's methods",
                   sorted(m for m in called if not hasattr(KVConnector, m))))
    placed = [f"missing: {p}" for p in ("engine/core/block_pool.py", "engine/core/kv_connector.py")
              if not (ROOT / p).exists()]
    checks.append(("the block pool and the connector interface live under engine/", placed))
    lint = subprocess.run(["bash", str(ROOT / "scripts" / "lint_imports.sh")], cwd=ROOT,
                          capture_output=True, text=True)
    checks.append(("the import-linter contracts hold",
                   [] if lint.returncode == 0 else lint.stdout.splitlines()[-5:]))
    failed = False
    for name, problems in checks:
        print(f"{'ok  ' if not problems else 'FAIL'} {name}")
        for problem in problems:
            print(f"       {problem}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
