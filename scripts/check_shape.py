"""The worker side's shape, checked: one engine that names no transport or stream, a typed
connector seam, transports behind one registry, each transport's hand-off read only by that
transport, typed stats to the gateway, the import layers. Prints each check and exits 1 if any fails; scripts/test.sh runs it.

    .venv/bin/python scripts/check_shape.py
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the one module that maps transport names to what implements them
REGISTRY = "kvstore/transport/registry.py"
#: names a transport, a decode source's path or a hand-off kind goes by
TRANSPORT_NAMES = {"grpc", "torch", "mooncake", "pool", "layer", "layer-mooncake", "arena",
                   "push", "region", "store"}
#: what such a name is compared through when code switches on it
SWITCHES = {"handoff", "path", "backend", "transport", "name", "kind"}
#: keys of kv_transfer_params one transport writes and only that transport reads
TRANSPORT_KEYS = {"pair_address": "kvstore/transport/torch_pair/",
                  "pair_tag": "kvstore/transport/torch_pair/",
                  "kv_region": "kvstore/transport/mooncake/",
                  "layer_stream": "kvstore/transport/layer_stream/"}
TRANSPORT_WORDS = re.compile(r"\b(pair_address|pair_tag|kv_region|layer_stream|mooncake|grpc|"
                             r"nccl|torch\.distributed)\b", re.IGNORECASE)
#: a KV stream named (an engine that knows one has a transport's feature inside it)
KV_STREAM = re.compile(r"stream", re.IGNORECASE)


def product_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return [ROOT / n for n in names if (ROOT / n).exists()
            and not re.match(r"(tests|benchmarks|scripts|docs)/", n) and "_pb2" not in n]


def _switched(node: ast.AST) -> str | None:
    """The identifier a comparison reads, when it is one of SWITCHES (``x.path``, ``handoff``)."""
    if isinstance(node, ast.Attribute):
        return node.attr if node.attr in SWITCHES else None
    if isinstance(node, ast.Name):
        return node.id.lstrip("_") if node.id.lstrip("_") in SWITCHES else None
    return None


def _names(node: ast.AST) -> set[str]:
    """The transport names a literal (a string, or a tuple/set/list of them) holds."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & TRANSPORT_NAMES
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def transport_switches(path: Path) -> list[tuple[int, str]]:
    """(line, source) of each comparison of a SWITCHES identifier with a transport name."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(_switched(a) for a in sides) and any(_names(b) for b in sides):
            found.append((node.lineno, ast.unparse(node)))
    return found


def transport_keys(path: Path, rel: str) -> list[tuple[int, str]]:
    """(line, key) of each string literal naming another transport's kv_transfer_params key."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            owner = TRANSPORT_KEYS.get(node.value)
            if owner is not None and not rel.startswith(owner):
                found.append((node.lineno, node.value))
    return found


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
    branches = [f"{rel[p]}:{n}: {code}" for p in files
                if rel[p] != REGISTRY and not rel[p].startswith("kernels/")
                for n, code in transport_switches(p)]
    checks.append(("no module outside the registry compares a handoff, path or backend with a "
                   "transport's name", branches))
    keys = [f"{rel[p]}:{n}: {key!r}" for p in files for n, key in transport_keys(p, rel[p])]
    checks.append(("a transport's kv_transfer_params keys appear only in its own package",
                   keys))
    router = [f"{rel[p]}:{n}: {line.strip()}" for p in files if rel[p].startswith("router/")
              for n, line in code_lines(p)
              if re.search(r"\bstats\s*(\.get\(|\[)\s*[\"']", line)]
    checks.append(("the gateway reads no worker stat by string", router))
    protocol = ROOT / "engine" / "protocol.py"
    words = [f"engine/protocol.py:{n}: {line.strip()}" for n, line in code_lines(protocol)
             if TRANSPORT_WORDS.search(line)]
    checks.append(("engine/protocol.py names no transport", words))
    core_words = [f"engine/core/{p.name}:{n}: {line.strip()}"
                  for p in sorted((ROOT / "engine" / "core").glob("*.py"))
                  for n, line in enumerate(p.read_text().splitlines(), 1)
                  if TRANSPORT_WORDS.search(line.replace("Mooncake FAST'25", ""))
                  or KV_STREAM.search(line)]  # (the paper cited is not the transport)
    checks.append(("engine/core/ names no transport and no stream, docstrings included",
                   core_words))
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
