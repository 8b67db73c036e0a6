"""A choice's text however its ids arrive in deltas: one at a time, all at once, or the stop
token alone before the delta that ends the choice (a prefill's first token). The reference is
transformers' decode of the same ids with vLLM's rules applied by hand."""

from __future__ import annotations

import pytest

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.protocol import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.stop import ChoiceText, StopStringMatcher

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(BUNDLED_MODEL)


def fed(tokenizer, prompt, ids, deltas, params=SamplingParams(), stops=(),
        include=False) -> tuple[str, ChoiceText]:
    """The text ChoiceText gives for `ids` split at the `deltas` boundaries (no EOS ids)."""
    text = ChoiceText(tokenizer, prompt, params, stops, set(), include)
    bounds = [0, *deltas, len(ids)]
    out = ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out += text.add(ids[a:b], final=i == len(bounds) - 2)
        if text.stop_string is not None:
            break
    return out, text


def test_min_tokens_protects_text_whatever_the_deltas(tokenizer, hf):
    prompt = hf.encode(PROMPT)
    ids = hf.greedy(prompt, 30)
    whole = hf.decode_output(prompt, ids)
    stop = " there"
    protected = len(hf.decode_output(prompt, ids[:4]))
    assert whole.find(stop) + len(stop) <= protected  # within the first 4 tokens' text
    later = whole.find(stop, protected - len(stop) + 1)
    want = whole[:later] if later >= 0 else whole
    assert want != whole[:whole.find(stop)]
    params = SamplingParams(max_tokens=30, min_tokens=4)
    for deltas in ([], list(range(1, 30)), [2, 7]):  # the 4th token inside a delta
        assert fed(tokenizer, prompt, ids, deltas, params, [stop])[0] == want
        assert fed(tokenizer, prompt, ids, deltas, SamplingParams(), [stop])[0] == \
            whole[:whole.find(stop)]


def test_a_stop_token_adds_no_text_unless_asked(tokenizer, hf):
    prompt = hf.encode(PROMPT)
    ids = hf.greedy(prompt, 6)
    params = SamplingParams(stop_token_ids=(ids[-1],))
    for deltas in ([], [5], [1, 2, 3, 4, 5]):
        text, state = fed(tokenizer, prompt, ids, deltas, params)
        assert text == hf.decode_output(prompt, ids[:-1])
        assert state.stop_reason == ids[-1]
        text, _ = fed(tokenizer, prompt, ids, deltas, params, include=True)
        assert text == hf.decode_output(prompt, ids)
    # the stop token alone, then the ending delta with no ids (a prefill's first token)
    state = ChoiceText(tokenizer, prompt, params, (), {ids[0]})  # ids[0] as the EOS
    assert state.add(ids[:1], final=False) + state.add([], final=True) == ""
    assert state.stop_reason is None  # not a stop_token_ids id: an EOS


def test_the_stop_string_complete_first_wins_then_list_order():
    """As vLLM, which checks after each token: "bc" is complete before "abcd" is."""
    assert StopStringMatcher(["abcd", "bc"]).update("xabcdy", final=True) == "xa"
    assert StopStringMatcher(["bc", "xbc"]).update("xbcd", final=True) == "x"
    kept = StopStringMatcher(["abcd", "bc"], include_in_output=True)
    assert kept.update("xabcdy", final=True) == "xabc" and kept.stopped == "bc"
