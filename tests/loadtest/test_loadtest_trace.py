"""Mooncake trace → token-id requests: determinism, prefix sharing, scaling, drops, slicing."""

import json
from pathlib import Path

import pytest

from pdcluster.loadtest.prefix import offline_prefix_hits
from pdcluster.loadtest.tokens import TokenSpace, token_space_from_tokenizer
from pdcluster.loadtest.trace import read_trace, scaled_block_size, trace_workload

REAL_TRACE = Path(__file__).resolve().parents[3] / "shared/traces/mooncake/conversation_trace.jsonl"
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[2] / "engine/models/stories260K"


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TINY = [
    {"timestamp": 0, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1500, "output_length": 32, "hash_ids": [0, 1, 5]},
    {"timestamp": 2000, "input_length": 600, "output_length": 512, "hash_ids": [0, 9]},
    {"timestamp": 5000, "input_length": 3000, "output_length": 100,
     "hash_ids": [7, 8, 10, 11, 12, 13]},
]


def test_same_hash_id_same_tokens_and_prefix_sharing(tmp_path):
    records = read_trace(write_trace(tmp_path / "t.jsonl", TINY))
    w = trace_workload(records, TokenSpace(), length_scale=1 / 32)  # 16-token blocks
    a, b, c, _ = (r.prompt for r in w.requests)
    assert a[:32] == b[:32]                 # hash ids 0, 1 shared
    assert a[32:48] != b[32:48]             # 2 vs 5 differ
    assert a[:16] == c[:16] and a[16:32] != c[16:32]   # 0 shared, 1 vs 9 differ
    again = trace_workload(read_trace(tmp_path / "t.jsonl"), TokenSpace(), length_scale=1 / 32)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]
    other_seed = trace_workload(records, TokenSpace(), length_scale=1 / 32, seed=1)
    assert other_seed.requests[0].prompt != a


def test_length_scale_shrinks_inputs_outputs_and_block(tmp_path):
    records = read_trace(write_trace(tmp_path / "t.jsonl", TINY))
    assert scaled_block_size(1 / 32) == 16 and scaled_block_size(1 / 64) == 8
    w = trace_workload(records, TokenSpace(), length_scale=1 / 32)
    # 1100 = 2·512 + 76 → 2·16 + round(76/32)=2; 1500 = 2·512 + 476 → 32 + 15
    assert [r.prompt_len for r in w.requests] == [34, 47, 16 + 3, 5 * 16 + 14]
    assert [r.output_len for r in w.requests] == [2, 1, 16, 3]
    full = trace_workload(records, TokenSpace(), length_scale=1.0)
    assert [r.prompt_len for r in full.requests] == [1100, 1500, 600, 3000]
    assert full.requests[0].prompt[:1024] == full.requests[1].prompt[:1024]
    space = TokenSpace()
    assert all(3 <= t < 512 for r in full.requests for t in r.prompt)
    assert set(space.allowed.tolist()) == set(range(3, 512))


def test_drops_over_max_model_len_and_time_scale(tmp_path):
    records = read_trace(write_trace(tmp_path / "t.jsonl", TINY))
    w = trace_workload(records, TokenSpace(), length_scale=1 / 32, max_model_len=48,
                       time_scale=0.5)
    assert w.dropped == 1                                # 94 + 3 > 48
    assert [r.index for r in w.requests] == [0, 1, 2]
    assert [r.arrival_s for r in w.requests] == [0.0, 0.0, 1.0]   # 2000 ms · 0.5
    exact = trace_workload(records, TokenSpace(), length_scale=1 / 32, max_model_len=36)
    assert [r.index for r in exact.requests] == [0, 2]   # 34 + 2 = 36 fits exactly


def test_slice_start_and_num_requests(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", TINY)
    sliced = read_trace(path, start=1, num_requests=2)
    assert [r.index for r in sliced] == [1, 2]
    assert [r.hash_ids for r in sliced] == [(0, 1, 5), (0, 9)]
    w = trace_workload(sliced, TokenSpace(), length_scale=1 / 32, time_scale=1.0)
    assert [r.arrival_s for r in w.requests] == [0.0, 2.0]  # relative to the slice's first
    whole = trace_workload(read_trace(path), TokenSpace(), length_scale=1 / 32)
    assert w.requests[0].prompt == whole.requests[1].prompt  # same tokens whatever the slice
    assert read_trace(path, start=10) == []


def test_malformed_record_is_reported(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    with pytest.raises(ValueError, match="record 0"):
        read_trace(path)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="shared Mooncake trace not present")
def test_real_trace_prefix_sharing_reproduced_exactly():
    """With 16-token trace blocks and a 16-token server block, the offline hit ratio computed
    from the token ids equals the trace's own block-level reuse computed from hash ids."""
    records = read_trace(REAL_TRACE, 0, 400)
    w = trace_workload(records, TokenSpace(), length_scale=1 / 32)
    hits = offline_prefix_hits((r.prompt for r in w.requests), block_size=16,
                               denominator="full_blocks", cap_last_token=False)
    seen: set[int] = set()
    hit_blocks = full_blocks = 0
    for rec, req in zip(records, w.requests):
        n_full = req.prompt_len // 16
        ids = rec.hash_ids[:n_full]
        lead = 0
        while lead < len(ids) and ids[lead] in seen:
            lead += 1
        hit_blocks += lead
        full_blocks += n_full
        seen.update(ids)
    assert hit_blocks > 0
    assert sum(hits.hit) == 16 * hit_blocks and sum(hits.queried) == 16 * full_blocks


@pytest.mark.skipif(not (BUNDLED_TOKENIZER / "tokenizer.json").exists(),
                    reason="bundled model not present")
def test_token_space_from_bundled_tokenizer():
    space = token_space_from_tokenizer(BUNDLED_TOKENIZER)
    assert space == TokenSpace(vocab_size=512, special_ids=(0, 1, 2))
