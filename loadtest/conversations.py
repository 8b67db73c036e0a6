"""Multi-turn conversations (`pdcluster bench run --multi-turn`): what each turn adds.

Turn 1 sends a conversation's first prompt. Turn k > 1 sends the whole history: the previous
turn's prompt, the reply the server actually returned for it (its token ids, so no
tokenization round trip can change them), and the turn's new user message. A turn goes out
`think_s` after the previous reply ended, and not before `not_before_s` (seconds after the
benchmark start), as in vLLM's multi-turn benchmark (benchmarks/multi_turn).

Synthetic: N conversations of K turns; first prompts as the synthetic workload draws them
(`--input-len`, with any shared prefix), user messages of `--user-len` tokens, replies of
`--output-len`, think times exponential with mean `--think-time`, conversation starts at
`--request-rate` (default: all at once).

Trace (Mooncake's conversation trace): records carry no conversation id, only
`timestamp, input_length, output_length, hash_ids` (512-token prefix block hashes), so turns
are inferred from prefix chains. Records are taken in order; record r's parent is an earlier
record p such that

    * every full block of p's prompt is a prefix of r's hash ids (p's last block, when partial,
      is not: the next turn fills it with the reply, so its hash changes),
    * r's prompt has room for p's prompt and reply: input_r ≥ input_p + output_p − REPLY_SLACK
      (the slack absorbs the chat template's few tokens around the reply), and
    * p has no next turn yet.

Ambiguity: among the candidates, the one sharing the most blocks wins, then the most recent.
A prompt that extends a record that already has a next turn (a regenerated reply, or two users
of one shared system prompt) starts a conversation of its own, as does one that shares only a
prefix too short for the reply. Record 0's first block, shared by every record of the trace, is
thereby never a conversation on its own: a one-block prompt has no room for another's reply.

A trace conversation's turn 1 is the record's prompt as trace replay builds it
(`loadtest.trace.record_prompt`); turn k > 1 appends the actual reply and a user message of
max(1, input_r − input_p − output_p) tokens (scaled by the length scale), and goes out at the
record's own (time-scaled) timestamp or when the previous reply ended, whichever is later.
Turns that no longer fit `max_model_len` (prompt plus reply, with replies of their requested
length) are dropped with the rest of their conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdcluster.loadtest.arrivals import trace_arrivals
from pdcluster.loadtest.synthetic import LengthDist, synthetic_workload
from pdcluster.loadtest.tokens import BlockTokens, TokenSpace
from pdcluster.loadtest.trace import TRACE_BLOCK_SIZE, TraceRecord, record_prompt, scaled_block_size

REPLY_SLACK = 32


@dataclass(frozen=True)
class Turn:
    """One request of a conversation.

    Attributes:
        user_ids: turn 1: the whole first prompt; later turns: the user message appended after
            the previous reply.
        output_len: `max_tokens` of the turn.
        not_before_s: earliest send time, seconds after the benchmark start.
        think_s: seconds between the previous reply's end and this turn (0 for turn 1).
        source: the trace record it stands for (None: synthetic).
    """

    user_ids: list[int]
    output_len: int
    not_before_s: float = 0.0
    think_s: float = 0.0
    source: int | None = None


@dataclass(frozen=True)
class Conversation:
    id: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class ConversationSet:
    """Conversations plus what was left out: `dropped_turns` did not fit `max_model_len`."""

    conversations: list[Conversation]
    dropped_turns: int = 0
    description: str = ""
    params: dict = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def _fit(turns: list[Turn], max_model_len: int | None) -> tuple[list[Turn], int]:
    """The turns whose history plus reply fits `max_model_len`; the first that does not ends
    the conversation. Returns (kept, dropped)."""
    if max_model_len is None:
        return turns, 0
    length = 0
    for k, turn in enumerate(turns):
        length += len(turn.user_ids)
        if length + turn.output_len > max_model_len:
            return turns[:k], len(turns) - k
        length += turn.output_len
    return turns, 0


def synthetic_conversations(num_conversations: int, num_turns: int, first_len: LengthDist,
                            user_len: LengthDist, output_len: LengthDist, space: TokenSpace, *,
                            think_time_s: float = 0.0, starts_s: list[float] | None = None,
                            shared_prefix_fraction: float = 0.0, num_prefix_groups: int = 1,
                            max_model_len: int | None = None, seed: int = 0) -> ConversationSet:
    """`num_conversations` conversations of `num_turns` turns (see the module docstring).

    Raises:
        ValueError: fewer than 1 conversation or turn, a negative think time, starts of the
            wrong length, or the synthetic workload's own errors.
    """
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("need at least one conversation and one turn")
    if think_time_s < 0:
        raise ValueError(f"think time must be >= 0 (got {think_time_s})")
    starts_s = starts_s if starts_s is not None else [0.0] * num_conversations
    first = synthetic_workload(num_conversations, first_len, output_len, space,
                               arrivals_s=starts_s,
                               shared_prefix_fraction=shared_prefix_fraction,
                               num_prefix_groups=num_prefix_groups, seed=seed)
    rng = np.random.default_rng([seed, 1])
    users = BlockTokens(space, seed, namespace="user")
    conversations, dropped = [], 0
    for c, request in enumerate(first.requests):
        outs = output_len.sample(rng, num_turns)
        lens = user_len.sample(rng, num_turns)
        thinks = rng.exponential(think_time_s, num_turns) if think_time_s > 0 else \
            np.zeros(num_turns)
        turns = [Turn(request.prompt, request.output_len, request.arrival_s)]
        turns += [Turn(users.get(c * num_turns + k, int(lens[k])), int(outs[k]),
                       think_s=float(thinks[k])) for k in range(1, num_turns)]
        kept, lost = _fit(turns, max_model_len)
        dropped += lost
        if kept:
            conversations.append(Conversation(c, tuple(kept)))
    return ConversationSet(
        conversations, dropped,
        description=(f"multi-turn synthetic {num_conversations}x{num_turns} "
                     f"first={first_len.spec} user={user_len.spec} out={output_len.spec}"),
        params={"multi_turn": True, "num_conversations": num_conversations,
                "num_turns": num_turns, "input_len": first_len.spec, "user_len": user_len.spec,
                "output_len": output_len.spec, "think_time_s": think_time_s,
                "shared_prefix_fraction": shared_prefix_fraction,
                "num_prefix_groups": num_prefix_groups, "max_model_len": max_model_len,
                "seed": seed})


def infer_turns(records: list[TraceRecord]) -> dict[int, int]:
    """Parent of each record that is a later turn, as positions in `records` (see the module
    docstring for the rule): {child: parent}."""
    latest: dict[tuple[int, ...], int] = {}  # full-block prefix → the latest record with it
    parent: dict[int, int] = {}
    continued: set[int] = set()
    for i, record in enumerate(records):
        ids = record.hash_ids
        for k in range(len(ids), 0, -1):
            p = latest.get(ids[:k])
            if p is None:
                continue
            prev = records[p]
            if (p not in continued and record.input_length
                    >= prev.input_length + prev.output_length - REPLY_SLACK):
                parent[i] = p
                continued.add(p)
            break
        full = ids[:record.input_length // TRACE_BLOCK_SIZE]
        if full:
            latest[full] = i
    return parent


def trace_conversations(records: list[TraceRecord], space: TokenSpace, *,
                        length_scale: float = 1.0, time_scale: float = 1.0,
                        max_model_len: int | None = None, seed: int = 0,
                        source: str = "trace") -> ConversationSet:
    """Conversations inferred from `records` (see the module docstring)."""
    block = scaled_block_size(length_scale)
    scale = block / TRACE_BLOCK_SIZE
    blocks = BlockTokens(space, seed, namespace="mooncake")
    users = BlockTokens(space, seed, namespace="mooncake-user")
    arrivals = trace_arrivals([r.timestamp_ms for r in records], time_scale)
    parent = infer_turns(records)
    chains: dict[int, list[int]] = {}
    root: dict[int, int] = {}
    for i in range(len(records)):
        root[i] = root[parent[i]] if i in parent else i
        chains.setdefault(root[i], []).append(i)
    conversations, dropped = [], 0
    for c, (head, chain) in enumerate(sorted(chains.items())):
        turns = []
        for k, i in enumerate(chain):
            record = records[i]
            out = max(1, round(record.output_length * scale))
            if k == 0:
                turns.append(Turn(record_prompt(record, block, blocks), out, arrivals[i],
                                  source=record.index))
                continue
            prev = records[chain[k - 1]]
            n_user = max(1, round((record.input_length - prev.input_length
                                   - prev.output_length) * scale))
            turns.append(Turn(users.get(record.index, n_user), out, arrivals[i],
                              source=record.index))
        kept, lost = _fit(turns, max_model_len)
        dropped += lost
        if kept:
            conversations.append(Conversation(c, tuple(kept)))
    first = records[0].index if records else 0
    return ConversationSet(
        conversations, dropped,
        description=f"multi-turn trace {source}[{first}:{first + len(records)}]",
        params={"multi_turn": True, "trace": source, "start": first,
                "num_requests": len(records), "num_conversations": len(conversations),
                "length_scale": length_scale, "trace_block_size": block,
                "time_scale": time_scale, "max_model_len": max_model_len, "seed": seed})
