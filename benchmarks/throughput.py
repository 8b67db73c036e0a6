"""Throughput of pdcluster (colocated and disaggregated) against HF transformers `generate`.

    .venv/bin/python benchmarks/throughput.py [--num-prompts 64] [--concurrency 32]
        [--threads 2] [--small] [--modes colocated,disaggregated,hf_sequential,hf_batched]

One run, one machine, the same 64 prompts (fixed seed; input 128–1024 tokens, output 32–256,
every request generating exactly its output length: `ignore_eos` / `min_new_tokens`), fp32
everywhere, an equal torch thread budget (`--threads`: HF uses all of them; pdcluster colocated
gives them to its one worker, disaggregated splits them between prefill and decode). Wall clock
runs from the first request to the last token. The model is a random-weight Llama of about 100M
parameters written in HF format (hidden 768, 12 layers, 12 heads, 4 KV heads, vocab 32000,
context 2048) with a word-level tokenizer over the same vocabulary; `--small` shrinks it for a
smoke run. HF runs with sdpa attention: one request at a time, and batched by 32 with left padding
(a batch runs until its longest output, and only each request's own tokens count). Both sides
are warmed up with one short untimed request first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from pdcluster.loadtest.client import ClientConfig  # noqa: E402
from pdcluster.loadtest.runner import RunConfig, run_benchmark  # noqa: E402
from pdcluster.loadtest.workload import BenchRequest, Workload  # noqa: E402

FULL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
            max_position_embeddings=2048)
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
             max_position_embeddings=2048)


def write_model(path: Path, shape: dict, seed: int) -> int:
    """A random-weight Llama (HF format) and a word-level tokenizer; returns parameters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "add_bos_token": False}))
    return sum(p.numel() for p in model.parameters())


def make_prompts(n: int, vocab: int, seed: int, small: bool) -> list[BenchRequest]:
    rng = random.Random(seed)
    lo_in, hi_in, lo_out, hi_out = (16, 64, 4, 16) if small else (128, 1024, 32, 256)
    return [BenchRequest(i, [rng.randrange(3, vocab) for _ in range(rng.randint(lo_in, hi_in))],
                         rng.randint(lo_out, hi_out)) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pdcluster(model_dir: Path, requests: list[BenchRequest], concurrency: int, threads: int,
                  colocated: bool) -> dict:
    port = free_port()
    kv_blocks = concurrency * 1300 // 16 + 64
    args = [str(Path(sys.executable).parent / "pdcluster"), "serve", "--model", str(model_dir),
            "--port", str(port), "--num-kv-blocks", str(kv_blocks), "--log-level", "warning",
            "--max-num-batched-tokens", "1024"]
    # disaggregated means every request: the PD decider would keep some on the decode
    args += (["--colocated", "--torch-threads", str(threads)] if colocated else
             ["--torch-threads", str(max(1, threads // 2)), "--pd-decider", "always"])
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_healthy(port, server)
        client = ClientConfig(api_url=f"http://127.0.0.1:{port}/v1/completions",
                              model=model_dir.name)
        run = RunConfig(max_concurrency=concurrency, progress=False)
        warmup = [BenchRequest(0, requests[0].prompt[:16], 4)]  # first-call costs, untimed
        asyncio.run(run_benchmark(Workload(warmup), client, run))
        return asyncio.run(run_benchmark(Workload(requests), client, run))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def wait_healthy(port: int, server: subprocess.Popen, poll_s: float = 1.0) -> None:
    """Return once the server's /health answers, asking every `poll_s` s. Raises RuntimeError
    if it exits first or is not healthy within 300 s."""
    import urllib.request

    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(poll_s)
    raise RuntimeError("the server did not become healthy")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started with start_new_session), then
    SIGKILL if it has not exited within 60 s."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


@torch.inference_mode()
def run_hf(model_dir: Path, requests: list[BenchRequest], threads: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    model.generate(torch.tensor([requests[0].prompt[:16]]), do_sample=False, max_new_tokens=4,
                   pad_token_id=0)  # first-call costs, untimed
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        group = requests[i:i + batch]
        width = max(r.prompt_len for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(group):  # left padding
            ids[row, width - r.prompt_len:] = torch.tensor(r.prompt)
            mask[row, width - r.prompt_len:] = 1
        longest = max(r.output_len for r in group)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                       min_new_tokens=longest, pad_token_id=0)
    duration = time.perf_counter() - start
    total_output = sum(r.output_len for r in requests)
    return {"duration": duration, "output_throughput": total_output / duration,
            "completed": len(requests), "total_output_tokens": total_output}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="tiny model and lengths (smoke)")
    parser.add_argument("--modes", default="colocated,disaggregated,hf_sequential,hf_batched")
    parser.add_argument("--output", help="write the results JSON here")
    args = parser.parse_args()
    shape = SMALL if args.small else FULL
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        params = write_model(model_dir, shape, args.seed)
        requests = make_prompts(args.num_prompts, shape["vocab_size"], args.seed, args.small)
        print(f"model: {params / 1e6:.1f}M parameters; {len(requests)} prompts, "
              f"{sum(r.prompt_len for r in requests)} input / "
              f"{sum(r.output_len for r in requests)} output tokens; {args.threads} threads")
        results = {}
        for mode in modes:
            if mode in ("colocated", "disaggregated"):
                results[mode] = run_pdcluster(model_dir, requests, args.concurrency,
                                              args.threads, mode == "colocated")
            else:
                results[mode] = run_hf(model_dir, requests, args.threads,
                                       1 if mode == "hf_sequential" else args.concurrency)
            r = results[mode]
            print(f"{mode:>14}: {r['duration']:8.1f} s  {r['output_throughput']:8.1f} out tok/s")
    report(results)
    if args.output:
        slim = {m: {k: v for k, v in r.items() if k != "requests"} for m, r in results.items()}
        Path(args.output).write_text(json.dumps(slim, indent=2))
    return 0


def report(results: dict) -> None:
    print("\n| mode | wall s | output tok/s | ×hf_sequential | ×hf_batched | "
          "TTFT p50/p99 ms | TPOT p50/p99 ms |\n|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        ratio = {b: r["output_throughput"] / results[b]["output_throughput"]
                 for b in ("hf_sequential", "hf_batched") if b in results}
        lat = (f"{r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} | "
               f"{r['median_tpot_ms']:.1f}/{r['p99_tpot_ms']:.1f}") if "median_ttft_ms" in r \
            else "– | –"
        print(f"| {mode} | {r['duration']:.1f} | {r['output_throughput']:.1f} | "
              f"{ratio.get('hf_sequential', float('nan')):.2f} | "
              f"{ratio.get('hf_batched', float('nan')):.2f} | {lat} |")


if __name__ == "__main__":
    sys.exit(main())
