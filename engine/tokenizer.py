"""Tokenizer loaded from a Hugging Face model directory's `tokenizer.json`.

Uses the `tokenizers` library directly (the same Rust code transformers' fast tokenizers run),
so encode/decode match `AutoTokenizer` for `PreTrainedTokenizerFast` checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Sequence

from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer, or input cannot be tokenized."""


class Tokenizer:
    """Encode text to token ids and decode ids to text.

    encode() adds special tokens the way transformers does for this checkpoint: the
    post-processor in tokenizer.json, plus BOS when tokenizer_config.json sets add_bos_token
    and the post-processor did not add it.
    """

    def __init__(self, tokenizer: HFTokenizer, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos_token: bool) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._add_bos = add_bos_token and bos_token_id is not None
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special = frozenset(i for i, t in added.items() if t.special)
        decoder = tokenizer.decoder
        self._piece_steps = _piece_steps(
            json.loads(decoder.__getstate__()) if decoder is not None else None)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` (+ optional `tokenizer_config.json`) from a model directory.

        Raises TokenizerError if `tokenizer.json` is missing.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}

        def token_id(name: str) -> int | None:
            value = cfg.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        return cls(tok, token_id("bos_token"), token_id("eos_token"),
                   bool(cfg.get("add_bos_token", False)))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar libraries load)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`.

        Raises TokenizerError if `text` is not valid Unicode (a str holding a surrogate code
        point, which JSON's "\\ud800" escape can produce: it has no UTF-8 encoding).
        """
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError as exc:  # tokenizers' message ("must be str") hides the cause
            raise TokenizerError(_untokenizable(text)) from exc
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (transformers' convert_ids_to_tokens). Raises
        TokenizerError for an id outside the vocabulary."""
        outside = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if outside:
            raise TokenizerError(f"token id {outside[0]} is not in the vocabulary "
                                 f"[0, {self.vocab_size})")
        return [self._tok.id_to_token(t) for t in token_ids]

    def is_special(self, token_id: int) -> bool:
        """True for a special token: decode() leaves it out of the text by default."""
        return token_id in self._special

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes this token contributes to decoded text (special tokens kept).

        Concatenated over a sequence the result equals decode(ids, skip_special_tokens=False)
        encoded as UTF-8, except where the decoder acts on the whole text: a SentencePiece
        decoder's Strip drops the space of the sequence's first word, which this keeps (the
        token holds it; output tokens follow a prompt, so their text keeps it too).
        A SentencePiece byte-fallback piece `<0xNN>` gives that one byte; a byte-level BPE
        (GPT-2, Llama-3, Qwen2) piece maps back through the ByteLevel alphabet; either may be
        part of a UTF-8 character. An added or special token gives its content. The pieces are
        run through the per-token steps of the decoder in tokenizer.json (Replace,
        ByteFallback, ByteLevel, Metaspace, Strip); a decoder of another type (WordPiece, CTC)
        falls back to decoding the token on its own.

        Raises TokenizerError if `token_id` is not in the vocabulary.
        """
        data = self._bytes_cache.get(token_id)
        if data is None:
            data = self._token_bytes(token_id)
            self._bytes_cache[token_id] = data
        return data

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise TokenizerError(f"token id {token_id} is not in the vocabulary "
                                 f"[0, {self.vocab_size})")
        if self._piece_steps is None:
            return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        value: str | bytes = piece
        for step in self._piece_steps:
            value = step(value)
        return value.encode("utf-8") if isinstance(value, str) else value


Piece = str | bytes  # a token's text while decoder steps run; bytes once a step decoded bytes

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """The ByteLevel alphabet inverted: char -> byte. GPT-2's `bytes_to_unicode`: printable
    Latin-1 bytes stand for themselves, the other 68 map to U+0100 onward in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = chr(0x100 + n)
    return {c: b for b, c in char_of.items()}


_BYTE_LEVEL_CHARS = _byte_level_chars()


def _byte_level(piece: Piece) -> Piece:
    if isinstance(piece, bytes):
        return piece
    try:
        return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
    except KeyError:  # like tokenizers: a piece outside the alphabet stands for itself
        return piece.encode("utf-8")


def _byte_fallback(piece: Piece) -> Piece:
    match = isinstance(piece, str) and _BYTE_PIECE.fullmatch(piece)
    return bytes([int(match.group(1), 16)]) if match else piece


def _replace(pattern: dict, content: str) -> Callable[[Piece], Piece]:
    if "String" in pattern:
        old = pattern["String"]
        return lambda p: p.replace(old, content) if isinstance(p, str) else p
    regex = re.compile(pattern["Regex"])
    return lambda p: regex.sub(content, p) if isinstance(p, str) else p


def _strip(content: str, start: int, stop: int) -> Callable[[Piece], Piece]:
    def strip(piece: Piece) -> Piece:
        if not isinstance(piece, str):
            return piece
        for _ in range(start):
            if not piece.startswith(content):
                break
            piece = piece[len(content):]
        for _ in range(stop):
            if not piece.endswith(content):
                break
            piece = piece[:-len(content)]
        return piece
    return strip


def _piece_steps(decoder: dict | None) -> list[Callable[[Piece], Piece]] | None:
    """The steps of a tokenizer.json decoder that act on each token's piece on its own.

    A step after Fuse sees the joined text, not tokens, so it is left out (in SentencePiece
    tokenizers that is the Strip of the text's first space). Metaspace's own first-space
    strip is likewise a whole-text rule. None: a decoder type whose per-token result is
    not known here.
    """
    if decoder is None:
        return None
    kind = decoder["type"]
    if kind == "Sequence":
        steps: list[Callable[[Piece], Piece]] = []
        for sub in decoder["decoders"]:
            if sub["type"] == "Fuse":
                break
            sub_steps = _piece_steps(sub)
            if sub_steps is None:
                return None
            steps.extend(sub_steps)
        return steps
    if kind == "Replace":
        return [_replace(decoder["pattern"], decoder["content"])]
    if kind == "ByteFallback":
        return [_byte_fallback]
    if kind == "ByteLevel":
        return [_byte_level]
    if kind == "Metaspace":
        return [_replace({"String": decoder["replacement"]}, " ")]
    if kind == "Strip":
        return [_strip(decoder["content"], decoder["start"], decoder["stop"])]
    if kind == "Fuse":
        return []
    return None


def _untokenizable(text: object) -> str:
    if not isinstance(text, str):
        return f"text must be a string, got {type(text).__name__}"
    surrogate = re.search("[\ud800-\udfff]", text)
    if surrogate:
        return (f"text is not valid Unicode: lone surrogate U+{ord(surrogate.group()):04X} "
                f"at position {surrogate.start()}")
    return "text cannot be tokenized"


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    The text of the output is defined as decode(prompt + output)[len(decode(prompt)):], which is
    what a client gets by decoding the whole sequence (it keeps the space a SentencePiece
    tokenizer attaches to a word's first piece), with special tokens' text dropped unless
    skip_special_tokens is False. A delta that ends in U+FFFD (an incomplete
    UTF-8 byte sequence from byte-fallback tokens) is held back until the bytes complete.

    Each call decodes a window, not the whole sequence (vLLM's incremental detokenization): the
    ids from the end of the text emitted before the last delta, with and without the new ids;
    the delta is the difference of the two texts. Whatever the decoder does at the window's
    first token (the SentencePiece strip of a leading space) it does to both, so it cancels.
    A window starts where emitted text ended, never inside a character: a byte-fallback
    decoder replaces a whole run of byte pieces that does not start a character, which would
    not cancel. Decoding the whole sequence for every token made the gateway's CPU time grow
    with the context, and on a small machine it competes with the engine for the cores
    (docs/notes/cpu-engine-findings.md, "Outputs and the gateway").
    """

    #: prompt tokens the first decode starts with: enough context for a decoder (a word's
    #: leading space); moved back if it would start inside a character
    WINDOW = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids)
        start = max(len(self._ids) - self.WINDOW, 0)
        while start > 0 and tokenizer.decode(self._ids[start:]).startswith("\ufffd"):
            start -= 1
        self._prefix_offset = start
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append output ids; return the newly complete text (may be empty)."""
        self._ids.extend(token_ids)
        window = self._ids[self._prefix_offset:]
        emitted = self._tok.decode(window[:self._read_offset - self._prefix_offset], self._skip)
        full = self._tok.decode(window, self._skip)
        if len(full) <= len(emitted) or (not final and full.endswith("\ufffd")):
            return ""
        delta = full[len(emitted):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta
