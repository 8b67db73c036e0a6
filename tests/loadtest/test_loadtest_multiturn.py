"""Multi-turn load: turn inference on Mooncake-style records, synthetic conversations, the
bound with replies cached (hand-counted), and whole runs against the real HTTP stub."""

import asyncio
import json
from pathlib import Path

import pytest

from pdcluster.loadtest.cli import main
from pdcluster.loadtest.client import ClientConfig
from pdcluster.loadtest.conversations import (REPLY_SLACK, infer_turns, synthetic_conversations,
                                              trace_conversations)
from pdcluster.loadtest.multiturn import run_conversations
from pdcluster.loadtest.prefix import SentRequest, conversation_prefix_hits
from pdcluster.loadtest.runner import RunConfig
from pdcluster.loadtest.synthetic import parse_length
from pdcluster.loadtest.tokens import TokenSpace
from pdcluster.loadtest.trace import TraceRecord, read_trace

REAL_TRACE = Path(__file__).resolve().parents[3] / "shared/traces/mooncake/conversation_trace.jsonl"


def rec(i: int, n_in: int, n_out: int, ids: list[int], t: float = 0.0) -> TraceRecord:
    return TraceRecord(i, t, n_in, n_out, tuple(ids))


def test_turns_follow_full_block_prefix_chains():
    records = [
        rec(0, 700, 100, [0, 1]),            # full block [0], partial 1
        rec(1, 830, 50, [0, 2]),             # extends 0's full block, room for 0's reply
        rec(2, 1000, 20, [0, 2]),            # extends 1 ([0]); 1 >= 830+50-32: turn 3
        rec(3, 1100, 10, [0, 2, 3]),         # 2's full block [0]: 2 is the latest with it
        rec(4, 5000, 10, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]),  # unrelated
    ]
    assert infer_turns(records) == {1: 0, 2: 1, 3: 2}


def test_ambiguous_children_and_too_short_prompts_start_their_own_conversation():
    records = [
        rec(0, 1100, 200, [0, 1, 2]),        # full blocks [0, 1]
        rec(1, 1600, 10, [0, 1, 3, 4]),      # room for 0's reply (1600 >= 1268): next turn
        rec(2, 1600, 10, [0, 1, 5, 6]),      # 0 is continued already: a conversation of its own
        rec(3, 1600 + 10 - REPLY_SLACK - 1, 5, [0, 1, 5, 9]),  # extends 2, no room for its reply
        rec(4, 1200, 5, [0, 7, 8]),          # shares block 0 only; no prompt is just that block
    ]
    assert infer_turns(records) == {1: 0}


def test_real_trace_chains_grow_by_a_reply_and_a_message():
    records = read_trace(REAL_TRACE, 0, 3000)
    parent = infer_turns(records)
    assert len(parent) > 500
    for child, p in parent.items():
        a, b = records[p], records[child]
        full = a.hash_ids[:a.input_length // 512]
        assert b.hash_ids[:len(full)] == full and p < child
        assert b.input_length >= a.input_length + a.output_length - REPLY_SLACK
    assert len(set(parent.values())) == len(parent)       # a chain: one next turn each


def test_trace_conversations_scale_lengths_and_keep_timestamps(tmp_path):
    records = [rec(0, 1100, 256, [0, 1, 2], 0), rec(1, 1100 + 256 + 64, 128, [0, 1, 3], 4000),
               rec(2, 300, 64, [9], 1000)]
    convs = trace_conversations(records, TokenSpace(), length_scale=1 / 32, time_scale=0.5)
    assert [len(c.turns) for c in convs.conversations] == [2, 1]
    first, second = convs.conversations[0].turns
    assert len(first.user_ids) == 16 + 16 + 2 and first.output_len == 8   # 76/32 → 2; 256/32
    assert len(second.user_ids) == 2 and second.output_len == 4           # 64/32, 128/32
    assert second.not_before_s == pytest.approx(2.0) and second.source == 1
    assert convs.conversations[1].turns[0].not_before_s == pytest.approx(0.5)
    fitted = trace_conversations(records, TokenSpace(), length_scale=1 / 32,
                                 max_model_len=34 + 8 + 2 + 3)
    assert [len(c.turns) for c in fitted.conversations] == [1, 1]
    assert fitted.dropped_turns == 1


def test_synthetic_conversations_are_deterministic_and_fit():
    args = (5, 3, parse_length("40"), parse_length("4:8"), parse_length("10"), TokenSpace())
    a = synthetic_conversations(*args, think_time_s=0.5, seed=3)
    b = synthetic_conversations(*args, think_time_s=0.5, seed=3)
    assert a == b and a.num_turns == 15
    for conv in a.conversations:
        first, *later = conv.turns
        assert len(first.user_ids) == 40 and all(4 <= len(t.user_ids) <= 8 for t in later)
        assert first.think_s == 0 and all(t.think_s >= 0 for t in later)
    # 40 + 10 + (≤ 8 + 10): a third turn never fits 60 tokens
    short = synthetic_conversations(*args, max_model_len=60, seed=3)
    assert all(len(c.turns) == 1 or len(c.turns) == 2 for c in short.conversations)
    assert short.dropped_turns >= 5


def test_bound_with_replies_hand_counted():
    b = 4
    reqs = [
        SentRequest([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], 0.0, 1.0),
        # sent before request 0 finished: only its prompt's block [1-4] is there
        SentRequest([1, 2, 3, 4, 5, 6, 7, 8, 1], None, 0.5, 0.6),
        # after: blocks [1-4][5-8] of prompt + reply; [9 ...] is not full
        SentRequest([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [], 1.0, 2.0),
        # a whole-block prompt fully cached recomputes its last block
        SentRequest([1, 2, 3, 4, 5, 6, 7, 8], None, 3.0, 3.0),
    ]
    hits = conversation_prefix_hits(reqs, b)
    assert hits.hit == [0, 4, 8, 4]
    assert hits.queried == [5, 9, 10, 8]
    assert conversation_prefix_hits(reqs, b, cap_last_token=False).hit == [0, 4, 8, 8]


def test_run_sends_history_plus_actual_reply_and_measures_per_turn(stub_server):
    convs = synthetic_conversations(4, 3, parse_length("40"), parse_length("8"),
                                    parse_length("20"), TokenSpace(), think_time_s=0.01)
    client = ClientConfig(api_url=f"{stub_server.url}/v1/completions", model="stub-model")
    run = RunConfig(metrics_url=f"{stub_server.url}/metrics", progress=False,
                    scrape_interval_s=0.1)
    result = asyncio.run(run_conversations(convs, client, run))
    assert result["completed"] == 12 and result["failed"] == 0
    assert all(body["return_token_ids"] for body in stub_server.bodies)
    by_prompt = {tuple(body["prompt"]) for body in stub_server.bodies}
    reply = [3 + i for i in range(20)]           # the stub's ids
    for conv in convs.conversations:
        history = list(conv.turns[0].user_ids)
        for turn in conv.turns[1:]:
            history = history + reply + turn.user_ids
            assert tuple(history) in by_prompt
    rows = {row["turn"]: row for row in result["turns"]}
    assert set(rows) == {1, 2, 3, "2+"} and rows["2+"]["completed"] == 8
    # the stub caches prompts only: its per-request reports sum to its /metrics counters
    cached = sum(r["cached_tokens"] for r in result["requests"])
    assert cached == result["prefix_cache_hit_tokens"]
    # ... and cannot reach the bound, which counts replies
    assert rows["2+"]["hit_ratio"] < rows["2+"]["offline_bound_hit_ratio"]
    assert rows[1]["offline_bound_hit_ratio"] == 0


def test_a_failed_turn_ends_its_conversation(stub_server):
    stub_server.behavior = lambda body: "fail" if len(body["prompt"]) > 50 else "ok"
    convs = synthetic_conversations(2, 3, parse_length("40"), parse_length("8"),
                                    parse_length("6"), TokenSpace())
    client = ClientConfig(api_url=f"{stub_server.url}/v1/completions", model="stub-model")
    result = asyncio.run(run_conversations(convs, client, RunConfig(progress=False)))
    assert result["completed"] == 2 and result["failed"] == 2
    assert result["abandoned_turns"] == 2


def test_cli_multi_turn_from_trace(stub_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 256,
             "hash_ids": [0, 1, 2]},
            {"timestamp": 100, "input_length": 1500, "output_length": 128,
             "hash_ids": [0, 1, 3]},
            {"timestamp": 50, "input_length": 700, "output_length": 64, "hash_ids": [4, 5]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    rc = main(["run", "--multi-turn", "--base-url", stub_server.url, "--trace", str(trace),
               "--length-scale", "1/32", "--result-dir", str(out),
               "--result-filename", "mt.json", "--disable-tqdm"])
    assert rc == 0
    result = json.loads((out / "mt.json").read_text())
    assert result["num_conversations"] == 2 and result["completed"] == 3
    assert [row["turn"] for row in result["turns"]] == [1, 2, "2+"]
    assert "## Per turn" in (out / "mt.md").read_text()
    assert main(["run", "--multi-turn", "--base-url", stub_server.url, "--trace", str(trace),
                 "--request-rate", "2", "--disable-tqdm", "--result-dir", str(out)]) == 2
