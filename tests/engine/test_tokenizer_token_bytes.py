"""Per-token bytes and API token strings, against transformers' own pieces and decode.

References: transformers' `convert_ids_to_tokens` pieces (SentencePiece "▁" is a space,
`<0xNN>` is that byte; byte-level pieces map back through transformers' `bytes_to_unicode`)
and `decode` of whole sequences.
"""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.tokenizer import Tokenizer, TokenizerError
from pdcluster.router.logprobs import TextOffsets, token_string

TEXTS = ["Once upon a time, there was a little girl.", "Lily said, \"Hi!\"\nBye.\n\n  ok",
         "naïve café", "日本語", "an emoji 🙂 here", "dash — and “quotes”", "x\ty\r\nz"]


@pytest.fixture(scope="module")
def sentencepiece():
    return Tokenizer.from_pretrained(BUNDLED_MODEL), AutoTokenizer.from_pretrained(BUNDLED_MODEL)


def sentencepiece_bytes(piece: str) -> bytes:
    byte = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()


def escaped(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join("\\x%02x" % b for b in data)


def output_text(hf, prefix: list[int], ids: list[int]) -> str:
    """The OpenAI text of `ids` generated after `prefix`."""
    return hf.decode(prefix + ids, skip_special_tokens=True)[
        len(hf.decode(prefix, skip_special_tokens=True)):]


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_bytes_equal_hf_pieces_and_decode(sentencepiece, text):
    ours, hf = sentencepiece
    ids = hf(text, add_special_tokens=False)["input_ids"]
    pieces = hf.convert_ids_to_tokens(ids)
    assert [ours.token_bytes(i) for i in ids] == [sentencepiece_bytes(p) for p in pieces]
    # The decoder strips the first word's space only at the start of a sequence; after a
    # prefix (as output follows a prompt) every token's bytes are in the text.
    prefix = hf("Once")["input_ids"]
    assert b"".join(ours.token_bytes(i) for i in ids) == output_text(hf, prefix, ids).encode()
    assert " " + hf.decode(ids) == b"".join(ours.token_bytes(i) for i in ids).decode()


@pytest.mark.parametrize("text", ["日本語", "an emoji 🙂 here"])
def test_byte_fallback_pieces_are_single_bytes(sentencepiece, text):
    ours, hf = sentencepiece
    ids = hf(text, add_special_tokens=False)["input_ids"]
    fallback = [i for i, p in zip(ids, hf.convert_ids_to_tokens(ids)) if p.startswith("<0x")]
    assert fallback
    for i in fallback:
        byte = int(hf.convert_ids_to_tokens(i)[3:5], 16)
        assert ours.token_bytes(i) == bytes([byte])
        if byte >= 0x80:
            assert token_string(ours.token_bytes(i)) == f"bytes:\\x{byte:02x}"


def test_api_strings_concatenate_to_text(sentencepiece):
    ours, hf = sentencepiece
    ids = hf(TEXTS[0], add_special_tokens=False)["input_ids"]
    strings = [token_string(ours.token_bytes(i)) for i in ids]
    assert strings == [p.replace("▁", " ") for p in hf.convert_ids_to_tokens(ids)]
    assert "".join(strings) == " " + hf.decode(ids)


def test_special_tokens_show_their_content(sentencepiece):
    ours, hf = sentencepiece
    for token_id in hf.all_special_ids:
        content = hf.convert_ids_to_tokens(token_id)
        assert ours.token_bytes(token_id) == content.encode()
        assert ours.is_special(token_id)
        assert hf.decode([token_id], skip_special_tokens=False) == content
    assert not ours.is_special(hf.convert_tokens_to_ids("▁the"))


def test_unknown_id_raises(sentencepiece):
    ours, _ = sentencepiece
    with pytest.raises(TokenizerError):
        ours.token_bytes(ours.vocab_size)


@pytest.mark.parametrize("text", ["café 日本語 🙂\nhi", "a — b “c”", "🙂🙂"])
def test_text_offsets_index_the_text(sentencepiece, text):
    """Offsets from bytes equal the length of the text decoded so far; a token inside a
    character gets that character's offset (the text up to the last whole character)."""
    ours, hf = sentencepiece
    prefix = hf("Once")["input_ids"]
    ids = hf(text, add_special_tokens=False)["input_ids"]
    full = output_text(hf, prefix, ids)
    offsets = TextOffsets()
    whole = 0  # the longest prefix of ids whose text has no incomplete character
    for i, token_id in enumerate(ids):
        if "\ufffd" not in output_text(hf, prefix, ids[:i]):
            whole = i
        want = len(output_text(hf, prefix, ids[:whole]))
        data = ours.token_bytes(token_id)
        assert offsets.take(data) == want
        if not token_string(data).startswith("bytes:"):
            assert full[want:want + len(token_string(data))] == token_string(data)


def test_text_offsets_do_not_count_special_tokens(sentencepiece):
    ours, hf = sentencepiece
    prefix = hf("Once")["input_ids"]
    ids = hf(" Hi there", add_special_tokens=False)["input_ids"]
    ids = [ids[0], hf.eos_token_id, *ids[1:], hf.eos_token_id]
    offsets = TextOffsets()
    got = [offsets.take(b"" if ours.is_special(i) else ours.token_bytes(i)) for i in ids]
    assert got == [len(output_text(hf, prefix, ids[:i])) for i in range(len(ids))]


def test_lone_surrogate_raises_tokenizer_error(sentencepiece):
    ours, _ = sentencepiece
    with pytest.raises(TokenizerError, match="lone surrogate U\\+D800 at position 1"):
        ours.encode("a\ud800b")
    with pytest.raises(ValueError, match="not valid Unicode"):
        ours.encode("\udfff", add_special_tokens=False)
    assert ours.encode("a\U0001F642b")  # a real astral character is fine


SENTENCES = ["Once upon a time there was a café in Tokyo.", "日本語のテキストです。日本語は難しい。",
             "Emoji: 🙂🙂 and 🎉!", "naïve résumé — “quoted” text", "spaces   and\ttabs\nnewline",
             "The little dog ran to the park and played with a ball."] * 3


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A GPT-2-style byte-level BPE (ByteLevel pre-tokenizer and decoder) trained here, loaded by
    our wrapper and by transformers from the same tokenizer.json."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    path = tmp_path_factory.mktemp("byte_level_bpe")
    tok.save(str(path / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                 eos_token="<|endoftext|>")
    return Tokenizer.from_pretrained(path), hf


@pytest.mark.parametrize("text", SENTENCES[:6] + ["unseen: 漢字 ü 🚀"])
def test_byte_level_bytes_equal_hf_pieces_and_decode(byte_level, text):
    ours, hf = byte_level
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ids = hf(text)["input_ids"]
    pieces = hf.convert_ids_to_tokens(ids)
    got = [ours.token_bytes(i) for i in ids]
    assert got == [bytes(byte_of[c] for c in p) for p in pieces]
    assert b"".join(got) == hf.decode(ids).encode() == text.encode()
    assert [token_string(b) for b in got] == [escaped(b) for b in got]


def test_byte_level_has_partial_character_tokens(byte_level):
    ours, hf = byte_level
    ids = hf("unseen: 漢字 🚀")["input_ids"]
    strings = [token_string(ours.token_bytes(i)) for i in ids]
    assert any(s.startswith("bytes:\\x") for s in strings)
    assert all(re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", s) or "\ufffd" not in s for s in strings)


def test_byte_level_special_token(byte_level):
    ours, hf = byte_level
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    assert ours.token_bytes(eos) == b"<|endoftext|>" and ours.is_special(eos)
