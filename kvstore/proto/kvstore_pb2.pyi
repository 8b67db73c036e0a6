from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockLayout(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("keys", "handle", "layout", "payload", "num_tokens", "last", "error")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    handle: str
    layout: BlockLayout
    payload: bytes
    num_tokens: int
    last: bool
    error: FetchError
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., handle: _Optional[str] = ..., layout: _Optional[_Union[BlockLayout, _Mapping]] = ..., payload: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., last: _Optional[bool] = ..., error: _Optional[_Union[FetchError, _Mapping]] = ...) -> None: ...

class FetchError(_message.Message):
    __slots__ = ("kind", "details", "missing")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    kind: str
    details: str
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kind: _Optional[str] = ..., details: _Optional[str] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys", "max_chunk_bytes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class TailRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    def __init__(self, handle: _Optional[str] = ...) -> None: ...

class ReleaseTailReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsReply(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "pinned")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pinned: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, applied: _Optional[_Iterable[bool]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("num_blocks", "bytes_used", "capacity_bytes", "num_tails", "evictions", "expired_tails")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TAILS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_TAILS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    num_tails: int
    evictions: int
    expired_tails: int
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_tails: _Optional[int] = ..., evictions: _Optional[int] = ..., expired_tails: _Optional[int] = ...) -> None: ...
