"""What structured output costs: `pdcluster bench run` output throughput with a JSON schema
against the same load without one, on one server in one invocation.

    .venv/bin/python benchmarks/structured_output.py [--num-requests 64] [--concurrency 32]
        [--rounds 2] [--colocated]

The model is throughput.py's random 100M Llama (fp32, vocab 32,000) with a byte-level BPE
tokenizer of the same vocabulary trained here on the venv's Python sources, so JSON can be
spelled in its tokens (throughput.py's word-level vocabulary has none of `{`, `"` or `:`).
Every request has a random 256-token prompt and 128 output tokens (`ignore_eos`); the schema
asks for an object holding an array of at least 1,000 strings, so no constrained request
completes its grammar before max_tokens and both runs generate the same number of tokens, each
under a token mask. Runs alternate (free, constrained, free, ...) after a warm-up; the ratio is
of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from benchmarks.throughput import FULL, free_port, stop_server, wait_healthy, write_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "string"}, "minItems": 1000}},
    "required": ["notes"], "additionalProperties": False}
CORPUS_BYTES = 32 << 20


def write_bpe_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE (GPT-2's scheme) of `vocab_size` ids, <unk> <s> </s> first, trained on
    the Python sources beside this interpreter; replaces throughput.py's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files, total = [], 0
    for path in sorted(Path(sys.prefix).rglob("*.py")):
        files.append(str(path))
        total += path.stat().st_size
        if total > CORPUS_BYTES:
            break
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size,
                                         special_tokens=["<unk>", "<s>", "</s>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(model_dir / "tokenizer.json"))


def bench(port: int, model: str, args, label: str, extra_body: dict | None, out: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "pdcluster"), "bench", "run",
           "--base-url", f"http://127.0.0.1:{port}", "--model", model,
           "--input-len", "256", "--output-len", "128", "--num-requests", str(args.num_requests),
           "--max-concurrency", str(args.concurrency), "--seed", str(args.seed),
           "--tokenizer", str(out.parent / "model"), "--result-dir", str(out),
           "--result-filename", f"{label}.json", "--label", label, "--no-report",
           "--disable-tqdm"]
    if extra_body is not None:
        cmd += ["--extra-body", json.dumps(extra_body)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((out / f"{label}.json").read_text())
    assert result["failed"] == 0, f"{label}: {result['failed']} requests failed"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--colocated", action="store_true",
                        help="one colocated worker (default: 1 prefill + 1 decode)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, FULL, args.seed)
        write_bpe_tokenizer(model_dir, FULL["vocab_size"])
        port = free_port()
        serve = [str(Path(sys.executable).parent / "pdcluster"), "serve", "--model",
                 str(model_dir), "--port", str(port), "--num-kv-blocks",
                 str(args.concurrency * 400 // 16 + 64), "--log-level", "warning"]
        serve += (["--colocated", "--torch-threads", "2"] if args.colocated
                  else ["--torch-threads", "1", "--pd-decider", "always"])
        server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        constrained = {"structured_outputs": {"json": SCHEMA}}
        try:
            wait_healthy(port, server)
            runs: dict[str, list[dict]] = {"free": [], "json_schema": []}
            out = Path(tmp) / "results"
            for r in range(-1, args.rounds):  # round -1 warms both paths up, untimed
                for label, body in (("free", None), ("json_schema", constrained)):
                    result = bench(port, "model", args, f"{label}-{r + 1}", body, out)
                    if r >= 0:
                        runs[label].append(result)
                        print(f"round {r + 1} {label:>11}: "
                              f"{result['output_throughput']:7.1f} out tok/s, "
                              f"TPOT p50 {result['median_tpot_ms']:6.1f} ms, "
                              f"{result['total_output_tokens']} tokens")
        finally:
            stop_server(server)
    free = statistics.median(r["output_throughput"] for r in runs["free"])
    schema = statistics.median(r["output_throughput"] for r in runs["json_schema"])
    tpot = {k: statistics.median(r["median_tpot_ms"] for r in v) for k, v in runs.items()}
    print(f"\n| run | output tok/s | TPOT p50 ms |\n|---|---:|---:|\n"
          f"| free | {free:.1f} | {tpot['free']:.1f} |\n"
          f"| JSON schema | {schema:.1f} | {tpot['json_schema']:.1f} |\n"
          f"\nconstrained / free: {schema / free:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
