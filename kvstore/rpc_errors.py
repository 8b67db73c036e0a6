"""Errors of the KV store's gRPC service, both ends: how the server names a failure and how a
client turns it back into a typed :class:`kvstore.errors.KVStoreError` (``grpc.RpcError``
never escapes a client).

A failed call carries its kind in the trailing metadata entry ``pdcluster-error``
(``not_found`` | ``capacity`` | ``layout`` | ``invalid`` | ``auth``); a FetchBlocks session
reports a miss in-band (``BlockData.error``), so its stream stays open for the next request.
A miss lists the missing keys in its details (:func:`missing_details`), at most
``MAX_MISSING_KEYS_IN_DETAILS`` of them: grpc-message is a size-limited header.
"""

from __future__ import annotations

import grpc

from pdcluster.kvstore.errors import (BlockLayoutError, BlockNotFoundError, KVAuthError,
                                      KVStoreError, KVTransferError, KVTransferTimeout,
                                      StoreCapacityError)
from pdcluster.kvstore.proto import kvstore_pb2 as pb

ERROR_METADATA_KEY = "pdcluster-error"
#: NOT_FOUND details list at most this many missing keys.
MAX_MISSING_KEYS_IN_DETAILS = 64


def missing_details(missing: list[bytes], num_keys: int) -> str:
    """``missing N of M block(s): hex,hex[ (+K more)]``, the details of a miss."""
    shown = ",".join(k.hex() for k in missing[:MAX_MISSING_KEYS_IN_DETAILS])
    more = len(missing) - MAX_MISSING_KEYS_IN_DETAILS
    suffix = f" (+{more} more)" if more > 0 else ""
    return f"missing {len(missing)} of {num_keys} block(s): {shown}{suffix}"


def rpc_error(address: str, method: str, exc: grpc.RpcError,
              handle: str | None = None) -> KVStoreError:
    """The typed error of a failed call of ``method`` to the store at ``address``.

    ``handle``: the tail handle the call was about (a tail miss names it), else ``None``.
    Returns KVAuthError (token refused), BlockNotFoundError (``.missing`` or ``.handle``),
    StoreCapacityError, BlockLayoutError, or KVTransferError (deadline, unreachable, other).
    """
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailers = dict(exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else {}
    kind = trailers.get(ERROR_METADATA_KEY)
    where = f"{address}: {method}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return KVAuthError(f"{where} refused: missing or invalid KV store token", address=address)
    if code == grpc.StatusCode.NOT_FOUND and kind == "not_found":
        if handle is not None:
            return BlockNotFoundError(f"{where}: {details}", handle=handle)
        return BlockNotFoundError(f"{where}: {details}", missing=_parse_missing(details))
    if kind == "capacity":
        return StoreCapacityError(f"{where}: {details}")
    if kind == "layout":
        return BlockLayoutError(f"{where}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KVTransferTimeout(f"{where} exceeded its deadline", address=address)
    name = code.name if code is not None else "UNKNOWN"
    return KVTransferError(f"{where} failed with {name}: {details}", address=address)


def fetch_error(address: str, error: pb.FetchError) -> KVStoreError:
    """The typed error of a FetchBlocks reply's in-band ``error`` from the store at
    ``address``: BlockNotFoundError for a miss, else KVTransferError."""
    where = f"{address}: FetchBlocks"
    if error.kind == "not_found":
        return BlockNotFoundError(f"{where}: {error.details}", missing=list(error.missing))
    return KVTransferError(f"{where} failed ({error.kind}): {error.details}", address=address)


def _parse_missing(details: str) -> list[bytes]:
    """Keys from :func:`missing_details` text (the listed ones; unparsable tokens skipped)."""
    _, _, listed = details.partition(": ")
    listed = listed.split(" ", 1)[0]
    out = []
    for token in listed.split(","):
        try:
            out.append(bytes.fromhex(token))
        except ValueError:
            continue
    return out
