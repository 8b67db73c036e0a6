"""The layout of one KV block's payload: its dtype name and shape, as it travels on the wire.

Payloads are raw little-endian bytes of a C-contiguous block; bfloat16 travels as its int16 bit
pattern. A cluster's model fixes one layout (deploy.launcher.block_layout): its KV cache
spec's bytes, uint8 [block_nbytes], whatever the block holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.kvstore.errors import BlockLayoutError

#: dtype name -> bytes per element. bfloat16 travels as its int16 bit pattern.
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


@dataclass(frozen=True)
class BlockLayout:
    """Layout of one block: ``dtype`` name (a key of DTYPE_ITEMSIZE) and block ``shape``.

    Raises BlockLayoutError for an unknown dtype or a negative dimension.
    """

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise BlockLayoutError(
                f"unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}"
            )
        if any(d < 0 for d in self.shape):
            raise BlockLayoutError(f"negative dimension in block shape {self.shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of one block's payload."""
        n = DTYPE_ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def check_payload(payload: bytes, layout: BlockLayout) -> None:
    """Raise BlockLayoutError unless ``payload`` holds exactly one block of ``layout``."""
    if len(payload) != layout.nbytes:
        raise BlockLayoutError(
            f"payload of {len(payload)} bytes does not match layout {layout} "
            f"({layout.nbytes} bytes)"
        )
