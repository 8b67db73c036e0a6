"""The ``ray`` and ``server`` markers (pyproject.toml): what a test starts, so that
``pytest -m "not ray and not server"`` runs the quick rest.

- ``ray``: starts or joins a Ray (``ray.init``, the launcher's ``Cluster``, a
  ``ray.cluster_utils.Cluster``, ``ray start``, a ``pdcluster serve`` subprocess);
- ``server``: starts a server: a process (``redis-server``, ``mooncake_master``,
  ``pdcluster serve``) or one in this process (uvicorn, a gRPC KV store, the aiohttp stub).

A fixture that starts one says so under its ``@pytest.fixture``::

    @pytest.fixture(scope="session")
    @starts("ray")
    def cluster(): ...

and tests/conftest.py marks every test whose fixtures include it (through other fixtures
too). A test that starts one in its own body carries the mark itself (``pytestmark`` or
``@pytest.mark.server``), and so does the parameter of a fixture that requests one with
``request.getfixturevalue`` (``pytest.param("redis", marks=pytest.mark.server)``): that request
is not in the fixture closure collection sees.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

KINDS = ("ray", "server")


def starts(*kinds: str) -> Callable:
    """Tag a fixture function with what it starts (``"ray"``, ``"server"``)."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"starts() takes some of {KINDS}, not {sorted(unknown) or 'nothing'}")

    def tag(func: Callable) -> Callable:
        # under @pytest.fixture (the function) or over it (pytest's fixture definition)
        target = func._get_wrapped_function() if hasattr(func, "_get_wrapped_function") else func
        target.pdc_starts = frozenset(kinds) | getattr(target, "pdc_starts", frozenset())
        return func

    return tag


def fixture_starts(item: pytest.Item) -> set[str]:
    """What the fixtures this test uses start (each name's definition in effect, and the
    ones it overrides where it requests them)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    kinds: set[str] = set()
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name, ())
        for fixturedef in reversed(defs):
            kinds |= getattr(fixturedef.func, "pdc_starts", frozenset())
            if name not in fixturedef.argnames:  # does not request the one it overrides
                break
    return kinds


def mark_starts(items: list[pytest.Item]) -> None:
    """Add the ``ray`` / ``server`` marks of each test's fixtures."""
    for item in items:
        for kind in sorted(fixture_starts(item)):
            if item.get_closest_marker(kind) is None:
                item.add_marker(kind)
