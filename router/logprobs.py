"""Logprob entries as the OpenAI API shows them: token strings, bytes and text offsets.

A token's string is its UTF-8 bytes (Tokenizer.token_bytes) decoded, so the tokens of a
completion concatenate to its text. A token that holds only part of a UTF-8 character (a
byte-fallback piece, or a byte-level BPE piece that splits a character) cannot be a str; it is
shown as `bytes:` followed by `\\xNN` per byte, as OpenAI and vLLM show it, and chat entries
carry the real bytes alongside.
"""

from __future__ import annotations

import codecs

from pdcluster.engine.protocol import TokenLogprob
from pdcluster.engine.tokenizer import Tokenizer


def token_string(data: bytes) -> str:
    """The API string of a token with UTF-8 bytes `data`: the text when `data` is whole
    characters, else `bytes:\\xe2\\x80`-style escapes of every byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def token_name(tokenizer: Tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprob entries show it: its string, or with vLLM's
    return_tokens_as_token_ids (`as_id`) `token_id:N`, which no tokenization can blur."""
    return f"token_id:{token_id}" if as_id else token_string(tokenizer.token_bytes(token_id))


class TextOffsets:
    """Character offsets of a choice's tokens in its text, fed one token at a time.

    Counted from the tokens' bytes, so the count is right however the text was cut into
    stream chunks (a chunk's text is held back while a UTF-8 character is incomplete). A token
    starting inside a character gets that character's offset. Special tokens are not in the
    text and take no room. Bytes that are not valid UTF-8 count as the text shows them when
    decoded with replacement (one U+FFFD per maximal invalid subsequence).
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def take(self, data: bytes) -> int:
        """Offset (characters) of a token with bytes `data` that follows the ones taken."""
        offset = self._chars
        self._chars += len(self._utf8.decode(data))
        return offset


def completion_logprobs(entries: list[TokenLogprob], tokenizer: Tokenizer,
                        offsets: TextOffsets, as_ids: bool = False) -> dict:
    """The completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset)
    for a choice's next `entries`; `offsets` carries the choice's position across chunks;
    as_ids: tokens named `token_id:N` (token_name)."""
    tokens, text_offset = [], []
    for e in entries:
        data = tokenizer.token_bytes(e.token_id)
        tokens.append(token_name(tokenizer, e.token_id, as_ids))
        text_offset.append(offsets.take(b"" if tokenizer.is_special(e.token_id) else data))
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_name(tokenizer, t, as_ids): lp for t, lp in e.top}
                         for e in entries],
        "text_offset": text_offset,
    }


def chat_logprob(token_id: int, logprob: float, tokenizer: Tokenizer,
                 as_id: bool = False) -> dict:
    """A chat `{token, logprob, bytes}` object; bytes are the token's UTF-8 bytes."""
    data = tokenizer.token_bytes(token_id)
    return {"token": token_name(tokenizer, token_id, as_id), "logprob": logprob,
            "bytes": list(data)}


def chat_logprob_entry(entry: TokenLogprob, tokenizer: Tokenizer, as_ids: bool = False) -> dict:
    """One chat `logprobs.content` item with its `top_logprobs`."""
    return {**chat_logprob(entry.token_id, entry.logprob, tokenizer, as_ids),
            "top_logprobs": [chat_logprob(t, lp, tokenizer, as_ids) for t, lp in entry.top]}


def echo_logprobs(prompt_ids: list[int], entries: list[TokenLogprob], top: int,
                  tokenizer: Tokenizer, offsets: TextOffsets, as_ids: bool = False) -> dict:
    """The completions `logprobs` object of an echoed prompt: `entries` hold the prompt's
    tokens after the first (engine prompt logprobs), whose logprob and top entries are null,
    as vLLM and OpenAI show it; `top` caps the top entries shown."""
    tokens, text_offset = [], []
    for t in prompt_ids:
        data = tokenizer.token_bytes(t)
        tokens.append(token_name(tokenizer, t, as_ids))
        text_offset.append(offsets.take(b"" if tokenizer.is_special(t) else data))
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(e.logprob for e in entries)],
        "top_logprobs": [None, *({token_name(tokenizer, t, as_ids): lp for t, lp in e.top[:top]}
                                 for e in entries)],
        "text_offset": text_offset,
    }


def vllm_prompt_logprobs(entries: list[TokenLogprob], top: int,
                         tokenizer: Tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from
    token id (a string) to {logprob, rank, decoded_token} holding the token itself and the
    `top` most likely."""
    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank,
                "decoded_token": token_string(tokenizer.token_bytes(token_id))}

    out: list[dict | None] = [None]
    for e in entries:
        position = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        for rank, (t, lp) in enumerate(e.top[:top], 1):
            position.setdefault(str(t), entry(t, lp, rank))
        out.append(position)
    return out
