"""A sliding-window model (the factory's Mistral, window 2 blocks) on the one engine core:
prompts of four windows in chunks and decodes past the window give transformers' greedy
tokens, the blocks a request holds stay at its window's once its prompt is computed (the
others go back to the pool), and a later request with the same prompt hits the cache on the
blocks its window sees although the prompt's first blocks were never cached."""

from __future__ import annotations

import random

import pytest

from pdcluster.decode_worker.instance import decode_core
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.engine_loop import run_once
from pdcluster.engine.core.kv_cache_manager import NULL_BLOCK
from pdcluster.engine.protocol import DecodeRequest, SamplingParams
from pdcluster.engine.runner import ModelRunner
from tests.engine.test_engine_core import HeldFetches, submit, tokens
from tests.models.factory import build, reference_greedy

BLOCK, WINDOW, NEW_TOKENS = 4, 8, 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-window")
    return path, build("mistral", path, sliding_window=WINDOW)


def engine(path):
    config = EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=64,
                          max_num_batched_tokens=2 * BLOCK + 1)
    return decode_core(ModelRunner(config), "decode-window", 0, HeldFetches())


def held(table: list[int]) -> int:
    return sum(b != NULL_BLOCK for b in table)


def test_long_prompt_and_decode_hold_only_the_window_and_equal_transformers(model):
    path, hf = model
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, 512) for _ in range(4 * WINDOW)]
    eng = engine(path)
    free_at_start = eng.kv.num_free_blocks
    out = submit(eng, DecodeRequest("long", tuple(prompt), GREEDY))
    most = 0
    while not (out and out[-1].finish_reason is not None):
        run_once(eng)
        request = eng.scheduler.active.get("long")
        if request is not None and request.num_computed_tokens >= len(prompt):
            most = max(most, held(request.block_table))
    # the window's blocks, the one being written and the lookahead's
    assert 0 < most <= WINDOW // BLOCK + 2
    assert tokens(out) == reference_greedy(hf, prompt, NEW_TOKENS)
    assert eng.kv.num_free_blocks == free_at_start

    again = submit(eng, DecodeRequest("again", tuple(prompt), GREEDY))
    run_once(eng)
    request = eng.scheduler.active["again"]
    # the hit ends where the prompt's cached tail does; the blocks before the window are NULL
    assert request.block_table[0] == NULL_BLOCK
    assert request.num_cached_tokens >= len(prompt) - 2 * BLOCK
    while not (again and again[-1].finish_reason is not None):
        run_once(eng)
    assert tokens(again) == tokens(out)
    eng.close()
