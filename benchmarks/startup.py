"""How long `pdcluster serve` takes to become healthy, and where the time goes.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--modes colocated,disaggregated]
        [--baseline DIR]

- Servers: benchmarks/vs_vllm.py's pdcluster commands (its random 100M Llama, fp32, the same
  flags), logging at info so the milestones below can be timed. Eager, as vs_vllm's plain
  modes; a compiled mode (`colocated-compiled`) reads Inductor's cache once it is warm.
- `--baseline DIR`: another checkout of pdcluster (e.g. `git worktree add /tmp/base HEAD~1`),
  run with this venv and interleaved with this tree, round by round, so the two are compared
  on the same machine at the same minutes. Each tree builds its C++ kernels once, before
  its first round (kernels/cpu_extension.py names the build after its directory).
- Prints, per tree and mode, the median and range over rounds of the time from the process
  start to the first 200 from /health, and the median time at which each milestone's log line
  appeared: Ray started, the KV store actor's first line, the first line of each engine
  worker, the workers ready, the gateway serving. Then the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

from throughput import FULL, free_port, stop_server, wait_healthy, write_model  # noqa: E402
from vs_vllm import pdcluster_command  # noqa: E402

#: milestone -> a piece of the log line that marks it (the first such line)
MILESTONES = {
    "ray started": "Started a local Ray instance",
    "KV store actor": "(KVStoreActor pid=",
    "prefill worker": "(PrefillWorker pid=",
    "decode worker": "(DecodeWorker pid=",
    "workers ready": "ready: pid",
    "serving": "serving ",
}


def start_once(tree: Path, mode: str, model: Path) -> dict[str, float]:
    """Start the server of `tree` in `mode`, time it to healthy, stop it. Returns seconds
    from the start to each milestone seen and to "healthy"."""
    port = free_port()
    command, env = pdcluster_command(model, port, "float32", 2, mode.startswith("colocated"),
                                     mode.endswith("-compiled"), mode=mode)
    command = [sys.executable, "-c",
               "import sys; from pdcluster.deploy.cli import main; sys.exit(main())",
               *command[1:]]
    command[command.index("--log-level") + 1] = "info"
    env = dict(env, PYTHONPATH=str(tree))
    start = time.perf_counter()
    server = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: dict[str, float] = {}

    def read() -> None:
        for line in server.stdout:
            for name, mark in MILESTONES.items():
                if name not in seen and mark in line:
                    seen[name] = time.perf_counter() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_healthy(port, server, poll_s=0.05)
        seen["healthy"] = time.perf_counter() - start
        return dict(seen)
    finally:
        stop_server(server)


def build_kernels(tree: Path) -> None:
    """Build `tree`'s C++ kernels now, so no round times the build."""
    subprocess.run([sys.executable, "-c", "from pdcluster.kernels import cpu_extension; "
                    "cpu_extension.module()"], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                   check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--baseline", type=Path, help="another pdcluster checkout to compare")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    modes = args.modes.split(",")
    for tree in trees.values():
        build_kernels(tree)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {
        (name, mode): [] for name in trees for mode in modes}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "random-llama"
        write_model(model, FULL, 0)
        for round_ in range(args.rounds):
            order = list(trees.items()) if round_ % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                for mode in modes:
                    loads.append(os.getloadavg()[0])
                    runs[name, mode].append(start_once(tree, mode, model))
                    print(f"round {round_ + 1}: {name} {mode}: "
                          f"{runs[name, mode][-1]['healthy']:.1f} s", flush=True)
    print()
    print("| tree | mode | healthy, median (range) | "
          + " | ".join(MILESTONES) + " |")
    print("|---|---|---:|" + "---:|" * len(MILESTONES))
    for (name, mode), results in runs.items():
        healthy = [r["healthy"] for r in results]
        cells = []
        for milestone in MILESTONES:
            times = [r[milestone] for r in results if milestone in r]
            cells.append(f"{statistics.median(times):.1f}" if times else "-")
        print(f"| {name} | {mode} | {statistics.median(healthy):.1f} s "
              f"({min(healthy):.1f}-{max(healthy):.1f}) | " + " | ".join(cells) + " |")
    print(f"\nload average (1 min) during the runs: {min(loads):.2f}-{max(loads):.2f}; "
          f"{os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
