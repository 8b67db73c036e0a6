"""Child process of test_triton_engine: greedy decoding on the bundled model with each backend.

Run with TRITON_INTERPRET=1 in the environment (the Triton backend on CPU needs the
interpreter). argv[1]: JSON list of prompts (token-id lists); argv[2]: tokens to generate.
Prints one JSON line: {"tokens": {backend: [[ids per prompt]]}, "max_logit_diff": float,
"seconds": {backend: float}}.

The batch mixes every attention path: prompt 0 is prefilled in two chunks (the second over its
cached first chunk, batched with the whole of prompt 1: varlen prefill), then both decode
together one token per step (decode kernel), crossing a block boundary.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from pdcluster import kernels
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.runner import ModelRunner, SequenceChunk


def greedy(prompts: list[list[int]], num_tokens: int, runner: ModelRunner | None = None,
           **config: object) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens per prompt and each step's logits, on `runner` or a new one with
    EngineConfig(**config) (the bundled model, 16 blocks of 16 tokens unless overridden);
    prompt i's table is blocks 8i..8i+7."""
    runner = runner or ModelRunner(EngineConfig(**{"num_kv_blocks": 16, "block_size": 16, **config}))
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    split = len(prompts[0]) // 2
    runner.execute([SequenceChunk(seqs[0][:split], 0, tables[0])])
    chunks = [SequenceChunk(seqs[0][split:], split, tables[0])]
    chunks += [SequenceChunk(seq, 0, table) for seq, table in zip(seqs[1:], tables[1:])]
    logits = [runner.execute(chunks)]
    for step in range(num_tokens):
        for seq, row in zip(seqs, logits[-1]):
            seq.append(int(row.argmax()))
        if step + 1 < num_tokens:
            chunks = [SequenceChunk(seq[-1:], len(seq) - 1, table) for seq, table in zip(seqs, tables)]
            logits.append(runner.execute(chunks))
    return [seq[len(p):] for seq, p in zip(seqs, prompts)], logits


def main() -> None:
    prompts, num_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
    tokens, logits, seconds = {}, {}, {}
    for backend in ("torch", "triton"):
        kernels.set_backend(backend)
        start = time.perf_counter()
        tokens[backend], logits[backend] = greedy(prompts, num_tokens)
        seconds[backend] = round(time.perf_counter() - start, 2)
    diff = max((a - b).abs().max().item() for a, b in zip(logits["torch"], logits["triton"]))
    print(json.dumps({"tokens": tokens, "max_logit_diff": diff, "seconds": seconds}))


if __name__ == "__main__":
    main()
