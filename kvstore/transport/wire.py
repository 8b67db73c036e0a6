"""Zero-copy codec of ``pdcluster.kvstore.v1.BlockData`` for the block stream's hot path.

The bytes on the wire are exactly protobuf (any protobuf reader parses them, and
:func:`decode_block_data` parses any protobuf writer's output); only the payload is handled by
hand, so a message costs one copy to build and none to read:

* encode: the small fields are serialized by protobuf, then the payload field
  (``0x22 <varint len> <bytes>``, field 4, wire type 2) is appended by one ``bytes.join``
  over the blocks' own buffers. Protobuf fields may come in any order.
* decode: the top-level fields are walked; the payload comes back as a ``memoryview`` into the
  received bytes, everything else is parsed by protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pdcluster.kvstore.errors import BlockLayoutError
from pdcluster.kvstore.proto import kvstore_pb2 as pb

_PAYLOAD_FIELD = 4
_PAYLOAD_TAG = bytes([(_PAYLOAD_FIELD << 3) | 2])
_Buffer = bytes | bytearray | memoryview


class BlockDataView(NamedTuple):
    """A decoded BlockData: ``payload`` is a read-only view into the received message."""

    keys: Sequence[bytes]
    handle: str
    layout: pb.BlockLayout
    num_tokens: int
    payload: memoryview
    last: bool
    error: pb.FetchError | None


def encode_block_data(payload_parts: Sequence[_Buffer], *, keys: Sequence[bytes] = (),
                      layout: pb.BlockLayout | None = None, handle: str = "",
                      num_tokens: int = 0, last: bool = False) -> bytes:
    """Serialized BlockData whose payload is the concatenation of ``payload_parts``."""
    head = pb.BlockData(keys=keys, layout=layout, handle=handle, num_tokens=num_tokens,
                        last=last).SerializeToString()
    size = sum(len(p) for p in payload_parts)
    return b"".join((head, _PAYLOAD_TAG, _varint(size), *payload_parts))


def decode_block_data(raw: bytes) -> BlockDataView:
    """Parse a serialized BlockData without copying its payload.

    Raises:
        BlockLayoutError: the bytes are not a well-formed BlockData.
    """
    view = memoryview(raw)
    size = len(raw)
    payload = view[0:0]
    rest: list[memoryview] = []
    pos = 0
    while pos < size:
        tag, body = _read_varint(raw, pos)
        wire_type = tag & 7
        if wire_type == 2:
            length, body = _read_varint(raw, body)
            end = body + length
        elif wire_type == 0:
            end = _read_varint(raw, body)[1]
        elif wire_type in (1, 5):
            end = body + (8 if wire_type == 1 else 4)
        else:
            raise BlockLayoutError(f"malformed BlockData: wire type {wire_type} at byte {pos}")
        if end > size:
            raise BlockLayoutError(f"malformed BlockData: field at byte {pos} overruns the message")
        if tag >> 3 == _PAYLOAD_FIELD and wire_type == 2:
            payload = view[body:end]  # proto3: the last occurrence wins
        else:
            rest.append(view[pos:end])
        pos = end
    try:
        msg = pb.BlockData.FromString(b"".join(rest))
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise BlockLayoutError(f"malformed BlockData: {exc}") from None
    return BlockDataView(msg.keys, msg.handle, msg.layout, msg.num_tokens, payload, msg.last,
                         msg.error if msg.HasField("error") else None)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise BlockLayoutError("malformed BlockData: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
