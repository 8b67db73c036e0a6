"""What a prompt recomputed after a failed KV fetch costs the running batch, against the same
prompt arriving as a new colocated request: the running sequences' inter-token latency (ITL)
while it is computed, on one decode engine in this process (no Ray).

The fetch fails for real: the request's hand-off names a KV store on a closed port, so both
attempts (the first path and the retry) fail and the decode engine recomputes the prompt. The
baseline runs in the same invocation, alternating rounds. Prints p50 / p99 / max ITL of the
running sequences per mode and the ratio of the recompute's p99 to the baseline's.

    .venv/bin/python benchmarks/recompute_stall.py [--prompt-tokens 2048] [--running 8]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.throughput import FULL, write_model  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """The running sequences: when each of their tokens came (time.perf_counter)."""

    def __init__(self) -> None:
        self.arrivals: dict[str, list[float]] = {}
        self.lock = threading.Lock()

    def emit_for(self, request_id: str):
        self.arrivals[request_id] = []

        def emit(delta) -> None:
            with self.lock:
                self.arrivals[request_id].extend([time.perf_counter()] * len(delta.token_ids))
        return emit

    def gaps_between(self, start: float, end: float) -> list[float]:
        """Inter-token gaps (s) of every running sequence whose later token came in
        [start, end]."""
        with self.lock:
            series = [list(times) for times in self.arrivals.values()]
        return [b - a for times in series for a, b in zip(times, times[1:]) if start <= b <= end]


def _one_round(engine, mode: str, prompt: tuple[int, ...], running: Running, port: int,
               round_no: int) -> list[float]:
    from pdcluster.engine.core.request import Request
    from pdcluster.engine.protocol import DecodeRequest, PrefillResult, SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    request_id = f"{mode}-{round_no}"
    done = threading.Event()
    seen: list[float] = []

    def emit(delta) -> None:
        seen.extend([time.perf_counter()] * len(delta.token_ids))
        if seen:
            done.set()

    if mode == "colocated":
        request = DecodeRequest(request_id, prompt, params)
    else:  # its prefill's first token, and KV on a store nobody serves
        result = PrefillResult(request_id, 3, 0, "bench-prefill", 0, kv_transfer_params={
            "kv_address": f"127.0.0.1:{port}", "block_keys": _keys(engine, prompt),
            "tail_handle": None, "num_tail_tokens": 0})
        request = DecodeRequest(request_id, prompt, params, result)
    start = time.perf_counter()
    engine.add_request(Request.of_decode(request, emit))
    if not done.wait(600):
        raise RuntimeError(f"{request_id} produced no token")
    gaps = running.gaps_between(start, seen[0])
    engine.abort(request_id)
    return gaps


def _keys(engine, prompt: tuple[int, ...]) -> tuple[bytes, ...]:
    from pdcluster.engine.core.hashing import block_keys, make_namespace

    return tuple(block_keys(prompt, engine.block_size, make_namespace(engine.model_id, None)))


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--running", type=int, default=8, help="running sequences")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    import torch

    from pdcluster.decode_worker.instance import decode_core
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.core.engine_loop import EngineLoop
    from pdcluster.engine.core.request import Request
    from pdcluster.engine.protocol import DecodeRequest, SamplingParams
    from pdcluster.engine.runner import ModelRunner
    from pdcluster.kvstore.config import KVTransferConfig
    from pdcluster.kvstore.transport.fetch import FetchConnector

    torch.set_num_threads(args.threads)
    shape = {**FULL, "max_position_embeddings": 4096}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "random-llama"
        write_model(model, shape, 0)
        config = EngineConfig(model=str(model), num_kv_blocks=2048)
        loop = EngineLoop(lambda: decode_core(ModelRunner(config), "bench-decode", os.getpid(),
                                              FetchConnector(KVTransferConfig(timeout_s=2))),
                          "bench-engine", timeout_s=300)
        engine = loop.core
        running = Running()
        steady = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        for i in range(args.running):
            prompt = tuple(rng.randrange(3, shape["vocab_size"]) for _ in range(64))
            engine.add_request(Request.of_decode(DecodeRequest(f"run-{i}", prompt, steady),
                                                 running.emit_for(f"run-{i}")))
        time.sleep(5)  # every running sequence decoding
        port = _closed_port()
        gaps: dict[str, list[float]] = {"colocated": [], "recompute": []}
        for round_no in range(args.rounds):
            for mode in ("colocated", "recompute"):
                prompt = tuple(rng.randrange(3, shape["vocab_size"])
                               for _ in range(args.prompt_tokens))
                gaps[mode] += _one_round(engine, mode, prompt, running, port, round_no)
                time.sleep(1)
        stats = engine.stats()
        for i in range(args.running):
            engine.abort(f"run-{i}")
        loop.shutdown()
    print(f"{args.prompt_tokens}-token prompt beside {args.running} running sequences, 100M "
          f"model, {args.threads} torch threads, {args.rounds} rounds per mode; "
          f"fetch recomputes: {stats.num_fetch_recomputes_total}")
    print("| mode | ITL gaps | p50 ms | p99 ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    for mode, values in gaps.items():
        print(f"| {mode} | {len(values)} | {1e3 * _pct(values, 50):.1f} | "
              f"{1e3 * _pct(values, 99):.1f} | {1e3 * max(values):.1f} |")
    print(f"recompute p99 / colocated p99: "
          f"{_pct(gaps['recompute'], 99) / _pct(gaps['colocated'], 99):.2f}x")


if __name__ == "__main__":
    main()
