"""Token sampling, reproducible per request.

The random draw for output token t of a request comes from a generator seeded with
step_seed(seed, t), never from a shared generator, so the same seed gives the same tokens
whatever the batch composition, after a recompute, or on another worker.
The logits processing follows vLLM's sampler in its order (SamplingParams); logprobs come
from the raw logits.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass
from typing import AbstractSet, Sequence

import torch

from pdcluster.engine.protocol import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
#: rows of a batch the sampling chain processes at once (sample)
_CHUNK_ROWS = 4


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
class TokenEdits:
    """A request's allowed_token_ids and logit_bias as CPU tensors, built once per request
    (Request.token_edits) rather than from its Python tuples at every step.

    allowed: int64 [k] or None; bias_ids: int64 [m], bias: float32 [m], or both None.
    """

    allowed: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> TokenEdits | None:
        """None when the params edit no token."""
        if params.allowed_token_ids is None and not params.logit_bias:
            return None
        allowed = None if params.allowed_token_ids is None else \
            torch.tensor(params.allowed_token_ids, dtype=torch.int64)
        if not params.logit_bias:
            return cls(allowed)
        pairs = torch.tensor(params.logit_bias, dtype=torch.float64)  # [m, 2]: id, bias
        return cls(allowed, pairs[:, 0].to(torch.int64), pairs[:, 1].to(torch.float32))


@dataclass(frozen=True)
class SampleInput:
    """One row of a sampling batch.

    seed: the request's effective seed; prompt_ids / output_ids: the request's tokens so far
    (output_ids excludes the token being sampled). The token's step index is
    params.output_offset + len(output_ids): a migrated request carries its earlier output as
    the last output_offset prompt ids (SamplingParams.output_offset).
    edits: TokenEdits.of(params), when the caller keeps it across steps (else built here).
    """

    params: SamplingParams
    seed: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    edits: TokenEdits | None = None

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

    Temperature, min_p, top_k, top_p and the draw run as tensor ops over the batch; the
    logits edits before them (SamplingParams.edits_logits, min_tokens masking) and logprobs
    touch single rows, and only the rows that ask for them. The draw reproduces
    torch.multinomial(probs, 1, generator) on each row: that op samples one token as
    argmax(probs / q) with q ~ Exp(1) drawn from the generator over the whole row, so filling
    row i of q from row i's own (seed, step) generator keeps every row's stream independent
    of the batch.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    raw = logits.float()
    if all(_is_plain_greedy(r) for r in rows):
        return [(t, None) for t in torch.argmax(raw, dim=-1).tolist()]
    logits = _processed_logits(raw, rows, eos_token_ids)
    hot = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    chosen: list[int | None] = [None] * len(rows)
    # a few rows at a time: the chain's [rows, vocab] intermediates then stay in the core's
    # L2 cache between ops, which a whole batch of them does not
    for start in range(0, len(hot), _CHUNK_ROWS):
        chunk = hot[start:start + _CHUNK_ROWS]
        params = [rows[i].params for i in chunk]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = filter_probs(torch.softmax(logits[chunk] / temperature[:, None], dim=-1),
                             params)
        q = torch.empty_like(probs)
        for j, i in enumerate(chunk):
            gen = torch.Generator(device=q.device)
            gen.manual_seed(step_seed(rows[i].seed, _step(rows[i])))
            q[j].exponential_(1, generator=gen)
        # a row sum is finite and positive only when every entry is (entries are <= 1); a
        # row without one (a temperature or penalty that overflows the float32 logits to
        # inf) leaves no distribution and degenerates to its mode, the argmax below
        mass = probs.sum(dim=-1)
        valid = (torch.isfinite(mass) & (mass > 0)).tolist()
        for i, token, ok in zip(chunk, torch.argmax(probs / q, dim=-1).tolist(), valid):
            if ok:
                chosen[i] = token
    cold = [i for i, token in enumerate(chosen) if token is None]
    if cold:
        modes = torch.argmax(torch.nan_to_num(logits[cold], nan=float("-inf")), dim=-1)
        for i, token in zip(cold, modes.tolist()):
            chosen[i] = token
    out: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in chosen]
    for i, r in enumerate(rows):
        if r.params.logprobs is not None:
            out[i] = (chosen[i], token_logprob(raw[i], chosen[i], r.params.logprobs))
    return out


def _is_plain_greedy(row: SampleInput) -> bool:
    p = row.params
    return (p.temperature == 0 and p.logprobs is None and not p.edits_logits
            and len(row.output_ids) >= p.min_tokens)


def _step(row: SampleInput) -> int:
    """The index of the output token being sampled, counting tokens made before a move.
    Raises ValueError when output_offset exceeds the prompt."""
    _, output_ids = row.history()
    return len(output_ids)


def _processed_logits(raw: torch.Tensor, rows: Sequence[SampleInput],
                      eos_token_ids: AbstractSet[int]) -> torch.Tensor:
    """raw with each row's edits applied in vLLM's order: allowed_token_ids, bad words,
    min_tokens masking, logit_bias, penalties; raw itself when no row asks for any (raw is
    kept intact for logprobs). Ids past the row's vocabulary are ignored."""
    edits = [i for i, r in enumerate(rows)
             if r.params.edits_logits or len(r.output_ids) < r.params.min_tokens]
    if not edits:
        return raw
    logits = raw.clone()
    vocab, device = logits.shape[-1], logits.device
    for i in edits:
        row, p, values = rows[i], rows[i].params, logits[i]
        prompt_ids, output_ids = row.history()
        tensors = row.edits if row.edits is not None else TokenEdits.of(p)
        if tensors is not None and tensors.allowed is not None:
            allowed = tensors.allowed[tensors.allowed < vocab].to(device)
            outside = torch.ones(vocab, dtype=torch.bool, device=device)
            outside[allowed] = False
            values.masked_fill_(outside, float("-inf"))
        banned = {w[-1] for w in p.bad_words_token_ids
                  if len(w) - 1 <= len(output_ids)
                  and list(output_ids[len(output_ids) - len(w) + 1:]) == list(w[:-1])}
        if len(row.output_ids) < p.min_tokens:  # this run's tokens (see protocol)
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            values[sorted(t for t in banned if t < vocab)] = float("-inf")
        if tensors is not None and tensors.bias_ids is not None:
            inside = tensors.bias_ids < vocab
            values.index_add_(0, tensors.bias_ids[inside].to(device),
                              tensors.bias[inside].to(device, values.dtype))
        if p.needs_history:
            apply_penalties(values, p, prompt_ids, output_ids)
    return logits


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """In place on a [vocab] row; returns it. vLLM's apply_penalties semantics."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64,
                            device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                       vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.int64, device=logits.device)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= p.frequency_penalty * freq + p.presence_penalty
    return logits


def filter_probs(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k, then top_p, each row with its own params; renormalized.

    probs: [rows, vocab] float probabilities, one row per entry of params. Returns a new
    [rows, vocab] tensor whose rows sum to 1 (NaN where a row kept no mass). A row with the
    filter off is left as it is, so one batch mixes requests with and without them.
    """
    vocab, device = probs.shape[-1], probs.device
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
    if bool((min_p > 0).any()):
        floor = min_p * probs.max(dim=-1).values
        probs = torch.where(probs < floor[:, None], torch.zeros_like(probs), probs)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params],
                         device=device)
    if bool((top_k > 0).any()):
        k_max = int(top_k.max())
        largest = torch.topk(probs, k_max, dim=-1).values
        kth = largest.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, torch.zeros_like(kth))
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)
    if bool((top_p < 1.0).any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= (top_p * sorted_probs.sum(dim=-1))[:, None]
        drop[:, 0] = False  # the most likely token always stays (a top_p that underflows to 0)
        drop &= (top_p < 1.0)[:, None]
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill_(drop, 0))
    return probs / probs.sum(dim=-1, keepdim=True)


def prompt_logprobs(raw_logits: torch.Tensor, targets: Sequence[int], top: int
                    ) -> list[TokenLogprob]:
    """Each target token's logprob, its rank and the `top` most likely, from the raw logits of
    the position before it (vLLM's prompt_logprobs).

    raw_logits: [len(targets), vocab], any float dtype; row i is the distribution target i was
    drawn from. rank: 1 + the number of tokens more likely than the target.
    """
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top > 0:
        values, top_ids = torch.topk(logprobs, top)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, entries, rank)
            for t, lp, entries, rank in zip(targets, chosen[:, 0].tolist(), tops, ranks)]


def token_logprob(raw_logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The sampled token's logprob and the `top` most likely, from raw [vocab] logits."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    entries: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        entries = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), entries)
