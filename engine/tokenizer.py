"""Tokenizer loaded from a Hugging Face model directory's `tokenizer.json`.

Uses the `tokenizers` library directly (the same Rust code transformers' fast tokenizers run),
so encode/decode match `AutoTokenizer` for `PreTrainedTokenizerFast` checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens kept), as logprob entries show it."""
        return self._tok.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    The text of the output is defined as decode(prompt + output)[len(decode(prompt)):], which is
    what a client gets by decoding the whole sequence (it keeps the space a SentencePiece
    tokenizer attaches to a word's first piece). A delta that ends in U+FFFD (an incomplete
    UTF-8 byte sequence from byte-fallback tokens) is held back until the bytes complete.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._prompt = list(prompt_token_ids)
        self._prompt_text_len = len(tokenizer.decode(self._prompt))
        self._output: list[int] = []
        self.text = ""

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append output ids; return the newly complete text (may be empty)."""
        self._output.extend(token_ids)
        full = self._tok.decode(self._prompt + self._output)[self._prompt_text_len:]
        if not final and full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta
