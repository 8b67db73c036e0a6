"""Token sampling: greedy and temperature, reproducible per request.

The random draw for output token t of a request comes from a generator seeded with
step_seed(seed, t), never from a shared generator, so the same seed gives the same tokens
whatever the batch composition, after a recompute, or on another worker (DESIGN.md "Sampling").
"""

from __future__ import annotations

import secrets
from typing import Sequence

import torch

from engine.protocol import SamplingParams

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


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           steps: Sequence[int]) -> list[int]:
    """Pick one token per row.

    logits: [num_seqs, vocab] float32 (any float dtype is upcast).
    params, seeds, steps: per row — the request's sampling params, its effective seed and the
        index of the output token being sampled (0 for the first token, from prefill).
    Returns a list of num_seqs token ids. Rows with temperature 0 take the argmax (ties go to
    the lowest id, as torch.argmax and HF greedy do).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} requests")
    logits = logits.float()
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(step_seed(seeds[i], steps[i]))
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
