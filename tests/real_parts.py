"""Real parts the tests need: redis-server and redis-py, Mooncake's Transfer Engine, the C++
CPU extension (a C++ compiler), Ray, Triton, hadolint (all from ``scripts/setup.sh --dev``) and
kubectl. A test whose part is absent is skipped on a developer's machine, but fails under
``CI=true`` (CI runs ``CI=true bash .ci/run``), where a skip would hide that the part is
missing. Stay skips everywhere: no CUDA device (CI has none by design), hardware features
(AMX, oneDNN, a core count), the platform (/dev/shm), tcmalloc (optional in setup.sh) and data
outside the repository (the shared Mooncake trace).

- ``require_real_part(name, available, hint)`` in a test or fixture: skip or fail now;
- ``import_real_part(module, name, hint)`` for ``pytest.importorskip``; at module level under
  CI it is a collection error, which fails the run;
- ``real_part(name, available, hint)``, a mark (``pytestmark``, a decorator) for ``skipif``:
  a ``skipif``, or under CI a ``real_part`` mark that tests/conftest.py fails the test by;
- ``real_part_present(name, available, hint)``: where a test runs its other cases without the
  part, whether to run the part's case too (under CI, an absent part fails instead).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

#: CI runs the suite as `CI=true bash .ci/run`
CI = os.environ.get("CI") == "true"

MOONCAKE_HINT = "needs pdcluster[mooncake] and libibverbs1 (scripts/setup.sh --dev)"


def _message(name: str, hint: str) -> str:
    return f"{name} is not available" + (f": {hint}" if hint else "")


def require_real_part(name: str, available: bool, hint: str = "") -> None:
    """Return if ``available``; otherwise skip, or under CI=true fail, the current test."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    if available:
        return
    if CI:
        pytest.fail(f"CI=true: {_message(name, hint)}", pytrace=False)
    pytest.skip(_message(name, hint), allow_module_level=True)  # as pytest.importorskip


def real_part_present(name: str, available: bool, hint: str = "") -> bool:
    """``available``, where a missing part only narrows the test; under CI=true a missing
    part fails it."""
    __tracebackhide__ = True
    if not available and CI:
        pytest.fail(f"CI=true: {_message(name, hint)}", pytrace=False)
    return available


def import_real_part(module: str, name: str | None = None, hint: str = "") -> ModuleType:
    """``pytest.importorskip(module)``, failing instead under CI=true."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = exc
    require_real_part(name or module, False, f"{hint} ({error})" if hint else str(error))
    raise error  # unreachable: require_real_part raised


def real_part(name: str, available: bool, hint: str = "") -> pytest.MarkDecorator:
    """A mark: the test is skipped (``skipif``) unless ``available``; under CI=true a
    ``real_part`` mark instead, which tests/conftest.py fails the test by."""
    if CI:
        return pytest.mark.real_part(name, available, hint)
    return pytest.mark.skipif(not available, reason=_message(name, hint))
