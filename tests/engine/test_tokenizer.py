"""Our tokenizer wrapper against transformers' AutoTokenizer on the bundled model."""

import pytest
from transformers import AutoTokenizer

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["Once upon a time", "  leading and   repeated spaces ", "Lily said, \"Hi!\"\nBye.",
         "naïve café — 日本語 🙂", "12345 + 678", "<s> special </s> inside", ""]


@pytest.fixture(scope="module")
def tokenizers():
    return Tokenizer.from_pretrained(BUNDLED_MODEL), AutoTokenizer.from_pretrained(BUNDLED_MODEL)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizers, text):
    ours, hf = tokenizers
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_ids(tokenizers):
    ours, _ = tokenizers
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 512)


@pytest.mark.parametrize("text", TEXTS[:5])
def test_incremental_text_equals_whole_sequence_decode(tokenizers, text):
    ours, hf = tokenizers
    prompt = ours.encode("Once upon")
    output = ours.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt)
    pieces = [detok.add([t]) for t in output[:-1]] + [detok.add(output[-1:], final=True)] \
        if output else []
    expected = hf.decode(prompt + output, skip_special_tokens=True)[
        len(hf.decode(prompt, skip_special_tokens=True)):]
    assert "".join(pieces) == expected
    assert all("\ufffd" not in p for p in pieces)  # split UTF-8 sequences are held back


@pytest.mark.parametrize("group", [1, 2, 3, 7])
def test_incremental_text_over_long_outputs_in_groups_equals_whole_sequence_decode(tokenizers,
                                                                                    group):
    """Outputs many times longer than the decode window, added a few ids at a time (as a
    step of speculative or batched output would), with multi-byte characters split over
    byte-fallback pieces and runs of spaces: the deltas still add up to the whole decode."""
    ours, hf = tokenizers
    prompt = ours.encode("Lily and Ben went to the park.")
    output = ours.encode(" ".join(TEXTS[:5]) * 4, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt)
    pieces = []
    for start in range(0, len(output), group):
        last = start + group >= len(output)
        pieces.append(detok.add(output[start:start + group], final=last))
    expected = hf.decode(prompt + output, skip_special_tokens=True)[
        len(hf.decode(prompt, skip_special_tokens=True)):]
    assert "".join(pieces) == expected == detok.text
    assert all("\ufffd" not in p for p in pieces)
