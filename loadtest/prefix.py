"""Offline prefix-cache hit ratio: the bound an infinite cache reaches on the prompts sent.

Defined at the server's block granularity B (`--block-size`, pdcluster's default 16) so it is
directly comparable with the server's counters `pdcluster_prefix_cache_queried_tokens_total`
and `pdcluster_prefix_cache_hit_tokens_total`, which follow vLLM's prefix-cache stats
(`queries += prompt tokens`, `hits += tokens served from cache`). Prompts are taken in send
order; for each prompt of L tokens:

    keys    = chained keys of its ⌊L/B⌋ full blocks (block i's key covers blocks 0..i;
              engine.core.hashing's, as the workers key them, all in one namespace)
    hit     = B · (number of leading keys already seen), capped at B·⌊(L−1)/B⌋ when
              `cap_last_token` (vLLM: the last prompt token is always computed, to get logits,
              so a fully cached prompt that is a whole number of blocks recomputes its last block)
    queried = L                 (denominator "prompt", vLLM's and pdcluster's definition)
            | B · ⌊L/B⌋         (denominator "full_blocks": only cacheable tokens)
    then every key of the prompt is marked seen (an infinite cache evicts nothing).

ratio = Σ hit / Σ queried. Only full blocks are ever hits, as only full blocks are keyed
(a key names a full block's tokens). Requests racing on the same new prefix may both miss on a real
server where this bound counts the second as a hit; at trace arrival rates that is rare.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdcluster.engine.core.hashing import block_keys

DENOMINATORS = ("prompt", "full_blocks")


@dataclass(frozen=True)
class PrefixHits:
    """Per-prompt offline hits, in send order."""

    queried: list[int]
    hit: list[int]

    @property
    def ratio(self) -> float | None:
        total = sum(self.queried)
        return sum(self.hit) / total if total else None


def offline_prefix_hits(prompts: Iterable[Sequence[int]], block_size: int = 16,
                        denominator: str = "prompt", cap_last_token: bool = True) -> PrefixHits:
    """Infinite-cache hits of `prompts` taken in order (see the module docstring).

    Raises:
        ValueError: block_size < 1 or an unknown denominator.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if denominator not in DENOMINATORS:
        raise ValueError(f"denominator must be one of {DENOMINATORS} (got {denominator!r})")
    seen: set[bytes] = set()
    queried: list[int] = []
    hit: list[int] = []
    for prompt in prompts:
        keys = block_keys(prompt, block_size, b"")
        hit.append(_hit_tokens(keys, seen, len(prompt), block_size, cap_last_token))
        queried.append(len(prompt) if denominator == "prompt" else len(keys) * block_size)
        seen.update(keys)
    return PrefixHits(queried=queried, hit=hit)


def _hit_tokens(keys: list[bytes], seen: set[bytes], n: int, block_size: int,
                cap_last_token: bool) -> int:
    """Tokens of a prompt of `n` tokens with block keys `keys` an infinite cache holding
    `seen` serves: its leading seen blocks, capped to leave the last token computed."""
    cached = 0
    while cached < len(keys) and keys[cached] in seen:
        cached += 1
    hit_tokens = cached * block_size
    if cap_last_token:
        hit_tokens = min(hit_tokens, block_size * ((n - 1) // block_size) if n else 0)
    return hit_tokens


@dataclass(frozen=True)
class SentRequest:
    """A request as the conversation bound sees it: its prompt, the tokens whose KV it held
    when it finished (prompt and all output tokens but the last, which no forward ran; None
    when it failed), and when it was sent and finished (s after the benchmark start)."""

    prompt: Sequence[int]
    kv_ids: Sequence[int] | None
    start_s: float
    end_s: float


def conversation_prefix_hits(requests: Sequence[SentRequest], block_size: int = 16,
                             cap_last_token: bool = True) -> PrefixHits:
    """Infinite-cache hits when replies are cached too: the bound of decode-side publishing.

    As `offline_prefix_hits` (denominator "prompt"), except that a request's full blocks of
    prompt and reply (`kv_ids`) become hits for every request sent after it finished. Results
    are in the order of `requests`.

    Raises:
        ValueError: block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    # at equal times a finish comes first: a turn is sent the instant its previous one ended
    events = sorted([(r.start_s, 1, i) for i, r in enumerate(requests)]
                    + [(r.end_s, 0, i) for i, r in enumerate(requests) if r.kv_ids is not None])
    seen: set[bytes] = set()
    hit = [0] * len(requests)
    for _, is_send, i in events:
        request = requests[i]
        if not is_send:
            seen.update(block_keys(list(request.kv_ids), block_size, b""))
            continue
        keys = block_keys(list(request.prompt), block_size, b"")
        hit[i] = _hit_tokens(keys, seen, len(request.prompt), block_size, cap_last_token)
        seen.update(keys)
    return PrefixHits(queried=[len(r.prompt) for r in requests], hit=hit)
