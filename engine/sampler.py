"""Token sampling, reproducible per request.

The random draw for output token t of a request comes from a generator seeded with
step_seed(seed, t), never from a shared generator, so the same seed gives the same tokens
whatever the batch composition, after a recompute, or on another worker.
The logits processing follows vLLM's sampler: penalties, min_tokens masking, temperature,
min_p, top_k, top_p, then the draw; logprobs come from the raw logits.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass
from typing import AbstractSet, Sequence

import torch

from engine.protocol import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1


def draw_seed() -> int:
    """A fresh 63-bit seed for a request that did not ask for one."""
    return secrets.randbits(63)


def step_seed(seed: int, step: int) -> int:
    """Seed of the random stream for output token `step` of a request seeded with `seed`.

    SplitMix64 finalizer (Steele et al., "Fast splittable pseudorandom number generators",
    OOPSLA 2014) over seed and step, so nearby (seed, step) pairs give unrelated streams.
    Returns an int in [0, 2**63).
    """
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class SampleInput:
    """One row of a sampling batch.

    seed: the request's effective seed; prompt_ids / output_ids: the request's tokens so far
    (output_ids excludes the token being sampled). The token's step index is
    params.output_offset + len(output_ids): a migrated request carries its earlier output as
    the last output_offset prompt ids (SamplingParams.output_offset).
    """

    params: SamplingParams
    seed: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]

    def history(self) -> tuple[Sequence[int], Sequence[int]]:
        """(prompt ids, every output id so far) as the request was first submitted: the
        output_offset tail of prompt_ids moves to the output. Raises ValueError when
        output_offset exceeds the prompt."""
        k = self.params.output_offset
        if not k:
            return self.prompt_ids, self.output_ids
        if k > len(self.prompt_ids):
            raise ValueError(f"output_offset {k} exceeds the prompt's {len(self.prompt_ids)} ids")
        prompt = list(self.prompt_ids)
        return prompt[:-k], prompt[-k:] + list(self.output_ids)


def sample(logits: torch.Tensor, rows: Sequence[SampleInput],
           eos_token_ids: AbstractSet[int] = frozenset()) -> list[tuple[int, TokenLogprob | None]]:
    """Pick one token per row.

    logits: [num_rows, vocab], any float dtype (processed in float32).
    eos_token_ids: the model's EOS ids, masked (with the request's stop ids) while fewer than
        min_tokens tokens were generated, unless ignore_eos.
    Returns (token_id, logprob entry or None) per row. Greedy rows take the argmax; ties go to
    the lowest id, as torch.argmax and HF greedy do.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    logits = logits.float()
    if all(_is_plain_greedy(r) for r in rows):
        return [(t, None) for t in torch.argmax(logits, dim=-1).tolist()]
    return [_sample_row(logits[i], row, eos_token_ids) for i, row in enumerate(rows)]


def _is_plain_greedy(row: SampleInput) -> bool:
    p = row.params
    return (p.temperature == 0 and p.logprobs is None and not p.needs_history
            and len(row.output_ids) >= p.min_tokens)


def _sample_row(raw: torch.Tensor, row: SampleInput,
                eos_token_ids: AbstractSet[int]) -> tuple[int, TokenLogprob | None]:
    p = row.params
    prompt_ids, output_ids = row.history()
    logits = apply_penalties(raw.clone(), p, prompt_ids, output_ids)
    if len(row.output_ids) < p.min_tokens:  # min_tokens counts this run's tokens (see protocol)
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            logits[list(banned)] = float("-inf")
    probs = None
    if p.temperature > 0:
        probs = filter_probs(torch.softmax(logits / p.temperature, dim=-1), p)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            # extreme settings (a temperature or penalty that overflows the float32 logits to
            # inf): the distribution degenerates to its mode, so take the argmax
            probs = None
    if probs is None:
        token = int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))).item())
    else:
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(step_seed(row.seed, len(output_ids)))
        token = int(torch.multinomial(probs, 1, generator=gen).item())
    return token, (None if p.logprobs is None else token_logprob(raw, token, p.logprobs))


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """In place on a [vocab] row; returns it. vLLM's apply_penalties semantics."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                       vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.int64)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype)
        logits[ids] -= p.frequency_penalty * freq + p.presence_penalty
    return logits


def filter_probs(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """min_p, then top_k, then top_p on a [vocab] probability row; renormalized."""
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if p.top_k > 0 and p.top_k < probs.numel():
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= p.top_p * sorted_probs.sum()
        drop[0] = False  # the most likely token always stays (a top_p that underflows to 0)
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return probs / probs.sum()


def token_logprob(raw_logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The sampled token's logprob and the `top` most likely, from raw [vocab] logits."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    entries: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        entries = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), entries)
