"""Structured output in the engine core: the batch bitmask against llguidance's matchers, and a
constrained request that moves (its earlier output carried as the prompt's tail) continuing
token for token as if it had not."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from pdcluster.engine.config import BUNDLED_MODEL, EngineConfig
from pdcluster.engine.core.engine_loop import run_once
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.structured_output import StructuredOutputManager, apply_bitmask
from pdcluster.engine.protocol import (DecodeRequest, FinishReason, SamplingParams,
                                       StructuredOutputSpec)
from pdcluster.engine.runner import ModelRunner
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.decode_worker.instance import decode_core
from pdcluster.kvstore.config import KVTransferConfig
from pdcluster.kvstore.transport.fetch import FetchConnector

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["kind", "toys"], "additionalProperties": False}
SPEC = StructuredOutputSpec("json", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(BUNDLED_MODEL)


def test_the_batch_bitmask_allows_exactly_what_each_matcher_accepts(tokenizer):
    manager = StructuredOutputManager(tokenizer, 512, (2,))
    regex = manager.compile(StructuredOutputSpec("regex", "(Tom|Sam) has [1-9] cats")).result()
    assert regex.consume_tokens(manager.tokenizer.tokenize_str("Tom has"))
    json_matcher = manager.compile(SPEC).result()
    matchers = [regex, None, json_matcher]
    logits = torch.zeros(3, 512)
    apply_bitmask(logits, manager.bitmask(matchers))
    assert torch.isfinite(logits[1]).all()  # an unconstrained row keeps every token
    for row, matcher in ((0, regex), (2, json_matcher)):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed and all(matcher.deep_copy().consume_token(t) for t in allowed)
    # the regex forces a space next: no token without one is allowed (llguidance may also
    # leave out a token it accepts, one no canonical tokenization produces)
    spaced = {t for t in range(512) if tokenizer.token_bytes(t).startswith(b" ")}
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) <= spaced


def engine():
    config = EngineConfig(model=str(BUNDLED_MODEL), num_kv_blocks=128)
    return decode_core(ModelRunner(config), "decode-t", 0, FetchConnector(KVTransferConfig()))


def run(core, requests: list[DecodeRequest]) -> list[list]:
    outputs = [[] for _ in requests]
    for request, out in zip(requests, outputs):
        core.add_request(Request.of_decode(request, out.append))
    for _ in range(2000):
        if all(o and o[-1].finish_reason is not None for o in outputs):
            return outputs
        if not run_once(core):
            time.sleep(0.002)  # the grammars compile off the loop
    raise AssertionError("requests did not finish")


def ids(deltas: list) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_a_moved_request_resumes_its_grammar_from_the_output_it_carries(tokenizer):
    prompt = tuple(tokenizer.encode("Lily wrote her pet as JSON: "))
    core = engine()
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured_output=SPEC)
              for s in range(6)]
    whole = run(core, [DecodeRequest(f"r{i}", prompt, p) for i, p in enumerate(params)])
    for out in whole:
        assert out[-1].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(tokenizer.decode(ids(out))), SCHEMA)
    # each resumed after k tokens, as the gateway resubmits a request whose worker died
    moved = []
    for i, (p, out) in enumerate(zip(params, whole)):
        k = 1 + i * 3
        earlier = ids(out)[:k]
        moved.append(DecodeRequest(f"m{i}", prompt + tuple(earlier), SamplingParams(
            max_tokens=80 - k, temperature=1.0, seed=p.seed, structured_output=SPEC,
            output_offset=k)))
    resumed = run(core, moved)
    for i, (out, again) in enumerate(zip(whole, resumed)):
        assert ids(out)[1 + i * 3:] == ids(again), i
    core.close()


def test_a_grammar_that_does_not_compile_ends_its_request_with_an_error(tokenizer):
    core = engine()
    [out] = run(core, [DecodeRequest("bad", (1, 2, 3), SamplingParams(
        structured_output=StructuredOutputSpec("regex", "(ab")))])
    assert out[-1].finish_reason is FinishReason.ERROR and "regex" in out[-1].error
    assert core.stats().num_waiting == 0 and core.pool.stats()["num_used_blocks"] == 0
    core.close()



def test_a_grammar_holds_after_the_reasoning_ends(tokenizer):
    """vLLM's structured outputs with a reasoning parser: the output is free until the end
    marker (here two tokens the free greedy output writes), then follows the grammar; a
    request that moves before or after the marker continues token for token."""
    prompt = tuple(tokenizer.encode("Once upon a time"))
    core = engine()
    [free] = run(core, [DecodeRequest("free", prompt, SamplingParams(max_tokens=12,
                                                                     temperature=0))])
    marker = tuple(ids(free)[3:5])
    assert all(tuple(ids(free)[i:i + 2]) != marker for i in range(3))  # first at 3
    spec = StructuredOutputSpec("regex", "(Tom|Sam) has [1-9] cats")
    params = SamplingParams(max_tokens=40, temperature=0, structured_output=spec,
                            reasoning_end_token_ids=marker)
    [gated] = run(core, [DecodeRequest("gated", prompt, params)])
    out = ids(gated)
    assert out[:5] == ids(free)[:5] and gated[-1].finish_reason is FinishReason.STOP
    answer = tokenizer.decode(out[5:])
    assert answer.strip() in {f"{n} has {k} cats" for n in ("Tom", "Sam") for k in range(1, 10)}
    for k in (2, 7):  # moved inside the reasoning, and after it
        [again] = run(core, [DecodeRequest(f"m{k}", prompt + tuple(out[:k]), SamplingParams(
            max_tokens=40 - k, temperature=0, structured_output=spec,
            reasoning_end_token_ids=marker, output_offset=k))])
        assert ids(again) == out[k:], k
    core.close()
