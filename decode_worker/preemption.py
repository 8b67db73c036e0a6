"""Preemption of a running decode request when the paged cache runs out of blocks.

The scheduler preempts the newest running request (vLLM's policy: last come, first preempted)
and resumes preempted requests first, before any new one (first come, first served). Two modes
(`--preemption-mode`, vLLM's names):

- recompute: drop the request's blocks; on resume, re-prefill prompt + generated tokens on this
  decode worker (chunked by max_num_batched_tokens) and continue.
- swap: copy the request's blocks to host memory and free them; on resume, copy them back.

Either way the request continues with identical output: its KV is rebuilt bit for bit (same
kernels, same positions) and sampling draws token t from the (seed, t) stream.
"""

from __future__ import annotations

import abc
import logging
import math
from typing import TYPE_CHECKING

from engine.protocol import FinishReason
from engine.runner import SequenceChunk
from engine.sampler import SampleInput, sample

if TYPE_CHECKING:  # the engine imports this module
    from decode_worker.engine import DecodeEngine, DecodeSequence

log = logging.getLogger(__name__)


class PreemptionMode(abc.ABC):
    @abc.abstractmethod
    def preempt(self, engine: "DecodeEngine", seq: "DecodeSequence") -> None:
        """Release seq's blocks (keeping whatever resume needs)."""

    @abc.abstractmethod
    def resume(self, engine: "DecodeEngine", seq: "DecodeSequence") -> bool:
        """Give seq blocks again and restore its KV; False (nothing taken) if they don't fit."""


def prefill_locally(engine: "DecodeEngine", tokens: list[int], block_table: list[int]):
    """Run tokens through the model from position 0 into block_table, in chunks of at most
    max_num_batched_tokens. Returns the last token's logits [1, vocab]."""
    budget = engine.runner.engine_config.max_num_batched_tokens
    logits = None
    for start in range(0, len(tokens), budget):
        chunk = tuple(tokens[start:start + budget])
        logits = engine.runner.execute([SequenceChunk(chunk, start, block_table)])
    return logits


def prefill_colocated(engine: "DecodeEngine", seq: "DecodeSequence") -> None:
    """Colocated mode: prefill the prompt into seq's blocks here and sample output token 0
    (no transfer); the request then runs, or finishes if token 0 already stops it."""
    prompt = list(seq.request.prompt_token_ids)
    logits = prefill_locally(engine, prompt, seq.block_table)
    [(token, logprob)] = sample(logits, [SampleInput(seq.request.sampling, seq.seed, prompt, ())],
                                engine.eos_token_ids)
    seq.output_ids.append(token)
    finish = engine._check_stop(seq)
    if finish is not None:
        engine._finish(seq, finish, new_tokens=(token,), logprob=logprob)
        return
    from decode_worker.engine import RequestStatus  # the engine imports this module

    seq.status = RequestStatus.RUNNING
    seq.emit(engine._delta(seq, (token,), None, logprob=logprob))


def recompute_prompt(engine: "DecodeEngine", seq: "DecodeSequence") -> bool:
    """A KV fetch failed for good (after its retry): compute the prompt's KV into seq's
    blocks here instead (its output so far is kept: output token 0 came from the prefill).
    False: the recompute failed too and the request ended with an error."""
    prompt = list(seq.request.prompt_token_ids)
    try:
        prefill_locally(engine, prompt, seq.block_table)
    except Exception as exc:  # noqa: BLE001 — this request fails, the engine goes on
        log.exception("recomputing %s failed", seq.request_id,
                      extra={"request_id": seq.request_id})
        engine._finish(seq, FinishReason.ERROR, f"KV fetch and recompute failed: {exc}")
        return False
    engine.num_fetch_recomputes_total += 1
    engine.num_recomputed_tokens_total += len(prompt)
    return True


def _blocks_for(engine: "DecodeEngine", seq: "DecodeSequence") -> int:
    """Blocks covering every token the next step attends to (the fed token included)."""
    return math.ceil(seq.num_tokens / engine.block_size)


class RecomputePreemption(PreemptionMode):
    def preempt(self, engine: "DecodeEngine", seq: "DecodeSequence") -> None:
        engine.pool.free(seq.block_table)
        seq.block_table = []

    def resume(self, engine: "DecodeEngine", seq: "DecodeSequence") -> bool:
        needed = _blocks_for(engine, seq)
        if needed > engine.pool.num_free_blocks:
            return False
        seq.block_table = engine.pool.allocate(needed)
        tokens = list(seq.request.prompt_token_ids) + seq.output_ids[:-1]
        prefill_locally(engine, tokens, seq.block_table)
        engine.num_recomputed_tokens_total += len(tokens)
        return True


class SwapPreemption(PreemptionMode):
    def preempt(self, engine: "DecodeEngine", seq: "DecodeSequence") -> None:
        seq.swapped = engine.runner.wire_kv.read_blocks(seq.block_table).cpu()
        engine.pool.free(seq.block_table)
        seq.block_table = []

    def resume(self, engine: "DecodeEngine", seq: "DecodeSequence") -> bool:
        needed = max(_blocks_for(engine, seq), seq.swapped.shape[0])
        if needed > engine.pool.num_free_blocks:
            return False
        seq.block_table = engine.pool.allocate(needed)
        engine.runner.wire_kv.write_blocks(seq.block_table[: seq.swapped.shape[0]],
                                            seq.swapped.to(engine.runner.wire_kv.device))
        seq.swapped = None
        return True


PREEMPTION_MODES: dict[str, type[PreemptionMode]] = {
    "recompute": RecomputePreemption,
    "swap": SwapPreemption,
}
