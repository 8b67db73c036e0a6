"""Token ids for synthetic prompts: which ids may appear, and deterministic blocks of them.

A prompt is sent as a list of token ids, so no tokenizer round trip can merge or split tokens
and the server sees exactly the prefixes the workload meant it to share. Ids are drawn from a
`TokenSpace`: the tokenizer's vocabulary minus its special tokens (for the bundled stories260K,
ids 3..511; 0, 1, 2 are <unk>, <s>, </s>).

`block_tokens(seed, key, n)` is a pure function of its arguments (SHAKE-256 over the seed and
key), so the same Mooncake `hash_id` yields the same tokens in every run, process and machine,
and two runs with the same `--seed` send byte-identical prompts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The bundled stories260K: vocab 512, ids 0..2 special. The default target of `pdcluster serve`.
DEFAULT_VOCAB_SIZE = 512
DEFAULT_SPECIAL_IDS = (0, 1, 2)


@dataclass(frozen=True)
class TokenSpace:
    """The token ids a synthetic prompt may contain: [0, vocab_size) minus `special_ids`."""

    vocab_size: int = DEFAULT_VOCAB_SIZE
    special_ids: tuple[int, ...] = DEFAULT_SPECIAL_IDS

    def __post_init__(self) -> None:
        if self.vocab_size - len(set(self.special_ids)) < 2:
            raise ValueError(f"token space too small: vocab {self.vocab_size}, "
                             f"special {self.special_ids}")

    @property
    def allowed(self) -> np.ndarray:
        """Sorted allowed ids, int64 [n_allowed]."""
        mask = np.ones(self.vocab_size, dtype=bool)
        mask[[i for i in self.special_ids if 0 <= i < self.vocab_size]] = False
        return np.flatnonzero(mask)


def token_space_from_tokenizer(path: str | Path) -> TokenSpace:
    """Read vocab size and special ids from a HF tokenizer (a directory or tokenizer.json).

    Raises:
        FileNotFoundError: no tokenizer.json at `path`.
    """
    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    tok = Tokenizer.from_file(str(file))
    special = tuple(sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special))
    return TokenSpace(vocab_size=tok.get_vocab_size(with_added_tokens=True), special_ids=special)


class BlockTokens:
    """Deterministic token blocks keyed by (seed, namespace, key), cached by key."""

    def __init__(self, space: TokenSpace, seed: int, namespace: str = "block") -> None:
        self._allowed = space.allowed
        self._seed = seed
        self._namespace = namespace
        self._cache: dict[tuple[int, int], list[int]] = {}

    def get(self, key: int, n: int) -> list[int]:
        """The first `n` tokens of block `key`. Same (key, n) → same list; a shorter `n` is a
        prefix of a longer one."""
        cached = self._cache.get((key, n))
        if cached is None:
            cached = block_tokens(self._allowed, self._seed, f"{self._namespace}:{key}", n)
            self._cache[(key, n)] = cached
        return cached


def block_tokens(allowed: np.ndarray, seed: int, key: str, n: int) -> list[int]:
    """`n` ids from `allowed`, a pure function of (seed, key); prefix-stable in `n`."""
    if n <= 0:
        return []
    stream = hashlib.shake_256(f"pdcluster-loadtest:{seed}:{key}".encode()).digest(4 * n)
    words = np.frombuffer(stream, dtype="<u4").astype(np.int64)
    return allowed[words % len(allowed)].tolist()
