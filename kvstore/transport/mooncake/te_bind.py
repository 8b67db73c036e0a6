"""Keeping Mooncake's Transfer Engine off every interface but the configured one.

TE binds its handshake listener to 0.0.0.0 and its TCP transport to [::], whatever local
host it is initialized with, and its data plane has no authentication. ``confine_listeners``
rewrites, in the already loaded ``mooncake`` libraries only, their calls to ``bind()`` so that
a wildcard address becomes the configured one (te_bind.c). It is built once per machine with
the system's C compiler, into ``~/.cache/pdcluster`` (``XDG_CACHE_HOME``), like the engine's
C++ kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pdcluster.kvstore.errors import KVTransferError

_SOURCE = Path(__file__).with_name("te_bind.c")
_LOCK = threading.Lock()
_LIBRARY: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdcluster"


def _library() -> ctypes.CDLL:
    """te_bind.c built (once per source version) and loaded. Raises KVTransferError when no C
    compiler is found or the build fails."""
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is not None:
            return _LIBRARY
        source = _SOURCE.read_bytes()
        path = _cache_dir() / f"te_bind-{hashlib.sha256(source).hexdigest()[:16]}.so"
        if not path.exists():
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if compiler is None:
                raise KVTransferError("confining Mooncake's listeners to --kv-transfer-bind "
                                      "needs a C compiler (cc or gcc)")
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built),
                                         str(_SOURCE)], capture_output=True, text=True)
                if result.returncode != 0:
                    raise KVTransferError(f"building te_bind.c failed: {result.stderr[-2000:]}")
                os.replace(built, path)  # atomic: concurrent workers see all of it or none
        library = ctypes.CDLL(str(path))
        library.confine_bind.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        library.confine_bind.restype = ctypes.c_int
        _LIBRARY = library
        return library


def confine_listeners(host: str) -> int:
    """Make the loaded ``mooncake`` libraries bind wildcard listeners to ``host`` instead.
    Call after importing ``mooncake.engine`` and before a TransferEngine initializes. A
    wildcard ``host`` (0.0.0.0, ::) changes nothing.

    Returns the number of call sites rewritten.

    Raises:
        KVTransferError: ``host`` is not a numeric IP address, nothing could be rewritten,
            or the helper could not be built (no C compiler).
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError as exc:
        raise KVTransferError(f"--kv-transfer-bind must be a numeric IP address for mooncake, "
                              f"got {host!r}") from exc
    if address.is_unspecified or not sys.platform.startswith("linux"):
        return 0
    patched = _library().confine_bind(b"/mooncake/", str(address).encode())
    if patched <= 0:
        raise KVTransferError(f"could not confine Mooncake's listeners to {host} "
                              f"(confine_bind returned {patched})")
    return patched
